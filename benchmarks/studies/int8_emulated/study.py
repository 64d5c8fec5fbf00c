"""Does an INT8 model keep its accuracy on a CPU of another INT8 class? Judged on this CPU and
on an emulated AVX2 CPU without VNNI.

efficientnet-lite0 is quantized as ``python -m app.quantize`` does, for each runtime, once with
the recipes of this CPU's INT8 class and once with those of the other kind (``--for-cpu``:
7-bit weights for x86 without VNNI, 8-bit for VNNI/AMX), calibrated on half of the bundled
photos. Each model is then judged on the held-out half and its variants twice: here, and
under ``qemu-x86_64 -cpu Haswell`` (user-mode emulation of an AVX2 CPU without AVX-512 or VNNI,
whose ``vpmaddubsw`` saturates as the real instruction does), through
``benchmarks/int8_evaluate.py``. Needs ``qemu-user`` (Debian: ``apt-get install qemu-user``);
the emulated runs take minutes.

Usage: ``python -m benchmarks int8_emulated``
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.engine import (
    GATE_IMAGES,
    REPORT,
    Bounds,
    build_int8,
    calibration_batches,
    compare,
    eager_reference,
    int8_bounds,
    load_model,
    named,
    probabilities,
    read_json,
    this_cpu,
    verdict,
)
from app.settings import Settings
from benchmarks.common import command_line, machine, machine_markdown, publish, table
from tests.real_model import FACTORY, photos, write_labels

HERE = Path(__file__).resolve().parent  # the study's report and its runs

EMULATED = ["qemu-x86_64", "-cpu", "Haswell"]
SHOWN = ("confident_top1_agreement", "plausible_top1", "mean_total_variation",
         "max_probability_difference", "top1_agreement")  # fmt: skip


def evaluate(backend: str, model: Path, inputs: Path, emulated: bool) -> np.ndarray[Any, Any]:
    output = inputs.with_name(f"out-{time.monotonic_ns()}.npy")
    command = [sys.executable, "-m", "benchmarks.int8_evaluate", backend, str(model),
               str(inputs), str(output)]  # fmt: skip
    subprocess.run(EMULATED + command if emulated else command, check=True,
                   stderr=subprocess.DEVNULL, cwd=Path(__file__).parent.parent)  # fmt: skip
    result: np.ndarray[Any, Any] = np.load(output)
    return result


def run(folder: Path, runtimes: list[str]) -> dict[str, Any]:
    pictures = folder / "photos"
    pictures.mkdir()
    for name, data in photos().items():
        (pictures / f"{name}.jpg").write_bytes(data)
    labels = write_labels(folder / "labels.txt")
    here = this_cpu()
    other = named("avx512-vnni" if here.saturates else "avx2")
    rows: list[dict[str, Any]] = []
    for runtime in runtimes:
        for target in (here, other):
            settings = Settings(_env_file=None, model=FACTORY, weights="auto", labels=labels,
                                backend=runtime, precision="int8", log_level="warning",
                                artifacts_dir=folder / f"artifacts-{target.name}")  # fmt: skip
            loaded = load_model(FACTORY, "auto", labels)
            path = build_int8(settings.own_model(), loaded, pictures, rebuild=True, target=target)
            report = read_json(path.parent / REPORT) or {}
            gate = [item.read_bytes() for item in sorted((path.parent / GATE_IMAGES).iterdir())]
            inputs = folder / "inputs.npy"
            np.save(inputs, np.concatenate(list(calibration_batches(loaded, gate))))
            reference = probabilities(eager_reference(loaded), gate)
            bounds = int8_bounds(settings.own_model())
            assert isinstance(bounds, Bounds)  # a classifier's
            row: dict[str, Any] = {"runtime": runtime, "recipes_for": target.name,
                                   "recipe": report.get("recipe"),
                                   "passed_when_built": report.get("passed")}  # fmt: skip
            for where, emulated in ((here.name, False), ("avx2 (emulated)", True)):
                started = time.perf_counter()
                candidate = torch.from_numpy(evaluate(runtime, path, inputs, emulated))
                figures = compare(reference, candidate)
                failures = verdict(figures, bounds)
                row[where] = {**{key: figures[key] for key in SHOWN}, "passed": not failures,
                              "failures": failures,
                              "seconds": time.perf_counter() - started}  # fmt: skip
            rows.append(row)
            print(row, flush=True)
    return {"machine": machine(), "model": "efficientnet-lite0", "this_cpu": here.describe(),
            "rows": rows}  # fmt: skip


def markdown(data: dict[str, Any]) -> str:
    here = data["this_cpu"]["name"]
    header = ["runtime", "recipes for", "recipe"]
    lines = []
    for where in (here, "avx2 (emulated)"):
        header += [f"{where}: plausible top-1", "mean TV", "max diff", "gate"]
    for row in data["rows"]:
        line: list[Any] = [row["runtime"], row["recipes_for"], row["recipe"]]
        for where in (here, "avx2 (emulated)"):
            judged = row[where]
            line += [judged["plausible_top1"], judged["mean_total_variation"],
                     judged["max_probability_difference"],
                     "pass" if judged["passed"] else "FAIL"]  # fmt: skip
        lines.append(line)
    return f"""# INT8 accuracy across CPU classes: {data["model"]}

`python -m benchmarks int8_emulated`. Each runtime's INT8 model is built twice, with the
recipes of this CPU's INT8 class (**{here}**) and with those of the other kind, then judged
against eager fp32 PyTorch on the held-out photos and their variants, here and under
`qemu-x86_64 -cpu Haswell` (AVX2 without VNNI, emulated: its `vpmaddubsw` saturates like the
real one). Gate: confident top-1 agreement, plausible top-1, mean total variation (TV) and the
largest probability difference, with the default `INT8_GATE_*` bounds.

{table(header, lines)}

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    parser = command_line(__doc__, __file__)
    parser.add_argument("--runtimes", nargs="+", default=["onnxruntime", "openvino"])
    parser.add_argument("--name", default="int8-emulated-efficientnet-lite0")
    args = parser.parse_args()
    if shutil.which(EMULATED[0]) is None:
        print("needs qemu-x86_64 (apt-get install qemu-user)", file=sys.stderr)
        raise SystemExit(2)
    with tempfile.TemporaryDirectory() as folder:
        data = run(Path(folder), args.runtimes)
    publish(args.name, data, markdown(data), folder=HERE)


if __name__ == "__main__":
    main()
