"""Agreement: does the served model answer what its own library answers, photo by photo?

The model is built as its library builds it (a torchvision architecture by name, or
``module:factory``), with a checkpoint's weights or, offline, weights whose answers spread
(``harness.spread``, saved beside the report and served from that checkpoint). The reference
is the library's own single-image eager pipeline (``harness.reference``: ``model([image])``
for a detector, the weights' preset for a segmenter or a classifier) on real photos of five
shapes (``harness.photos``). The server answers the same photos on each backend, sent as a
client would send them, equal shapes sharing batches. Also measured, for a detector: the
library's own batched call (``model(list_of_images)``, every photo padded to one canvas), the
answers padding costs; with ``--also-fit``, the server with another fit (the old letterbox,
say), the answers a replaced rule costs; and with ``--canvas-buckets``, the server padding
photos of different shapes into shared canvases (``CANVAS_BUCKETS``, opt-in), the answers those
larger batches cost.

Figures, as the fidelity tests and the start-up check state them: boxes judged from
``--confident-score``, recall and precision at IoU >= 0.5 with the same label, the matched
boxes' mean IoU, an instance segmenter's mask IoU, a keypoint detector's mean keypoint
distance (pixels) and PCK@0.1; a segmenter's share of pixels given the reference's class
(worst photo and mean) and mean IoU; a classifier's top-1 agreement and largest probability
difference.

Usage::

    python -m benchmarks agreement --model ssdlite320_mobilenet_v3_large --class-spread 1.3
    python -m benchmarks agreement --model deeplabv3_mobilenet_v3_large --backends torch
    python -m benchmarks agreement --model fasterrcnn_resnet50_fpn --weights model.pt
    python -m benchmarks agreement --model fasterrcnn_mobilenet_v3_large_320_fpn \
        --backends torch --canvas-buckets 320x640,640x320
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from app.engine import (
    Detected,
    ImageRequest,
    InferenceEngine,
    StartupError,
    build_engine,
    compare,
    compare_answers,
    resolve_task,
)
from app.settings import Settings
from benchmarks.common import RESULTS, command_line, machine, machine_markdown, publish, table
from harness import reference
from harness.photos import photos
from harness.spread import CLASS_SPREAD, SIGMOID_CONFIDENT, spread
from preprocessing import TransformConfig

SERVED_BATCH = 8


def library_model(name: str) -> nn.Module:
    """The model as its library builds it, random weights (replaced by the caller)."""
    if ":" in name:
        module, _, attr = name.partition(":")
        built: nn.Module = getattr(__import__(module, fromlist=[attr]), attr)()
        return built.eval()
    from torchvision.models import get_model

    return get_model(name, weights=None, weights_backbone=None).eval()  # type: ignore[no-any-return]


def preset(name: str) -> Any:
    """A torchvision architecture's weights' preset (read, never downloaded), or None."""
    from torchvision.models import get_model_weights

    try:
        return get_model_weights(name).DEFAULT
    except (ValueError, KeyError):
        return None


def library_answers(
    task: str, module: nn.Module, shots: Sequence[bytes], weights: Any, image_size: int | None
) -> list[Any]:
    """The library's own single-image answers (a classifier's as probability rows)."""
    if task == "detect":
        return list(reference.detected(module, shots))
    if task == "segment":
        size = image_size or (int(weights.transforms().resize_size[0]) if weights else 520)
        return reference.segmented(module, shots, TransformConfig(crop_size=size,
                                                                  resize_size=size))  # fmt: skip
    if weights is None:
        raise SystemExit("a classifier's reference is its weights' preset: a torchvision name")
    return list(reference.classified(module, shots, weights))


def batched_library_answers(module: nn.Module, shots: Sequence[bytes]) -> list[Detected]:
    """A torchvision detector's answers to one call on every photo (padded to one canvas)."""
    images = [reference.decoded(data).float() / 255 for data in shots]
    with torch.inference_mode():
        found = module.eval()(images)
    return [Detected(each["boxes"].numpy(), each["scores"].numpy(), each["labels"].numpy())
            for each in found]  # fmt: skip


def served_answers(
    engine: InferenceEngine, task: str, shots: Sequence[bytes]
) -> tuple[list[Any], Counter[str]]:
    """The engine's answers, ``SERVED_BATCH`` photos at a time (equal shapes side by side,
    each batch split by canvas as the server splits it), and the batch sizes formed per
    canvas."""
    answers: list[Any] = []
    formed: Counter[str] = Counter()
    for start in range(0, len(shots), SERVED_BATCH):
        chunk = shots[start : start + SERVED_BATCH]
        requests = [ImageRequest(engine.prepare(data), top_k=5, dense=task == "classify",
                                 max_detections=300) for data in chunk]  # fmt: skip
        for outcome in engine.run_batch(requests):
            if isinstance(outcome, BaseException):
                raise outcome
            if outcome.canvas is not None:
                formed[f"{outcome.canvas[0]}x{outcome.canvas[1]}"] += 1
            answers.append(answer_of(task, outcome))
    return answers, formed


def answer_of(task: str, prediction: Any) -> Any:
    if task == "detect":
        return prediction.detected
    if task == "segment":
        return prediction.mask
    return torch.from_numpy(prediction.probabilities)


def figures(task: str, want: list[Any], got: list[Any], confident: float) -> dict[str, Any]:
    if task == "classify":
        return compare(torch.stack(want), torch.stack(got))
    return compare_answers(task, want, got, confident_score=confident)


