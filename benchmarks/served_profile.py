"""Where the CPU goes while serving: per-thread CPU time under load, by role, beside the limits.

One server (settings from ``--set``), driven by wrk at ``--clients``. While it runs:

1. **Per thread**, from ``/proc/<pid>/task/*/stat``: the CPU each thread used during the
   measured seconds, grouped by role. Python threads are named by ``py-spy dump`` (the event
   loop is ``MainThread``, then ``decode_*``, ``parse_*``, ``run-batch_*``, and ``shard_*``
   for the parts of a batch beside its own thread); every other thread is the runtime's own
   (the intra-op pool of OpenMP, ONNX Runtime or OpenVINO). wrk, the load generator, runs on
   the same machine: its CPU is counted too. What neither used of the machine's CPUs is
   ``idle``.
2. **The event loop's Python**, from ``py-spy record`` in a second load of the same server:
   each sample of ``MainThread`` counted against the package of its innermost frame (uvicorn,
   starlette, fastapi, the instrumentator, batchserve's middleware, routes, serving core,
   batcher...), as CPU per request.
3. **The server's stages**: the mean forward pass per batch in the server (its metrics)
   against the forward pass alone offline on the same batch size, which says how much the
   work around it slows it down; and the offline limits of ``benchmarks.offline``.

Usage: ``python -m benchmarks.served_profile --model resnet18 --set backend=onnxruntime``
(needs ``py-spy``, from the ``bench`` extra, and permission to trace the server: root, or
``kernel.yama.ptrace_scope=0``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks import wrk
from benchmarks.backends import offline
from benchmarks.common import machine, machine_markdown, model_arguments, table, write_results
from benchmarks.compare import server_env
from benchmarks.corpus import corpus
from harness.servers import UvicornProcess

# The package of a frame's file, innermost match first: batchserve's parts, then libraries.
PACKAGES = (
    ("app/http/routes/", "batchserve routes"),
    ("app/http/", "batchserve middleware and HTTP helpers"),
    ("app/serving/", "batchserve serving core"),
    ("app/metrics", "batchserve metrics"),
    ("app/", "batchserve (other)"),
    ("batching/", "batcher"),
    ("preprocessing/", "preprocessing"),
    ("prometheus_fastapi_instrumentator", "prometheus-fastapi-instrumentator"),
    ("prometheus_client", "prometheus_client"),
    ("fastapi", "fastapi"),
    ("starlette", "starlette"),
    ("pydantic", "pydantic"),
    ("uvicorn", "uvicorn"),
    ("httptools", "uvicorn"),
    ("orjson", "orjson"),
    ("asyncio", "asyncio"),
    ("concurrent/futures", "concurrent.futures"),
)


def role(name: str | None) -> str:
    if name is None:
        return "runtime threads (intra-op pool)"
    for prefix, label in (("MainThread", "event loop"), ("decode", "decode threads"),
                          ("parse", "parse threads"), ("run-batch", "batch threads"),
                          ("shard", "batch parts' threads")):  # fmt: skip
        if name.startswith(prefix):
            return label
    return "other Python threads"


def proc_stat(path: str) -> tuple[str, list[str]] | None:
    """The command and the fields after it of a ``/proc/.../stat`` file (None once its process
    or thread has ended): ``fields[1]`` is the parent pid, ``fields[11:13]`` user and system
    ticks."""
    try:
        stat = Path(path).read_text()
    except OSError:
        return None
    command, _, rest = stat.partition("(")[2].rpartition(")")
    return command, rest.split()


def thread_ticks(pid: int) -> dict[int, int]:
    """CPU ticks (user + system) of every thread of ``pid`` (none once it has ended)."""
    ticks = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tids:
        stat = proc_stat(f"/proc/{pid}/task/{tid}/stat")
        if stat is not None:  # else the thread ended
            fields = stat[1]
            ticks[int(tid)] = int(fields[11]) + int(fields[12])
    return ticks


def children_named(name: str) -> list[int]:
    """The pids of this process's children whose command is ``name``."""
    found = []
    for entry in os.listdir("/proc"):
        stat = proc_stat(f"/proc/{entry}/stat") if entry.isdigit() else None
        if stat is not None and stat[0] == name and int(stat[1][1]) == os.getpid():
            found.append(int(entry))
    return found


