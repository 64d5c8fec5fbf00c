"""INT8 recipes for OpenVINO: NNCF post-training quantization, then its accuracy control.

- ``nncf-w8``: ``nncf.quantize`` with full 8-bit weights (``OverflowFix.DISABLE``), for CPUs
  whose INT8 products do not saturate (VNNI, AMX, Arm);
- ``nncf-w7``: the same with NNCF's overflow fix on every layer (``OverflowFix.ENABLE``: 7-bit
  weights), for x86 CPUs without VNNI;
- ``...-accuracy-control``: ``nncf.quantize_with_accuracy_control``, which quantizes the same
  way and then puts layers back in fp32, the most harmful first, until the model's answers on
  the calibration images stay within ``MAX_DROP`` of the fp32 model's.

Activation ranges are the calibration images' min and max (NNCF's default averages each
image's range, which clips the activations of the images that calibration saw least of).
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from app.engine.errors import MissingExtraError
from app.engine.int8.tail import openvino_tail
from app.engine.model.export import import_openvino

_NAME = re.compile(r"^nncf-w(?P<bits>[78])(?P<control>-accuracy-control)?$")
# Accuracy control's metric: the mean over calibration images of 1 - the total variation
# distance between fp32's and INT8's class probabilities; it may drop this much below fp32's.
MAX_DROP = 0.05
# Layers are ranked by their harm on this many of those images (all of them: minutes).
RANKING_IMAGES = 12


def recipe_order(saturates: bool) -> list[str]:
    bits = 7 if saturates else 8
    return [f"nncf-w{bits}", f"nncf-w{bits}-accuracy-control"]


def parse_recipe(name: str) -> tuple[int, bool] | None:
    """``(weight bits, accuracy control)`` of a recipe name, or None if it is not one."""
    match = _NAME.fullmatch(name)
    return None if match is None else (int(match["bits"]), bool(match["control"]))


class OpenVinoQuantizer:
    """Makes the INT8 IR of every recipe from one fp32 IR and calibration inputs, with the
    fp32 reference's probabilities on them for accuracy control."""

    def __init__(
        self,
        fp32: Path,
        calibration: Sequence[np.ndarray[Any, Any]],
        reference: Callable[[], Sequence[np.ndarray[Any, Any]]],
    ) -> None:
        self.fp32 = fp32
        self.calibration = list(calibration)
        self.reference = reference  # computed only if accuracy control needs it

    def build(self, recipe: str, out: Path) -> None:
        parsed = parse_recipe(recipe)
        if parsed is None:
            raise ValueError(f"not an OpenVINO INT8 recipe: {recipe}")
        bits, control = parsed
        nncf = _import_nncf()
        from nncf.quantization.advanced_parameters import (
            AdvancedAccuracyRestorerParameters,
            AdvancedQuantizationParameters,
            OverflowFix,
        )
        from nncf.quantization.range_estimator import RangeEstimatorParametersSet

        ov = import_openvino()
        parameters = AdvancedQuantizationParameters(
            overflow_fix=OverflowFix.ENABLE if bits == 7 else OverflowFix.DISABLE,
            activations_range_estimator_params=RangeEstimatorParametersSet.MINMAX,
        )
        model = ov.Core().read_model(str(self.fp32))
        calibration = nncf.Dataset(self.calibration)
        # The decoding after the last layers stays fp32, as in ONNX Runtime's recipes.
        ignored = nncf.IgnoredScope(names=openvino_tail(model), validate=False)
        with _quiet():
            if control:
                expected = list(self.reference())
                validation = nncf.Dataset(list(zip(self.calibration, expected, strict=True)))
                ranking = min(RANKING_IMAGES, len(self.calibration))
                quantized = nncf.quantize_with_accuracy_control(
                    model,
                    calibration,
                    validation,
                    _agreement,
                    max_drop=MAX_DROP,
                    subset_size=len(self.calibration),
                    advanced_quantization_parameters=parameters,
                    advanced_accuracy_restorer_parameters=AdvancedAccuracyRestorerParameters(
                        ranking_subset_size=ranking
                    ),
                    ignored_scope=ignored,
                )
            else:
                quantized = nncf.quantize(
                    model,
                    calibration,
                    subset_size=len(self.calibration),
                    advanced_parameters=parameters,
                    ignored_scope=ignored,
                )
        ov.save_model(quantized, str(out), compress_to_fp16=False)


def _agreement(
    compiled: Any, items: Iterable[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]
) -> tuple[float, list[float]]:
    """Accuracy control's metric, and its value per image (NNCF ranks layers with them)."""
    scores = []
    for inputs, expected in items:
        logits = np.asarray(compiled({0: inputs})[0], dtype=np.float64)[0]
        probabilities = np.exp(logits - logits.max())
        probabilities /= probabilities.sum()
        scores.append(float(1 - 0.5 * np.abs(probabilities - expected).sum()))
    return float(np.mean(scores)), scores


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """NNCF logs every step and draws progress bars on stdout: keep both out of the server's
    output."""
    logger = logging.getLogger("nncf")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


def _import_nncf() -> Any:
    try:
        import nncf
    except ImportError as exc:
        raise MissingExtraError("INT8 quantisation for OpenVINO", "openvino", exc) from None
    return nncf
