"""batchserve on a Ray cluster: one node against two, one replica each, each node pinned to one
core of its own, the same model, behind Ray Serve's one HTTP proxy (on the head node); and
batchserve alone under uvicorn on one core, for what Ray costs.

    python -m benchmarks.ray_nodes --model resnet18 --rounds 3 --clients 64

Each round starts fresh clusters (``harness.ray_cluster``: ``ray start`` per node on its own
loopback address, ``serve deploy`` of ``deploy/ray/serve.yaml``) and loads them with wrk at
``--clients`` connections. Where the CPU goes is read from the processes themselves during the
measured window: the replicas, Ray's proxy, the rest of Ray (GCS, raylets, controller,
dashboard and agents) and the load generator.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

from benchmarks import corpus, wrk
from benchmarks.common import machine, machine_markdown, median, write_results
from harness.ray_cluster import Node, RayCluster
from harness.servers import ROOT, ServerProcess, free_port

ONE_PER_NODE: dict[str, float] = {"batchserve": 1}
LAYOUTS = {
    "one node": [Node("127.0.0.10", cpus=1, resources=dict(ONE_PER_NODE), pin=[0])],
    "two nodes": [
        Node("127.0.0.10", cpus=1, resources=dict(ONE_PER_NODE), pin=[0]),
        Node("127.0.0.20", cpus=1, resources=dict(ONE_PER_NODE), pin=[1]),
    ],
}


def config(
    args: argparse.Namespace, replicas: int, artifacts: Path, capped: int | None = None
) -> dict[str, Any]:
    document: dict[str, Any] = copy.deepcopy(
        yaml.safe_load((ROOT / "deploy" / "ray" / "serve.yaml").read_text())
    )
    application = document["applications"][0]
    application["runtime_env"]["env_vars"] = {
        "BATCHSERVE_MODEL": args.model, "BATCHSERVE_WEIGHTS": "none",
        "BATCHSERVE_BACKEND": args.backend, "BATCHSERVE_PRECISION": "fp32",
        "BATCHSERVE_SHARDS": "1", "BATCHSERVE_MAX_BATCH_SIZE": str(args.batch_size),
        "BATCHSERVE_ARTIFACTS_DIR": str(artifacts),
    }  # fmt: skip
    application["args"] = {"num_cpus": 1, "resources": ONE_PER_NODE, "num_replicas": replicas}
    if capped is not None:
        application["args"]["max_ongoing_requests"] = capped
    return document


def group(process: psutil.Process) -> str:
    """Which part of the cluster a process is."""
    try:
        text = " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "gone"
    if "ServeReplica" in text:
        return "replicas"
    if "ProxyActor" in text:
        return "proxy"
    return "rest of Ray"


def cpu_seconds(cluster: RayCluster) -> dict[int, tuple[str, float]]:
    seconds = {}
    for process in cluster.processes():
        try:
            times = process.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        seconds[process.pid] = (group(process), times.user + times.system)
    return seconds


ALONE = "batchserve alone (uvicorn)"
# With --capped N: one node whose replica takes at most N requests from Ray's router.
CAPPED = "one node, max_ongoing_requests capped"


def measure_alone(args: argparse.Namespace, images: list[bytes]) -> dict[str, Any]:
    """The same settings under uvicorn, pinned to the core the head node gets, no Ray."""
    with tempfile.TemporaryDirectory() as scratch:
        env = config(args, 1, Path(scratch))["applications"][0]["runtime_env"]["env_vars"]
        env = {**os.environ, **env, "PYTHONPATH": str(ROOT), "BATCHSERVE_GRPC_PORT": "0",
               "BATCHSERVE_TORCH_THREADS": "1", "BATCHSERVE_DECODE_WORKERS": "1"}  # fmt: skip
        port = free_port()
        command = ["taskset", "--cpu-list", "0", sys.executable, "-m", "uvicorn", "app.main:app",
                   "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        with ServerProcess(command, url, env, startup_timeout=600) as server:
            assert server.process is not None
            process = psutil.Process(server.process.pid)
            wrk.run(url, images, args.clients, 0, args.warmup)
            before = process.cpu_times()
            started = time.perf_counter()
            result = wrk.run(url, images, args.clients, 0, args.duration)
            elapsed = time.perf_counter() - started
            after = process.cpu_times()
    used = (after.user + after.system) - (before.user + before.system)
    return summary(ALONE, result, {"replicas": used / elapsed})


def summary(layout: str, result: dict[str, Any], cores: dict[str, float]) -> dict[str, Any]:
    cores["load generator (wrk)"] = result["client_cpu_cores"]
    return {
        "layout": layout,
        "throughput": result["throughput"],
        "p50_ms": result["latency_ms"]["p50"],
        "p99_ms": result["latency_ms"]["p99"],
        "errors": result["errors"],
        "cpu_cores": cores,
    }


def measure(layout: str, args: argparse.Namespace, images: list[bytes]) -> dict[str, Any]:
    if layout == ALONE:
        return measure_alone(args, images)
    capped = args.capped if layout == CAPPED else None
    nodes = LAYOUTS["one node" if capped else layout]
    with tempfile.TemporaryDirectory() as scratch, RayCluster(nodes) as cluster:
        cluster.deploy(config(args, len(nodes), Path(scratch), capped))
        cluster.wait_for(len(nodes), timeout=600)
        wrk.run(cluster.url, images, args.clients, 0, args.warmup)
        before = cpu_seconds(cluster)
        started = time.perf_counter()
        result = wrk.run(cluster.url, images, args.clients, 0, args.duration)
        elapsed = time.perf_counter() - started
        after = cpu_seconds(cluster)
    cores: dict[str, float] = {}
    for pid, (name, used) in after.items():
        cores[name] = cores.get(name, 0.0) + (used - before.get(pid, (name, 0.0))[1]) / elapsed
    return summary(layout, result, cores)


def run(args: argparse.Namespace) -> dict[str, Any]:
    wrk.require()
    images = corpus.generate(64)
    layouts = ["one node", CAPPED] if args.capped else [ALONE, *LAYOUTS]
    samples: dict[str, list[dict[str, Any]]] = {layout: [] for layout in layouts}
    for round_index in range(args.rounds):
        for layout in samples:
            sample = measure(layout, args, images)
            samples[layout].append(sample)
            print(
                f"round {round_index + 1} {layout}: {sample['throughput']:.1f} images/s, "
                f"p50 {sample['p50_ms']:.0f} ms, cores {sample['cpu_cores']}",
                flush=True,
            )

    def ratios(over: str, under: str) -> list[float]:
        if over not in samples or under not in samples:
            return []
        pairs = zip(samples[over], samples[under], strict=True)
        return [top["throughput"] / bottom["throughput"] for top, bottom in pairs]

    return {
        "machine": machine(),
        "model": args.model,
        "backend": args.backend,
        "batch_size": args.batch_size,
        "clients": args.clients,
        "duration_s": args.duration,
        "rounds": args.rounds,
        "samples": samples,
        "capped": args.capped,
        "ratios": {
            "two nodes over one": ratios("two nodes", "one node"),
            "one node over batchserve alone on the same core": ratios("one node", ALONE),
            f"capped at {args.capped} over uncapped": ratios(CAPPED, "one node"),
        },
    }


def markdown(data: dict[str, Any]) -> str:
    lines = [
        f"# {data['model']} on Ray Serve: "
        + (
            f"max_ongoing_requests capped at {data['capped']}"
            if data.get("capped")
            else "one node against two"
        ),
        "",
        f"One replica per node, each node (its raylet, workers and replica) pinned to one core of "
        f"its own; Ray Serve's one HTTP proxy on the head node; {data['clients']} wrk "
        f"connections, {data['duration_s']:.0f} s measured after a warm-up, fresh clusters in "
        f"each of {data['rounds']} rounds; `BACKEND={data['backend']}`, fp32, random weights, "
        f"`MAX_BATCH_SIZE={data['batch_size']}`. Medians of the rounds.",
        "",
        "| layout | images/s | p50 ms | p99 ms | CPU cores: replicas | proxy | rest of Ray "
        "| load generator |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for layout, samples in data["samples"].items():

        def cores(name: str, samples: list[dict[str, Any]] = samples) -> float:
            return median([sample["cpu_cores"].get(name, 0.0) for sample in samples])

        lines.append(
            f"| {layout} | {median([s['throughput'] for s in samples]):.1f} "
            f"| {median([s['p50_ms'] for s in samples]):.0f} "
            f"| {median([s['p99_ms'] for s in samples]):.0f} "
            f"| {cores('replicas'):.2f} | {cores('proxy'):.2f} | {cores('rest of Ray'):.2f} "
            f"| {cores('load generator (wrk)'):.2f} |"
        )
    lines.append("")
    for name, values in data["ratios"].items():
        if values:
            spread = statistics.pstdev(values) if len(values) > 1 else 0.0
            lines.append(
                f"- {name}: **{median(values):.2f}x** images/s (the rounds' ratios: "
                f"{', '.join(f'{r:.2f}' for r in values)}; spread {spread:.2f})"
            )
    lines += [
        "",
        "Errors per round: "
        + "; ".join(
            f"{layout}: {[s['errors'] or 'none' for s in samples]}"
            for layout, samples in data["samples"].items()
        ),
        "",
        "## Machine",
        "",
        machine_markdown(data["machine"]),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--capped", type=int, default=None,
        help="instead: one node as deployed, and with max_ongoing_requests=N",
    )  # fmt: skip
    parser.add_argument("--name", default=None)
    args = parser.parse_args()
    data = run(args)
    name = args.name or f"ray-nodes-{args.model}" + (
        f"-capped-{args.capped}" if args.capped else ""
    )
    _, report = write_results(name, data, markdown(data))
    print(report.read_text())


if __name__ == "__main__":
    main()
