"""What follows a network's last weighted layer: its decoding, which INT8 leaves in fp32.

A detector's graph ends in arithmetic on what its last convolutions answer: a YOLO head adds
the anchor points, multiplies by the strides and joins boxes in pixels with scores in [0, 1]
into one tensor; a classifier that answers probabilities takes their softmax or logarithm.
Quantized, one scale would serve values hundreds apart (every score rounds to 0) and a
logarithm would see its input rounded. Only layers with weights gain from INT8, so every
node from which no weighted layer can be reached stays in fp32, on every runtime.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Node:
    """One node of a graph: its name, whether it holds weights, and the names of the
    tensors it reads and writes."""

    name: str
    weighted: bool
    inputs: Sequence[str]
    outputs: Sequence[str]


def decoding_tail(nodes: Sequence[Node]) -> list[str]:
    """The names of the nodes, in ``nodes``' topological order, from which no weighted node
    can be reached."""
    readers: dict[str, list[Node]] = {}
    for node in nodes:
        for tensor in node.inputs:
            readers.setdefault(tensor, []).append(node)
    feeds: dict[str, bool] = {}
    for node in reversed(nodes):  # every reader is decided before the node it reads from
        feeds[node.name] = node.weighted or any(
            feeds.get(reader.name, False) for reader in _readers(node.outputs, readers)
        )
    return [node.name for node in nodes if not feeds[node.name]]


def _readers(tensors: Iterable[str], readers: dict[str, list[Node]]) -> Iterable[Node]:
    for tensor in tensors:
        yield from readers.get(tensor, ())


def onnx_tail(model: object, weighted_ops: Iterable[str]) -> list[str]:
    """The decoding tail of an ONNX model (``onnx.ModelProto``)."""
    kinds = set(weighted_ops)
    graph = model.graph  # type: ignore[attr-defined]
    return decoding_tail([Node(node.name, node.op_type in kinds, list(node.input),
                               list(node.output)) for node in graph.node])  # fmt: skip


# OpenVINO's layers with weights (those NNCF quantizes).
OPENVINO_WEIGHTED = ("Convolution", "GroupConvolution", "ConvolutionBackpropData", "MatMul")


def openvino_tail(model: object) -> list[str]:
    """The decoding tail of an OpenVINO model (``openvino.Model``), by friendly name;
    parameters, constants and results left out (NNCF's scope is of operations)."""
    nodes = []
    for op in model.get_ordered_ops():  # type: ignore[attr-defined]
        kind = op.get_type_name()
        if kind in ("Parameter", "Constant", "Result"):
            continue
        name = op.get_friendly_name()
        inputs = [f"{each.get_source_output().get_node().get_friendly_name()}:"
                  f"{each.get_source_output().get_index()}" for each in op.inputs()]  # fmt: skip
        outputs = [f"{name}:{index}" for index in range(op.get_output_size())]
        nodes.append(Node(name, kind in OPENVINO_WEIGHTED, inputs, outputs))
    return decoding_tail(nodes)
