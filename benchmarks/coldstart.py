"""Cold start: from spawning the server process to its first answer, in rounds.

Each round starts, for every model and backend, a batchserve process on artefacts made by an
earlier start (``cached``: what a replica woken from zero finds in a shared cache) and, with
``--uncached``, one on an empty artefact folder (export, trace and check at start); then
LitServe on the same model for comparison (``benchmarks.peer_servers`` makes its environment).
The clock runs from just before the process is spawned to the first 200 answer to a real
prediction (polled every 50 ms), so it includes the interpreter, the imports, loading,
warm-up and uvicorn's bind. The cached starts' phases come from ``/v1/models``
(``startup_s``). Random weights everywhere (the same architecture for every server).

Usage: ``python -m benchmarks.coldstart --models resnet50 resnet18 --backends torch openvino``
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import machine, machine_markdown, median, table, write_results
from benchmarks.compare import server_env
from benchmarks.corpus import generate
from benchmarks.peer_servers import peer_server
from benchmarks.servers import ServerProcess, UvicornProcess, first_answer


def first_answer_s(server: ServerProcess, image: bytes) -> float:
    """Seconds from spawning ``server`` to its first 200 answer to a prediction."""
    started = time.perf_counter()
    server.start()
    first_answer(server, image, timeout_s=600.0)
    return time.perf_counter() - started


def ours(model: str, backend: str, artifacts: Path, batch_size: int) -> UvicornProcess:
    env = {**server_env(model, "fp32", batch_size), "BATCHSERVE_BACKEND": backend,
           "BATCHSERVE_ARTIFACTS_DIR": str(artifacts), "BATCHSERVE_GRPC_PORT": "0"}  # fmt: skip
    return UvicornProcess(env, startup_timeout=600)


def run(args: argparse.Namespace) -> dict[str, Any]:
    image = generate(1)[0]
    samples: dict[str, list[float]] = {}
    phases: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as folder:
        cache = Path(folder) / "cached"
        for model in args.models:
            for backend in args.backends:  # the cache a replica would find, made once
                with ours(model, backend, cache, args.batch_size) as server:
                    pass
        for round_index in range(args.rounds):
            print(f"round {round_index + 1}/{args.rounds}", flush=True)
            for model in args.models:
                for backend in args.backends:
                    runs = [("cached", cache)]
                    if args.uncached:
                        runs.append(("uncached", Path(folder) / f"empty-{round_index}-{backend}"))
                    for state, artifacts in runs:
                        name = f"{model} batchserve {backend} {state}"
                        server = ours(model, backend, artifacts, args.batch_size)
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
    return {"machine": machine(), "models": args.models, "backends": args.backends,
            "rounds": args.rounds, "batch_size": args.batch_size, "medians": medians,
            "samples": samples, "phases": phase_medians}  # fmt: skip


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
    phase_names = sorted({key for row in data["phases"].values() for key in row})
    phase_rows = [[name, *(row.get(key, 0.0) for key in phase_names)]
                  for name, row in data["phases"].items()]  # fmt: skip
    return f"""# Cold start: process spawn to first answer

`python -m benchmarks.coldstart --models {" ".join(data["models"])} --backends \\
{" ".join(data["backends"])} --rounds {data["rounds"]}`. Medians of {data["rounds"]} rounds; the
clock runs from spawning the process to the first 200 answer to a prediction (batch size
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet50", "resnet18"])
    parser.add_argument("--backends", nargs="+", default=["torch", "openvino"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--uncached", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--litserve", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--name", default="coldstart")
    args = parser.parse_args()
    data = run(args)
    text = markdown(data)
    print(text)
    write_results(args.name, data, text)


if __name__ == "__main__":
    main()
