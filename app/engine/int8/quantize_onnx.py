"""INT8 recipes for ONNX Runtime: static QDQ quantization, then fp32 for the layers it hurts most.

Every recipe is ONNX Runtime's ``quantize_static`` (QDQ, per-channel signed weights, unsigned
activations, MinMax calibration: the layout its x86 kernels run fastest), with

- ``qdq-w8``: full 8-bit weights, for CPUs whose INT8 products do not saturate (VNNI, AMX, Arm);
- ``qdq-w7``: 7-bit weights (``reduce_range``), for x86 CPUs without VNNI, where 8-bit weights
  overflow the 16-bit intermediate of ``vpmaddubsw``;
- ``...-fp32xN``: the same with the N layers that add the most quantization noise left in fp32.
  The noise each layer adds is found by comparing per-layer outputs of the fp32 model and the
  QDQ model on calibration images (ONNX Runtime's ``qdq_loss_debug``): the drop in
  signal-to-noise ratio from a layer's input to its output.

Every recipe leaves the decoding after the last layers in fp32 (``app.engine.int8.tail``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from app.engine.errors import MissingExtraError
from app.engine.int8.tail import onnx_tail
from app.engine.model.export import INPUT_NAME

QUANTIZED_OPS = ("Conv", "Gemm", "MatMul")
_NAME = re.compile(r"^qdq-w(?P<bits>[78])(-fp32x(?P<kept>\d+))?$")
SENSITIVITY_IMAGES = 4  # calibration images whose per-layer outputs rank the layers


def recipe_name(bits: int, kept: int = 0) -> str:
    return f"qdq-w{bits}" + (f"-fp32x{kept}" if kept else "")


def parse_recipe(name: str) -> tuple[int, int] | None:
    """``(weight bits, layers kept in fp32)`` of a recipe name, or None if it is not one."""
    match = _NAME.fullmatch(name)
    if match is None:
        return None
    return int(match["bits"]), int(match["kept"] or 0)


def recipe_order(saturates: bool, layers: int) -> list[str]:
    """What to try, in order: the plain recipe for the CPU, then 1, 2, 4, ... layers in fp32
    (at most half of the quantizable layers: beyond that INT8 buys little)."""
    bits = 7 if saturates else 8
    names = [recipe_name(bits)]
    kept = 1
    while kept <= max(1, layers // 2):
        names.append(recipe_name(bits, kept))
        kept *= 2
    return names


class OnnxQuantizer:
    """Makes the QDQ models of every recipe from one fp32 ONNX model and calibration inputs."""

    def __init__(self, fp32: Path, calibration: Sequence[np.ndarray[Any, Any]], work: Path):
        self.fp32 = fp32
        self.calibration = list(calibration)
        self.work = work
        self._prepared: Path | None = None
        self._ranking: dict[int, list[str]] = {}

    @property
    def prepared(self) -> Path:
        """The fp32 model after ONNX Runtime's pre-processing (shape inference, fusions)."""
        if self._prepared is None:
            quantization = _import_quantization()
            self._prepared = self.work / "prepared.onnx"
            quantization.shape_inference.quant_pre_process(
                str(self.fp32), str(self._prepared), skip_symbolic_shape=True
            )
        return self._prepared

    def quantizable_layers(self) -> list[str]:
        import onnx

        model = onnx.load(str(self.prepared), load_external_data=False)
        return [node.name for node in model.graph.node if node.op_type in QUANTIZED_OPS]

    def build(self, recipe: str, out: Path) -> None:
        parsed = parse_recipe(recipe)
        if parsed is None:
            raise ValueError(f"not an ONNX Runtime INT8 recipe: {recipe}")
        bits, kept = parsed
        excluded = self.most_sensitive(bits)[:kept] if kept else []
        self._quantize(out, reduce_range=bits == 7, exclude=excluded)

    def _quantize(self, out: Path, *, reduce_range: bool, exclude: Sequence[str]) -> None:
        import onnx

        q = _import_quantization()
        # The decoding after the last layers stays fp32 (``tail``): boxes in pixels and scores
        # in [0, 1] joined in one tensor would share one scale.
        tail = onnx_tail(onnx.load(str(self.prepared), load_external_data=False), QUANTIZED_OPS)
        q.quantize_static(
            str(self.prepared),
            str(out),
            _Reader(self.calibration),
            quant_format=q.QuantFormat.QDQ,
            per_channel=True,
            reduce_range=reduce_range,
            activation_type=q.QuantType.QUInt8,
            weight_type=q.QuantType.QInt8,
            calibrate_method=q.CalibrationMethod.MinMax,
            nodes_to_exclude=[*exclude, *tail],
        )

    def most_sensitive(self, bits: int) -> list[str]:
        """Quantizable layers, the one adding the most quantization noise first."""
        if bits not in self._ranking:
            plain = self.work / f"sensitivity-w{bits}.onnx"
            self._quantize(plain, reduce_range=bits == 7, exclude=())
            self._ranking[bits] = self._rank(plain)
        return self._ranking[bits]

    def _rank(self, quantized: Path) -> list[str]:
        import onnx
        from onnxruntime.quantization import qdq_loss_debug as debug

        samples = self.calibration[:SENSITIVITY_IMAGES]
        seen: dict[str, list[Any]] = {}
        for name, source in (("float", self.prepared), ("quantized", quantized)):
            augmented = self.work / f"augmented-{name}.onnx"
            debug.modify_model_output_intermediate_tensors(str(source), str(augmented))
            seen[name] = [debug.collect_activations(str(augmented), _Reader(samples))]
            augmented.unlink()
        matched = debug.create_activation_matching(seen["quantized"][0], seen["float"][0])
        snr = {
            name: debug.compute_signal_to_quantization_noice_ratio(pair["float"], pair["post_qdq"])
            for name, pair in matched.items()
            if "float" in pair
        }
        model = onnx.load(str(self.prepared), load_external_data=False)
        consumers: dict[str, list[Any]] = {}
        for node in model.graph.node:
            for tensor in node.input:
                consumers.setdefault(tensor, []).append(node)

        def quantized_output(tensor: str) -> str | None:
            # A layer's output is quantized after what is fused into it (Relu, Clip): follow
            # single consumers until a quantized tensor.
            while tensor not in snr:
                following = consumers.get(tensor, [])
                if len(following) != 1 or not following[0].output:
                    return None
                tensor = following[0].output[0]
            return tensor

        noise: list[tuple[float, str]] = []
        for node in model.graph.node:
            if node.op_type not in QUANTIZED_OPS or node.input[0] not in snr:
                continue
            output = quantized_output(node.output[0])
            if output is not None:
                noise.append((snr[node.input[0]] - snr[output], node.name))
        ranked = [name for _, name in sorted(noise, key=lambda pair: -pair[0])]
        # Layers whose noise could not be placed come last, in graph order.
        return ranked + [name for name in self.quantizable_layers() if name not in ranked]


class _Reader:
    """ONNX Runtime's calibration reader protocol over a list of inputs."""

    def __init__(self, inputs: Sequence[np.ndarray[Any, Any]]) -> None:
        self._inputs = iter(list(inputs))

    def get_next(self) -> dict[str, np.ndarray[Any, Any]] | None:
        item = next(self._inputs, None)
        return None if item is None else {INPUT_NAME: item}

    def __iter__(self) -> _Reader:
        return self

    def __next__(self) -> dict[str, np.ndarray[Any, Any]]:
        item = self.get_next()
        if item is None:
            raise StopIteration
        return item


def _import_quantization() -> Any:
    try:
        from onnxruntime import quantization
        from onnxruntime.quantization import shape_inference  # noqa: F401
    except ImportError as exc:
        raise MissingExtraError("INT8 quantisation", "onnx", exc) from None
    return quantization
