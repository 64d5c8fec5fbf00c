"""Cold start: from spawning the server process to its first answer, in rounds.

Each round starts, for every model and backend, a batchserve process on artefacts made by an
earlier start (``cached``: what a replica woken from zero finds in a shared cache) and, with
``--uncached``, one on an empty artefact folder (export, trace and check at start); then
LitServe on the same model for comparison (``benchmarks.peer_servers`` makes its environment).
The clock runs from just before the process is spawned to the first 200 answer to a real
prediction (polled every 50 ms), so it includes the interpreter, the imports, loading,
warm-up and uvicorn's bind. The cached starts' phases come from ``/v1/models``
(``startup_s``). Random weights everywhere (the same architecture for every server).

With ``--against REVISION``, every batchserve start also runs from a worktree of that
revision, beside this checkout's in the same rounds (in the opposite order every other round),
each with an artefact cache of its own; the report adds, per model and backend, the median of
each round's own ratio of this checkout's first answer to that revision's.

Usage: ``python -m benchmarks.coldstart --models resnet50 resnet18 --backends torch openvino``
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.commits import git, round_order
from benchmarks.common import (
    command_line,
    machine,
    machine_markdown,
    median,
    publish,
    table,
)
from benchmarks.compare import server_env
from benchmarks.corpus import generate
from benchmarks.peer_servers import peer_server
from harness.servers import ROOT, ServerProcess, UvicornProcess, first_answer

HERE = "this checkout"


def first_answer_s(server: ServerProcess, image: bytes) -> float:
    """Seconds from spawning ``server`` to its first 200 answer to a prediction."""
    started = time.perf_counter()
    server.start()
    first_answer(server, image, timeout_s=600.0)
    return time.perf_counter() - started


def ours(
    model: str, backend: str, artifacts: Path, batch_size: int, root: Path = ROOT
) -> UvicornProcess:
    env = {**server_env(model, "fp32", batch_size), "BATCHSERVE_BACKEND": backend,
           "BATCHSERVE_ARTIFACTS_DIR": str(artifacts), "BATCHSERVE_GRPC_PORT": "0"}  # fmt: skip
    return UvicornProcess(env, startup_timeout=600, root=root)


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        trees = {HERE: ROOT}
        if args.against:
            against = git("rev-parse", "--short", args.against)
            trees[against] = Path(folder) / against
            git("worktree", "add", "--detach", str(trees[against]), against)
        try:
            return measure(args, trees, Path(folder))
        finally:
            for label, tree in trees.items():
                if label != HERE:
                    git("worktree", "remove", "--force", str(tree))


def measure(args: argparse.Namespace, trees: dict[str, Path], folder: Path) -> dict[str, Any]:
    image = generate(1)[0]
    samples: dict[str, list[float]] = {}
    phases: dict[str, list[dict[str, float]]] = {}
    caches = {label: folder / f"cached-{index}" for index, label in enumerate(trees)}
    for label, tree in trees.items():
        for model in args.models:
            for backend in args.backends:  # the cache a replica would find, made once
                with ours(model, backend, caches[label], args.batch_size, tree):
                    pass
    for round_index in range(args.rounds):
        print(f"round {round_index + 1}/{args.rounds}", flush=True)
        for model in args.models:
            for backend in args.backends:
                for label in round_order(list(trees), round_index):
                    at = "" if label == HERE else f" at {label}"
                    runs = [("cached", caches[label])]
                    if args.uncached:
                        empty = f"empty-{round_index}-{backend}-{list(trees).index(label)}"
                        runs.append(("uncached", folder / empty))
                    for state, artifacts in runs:
                        name = f"{model} batchserve {backend} {state}{at}"
                        server = ours(model, backend, artifacts, args.batch_size, trees[label])
                        try:
                            seconds = first_answer_s(server, image)
                            if state == "cached":
                                (entry,) = httpx.get(f"{server.url}/v1/models").json()["models"]
                                phases.setdefault(name, []).append(
                                    {**entry["startup_s"]["process"], **entry["startup_s"]["model"]}
                                )
                        finally:
                            server.stop()
                        samples.setdefault(name, []).append(seconds)
                        print(f"  {name}: {seconds:.2f} s", flush=True)
                if args.litserve:
                    name = f"{model} litserve"
                    peer = peer_server("litserve", model, args.batch_size)
                    try:
                        seconds = first_answer_s(peer, image)
                    finally:
                        peer.stop()
                    samples.setdefault(name, []).append(seconds)
                    print(f"  {name}: {seconds:.2f} s", flush=True)
    medians = {name: median(values) for name, values in samples.items()}
    phase_medians = {
        name: {key: median([row.get(key, 0.0) for row in rows]) for key in rows[0]}
        for name, rows in phases.items()
    }
    against = next((label for label in trees if label != HERE), None)
    return {"machine": machine(), "models": args.models, "backends": args.backends,
            "rounds": args.rounds, "batch_size": args.batch_size, "medians": medians,
            "samples": samples, "phases": phase_medians, "against": against,
            "vs_against": paired_ratios(samples, against) if against else {}}  # fmt: skip


def paired_ratios(samples: dict[str, list[float]], against: str) -> dict[str, float]:
    """Per server run at ``against`` too: the median of each round's own ratio of this
    checkout's first answer to that revision's."""
    suffix = f" at {against}"
    ratios = {}
    for name, values in samples.items():
        if name.endswith(suffix):
            mine = samples[name.removesuffix(suffix)]
            ratios[name.removesuffix(suffix)] = median(
                [ours / theirs for ours, theirs in zip(mine, values, strict=True)]
            )
    return ratios


def markdown(data: dict[str, Any]) -> str:
    rows = [[name, value, min(data["samples"][name]), max(data["samples"][name])]
            for name, value in data["medians"].items()]  # fmt: skip
    ratios = []
    for model in data["models"]:
        peer = data["medians"].get(f"{model} litserve")
        for backend in data["backends"]:
            cached = data["medians"].get(f"{model} batchserve {backend} cached")
            if peer and cached:
                ratios.append([f"{model} {backend} cached vs LitServe", cached / peer])
    if data.get("against"):
        ratios += [[f"{name}: this checkout vs {data['against']} (per round)", value]
                   for name, value in data["vs_against"].items()]  # fmt: skip
    phase_names = sorted({key for row in data["phases"].values() for key in row})
    against = f" --against {data['against']}" if data.get("against") else ""
    phase_rows = [[name, *(row.get(key, 0.0) for key in phase_names)]
                  for name, row in data["phases"].items()]  # fmt: skip
    return f"""# Cold start: process spawn to first answer

`python -m benchmarks.coldstart --models {" ".join(data["models"])} --backends \\
{" ".join(data["backends"])} --rounds {data["rounds"]}{against}`. Medians of {data["rounds"]}
rounds; the clock runs from spawning the process to the first 200 answer to a prediction (batch size
{data["batch_size"]}, random weights, gRPC off). `cached`: artefacts made by an earlier start
(a shared cache); `uncached`: an empty artefact folder.

{table(["server", "first answer s (median)", "min s", "max s"], rows)}

{table(["ratio", "value"], ratios)}

Phases of the cached starts (seconds, medians; `imports` runs from the process's creation to
the application object, `ready` is the process's age when it turned ready; the models'
phases are theirs):

{table(["server", *phase_names], phase_rows)}

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    parser = command_line(__doc__, __file__)
    parser.add_argument("--models", nargs="+", default=["resnet50", "resnet18"])
    parser.add_argument("--backends", nargs="+", default=["torch", "openvino"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--uncached", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--litserve", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--against", help="a revision to start beside this checkout")
    parser.add_argument("--name", default="coldstart")
    args = parser.parse_args()
    data = run(args)
    publish(args.name, data, markdown(data))


if __name__ == "__main__":
    main()
