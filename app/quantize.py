"""``python -m app.quantize --calibration DIR``: build the INT8 model and run its accuracy gate.

Calibrates a static INT8 model (QDQ, per-channel) on the images under ``--calibration``,
passed through the server's own preprocessing, for ``BATCHSERVE_BACKEND`` (``onnxruntime`` or
``openvino``), compares it with eager fp32 PyTorch on the gate images (``--gate``, else the
calibration photos and variants of them) and stores the report beside the model. The server
serves ``PRECISION=int8`` only from a model whose report passed. Exits 1 when the gate fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from app.engine.artifacts import REPORT, read_json
from app.engine.factory import load_configured_model
from app.engine.quantize import build_int8
from app.logs import configure_logging
from app.settings import settings_for_tool


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", type=Path, required=True, help="a folder of images")
    parser.add_argument("--gate", type=Path, help="held-out images to judge on")
    args = parser.parse_args(argv)
    settings = settings_for_tool()
    if settings.backend == "torch":
        print("batchserve: set BATCHSERVE_BACKEND=onnxruntime or openvino", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_json)
    loaded = load_configured_model(settings)
    path = build_int8(settings, loaded, args.calibration, args.gate)
    report = read_json(path.parent / REPORT) or {}
    print(json.dumps({"model": str(path), "report": report}, indent=2))
    return 0 if report.get("passed") else 1


if __name__ == "__main__":
    sys.exit(main())
