"""Priorities under overload: do high-priority requests keep a low latency while the server is
saturated by low-priority ones?

A real server (fresh per round) is offered ``--overload`` times its measured capacity, open
loop (Poisson arrivals, latency from the scheduled send time): ``--high-share`` of the
requests with ``X-Priority: 1``, the rest with ``X-Priority: 3``. The report gives p50/p99 of
each class and the low/high p99 ratio, medians over rounds. With ``--max-queue-size`` the queue
fills: then a high-priority request takes the place of the newest low-priority one, and the
report gives each class's share of 503 answers and the latency of its 200 answers.

Usage: ``python -m benchmarks priorities --model resnet18 --rounds 2``
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from benchmarks import wrk
from benchmarks.common import (
    machine,
    machine_markdown,
    median,
    model_arguments,
    publish,
    table,
)
from benchmarks.compare import server_env
from benchmarks.corpus import corpus
from benchmarks.loadgen import LoadSpec, run_url
from harness.servers import UvicornProcess

HERE = Path(__file__).resolve().parent  # the study's report and its runs


async def both(url: str, images: list[bytes], rate: float, share: float,
               args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    def spec(level: int, rate: float) -> LoadSpec:
        return LoadSpec(concurrency=None, rate=rate, warmup_s=args.warmup,
                        duration_s=args.duration, timeout_s=120,
                        headers={"x-priority": str(level)})  # fmt: skip

    high, low = await asyncio.gather(
        run_url(url, images, spec(1, rate * share), open_clients=64),
        run_url(url, images, spec(3, rate * (1 - share)), open_clients=192),
    )
    return {"high": high, "low": low}


def run(args: argparse.Namespace) -> dict[str, Any]:
    images = corpus(args.images, 64)
    extra = {} if args.max_queue_size is None else {
        "BATCHSERVE_MAX_QUEUE_SIZE": str(args.max_queue_size)}  # fmt: skip
    env = server_env(args.model, args.precision, args.batch_size, **extra)
    rounds = []
    for round_index in range(args.rounds):
        with UvicornProcess(env) as server:
            capacity = wrk.run(server.url, images, 32, 2, 5)["throughput"]
            offered = capacity * args.overload
            print(f"round {round_index + 1}/{args.rounds}: capacity {capacity:.1f}/s, "
                  f"offering {offered:.1f}/s", flush=True)  # fmt: skip
            result = asyncio.run(both(server.url, images, offered, args.high_share, args))
        row = {"capacity": capacity, "offered": offered}
        for name, report in result.items():
            ok = report["latency_ms_by_status"].get(200) or report["latency_ms_by_status"].get(
                "200", {"p50": float("nan"), "p99": float("nan")}
            )
            refused = report["errors"].get("503", 0) / max(1, report["completed"])
            row[name] = {"throughput": report["throughput"], **report["latency_ms"],
                         "errors": report["errors"], "refused": refused,
                         "ok_p50": ok["p50"], "ok_p99": ok["p99"]}  # fmt: skip
            print(f"  {name}: {report['throughput']:.1f}/s, p50 "
                  f"{report['latency_ms']['p50']:.0f} ms, p99 {report['latency_ms']['p99']:.0f} "
                  f"ms", flush=True)  # fmt: skip
        rounds.append(row)
    summary: dict[str, Any] = {
        name: {key: median([row[name][key] for row in rounds])
               for key in ("throughput", "p50", "p99", "refused", "ok_p50", "ok_p99")}
        for name in ("high", "low")
    }  # fmt: skip
    summary["low_over_high_p99"] = summary["low"]["p99"] / summary["high"]["p99"]
    return {"machine": machine(), "model": args.model, "precision": args.precision,
            "batch_size": args.batch_size, "overload": args.overload,
            "high_share": args.high_share, "duration_s": args.duration, "rounds": rounds,
            "max_queue_size": args.max_queue_size,
            "capacity": median([row["capacity"] for row in rounds]),
            "summary": summary}  # fmt: skip


def markdown(data: dict[str, Any]) -> str:
    summary = data["summary"]
    rows = [[name, summary[name]["throughput"], f"{summary[name]['refused']:.1%}",
             summary[name]["ok_p50"], summary[name]["ok_p99"]]
            for name in ("high", "low")]  # fmt: skip
    queue = data.get("max_queue_size")
    queue_line = (f"`MAX_QUEUE_SIZE={queue}`: the queue fills, and a high-priority request takes "
                  "the place of the newest low-priority one." if queue else "")  # fmt: skip
    return f"""# Priorities under overload: {data["model"]} {data["precision"]}

`python -m benchmarks priorities`: a server of measured capacity {data["capacity"]:.1f}
images/s offered {data["overload"]:g}x that, open loop, for {data["duration_s"]} s;
{data["high_share"]:.0%} of the requests with `X-Priority: 1` (high), the rest with
`X-Priority: 3` (low); medians of {len(data["rounds"])} rounds with a fresh server. Latency
from each request's scheduled send time. {queue_line}

{table(["class", "served/s", "answered 503", "p50 ms (200s)", "p99 ms (200s)"], rows)}

Low-priority p99 / high-priority p99 (every answer): **{summary["low_over_high_p99"]:.1f}x**.

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    parser = model_arguments(__doc__, __file__)
    parser.add_argument("--overload", type=float, default=1.5)
    parser.add_argument("--high-share", type=float, default=0.2)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-queue-size", type=int, help="MAX_QUEUE_SIZE (default: 1024)")
    parser.add_argument("--images", type=Path)
    parser.add_argument("--name", help="results/<name>.* (default: priorities-<model>)")
    args = parser.parse_args()
    data = run(args)
    publish(args.name or f"priorities-{args.model}", data, markdown(data), folder=HERE)


if __name__ == "__main__":
    main()
