"""Static INT8: calibrated on real images through the server's own preprocessing, with the
recipe this CPU needs, then judged on images calibration never saw.

Longer than most modules: the split of the photos, the recipes tried in order, the gate's
run and the kept report are one procedure for both runtimes; what differs per runtime is in
``quantize_onnx.py`` and ``quantize_openvino.py``.

The images under the calibration folder are split in name order: every other photo calibrates
(with crops of it), the rest are held out for the accuracy gate (with variants of each: a
crop, a mirror image, brighter and duller colours, a harsh JPEG); ``--gate DIR`` gives the gate
its own photos instead. Below ``INT8_GATE_MIN_IMAGES`` gate images the gate refuses to judge.

The recipes follow the CPU's INT8 class (``int8_class.py``) and the runtime (ONNX Runtime:
``quantize_onnx.py``, OpenVINO: ``quantize_openvino.py``) and are tried in order until one
passes the gate against eager fp32 PyTorch. Each is timed against fp32 on the same runtime: one
that passes but runs slower than fp32 is not served, and then none after it (keeping more
layers in fp32 only makes it slower). The report lists every recipe tried with its figures,
and is bound to what it judged (``int8_report.py``); the gate images are stored beside the
model, so that a start-up that cannot believe the report can judge the model again.
"""

from __future__ import annotations

import hashlib
import io
import logging
import random
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image, ImageEnhance, ImageOps

from app.engine.backends import Backend, open_runtime
from app.engine.checks.gate import eager_reference, engine_for, probabilities
from app.engine.checks.precision import Rate, images_per_second, side_by_side
from app.engine.checks.task_gate import gate_answers, gate_compare, too_few_to_judge
from app.engine.errors import StartupError
from app.engine.int8.int8_class import Int8Class, this_cpu
from app.engine.int8.int8_report import (
    GATE_IMAGES,
    binding,
    gate_verdict,
    int8_bounds,
    int8_failures,
)
from app.engine.model.artifacts import REPORT, building, find, read_json, write_json
from app.engine.model.export import ONNX_FILE, OPENVINO_FILE
from app.engine.model.loading import LoadedModel, loaded_digest
from app.engine.model.store import (
    ensure_onnx,
    ensure_openvino,
    input_shape,
    int8_key,
    runtime_decode,
)
from app.engine.tasks import server_nms
from app.model_config import ModelConfig
from preprocessing import ImageLimits, normalize_into, prepare

logger = logging.getLogger("batchserve")

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif"}
CROPS_PER_CALIBRATION_PHOTO = 3
SPEED_BATCH = 8


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


def calibration_images(photos: Sequence[bytes]) -> list[bytes]:
    """The photos and crops of them."""
    return list(photos) + [
        variants(data, 1000 + 10 * index + crop)[0]
        for index, data in enumerate(photos)
        for crop in range(CROPS_PER_CALIBRATION_PHOTO)
    ]


def split(photos: Sequence[bytes]) -> tuple[list[bytes], list[bytes]]:
    """Calibration and gate photos: alternately, in name order."""
    return list(photos[0::2]), list(photos[1::2])


def calibration_batches(
    loaded: LoadedModel, images: Sequence[bytes], batch_size: int = 1
) -> Iterator[np.ndarray[Any, Any]]:
    """Model inputs as the server makes them: decoded, resized, cropped, normalised (one image
    per batch by default: histogram calibrators need every batch the same shape)."""
    transform = loaded.transform
    limits = ImageLimits(resize_size=transform.resize_size)
    for start in range(0, len(images), batch_size):
        prepared = [prepare(data, transform, limits) for data in images[start : start + batch_size]]
        # Each image on its canvas, as the server places it (a model whose canvas follows the
        # image's shape: batch_size 1 gives each its own).
        height = max(each.canvas[0] for each in prepared)
        width = max(each.canvas[1] for each in prepared)
        batch = torch.empty((len(prepared), input_shape(loaded)[0], height, width))
        pixels = [each.pixels for each in prepared if each.pixels is not None]
        normalize_into(pixels, batch, transform, [each.placement for each in prepared])
        yield batch.numpy()


