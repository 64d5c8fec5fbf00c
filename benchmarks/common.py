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


def write_results(
    name: str, data: dict[str, Any], markdown: str, folder: Path = RESULTS
) -> tuple[Path, Path]:
    """Write ``<name>.json`` and ``<name>.md`` into ``folder`` (``benchmarks/results`` for a
    tool; a study writes beside its report)."""
    folder.mkdir(parents=True, exist_ok=True)
    json_path = folder / f"{name}.json"
    md_path = folder / f"{name}.md"
    json_path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    md_path.write_text(markdown.rstrip() + "\n")
    return json_path, md_path


def command_line(doc: str | None, file: str) -> argparse.ArgumentParser:
    """A benchmark's parser, named as ``python -m benchmarks <name>`` runs it and described by
    the first line of ``doc`` (the module's docstring); ``file`` is the module's ``__file__``
    (a study's script is ``studies/<name>/study.py``)."""
    path = Path(file)
    name = path.parent.name if path.stem == "study" else path.stem
    return argparse.ArgumentParser(
        prog=f"python -m benchmarks {name}", description=(doc or "").splitlines()[0]
    )


def model_arguments(doc: str | None, file: str, *, batch_size: int = 8) -> argparse.ArgumentParser:
    """The command line of a benchmark that serves one model: ``--model``, ``--precision`` and
    ``--batch-size`` (see ``command_line``)."""
    parser = command_line(doc, file)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--batch-size", type=int, default=batch_size)
    return parser


DEFAULT_DURATION = 10.0  # seconds of each measured load


def load_arguments(
    parser: argparse.ArgumentParser,
    *,
    clients: int = 64,
    rounds: int = 3,
    duration: float = DEFAULT_DURATION,
    warmup: float = 3.0,
    duration_flag: str = "--duration",
) -> argparse.ArgumentParser:
    """The load a served benchmark offers: ``--clients``, ``--rounds`` (each with fresh
    processes), the measured seconds (``duration_flag``), ``--warmup`` seconds and the
    ``--images`` folder (generated photo-like JPEGs without it)."""
    parser.add_argument("--clients", type=int, default=clients)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument(duration_flag, type=float, default=duration)
    parser.add_argument("--warmup", type=float, default=warmup)
    parser.add_argument("--images", type=Path)
    return parser


def publish(name: str, data: dict[str, Any], markdown: str, folder: Path = RESULTS) -> None:
    """Write the results (``write_results``), then print the report and where it went."""
    paths = write_results(name, data, markdown, folder)
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
