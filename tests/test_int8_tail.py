"""INT8 leaves a network's decoding in fp32: a head that joins boxes in pixels and scores in
[0, 1] in one tensor (as a YOLO head does) keeps its scores on ONNX Runtime and OpenVINO."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from app.engine.int8.quantize_onnx import OnnxQuantizer
from app.engine.int8.tail import Node, decoding_tail, onnx_tail, openvino_tail
from app.engine.model.export import INPUT_NAME, export_onnx


class BoxesAndScores(nn.Module):
    """Two convolutions: one's output scaled to pixels, the other's through a sigmoid, joined."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.boxes = nn.Conv2d(3, 4, 3, padding=1)
        self.scores = nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.boxes(batch) * 640.0, self.scores(batch).sigmoid()], dim=1)


def test_the_tail_is_what_reaches_no_weighted_node() -> None:
    nodes = [
        Node("conv", True, ["x"], ["a"]),
        Node("relu", False, ["a"], ["b"]),  # feeds the second convolution: not the tail
        Node("conv2", True, ["b"], ["c"]),
        Node("sigmoid", False, ["c"], ["d"]),
        Node("mul", False, ["a"], ["e"]),
        Node("concat", False, ["d", "e"], ["y"]),
    ]
    assert decoding_tail(nodes) == ["sigmoid", "mul", "concat"]


@pytest.fixture
def exported(tmp_path: Path) -> Path:
    path = tmp_path / "head.onnx"
    export_onnx(BoxesAndScores().eval(), (3, 8, 8), path)
    return path


def calibration() -> list[np.ndarray]:
    generator = np.random.default_rng(0)
    return [generator.random((1, 3, 8, 8), dtype=np.float32) for _ in range(8)]


def test_onnx_runtime_int8_keeps_the_scores(exported: Path, tmp_path: Path) -> None:
    import onnx
    import onnxruntime

    assert {node.op_type for node in onnx.load(str(exported)).graph.node
            if node.name in onnx_tail(onnx.load(str(exported)), ("Conv",))} == {
        "Mul", "Sigmoid", "Concat"}  # fmt: skip
    out = tmp_path / "int8.onnx"
    OnnxQuantizer(exported, calibration(), tmp_path).build("qdq-w8", out)
    image = calibration()[0]
    expected = onnxruntime.InferenceSession(str(exported)).run(None, {INPUT_NAME: image})[0]
    found = onnxruntime.InferenceSession(str(out)).run(None, {INPUT_NAME: image})[0]
    # Quantized with the boxes, a score's step would be 640 / 255: every score 0 or 2.5.
    np.testing.assert_allclose(found[:, 4:], expected[:, 4:], atol=0.05)
    assert {node.op_type for node in onnx.load(str(out)).graph.node} >= {"QuantizeLinear"}


def test_openvino_int8_keeps_the_scores(exported: Path, tmp_path: Path) -> None:
    import openvino as ov

    from app.engine.int8.quantize_openvino import OpenVinoQuantizer

    fp32 = tmp_path / "fp32.xml"
    model = ov.convert_model(str(exported))
    ov.save_model(model, str(fp32), compress_to_fp16=False)
    assert openvino_tail(model)  # the multiply, the sigmoid and the join
    out = tmp_path / "int8.xml"
    OpenVinoQuantizer(fp32, calibration(), list).build("nncf-w8", out)
    core = ov.Core()
    image = calibration()[0]
    expected = core.compile_model(str(fp32), "CPU")(image)[0]
    found = core.compile_model(str(out), "CPU")(image)[0]
    np.testing.assert_allclose(found[:, 4:], expected[:, 4:], atol=0.05)