def _digest(images: Sequence[bytes]) -> str:
    digest = hashlib.sha256()
    for data in images:
        digest.update(hashlib.sha256(data).digest())
    return digest.hexdigest()


def runtime_backend(
    backend: str, path: Path, loaded: LoadedModel, precision: str, threads: int
) -> Backend:
    """The runtime's model at ``path`` on the CPU, with a detector's decoding of its graph's
    outputs in PyTorch (``store.runtime_decode``)."""
    return open_runtime(backend, path, precision=precision, threads=threads,
                        classes=len(loaded.labels), decode=runtime_decode(loaded))  # fmt: skip


class Quantizer(Protocol):
    def build(self, recipe: str, out: Path) -> None: ...


class _Runtime:
    """What differs between the runtimes: the artefact's file, the backend that runs it, the
    fp32 artefact and quantizer for this model, and the recipes in order."""

    def __init__(self, config: ModelConfig, loaded: LoadedModel, work: Path) -> None:
        self.name = config.backend
        self.threads = config.threads
        self.loaded = loaded
        self.file = OPENVINO_FILE if self.name == "openvino" else ONNX_FILE
        self.work = work

    def backend(self, path: Path, precision: str = "int8") -> Backend:
        return runtime_backend(self.name, path, self.loaded, precision, self.threads)

    def fp32_backend(self, root: Path) -> tuple[Backend, Path]:
        loaded = self.loaded
        if self.name == "openvino":
            path = ensure_openvino(root, loaded, "fp32")
        else:
            path = ensure_onnx(root, loaded)
        return self.backend(path, "fp32"), path

    def quantizer(
        self,
        fp32: Path,
        inputs: list[np.ndarray[Any, Any]],
        reference: Callable[[], torch.Tensor],
        saturates: bool,
        task: str,
    ) -> tuple[Quantizer, list[str]]:
        """The runtime's quantizer and recipes; ``reference()`` gives fp32's probabilities
        on the calibration images (asked only by accuracy control, whose metric is the
        classifiers': other tasks try the plain recipe alone on OpenVINO)."""
        if self.name == "openvino":
            import app.engine.int8.quantize_openvino as ov

            def expected() -> list[np.ndarray[Any, Any]]:
                return [row.numpy() for row in reference()]

            order = ov.recipe_order(saturates)
            return ov.OpenVinoQuantizer(fp32, inputs, expected), (
                order if task == "classify" else order[:1]
            )
        import app.engine.int8.quantize_onnx as ort

        onnx_quantizer = ort.OnnxQuantizer(fp32, inputs, self.work)
        order = ort.recipe_order(saturates, len(onnx_quantizer.quantizable_layers()))
        return onnx_quantizer, order


@dataclass(frozen=True)
class ImageSets:
    """What calibrates and what judges, kept apart."""

    calibration_photos: int
    calibration: list[bytes]
    gate_photos: int
    gate: list[bytes]

    @classmethod
    def from_folders(cls, config: ModelConfig, calibration: Path, gate: Path | None) -> ImageSets:
        photos = load_images(calibration)
        if gate is None:
            calibration_photos, gate_photos = split(photos)
        else:
            calibration_photos, gate_photos = photos, load_images(gate)
        judged_on = gate_images(gate_photos)
        if len(judged_on) < config.int8_gate_min_images:
            raise StartupError(
                f"the INT8 gate needs at least {config.int8_gate_min_images} images "
                f"(INT8_GATE_MIN_IMAGES) and would have {len(judged_on)}: {len(gate_photos)} "
                f"held-out photos and {len(judged_on) - len(gate_photos)} variants of them. "
                f"Give the calibration folder more photos (every other one is held out for "
                f"the gate), or the gate its own with --gate DIR"
            )
        return cls(len(calibration_photos), calibration_images(calibration_photos),
                   len(gate_photos), judged_on)  # fmt: skip

    def describe(self) -> dict[str, Any]:
        return {
            "calibration_images": len(self.calibration),
            "calibration_photos": self.calibration_photos,
            "calibration_digest": _digest(self.calibration),
            "gate_images": len(self.gate),
            "gate_photos": self.gate_photos,
            "gate_digest": _digest(self.gate),
        }


