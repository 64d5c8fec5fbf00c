"""INT8: the CPU's INT8 class, quantisation for ONNX Runtime and OpenVINO, and the gate's report."""
