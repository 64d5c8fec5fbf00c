"""The Open Inference Protocol (KServe v2 / Triton REST): tensors in JSON and binary."""
