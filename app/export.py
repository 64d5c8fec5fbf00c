"""``python -m app.export``: export the configured model for the inference runtimes now, then
build the engine the settings describe once.

Start-up does the same on the fly when an artefact is missing; running it ahead (in an image
build, a Job that fills a shared cache) keeps that work off the serving path. Building the
engine keeps in ``ARTIFACTS_DIR`` what a later start would otherwise do again: the TorchScript
model, ``BACKEND=auto``'s measured choice and the start-up check's verdict, so that a replica
started from that cache measures, traces and checks nothing (``--no-engine`` skips it). The
model, weights, input size and ``ARTIFACTS_DIR`` come from the usual ``BATCHSERVE_*`` settings.
"""

from __future__ import annotations

import argparse
import logging
import sys

from app.engine import build_engine
from app.engine.factory import load_configured_model
from app.engine.model.store import ensure_onnx, ensure_openvino
from app.logs import configure_logging
from app.settings import settings_for_tool

logger = logging.getLogger("batchserve")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", choices=["onnx", "openvino", "all"], default="all")
    parser.add_argument("--no-engine", action="store_true", help="only export; build no engine")
    args = parser.parse_args(argv)
    settings = settings_for_tool()
    configure_logging(settings.log_level, settings.log_json)
    config = settings.own_model()
    loaded = load_configured_model(config)
    print(ensure_onnx(settings.artifacts_dir, loaded))
    if args.format in ("openvino", "all"):
        print(ensure_openvino(settings.artifacts_dir, loaded, "fp32"))
    if not args.no_engine:
        engine = build_engine(config)
        logger.info("built %s on %s with %s (%s): a start from %s reuses it",
                    engine.name, engine.device, engine.backend.name, engine.precision,
                    settings.artifacts_dir)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
