"""Class probabilities of an ONNX Runtime or OpenVINO model on saved inputs, and nothing else.

It imports only NumPy and the runtime, so that it can run under an emulated CPU
(``qemu-x86_64 -cpu Haswell``: AVX2 without VNNI) where importing PyTorch takes minutes;
``benchmarks/int8_emulated.py`` runs it there.

Usage: ``python -m benchmarks.int8_evaluate BACKEND MODEL INPUTS.npy OUTPUT.npy``
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

BATCH = 8


def logits(backend: str, model: Path, inputs: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    batches = [inputs[start : start + BATCH] for start in range(0, len(inputs), BATCH)]
    if backend == "openvino":
        import openvino

        core = openvino.Core()
        compiled = core.compile_model(core.read_model(str(model)), "CPU",
                                      {"INFERENCE_PRECISION_HINT": "f32"})  # fmt: skip
        return np.concatenate([np.asarray(compiled({0: batch})[0]) for batch in batches])
    import onnxruntime

    session = onnxruntime.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: batch})[0] for batch in batches])


def softmax(values: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    shifted = np.exp(values - values.max(axis=1, keepdims=True))
    result: np.ndarray[Any, Any] = shifted / shifted.sum(axis=1, keepdims=True)
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    backend, model, inputs, output = argv
    probabilities = softmax(logits(backend, Path(model), np.load(inputs)).astype(np.float64))
    np.save(output, probabilities.astype(np.float32))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
