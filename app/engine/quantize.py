"""Static INT8: calibrated on real images through the server's own preprocessing, then judged.

ONNX Runtime's ``quantize_static`` makes a QDQ model (per-channel INT8 weights, UINT8
activations, the layout x86 VNNI kernels run fastest), calibrated with MinMax on the given
images decoded, resized, cropped and normalised exactly as requests are. OpenVINO runs the same
QDQ model as INT8 once converted to IR. Each INT8 artefact is then compared with eager fp32
PyTorch by the accuracy gate (``gate.py``) on the gate images (by default the calibration
photos themselves and variants of them the calibration never saw: crops, flips, colour
changes, recompression), and the report is stored beside it. Only a passing report lets it
serve.
"""

from __future__ import annotations

import copy
import io
import logging
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageEnhance, ImageOps

from app.engine.artifacts import REPORT, building, find, write_json
from app.engine.backends import Backend, TorchBackend
from app.engine.engine import InferenceEngine
from app.engine.errors import MissingExtraError, StartupError
from app.engine.export import INPUT_NAME, ONNX_FILE, OPENVINO_FILE, convert_to_openvino
from app.engine.factory import ensure_onnx, input_shape, int8_key
from app.engine.gate import INT8_GATE, compare, judged, probabilities
from app.engine.loading import LoadedModel
from app.settings import Settings
from preprocessing import ImageLimits, normalize_into, prepare

logger = logging.getLogger("batchserve")

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif"}


def load_images(folder: Path, limit: int | None = None) -> list[bytes]:
    """Every image file under ``folder`` (recursively), in name order."""
    paths = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if not paths:
        raise StartupError(f"no images (jpg, png, webp, bmp, gif) under {folder}")
    return [path.read_bytes() for path in paths[:limit]]


def variants(data: bytes, seed: int) -> list[bytes]:
    """Views of one photo a model should classify alike: a crop, a mirror image, brighter and
    duller colours, a harsher JPEG."""
    rng = random.Random(seed)
    image = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    width, height = image.size
    share = rng.uniform(0.7, 0.85)
    left = rng.randint(0, int(width * (1 - share)))
    top = rng.randint(0, int(height * (1 - share)))
    crop = image.crop((left, top, left + int(width * share), top + int(height * share)))
    views = [
        crop,
        ImageOps.mirror(image),
        ImageEnhance.Brightness(image).enhance(rng.uniform(1.15, 1.35)),
        ImageEnhance.Color(ImageEnhance.Contrast(image).enhance(0.75)).enhance(0.7),
    ]
    encoded = []
    for view in views:
        buffer = io.BytesIO()
        view.save(buffer, "JPEG", quality=90)
        encoded.append(buffer.getvalue())
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=rng.randint(25, 40))
    encoded.append(buffer.getvalue())
    return encoded


def gate_images(photos: Sequence[bytes]) -> list[bytes]:
    """The photos and their variants."""
    images = list(photos)
    for index, data in enumerate(photos):
        images += variants(data, seed=index)
    return images


def calibration_batches(
    loaded: LoadedModel, images: Sequence[bytes], batch_size: int = 1
) -> Iterator[dict[str, np.ndarray[Any, Any]]]:
    """Model inputs as the server makes them: decoded, resized, cropped, normalised (one image
    per batch by default: histogram calibrators need every batch the same shape)."""
    transform = loaded.transform
    limits = ImageLimits(resize_size=transform.resize_size)
    for start in range(0, len(images), batch_size):
        crops = [
            prepare(data, transform, limits).pixels for data in images[start : start + batch_size]
        ]
        batch = torch.empty((len(crops), *input_shape(loaded)), dtype=torch.float32)
        normalize_into([crop for crop in crops if crop is not None], batch, transform)
        yield {INPUT_NAME: batch.numpy()}


def quantize_onnx(
    fp32: Path, int8: Path, batches: Iterator[dict[str, np.ndarray[Any, Any]]]
) -> None:
    try:
        from onnxruntime.quantization import (
            CalibrationDataReader,
            CalibrationMethod,
            QuantFormat,
            QuantType,
            quantize_static,
        )
        from onnxruntime.quantization.shape_inference import quant_pre_process
    except ImportError as exc:
        raise MissingExtraError("INT8 quantisation", "onnx", exc) from None

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def get_next(self) -> dict[str, np.ndarray[Any, Any]] | None:
            return next(batches, None)

    prepared = int8.with_name("prepared.onnx")
    quant_pre_process(str(fp32), str(prepared), skip_symbolic_shape=True)
    quantize_static(
        str(prepared),
        str(int8),
        Reader(),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        calibrate_method=CalibrationMethod.MinMax,
    )
    prepared.unlink()