def without_empty_boxes(found: Detected) -> Detected:
    """The detections whose boxes have an area (the server never answers one without)."""
    keep = (found.boxes[:, 2] > found.boxes[:, 0]) & (found.boxes[:, 3] > found.boxes[:, 1])
    masks = [m for m, kept in zip(found.masks, keep, strict=True) if kept] if found.masks else None
    points = found.keypoints[keep] if found.keypoints is not None else None
    return Detected(found.boxes[keep], found.scores[keep], found.labels[keep], masks, points)


def run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    module = library_model(args.model)
    if args.task == "auto" and ":" in args.model:
        raise SystemExit("--task: a factory's task is not read from its name")
    task = resolve_task(args.task, args.model)
    weights_preset = preset(args.model) if ":" not in args.model else None
    shots = photos()
    if args.weights == "spread":

        def calibrate(model: nn.Module) -> list[Any]:
            return library_answers(task, model, shots[::4], weights_preset, args.image_size)

        spread(module, calibrate, class_spread=args.class_spread,
               sigmoid_confident=args.sigmoid_confident)  # fmt: skip
        checkpoint = folder / "spread.pt"
        torch.save(module.state_dict(), checkpoint)
    else:
        checkpoint = Path(args.weights)
        module.load_state_dict(torch.load(checkpoint, weights_only=True))
    want = library_answers(task, module, shots, weights_preset, args.image_size)
    if task == "detect":
        want = [without_empty_boxes(each) for each in want]
    sides: list[dict[str, Any]] = []
    if task == "detect":
        together = [without_empty_boxes(each) for each in batched_library_answers(module, shots)]
        sides.append({"side": "library, every photo in one call (padded)",
                      **figures(task, want, together, args.confident_score)})  # fmt: skip
    served = [(backend, args.fit, "") for backend in args.backends]
    served += [("torch", fit, "") for fit in args.also_fit]
    served += [("torch", args.fit, buckets) for buckets in args.canvas_buckets]
    for backend, fit, buckets in served:
        extra = {"image_size": args.image_size} if args.image_size else {}
        settings = Settings(
            _env_file=None, model=args.model, task=task, weights=str(checkpoint),
            backend=backend, precision="fp32", fit=fit, max_batch_size=SERVED_BATCH,
            artifacts_dir=folder / "artifacts", log_level="warning", canvas_buckets=buckets,
            **extra,
        )  # fmt: skip
        label = f"batchserve {backend}" + (f", FIT={fit}" if fit != "auto" else "")
        label += f", CANVAS_BUCKETS={buckets}" if buckets else ""
        try:
            engine = build_engine(settings.own_model())
        except StartupError as exc:
            sides.append({"side": label, "not_served": str(exc).splitlines()[0]})
            continue
        got, formed = served_answers(engine, task, shots)
        sides.append({"side": label, "backend": engine.backend.name,
                      "transform": engine.transform.as_dict(), "batches": dict(formed),
                      **figures(task, want, got, args.confident_score)})  # fmt: skip
    return {"model": args.model, "task": task, "weights": "spread" if args.weights == "spread"
            else args.weights, "photos": len(shots), "confident_score": args.confident_score,
            "sides": sides, "machine": machine()}  # fmt: skip


COLUMNS = {
    "detect": ("confident_boxes", "box_recall", "box_precision", "matched_iou", "mask_iou",
               "keypoint_distance", "keypoint_pck"),
    "segment": ("worst_pixel_agreement", "mean_pixel_agreement", "mean_iou"),
    "classify": ("top1_agreement", "top5_overlap", "max_probability_difference"),
}  # fmt: skip


def formed(batches: dict[str, int]) -> str:
    """Images served per canvas, as ``10 at 320x320``."""
    return ", ".join(f"{count} at {canvas}" for canvas, count in batches.items())


def markdown(report: dict[str, Any]) -> str:
    task = report["task"]
    columns = [name for name in COLUMNS[task]
               if any(name in side for side in report["sides"])]  # fmt: skip
    rows = [[side["side"], *(side.get(name, "") for name in columns),
             side.get("not_served", formed(side.get("batches", {})))]
            for side in report["sides"]]  # fmt: skip
    judged = (f"boxes judged from a score of {report['confident_score']}, matched at IoU >= 0.5 "
              "with the same label" if task == "detect" else "")  # fmt: skip
    return f"""# Agreement with the library: {report["model"]} ({task})

Against the library's own single-image eager pipeline on {report["photos"]} real photos of
five shapes (`harness.photos`), weights: {report["weights"]}. {judged}

{table(["side", *(name.replace("_", " ") for name in columns), "images per canvas"], rows)}

## Machine

{machine_markdown(report["machine"])}
"""


def parser() -> argparse.ArgumentParser:
    p = command_line(__doc__, __file__)
    p.add_argument("--model", default="ssdlite320_mobilenet_v3_large")
    p.add_argument("--task", default="auto")
    p.add_argument("--weights", default="spread", help="a checkpoint, or spread (offline)")
    p.add_argument("--backends", nargs="*", default=["torch", "onnxruntime", "openvino"])
    p.add_argument("--fit", default="auto")
    p.add_argument("--also-fit", nargs="*", default=[], help="served on torch with these too")
    p.add_argument(
        "--canvas-buckets",
        nargs="*",
        default=[],
        help="served on torch with each of these CANVAS_BUCKETS too (e.g. 320x640,640x320)",
    )
    p.add_argument("--image-size", type=int)
    p.add_argument("--confident-score", type=float, default=0.5)
    p.add_argument("--class-spread", type=float, default=CLASS_SPREAD)
    p.add_argument("--sigmoid-confident", type=float, default=SIGMOID_CONFIDENT)
    p.add_argument("--name", help="write results/<name>.md and .json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        report = run(args, Path(scratch))
    text = markdown(report)
    if args.name:
        publish(args.name, report, text, RESULTS)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
