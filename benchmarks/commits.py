"""One change measured side by side: ``benchmarks.backends`` at two or more commits, in
interleaved rounds on the same machine.

Each revision is checked out in a worktree of its own; every round runs one round of
``benchmarks.backends`` (its offline limits and its served figures, fresh processes) at each
revision in turn, in the opposite order every other round, so that the machine's drift within
a round does not always favour the same revision. Artefacts are shared (one
folder for every revision), so that only the first run exports or quantizes. The report gives,
per configuration, the medians at each revision and, against the first revision, the median of
each round's own ratio, for the served figure and for the offline forward pass: where a change
does not touch the forward pass, that ratio is the machine's drift between the two runs.

Usage: ``python -m benchmarks.commits --revisions 2d81e68 HEAD --rounds 3 -- --model resnet18
--configs "openvino int8:backend=openvino,precision=int8"``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import (
    command_line,
    machine,
    machine_markdown,
    median,
    publish,
    table,
)

ROOT = Path(__file__).resolve().parent.parent

# What each round's run reports per configuration, and what the comparison shows of it.
MEASURES = ("forward", "pipelined", "served", "one_client_p50_ms")


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip


def one_round(tree: Path, arguments: list[str]) -> dict[str, dict[str, float]]:
    """One round of ``benchmarks.backends`` in ``tree``: its sample per configuration."""
    name = "commits-round"
    subprocess.run([sys.executable, "-m", "benchmarks.backends", *arguments, "--rounds", "1",
                    "--name", name], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                   check=True)  # fmt: skip
    data = json.loads((tree / "benchmarks" / "results" / f"{name}.json").read_text())
    return {config: rows[0] for config, rows in data["samples"].items()}


def round_order(commits: list[str], round_index: int) -> list[str]:
    """The commits in the order that round ``round_index`` runs them: as given, then reversed."""
    return list(commits) if round_index % 2 == 0 else list(reversed(commits))


def compare(
    samples: dict[str, dict[str, list[dict[str, float]]]], commits: list[str]
) -> dict[str, dict[str, dict[str, float]]]:
    """Per configuration and commit: the medians of ``MEASURES``, of served/limit within each
    round, and of served against the first commit's in the same round."""
    first = commits[0]
    compared: dict[str, dict[str, dict[str, float]]] = {}
    for config in samples[first]:
        row: dict[str, dict[str, float]] = {}
        for commit in commits:
            rows = samples[commit][config]
            row[commit] = {key: median([sample[key] for sample in rows]) for key in MEASURES}
            row[commit]["served_vs_limit"] = median(
                [sample["served"] / sample["pipelined"] for sample in rows]
            )
            for key in ("served", "forward"):
                row[commit][f"{key}_vs_first"] = median([
                    mine[key] / theirs[key]
                    for mine, theirs in zip(rows, samples[first][config], strict=True)
                ])  # fmt: skip
        compared[config] = row
    return compared


def run(args: argparse.Namespace) -> dict[str, Any]:
    commits = [git("rev-parse", "--short", revision) for revision in args.revisions]
    samples: dict[str, dict[str, list[dict[str, float]]]] = {commit: {} for commit in commits}
    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        arguments = list(args.backends)
        if "--artifacts" not in arguments:
            arguments += ["--artifacts", str(scratch / "artifacts")]
        trees = {commit: scratch / commit for commit in commits}
        for commit, tree in trees.items():
            git("worktree", "add", "--detach", str(tree), commit)
        try:
            for round_index in range(args.rounds):
                for commit in round_order(commits, round_index):
                    tree = trees[commit]
                    print(f"round {round_index + 1}/{args.rounds} at {commit}", flush=True)
                    for config, sample in one_round(tree, arguments).items():
                        samples[commit].setdefault(config, []).append(sample)
        finally:
            for tree in trees.values():
                git("worktree", "remove", "--force", str(tree))
    compared = compare(samples, commits)
    return {"machine": machine(), "revisions": args.revisions, "commits": commits,
            "subjects": {commit: git("log", "-1", "--format=%s", commit)[:120]
                         for commit in commits},
            "rounds": args.rounds, "arguments": args.backends, "compared": compared,
            "samples": samples}  # fmt: skip


def markdown(data: dict[str, Any]) -> str:
    commits, first = data["commits"], data["commits"][0]
    rows = [
        [config, commit, m["forward"], m["pipelined"], m["served"], m["served_vs_limit"],
         m["served_vs_first"], m.get("forward_vs_first", ""), m["one_client_p50_ms"]]
        for config, row in data["compared"].items()
        for commit, m in row.items()
    ]  # fmt: skip
    heads = ["configuration", "commit", "forward img/s", "pipelined limit img/s",
             "served img/s", "served / limit", f"served / at {first}",
             f"forward / at {first}", "p50 ms @1"]  # fmt: skip
    revisions = "\n".join(f"- `{commit}`: {data['subjects'][commit]}" for commit in commits)
    return f"""# The same benchmark at {len(commits)} commits, side by side

`python -m benchmarks.commits --revisions {" ".join(data["revisions"])} --rounds \
{data["rounds"]} -- {" ".join(data["arguments"])}`: each round runs one round of
`benchmarks.backends` at every commit in turn (reversed every other round). Medians of
{data["rounds"]} rounds; ratios are medians of each round's own. The forward pass's ratio is
the control: a change to the serving path leaves it at 1 but for the machine's drift.

{revisions}

{table(heads, rows)}

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    parser = command_line(__doc__, __file__)
    parser.add_argument("--revisions", nargs="+", required=True, help="the first is the base")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--name", default="commits")
    parser.add_argument("backends", nargs=argparse.REMAINDER,
                        help="after --: the arguments of benchmarks.backends")  # fmt: skip
    args = parser.parse_args()
    args.backends = [arg for arg in args.backends if arg != "--"]
    data = run(args)
    publish(args.name, data, markdown(data))


if __name__ == "__main__":
    main()