def gate_report(
    settings: Settings, loaded: LoadedModel, backend: Backend, images: Sequence[bytes],
    calibration: int,
) -> dict[str, Any]:  # fmt: skip
    """The accuracy gate: the INT8 backend against eager fp32 PyTorch, through the whole path."""
    shape = input_shape(loaded)
    reference = InferenceEngine(
        loaded,
        TorchBackend(
            copy.deepcopy(loaded.module).float(), torch.device("cpu"), torch.float32, shape
        ),
        max_batch_size=8,
        max_inflight_batches=1,
    )
    candidate = InferenceEngine(loaded, backend, max_batch_size=8, max_inflight_batches=1)
    report = judged(compare(probabilities(reference, images), probabilities(candidate, images)),
                    INT8_GATE)  # fmt: skip
    report |= {
        "model": loaded.name,
        "weights": loaded.weights,
        "backend": backend.name,
        "reference": "eager PyTorch fp32",
        "calibration_images": calibration,
        "gate_images": len(images),
    }
    return report


def build_int8(
    settings: Settings, loaded: LoadedModel, calibration: Path, gate: Path | None = None
) -> Path:
    """Make (or find) the INT8 artefact for ``settings.backend``, with its gate report."""
    from app.engine.backends.onnx_runtime import OnnxRuntimeBackend

    root, threads = settings.artifacts_dir, settings.intra_op_threads
    photos = load_images(calibration)
    # Calibrate on the photos and crops of them; judge on the photos and other views of them.
    calibration_set = list(photos) + [
        variants(data, 1000 + 10 * index + crop)[0]
        for index, data in enumerate(photos)
        for crop in range(3)
    ]
    judged_on = gate_images(load_images(gate) if gate is not None else photos)
    classes = len(loaded.labels)

    key = int8_key(loaded, "onnxruntime")
    path = find(root, key, ONNX_FILE)
    if path is None:
        fp32 = ensure_onnx(root, loaded)
        with building(root, key) as scratch:
            quantize_onnx(fp32, scratch / ONNX_FILE, calibration_batches(loaded, calibration_set))
            onnx_backend = OnnxRuntimeBackend(
                scratch / ONNX_FILE, torch.device("cpu"), precision="int8", threads=threads,
                classes=classes,
            )  # fmt: skip
            report = gate_report(settings, loaded, onnx_backend, judged_on, len(calibration_set))
            write_json(scratch / REPORT, report)
            _log(report, key.path(root) / REPORT)
        path = key.path(root) / ONNX_FILE
    if settings.backend != "openvino":
        return path

    from app.engine.backends.openvino_runtime import OpenVinoBackend

    ov_key = int8_key(loaded, "openvino")
    ov_path = find(root, ov_key, OPENVINO_FILE)
    if ov_path is None:
        with building(root, ov_key) as scratch:
            convert_to_openvino(path, scratch / OPENVINO_FILE)
            ov_backend = OpenVinoBackend(
                scratch / OPENVINO_FILE, precision="int8", threads=threads, concurrent_batches=1
            )
            report = gate_report(settings, loaded, ov_backend, judged_on, len(calibration_set))
            write_json(scratch / REPORT, report)
            _log(report, ov_key.path(root) / REPORT)
        ov_path = ov_key.path(root) / OPENVINO_FILE
    return ov_path


def _log(report: dict[str, Any], where: Path) -> None:
    outcome = "PASSED" if report["passed"] else "FAILED (" + "; ".join(report["failures"]) + ")"
    logger.warning(
        "INT8 accuracy gate for %s on %s: %s; top-1 agreement %.3f, top-5 overlap %.3f, "
        "largest probability difference %.3f on %d images; report: %s",
        report["model"], report["backend"], outcome, report["top1_agreement"],
        report["top5_overlap"], report["max_probability_difference"], report["gate_images"],
        where,
    )  # fmt: skip