def build_int8(
    config: ModelConfig,
    loaded: LoadedModel,
    calibration: Path,
    gate: Path | None = None,
    *,
    recipe: str | None = None,
    rebuild: bool = False,
    target: Int8Class | None = None,
    rate: Rate = images_per_second,
) -> Path:
    """Make the INT8 artefact for ``config.backend`` with its gate report. One made from the
    same images (and recipe, if one is named) is reused unless ``rebuild``; one made from
    others is replaced. ``recipe`` tries that recipe alone instead of the CPU's order;
    ``target`` takes the recipes of another CPU class (the gate still judges on this CPU, and
    the target's start-up judges again on its own); ``rate`` measures a backend's speed (the
    machine's, unless a caller knows better)."""
    root = config.artifacts_dir
    key = int8_key(loaded, config.backend)
    runtime_file = OPENVINO_FILE if config.backend == "openvino" else ONNX_FILE
    if recipe is not None and not is_recipe(config.backend, recipe):
        raise StartupError(
            f"{config.backend} has no INT8 recipe {recipe!r}: "
            f"{RECIPE_FORMS.get(config.backend, 'none')}"
        )
    if recipe is not None and recipe.endswith("accuracy-control") and loaded.task != "classify":
        raise StartupError(
            f"{recipe}: accuracy control measures class probabilities; a model of "
            f"TASK={loaded.task} takes {plain_recipe(config.backend, this_cpu())} or the 7-bit one"
        )
    sets = ImageSets.from_folders(config, calibration, gate)
    described = sets.describe()
    existing = find(root, key, runtime_file)
    if existing is not None and not rebuild:
        made = read_json(existing.parent / REPORT) or {}
        same = all(made.get(name) == described[name] for name in ("calibration_digest",
                                                                   "gate_digest"))  # fmt: skip
        if same and recipe in (None, made.get("recipe")):
            return existing
    judged_on = sets.gate
    bounds = int8_bounds(config, loaded.task)

    with building(root, key, replace=True) as scratch:
        work = scratch / "work"
        work.mkdir()
        runtime = _Runtime(config, loaded, work)
        fp32_backend, fp32_path = runtime.fp32_backend(root)
        nms_iou = server_nms(loaded.task, config.model, config.nms_iou)
        reference_engine = eager_reference(loaded, nms_iou=nms_iou)
        reference = gate_answers(reference_engine, judged_on)
        inputs = list(calibration_batches(loaded, sets.calibration))
        target = target or this_cpu()
        quantizer, order = runtime.quantizer(
            fp32_path,
            inputs,
            lambda: probabilities(reference_engine, sets.calibration),
            target.saturates,
            loaded.task,
        )
        tried: list[dict[str, Any]] = []
        chosen: tuple[Path, dict[str, Any]] | None = None
        for name in [recipe] if recipe else order:
            candidate = work / name / runtime.file
            candidate.parent.mkdir()
            quantizer.build(name, candidate)
            backend = runtime.backend(candidate)
            answers = gate_answers(engine_for(loaded, backend, nms_iou=nms_iou), judged_on)
            figures = gate_compare(loaded.task, reference, answers, bounds)
            figures["bounds"] = asdict(bounds)
            fp32_rate, int8_rate = side_by_side(fp32_backend, backend, input_shape(loaded),
                                                SPEED_BATCH, rate=rate)  # fmt: skip
            figures |= {"recipe": name, "images_per_second": int8_rate,
                        "fp32_images_per_second": fp32_rate}  # fmt: skip
            figures["failures"] = int8_failures(figures, bounds)
            figures["passed"] = not figures["failures"]
            tried.append(figures)
            logger.info("INT8 recipe %s: %s", name, _summary(figures))
            if chosen is None or figures["passed"]:
                chosen = (candidate, figures)  # the first is kept when none passes
            if figures["passed"] or (int8_rate < fp32_rate and not gate_verdict(figures, bounds)):
                break  # accurate but slower: more layers in fp32 would only run slower
            if too_few_to_judge(figures, bounds):
                break  # fp32's answers on the gate images judge no recipe
        assert chosen is not None
        path, figures = chosen
        for part in path.parent.iterdir():
            part.rename(scratch / part.name)
        shutil.rmtree(work)
        stored = scratch / GATE_IMAGES
        stored.mkdir()
        for index, data in enumerate(judged_on):
            (stored / f"{index:04d}").write_bytes(data)
        report = {
            **binding(
                loaded,
                loaded_digest(loaded),
                scratch / runtime.file,
                config.backend,
                runtime.threads,
            ),
            **figures,
            "backend": config.backend,
            "weights": loaded.weights,
            "reference": "eager PyTorch fp32",
            "cpu": this_cpu().describe(),
            "recipes_for": target.name,
            "recipes": tried,
            **described,
        }
        write_json(scratch / REPORT, report)
    final = key.path(root)
    _log(report, final / REPORT)
    return final / runtime.file


