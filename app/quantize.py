"""``python -m app.quantize --calibration DIR``: build the INT8 model and run its accuracy gate.

Quantizes the model for ``BATCHSERVE_BACKEND`` (``onnxruntime``: static QDQ; ``openvino``:
NNCF) with the recipes this CPU's INT8 arithmetic needs (7-bit weights on x86 without VNNI),
calibrated on every other photo under ``--calibration`` (in name order) passed through the
server's own preprocessing, and judges each recipe in turn against eager fp32 PyTorch on the
photos held out (``--gate DIR``: on those instead) and variants of them, until one passes and
runs faster than fp32. The report, stored beside the model, lists every recipe tried. The
server serves ``PRECISION=int8`` only from a model whose report holds on its CPU. Every run
builds anew (``--recipe NAME`` tries that recipe alone). Exits 1 when the gate fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from app.engine.errors import StartupError
from app.engine.factory import load_configured_model
from app.engine.int8.int8_class import CLASSES, named
from app.engine.int8.quantize import build_int8
from app.engine.model.artifacts import REPORT, read_json
from app.logs import configure_logging
from app.settings import settings_for_tool


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", type=Path, required=True, help="a folder of images")
    parser.add_argument("--gate", type=Path, help="held-out images to judge on")
    parser.add_argument("--recipe", help="try this recipe alone (e.g. qdq-w8, nncf-w7)")
    parser.add_argument(
        "--for-cpu", choices=sorted(CLASSES), metavar="CLASS",
        help="the recipes of another CPU INT8 class (default: this CPU's); its servers judge "
             "the model again on their own CPU before serving it",
    )  # fmt: skip
    args = parser.parse_args(argv)
    settings = settings_for_tool()
    if settings.backend in ("torch", "auto"):
        print("batchserve: set BATCHSERVE_BACKEND=onnxruntime or openvino", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_json)
    config = settings.own_model()
    loaded = load_configured_model(config)
    try:
        path = build_int8(
            config, loaded, args.calibration, args.gate, recipe=args.recipe, rebuild=True,
            target=named(args.for_cpu) if args.for_cpu else None,
        )  # fmt: skip
    except StartupError as exc:
        print(f"batchserve: {exc}", file=sys.stderr)
        return 2
    report = read_json(path.parent / REPORT) or {}
    print(json.dumps({"model": str(path), "report": report}, indent=2))
    return 0 if report.get("passed") else 1


if __name__ == "__main__":
    sys.exit(main())
