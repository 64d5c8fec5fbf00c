"""Where the time goes: ``torch.profiler`` over real batches, and one request end to end.

1. Runs ``--batches`` batches through the engine (decoding included) under ``torch.profiler``
   with CPU and, where present, CUDA activities and ``record_shapes``; prints the operator table
   sorted by device time (CPU time on a CPU) and writes a Chrome trace. The real code marks its
   stages with ``record_function`` (``batchserve.decode``, ``.device_decode``, ``.collate``,
   ``.h2d``, ``.forward``, ``.postprocess``, ``.d2h``), so the trace reads like the architecture.
2. Sends single requests to a real server process and splits each one's latency into parse,
   decode, queue, transfer, forward, readback, serialize and the rest (HTTP, thread hops),
   from the ``Server-Timing`` header, with each stage's share.

Usage: ``python -m benchmarks.profile --model resnet18 --batches 8 --batch-size 8``; any other
setting with ``--set backend=onnxruntime --set compile=none`` (the same in both parts).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
from torch.profiler import ProfilerActivity, profile

from app.engine import ImageRequest
from benchmarks.common import (
    RESULTS,
    machine,
    machine_markdown,
    median,
    model_arguments,
    publish,
    table,
)
from benchmarks.compare import server_env
from benchmarks.corpus import content_type, corpus
from benchmarks.offline import make_engine
from harness.servers import UvicornProcess

# Server-Timing stages grouped the way the question is asked.
GROUPS = {
    "parse": ("parse",),
    "decode": ("decode", "device_decode"),
    "queue": ("queue",),
    "transfer": ("collate", "h2d"),
    "forward": ("forward",),
    "readback": ("postprocess", "d2h"),
    "serialize": ("serialize",),
}


def profile_batches(model: str, precision: str, batch_size: int, batches: int,
                    images: list[bytes], trace: Path,
                    settings: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    engine = make_engine(model, precision, batch_size, **(settings or {}))
    activities = [ProfilerActivity.CPU]
    on_cuda = engine.device.type == "cuda"
    if on_cuda:
        activities.append(ProfilerActivity.CUDA)
    started = time.perf_counter()
    with profile(activities=activities, record_shapes=True) as profiler:
        for index in range(batches):
            chunk = [images[(index * batch_size + i) % len(images)] for i in range(batch_size)]
            requests = [ImageRequest(engine.prepare(data), 5) for data in chunk]
            for outcome in engine.run_batch(requests):
                if isinstance(outcome, BaseException):
                    raise outcome
    wall = time.perf_counter() - started
    trace.parent.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(trace))
    averages = profiler.key_averages()
    sort_by = "self_cuda_time_total" if on_cuda else "self_cpu_time_total"
    operators = averages.table(sort_by=sort_by, row_limit=25)
    stages = {
        event.key: event.cpu_time_total / 1000
        for event in averages
        if event.key.startswith("batchserve.")
    }
    busy = busy_ratio(kernel_intervals(trace), wall) if on_cuda else None
    return {"operators": operators, "stages_ms": stages, "wall_s": wall, "gpu_busy_ratio": busy,
            "device": str(engine.device), "compile": engine.backend.variant}  # fmt: skip


def busy_ratio(intervals: list[tuple[float, float]], wall_s: float) -> float:
    """The share of ``wall_s`` in which at least one kernel ran: the union of the kernels'
    ``(start, end)`` intervals in microseconds (kernels on several streams overlap, so their
    durations summed would count the same time twice)."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        covered += end - max(start, reach)
        reach = end
    return covered / 1e6 / wall_s


def kernel_intervals(trace: Path) -> list[tuple[float, float]]:
    """Each GPU kernel's ``(start, end)`` in microseconds, from a Chrome trace."""
    events = json.loads(trace.read_text()).get("traceEvents", [])
    return [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
            if e.get("cat") == "kernel" and "ts" in e]  # fmt: skip


def env_of(settings: dict[str, str]) -> dict[str, str]:
    return {f"BATCHSERVE_{key.upper()}": value for key, value in settings.items()}


