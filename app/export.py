"""``python -m app.export``: export the configured model for the inference runtimes now.

Start-up does the same on the fly when an artefact is missing; running it ahead (in an image
build, an init container) keeps that work off the serving path. The model, weights, input
size and ``ARTIFACTS_DIR`` come from the usual ``BATCHSERVE_*`` settings.
"""

from __future__ import annotations

import argparse
import sys

from app.engine.factory import ensure_onnx, ensure_openvino, load_configured_model
from app.logs import configure_logging
from app.settings import settings_for_tool


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", choices=["onnx", "openvino", "all"], default="all")
    args = parser.parse_args(argv)
    settings = settings_for_tool()
    configure_logging(settings.log_level, settings.log_json)
    loaded = load_configured_model(settings)
    print(ensure_onnx(settings.artifacts_dir, loaded))
    if args.format in ("openvino", "all"):
        print(ensure_openvino(settings.artifacts_dir, loaded, "fp32"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
