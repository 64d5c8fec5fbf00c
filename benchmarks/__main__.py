"""``python -m benchmarks <tool> [arguments]``: the benchmark tools behind one entry point.

Each tool is a module of this package with its own ``--help``; ``python -m benchmarks`` lists
them. The tools are what a user runs to measure a model, a machine or a deployment, and write
under ``benchmarks/results/``. Each study answers one question: its report, its script
(``study.py``) and its runs live together under ``benchmarks/studies/<name>/``.
"""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

# What a user runs to measure a model, a machine or a deployment.
TOOLS = (
    "loadgen", "offline", "compare", "served_vs_limit", "served_ab", "served_profile", "sweep",
    "profile", "accuracy", "backends", "coldstart", "commits", "revisions", "peer_servers", "soak",
    "batcher_overhead", "int8_gate", "int8_evaluate", "gpu_check", "gpu_wheels", "agreement",
    "ray_nodes",
)  # fmt: skip
# One question each: what a change gained, a suspect cleared, a choice measured.
STUDIES = (
    "decode", "event_loop", "grpc_rest", "handoff", "int8_emulated", "models", "priorities",
    "rcnn_split", "reload", "resize", "runtime_options", "shards", "task_batching",
    "torch_threads", "workers",
)  # fmt: skip
HERE = Path(__file__).parent


def module(name: str) -> str:
    return f"benchmarks.studies.{name}.study" if name in STUDIES else f"benchmarks.{name}"


def summary(name: str) -> str:
    """The first line of a module's docstring, read without importing it (and torch)."""
    path = HERE / "studies" / name / "study.py" if name in STUDIES else HERE / f"{name}.py"
    source = path.read_text()
    docstring = ast.get_docstring(ast.parse(source)) or ""
    return docstring.strip().splitlines()[0] if docstring.strip() else ""


def usage() -> str:
    width = max(map(len, TOOLS + STUDIES))
    lines = ["usage: python -m benchmarks <tool> [arguments]   (each tool has --help)", "",
             "tools:"]  # fmt: skip
    lines += [f"  {name:<{width}}  {summary(name)}" for name in TOOLS]
    lines += ["", "studies (each with its report in benchmarks/studies/<name>/README.md):"]
    lines += [f"  {name:<{width}}  {summary(name)}" for name in STUDIES]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name = argv[0].replace("-", "_")
    if name not in TOOLS + STUDIES:
        print(f"no tool named {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    sys.argv = [f"python -m benchmarks {argv[0]}", *argv[1:]]
    runpy.run_module(module(name), run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