def process_ticks(pids: list[int]) -> int:
    """CPU ticks (user + system) of these processes, all their threads together."""
    return sum(sum(thread_ticks(pid).values()) for pid in pids)


def python_threads(py_spy: str, pid: int) -> dict[int, str]:
    """OS thread id -> Python thread name, from ``py-spy dump``."""
    output = subprocess.run(
        [py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, check=True
    ).stdout
    names = {}
    for line in output.splitlines():
        # Thread 4025 (idle): "MainThread"
        if line.startswith("Thread ") and '"' in line:
            names[int(line.split()[1], 0)] = line.split('"')[1]
    return names


def in_background(work: Any) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(work()))
    thread.start()
    return thread, result


def per_thread(server: UvicornProcess, images: list[bytes], args: argparse.Namespace,
               py_spy: str) -> dict[str, Any]:  # fmt: skip
    assert server.process is not None
    pid = server.process.pid
    load, served = in_background(
        lambda: wrk.run(server.url, images, args.clients, 0, args.seconds + 2)
    )
    time.sleep(1)
    names = python_threads(py_spy, pid)
    generator = children_named("wrk")
    before, started = thread_ticks(pid), time.perf_counter()
    generator_before = process_ticks(generator)
    time.sleep(args.seconds)
    after, elapsed = thread_ticks(pid), time.perf_counter() - started
    generator_after = process_ticks(generator)
    load.join()
    hz = os.sysconf("SC_CLK_TCK")
    cores: dict[str, float] = {}
    threads: Counter[str] = Counter()
    for tid, ticks in after.items():
        name = role(names.get(tid))
        cores[name] = cores.get(name, 0.0) + (ticks - before.get(tid, 0)) / hz / elapsed
        threads[name] += 1
    cores["load generator (wrk, same machine)"] = (
        (generator_after - generator_before) / hz / elapsed
    )
    threads["load generator (wrk, same machine)"] = len(generator)
    cpus = len(os.sched_getaffinity(pid))
    cores["idle"] = max(0.0, cpus - sum(cores.values()))
    return {"throughput": served["throughput"], "server": served["server"],
            "cores": dict(cores), "threads": dict(threads), "cpus": cpus}  # fmt: skip


def package(frame: str) -> str:
    """The package of a py-spy frame ``function (path:line)``."""
    path = frame.rpartition("(")[2]
    for marker, label in PACKAGES:
        if marker in path:
            return label
    return "other"