def breakdown(model: str, precision: str, batch_size: int, images: list[bytes],
              requests: int, settings: dict[str, str]) -> dict[str, Any]:  # fmt: skip
    """Median per stage of single requests through a real server."""
    per_stage: dict[str, list[float]] = {name: [] for name in (*GROUPS, "other", "total")}
    client_ms: list[float] = []
    with (
        UvicornProcess(server_env(model, precision, batch_size, **env_of(settings))) as server,
        httpx.Client(base_url=server.url, timeout=60) as client,
    ):
        for index in range(requests + 3):
            data = images[index % len(images)]
            sent = time.perf_counter()
            response = client.post("/predict", content=data,
                                   headers={"content-type": content_type(data)})  # fmt: skip
            elapsed = (time.perf_counter() - sent) * 1000
            response.raise_for_status()
            if index < 3:
                continue  # warm-up
            timing = {
                part.split(";dur=")[0].strip(): float(part.split(";dur=")[1])
                for part in response.headers["server-timing"].split(",")
            }
            grouped = {
                name: sum(timing.get(s, 0.0) for s in parts) for name, parts in GROUPS.items()
            }
            for name, value in grouped.items():
                per_stage[name].append(value)
            per_stage["total"].append(timing["total"])
            per_stage["other"].append(max(0.0, timing["total"] - sum(grouped.values())))
            client_ms.append(elapsed)
    medians = {name: median(values) for name, values in per_stage.items()}
    return {"median_ms": medians, "client_ms": median(client_ms), "requests": requests}


def markdown(data: dict[str, Any]) -> str:
    b = data["breakdown"]["median_ms"]
    total = b["total"] or 1.0
    rows = [[name, b[name], 100 * b[name] / total] for name in (*GROUPS, "other")]
    rows.append(["total (server)", total, 100.0])
    client = data["breakdown"]["client_ms"]
    stage_rows = [[name, ms] for name, ms in sorted(data["profile"]["stages_ms"].items())]
    busy = data["profile"]["gpu_busy_ratio"]
    busy_line = (
        f"GPU busy ratio (kernel time / wall): {busy:.2f}"
        if busy is not None
        else (
            "CPU run: the device is the CPU; see batchserve_device_busy_seconds_total when serving"
        )
    )
    return f"""# Profile: {data["model"]} {data["precision"]} on {data["profile"]["device"]}

Backend variant: {data["profile"]["compile"]}; settings: {data.get("settings") or "defaults"}.

## One request, end to end (1 client, medians of {data["breakdown"]["requests"]} requests)

{table(["stage", "ms", "share %"], rows)}

The client saw {client:.1f} ms; "other" is HTTP handling, thread hand-offs and waiting for
the GIL inside the server.

## {data["batches"]} batches of {data["batch_size"]} under torch.profiler

{busy_line}. Chrome trace: `{data["trace"]}` (open in chrome://tracing or Perfetto).

{table(["record_function", "total ms"], stage_rows)}

```
{data["profile"]["operators"]}
```

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    parser = model_arguments(__doc__, __file__)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--images", type=Path)
    parser.add_argument("--set", action="append", default=[], metavar="SETTING=VALUE",
                        help="another setting, e.g. backend=onnxruntime")  # fmt: skip
    parser.add_argument("--name", help="results/<name>.* (default: profile-<model>)")
    args = parser.parse_args()
    settings = dict(pair.split("=", 1) for pair in args.set)
    name = args.name or f"profile-{args.model}"
    images = corpus(args.images, 64)
    trace = RESULTS / "traces" / f"{name}.json"
    data = {
        "machine": machine(),
        "model": args.model,
        "precision": args.precision,
        "batch_size": args.batch_size,
        "batches": args.batches,
        "settings": settings,
        "trace": str(trace.relative_to(RESULTS.parent.parent)),
        "profile": profile_batches(
            args.model, args.precision, args.batch_size, args.batches, images, trace, settings
        ),
        "breakdown": breakdown(
            args.model, args.precision, args.batch_size, images, args.requests, settings
        ),
    }
    publish(name, data, markdown(data))


if __name__ == "__main__":
    main()
