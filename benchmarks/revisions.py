"""The same comparison on several checkouts of batchserve, interleaved round by round.

Is a change faster or slower? Each round runs ``benchmarks.compare`` (one round, fresh
processes) in every checkout in turn, so that the machine's drift over minutes shifts all of
them alike; the report gives the medians over rounds per checkout.

Usage::

    git worktree add /tmp/base <revision>
    python -m benchmarks.revisions --tree base=/tmp/base --tree change=. --rounds 2 \\
        -- --model resnet18 --precision fp32 --batch-size 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import command_line, machine, machine_markdown, median, table, write_results

Measure = Callable[[dict[str, Any]], float]

MEASURES: dict[str, Measure] = {
    "offline limit, images/s": lambda data: data["medians"]["offline"]["throughput"],
    "served at 64 clients, images/s": lambda data: data["medians"]["batched@64"]["throughput"],
    "served / offline": lambda data: data["ratios"]["served_vs_offline_pipelined"],
    "batched / unbatched": lambda data: data["ratios"]["batched_vs_unbatched"],
    "one client p50 ms": lambda data: data["medians"]["batched@1"]["p50_ms"],
    "one client p50, batched / unbatched": lambda data: data["ratios"][
        "one_client_p50_batched_vs_unbatched"
    ],
}


def run_round(label: str, tree: Path, round_index: int, compare_args: list[str]) -> dict[str, Any]:
    name = f"revisions-{label}-{round_index}"
    command = [sys.executable, "-m", "benchmarks.compare", *compare_args, "--rounds", "1",
               "--name", name]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run(command, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    path = tree / "benchmarks" / "results" / f"{name}.json"
    data: dict[str, Any] = json.loads(path.read_text())
    for suffix in (".json", ".md"):
        path.with_suffix(suffix).unlink()
    return data


def main() -> None:
    parser = command_line(__doc__, __file__)
    parser.add_argument("--tree", action="append", required=True, help="label=path")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--name", default="revisions")
    parser.add_argument("compare_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    compare_args = [arg for arg in args.compare_args if arg != "--"]
    trees = {label: Path(path).resolve() for label, _, path in
             (tree.partition("=") for tree in args.tree)}  # fmt: skip
    commits = {
        label: subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree,
                              capture_output=True, text=True).stdout.strip()
        for label, tree in trees.items()
    }  # fmt: skip
    results: dict[str, list[dict[str, Any]]] = {label: [] for label in trees}
    for round_index in range(args.rounds):
        for label, tree in trees.items():
            print(f"round {round_index + 1}/{args.rounds}: {label}", flush=True)
            results[label].append(run_round(label, tree, round_index, compare_args))
    rows = [
        [measure, *(median([get(data) for data in results[label]]) for label in trees)]
        for measure, get in MEASURES.items()
    ]
    summary = {
        "machine": machine(),
        "compare_args": compare_args,
        "rounds": args.rounds,
        "trees": {
            label: {"path": str(tree), "commit": commits[label]} for label, tree in trees.items()
        },
        "medians": {row[0]: dict(zip(trees, row[1:], strict=True)) for row in rows},
        "results": results,
    }
    heads = [f"{label} ({commits[label]})" for label in trees]
    text = f"""# Side by side: {", ".join(heads)}

`python -m benchmarks.revisions` with `benchmarks.compare {" ".join(compare_args)}`; medians
of {args.rounds} rounds, each running every checkout in turn with fresh processes.

{table(["measure", *heads], rows)}

## Machine

{machine_markdown(summary["machine"])}
"""
    print(text)
    write_results(args.name, summary, text)


if __name__ == "__main__":
    main()
