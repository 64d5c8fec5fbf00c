"""Shared helpers for the benchmarks: machine description, statistics, result files."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app.cpus import cpu_model

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "cpu": cpu_model(),
    }
    try:
        import torch
        import torchvision

        info["torch"] = torch.__version__
        info["torchvision"] = torchvision.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        info["native_bf16"] = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    from app.engine import this_cpu

    info["int8_class"] = this_cpu().name
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        info["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    return info


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), nearest-rank on sorted values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def machine_markdown(info: dict[str, Any]) -> str:
    keys = ("date", "cpu", "cpus", "cpu_capability", "int8_class", "native_bf16",
            "torch_threads", "cuda",
            "python", "torch", "torchvision", "platform", "commit")  # fmt: skip
    return "\n".join(f"- {key}: {info[key]}" for key in keys if key in info)


def write_results(name: str, data: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    """Write ``results/<name>.json`` and ``results/<name>.md``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    json_path = RESULTS / f"{name}.json"
    md_path = RESULTS / f"{name}.md"
    json_path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    md_path.write_text(markdown.rstrip() + "\n")
    return json_path, md_path


def model_arguments(doc: str | None, *, batch_size: int = 8) -> argparse.ArgumentParser:
    """The command line of a benchmark that serves one model: ``--model``, ``--precision`` and
    ``--batch-size``, described by the first line of ``doc`` (the module's docstring)."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--batch-size", type=int, default=batch_size)
    return parser


def publish(name: str, data: dict[str, Any], markdown: str) -> None:
    """Write the results (``write_results``), then print the report and where it went."""
    paths = write_results(name, data, markdown)
    print(markdown)
    print("wrote", *paths)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)