def is_recipe(backend: str, name: str) -> bool:
    if backend == "openvino":
        from app.engine.int8.quantize_openvino import parse_recipe as parse_openvino

        return parse_openvino(name) is not None
    from app.engine.int8.quantize_onnx import parse_recipe as parse_onnx

    return parse_onnx(name) is not None


def plain_recipe(backend: str, cpu: Int8Class) -> str:
    """The first recipe a CPU of this class tries: the fastest INT8 model it can run."""
    prefix = "nncf" if backend == "openvino" else "qdq"
    return f"{prefix}-w{7 if cpu.saturates else 8}"


RECIPE_FORMS = {
    "onnxruntime": "qdq-w8, qdq-w7, qdq-w8-fp32xN or qdq-w7-fp32xN",
    "openvino": "nncf-w8, nncf-w7, nncf-w8-accuracy-control or nncf-w7-accuracy-control",
}


def _summary(report: dict[str, Any]) -> str:
    outcome = "PASSED" if report["passed"] else "FAILED (" + "; ".join(report["failures"]) + ")"
    speed = (f"{report['images_per_second']:.1f} images/s against fp32's "
             f"{report['fp32_images_per_second']:.1f}")  # fmt: skip
    if "top1_agreement" not in report:  # a detector's, a segmenter's or an encoder's figures
        shown = ", ".join(
            f"{name.replace('_', ' ')} {value if isinstance(value, int) else f'{value:.4f}'}"
            for name, value in report.items()
            if name in _TASK_FIGURES and isinstance(value, int | float)
        )  # fmt: skip
        return f"{outcome}; {shown} on {report['images']} images; {speed}"
    return (
        f"{outcome}; confident top-1 agreement {report['confident_top1_agreement']:.3f}, "
        f"plausible top-1 {report['plausible_top1']:.3f}, mean total variation "
        f"{report['mean_total_variation']:.3f}, largest probability difference "
        f"{report['max_probability_difference']:.3f} (top-1 agreement "
        f"{report['top1_agreement']:.3f}, top-5 overlap {report['top5_overlap']:.3f}) on "
        f"{report['images']} images; {speed}"
    )


_TASK_FIGURES = ("confident_boxes", "box_recall", "box_precision", "matched_iou",
                 "worst_pixel_agreement", "mean_pixel_agreement", "mean_iou", "mean_cosine",
                 "worst_cosine", "neighbour_agreement")  # fmt: skip


def _log(report: dict[str, Any], where: Path) -> None:
    logger.warning(
        "INT8 accuracy gate for %s on %s (CPU INT8 class %s), recipe %s: %s; report: %s",
        report["model"], report["backend"], report["cpu_int8_class"], report["recipe"],
        _summary(report), where,
    )  # fmt: skip