def event_loop(server: UvicornProcess, images: list[bytes], args: argparse.Namespace,
               py_spy: str) -> dict[str, Any]:  # fmt: skip
    assert server.process is not None
    with tempfile.TemporaryDirectory() as folder:
        raw = Path(folder) / "raw.txt"
        load, served = in_background(
            lambda: wrk.run(server.url, images, args.clients, 0, args.seconds + 2)
        )
        time.sleep(1)
        subprocess.run(
            [py_spy, "record", "--pid", str(server.process.pid), "--duration",
             str(round(args.seconds)), "--rate", str(args.rate), "--format", "raw", "--threads",
             "--nonblocking", "--output", str(raw)],
            capture_output=True, check=True,
        )  # fmt: skip
        load.join()
        samples: Counter[str] = Counter()
        for line in raw.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            thread, *frames = stack.split(";")
            if not thread.endswith("MainThread") or not frames:
                continue
            samples[package(frames[-1])] += int(count)
    requests = served["throughput"] * args.seconds
    seconds_per_sample = 1 / args.rate
    return {
        "throughput": served["throughput"],
        "ms_per_request": {
            name: count * seconds_per_sample / requests * 1000
            for name, count in samples.most_common()
        },
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if py_spy is None:
        raise SystemExit("py-spy is needed: pip install 'batchserve[bench]'")
    extra = dict(item.split("=", 1) for item in args.set)
    env = server_env(args.model, args.precision, args.batch_size,
                     **{f"BATCHSERVE_{key.upper()}": value for key, value in extra.items()},
                     BATCHSERVE_GRPC_PORT="0")  # fmt: skip
    images = corpus(args.images, 64)
    limits = offline(args.model, args.batch_size, args.seconds, env)
    with UvicornProcess(env, startup_timeout=600) as server:
        wrk.run(server.url, images, args.clients, args.warmup, 1)
        threads = per_thread(server, images, args, py_spy)
        loop = event_loop(server, images, args, py_spy)
    forward_ms = threads["server"]["mean_stage_ms"].get("forward", float("nan"))
    return {
        "machine": machine(), "model": args.model, "settings": extra,
        "precision": args.precision, "batch_size": args.batch_size, "clients": args.clients,
        "seconds": args.seconds, "limits": limits, "per_thread": threads, "event_loop": loop,
        "forward_ms_served": forward_ms,
        "forward_ms_alone": args.batch_size / limits["forward"] * 1000,
    }  # fmt: skip


def markdown(data: dict[str, Any]) -> str:
    threads, loop, limits = data["per_thread"], data["event_loop"], data["limits"]
    served = threads["throughput"]
    pairs = [f"{k}={v}" for k, v in data["settings"].items()]
    settings = ", ".join(pairs) or "defaults"
    chosen = f" --set {' '.join(pairs)}" if pairs else ""
    core_rows = [
        [name, threads["threads"].get(name, ""), cores, cores / served * 1000 if served else 0]
        for name, cores in sorted(threads["cores"].items(), key=lambda item: -item[1])
    ]
    loop_rows = [[name, ms] for name, ms in loop["ms_per_request"].items()]
    return f"""# Where the CPU goes while serving: {data["model"]} ({settings}, {data["precision"]})

`python -m benchmarks.served_profile --model {data["model"]}{chosen}`; wrk at
{data["clients"]} clients posting the same 64 photo-like JPEGs, {data["seconds"]} s measured;
batch {data["batch_size"]}.

| measure | images/s |
|---|---|
| forward pass alone (offline) | {limits["forward"]:.1f} |
| pipelined limit (offline, with decoding) | {limits["pipelined"]:.1f} |
| served, per-thread run | {served:.1f} |
| served, py-spy run | {loop["throughput"]:.1f} |

Served / pipelined limit: **{served / limits["pipelined"]:.3f}**. The forward pass of a batch
took {data["forward_ms_served"]:.1f} ms in the server against {data["forward_ms_alone"]:.1f} ms
alone: the work around it (decoding, the event loop, the next batch's normalisation) shares
its {threads["cpus"]} CPUs.

## CPU by thread role

Cores used during the measured seconds (of {threads["cpus"]}), and CPU ms per image served:

{table(["role", "threads", "cores", "CPU ms per image"], core_rows)}

## The event loop's Python, by package

`py-spy record` samples of the event loop thread (`MainThread`) by the package of the
innermost Python frame, in ms per request (the native code a frame calls counts with it). The
column adds up to more than the event loop's CPU measured above: `asyncio` is uvloop's own
loop (`Runner.run`: socket reads and writes, the HTTP parser's callbacks, and waiting for
events, which py-spy cannot always tell from work); the other rows are Python work.

{table(["package", "ms per request"], loop_rows)}

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    parser = model_arguments(__doc__, __file__)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--images", type=Path)
    parser.add_argument("--set", nargs="*", default=[], help="settings, e.g. backend=openvino")
    parser.add_argument("--name", help="results/<name>.* (default: served-profile-<model>-...)")
    args = parser.parse_args()
    wrk.require()
    data = run(args)
    text = markdown(data)
    print(text)
    backend = dict(item.split("=", 1) for item in args.set).get("backend", "auto")
    write_results(args.name or f"served-profile-{args.model}-{backend}-{args.precision}",
                  data, text)  # fmt: skip


if __name__ == "__main__":
    main()
