"""Served throughput against the pipelined limit, in slices seconds apart on one machine.

``benchmarks.backends`` measures the offline limit and the server in separate processes, one
after the other; on a shared machine whose speed drifts by a fifth within a minute, the ratio
of one round then says as much about the drift as about the server. Here both stay alive side
by side, and only one of them runs at a time:

- the **server** (uvicorn, ready and warm), served by wrk at ``--clients`` for a slice, its
  answers counted from its own metrics in the middle of the load (wrk's ramp-up and its last
  answers stay out);
- the **offline pipeline** (``benchmarks.offline``'s pipelined loop on an engine built from
  the same settings), in a process of its own that is stopped (``SIGSTOP``) while the server
  is measured and continued for its own slice, its images counted by batch completions.

Slices alternate (offline then served, then served then offline, ...), so each pair of slices
sees the same machine within seconds, and each pair gives its own ratio; the report is the
median of the pairs, in ``--rounds`` rounds of fresh processes.

Usage: ``python -m benchmarks.served_vs_limit --model resnet18 --set backend=openvino``
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from multiprocessing.sharedctypes import SynchronizedArray
from pathlib import Path
from typing import Any

from benchmarks import offline, wrk
from benchmarks.backends import engine_settings
from benchmarks.common import machine, machine_markdown, median, model_arguments, publish, table
from benchmarks.compare import server_env
from benchmarks.corpus import corpus
from harness.promtext import value
from harness.servers import UvicornProcess

# A slice's first and last part stay out of its count (connections opening, a batch finishing).
SETTLE_S = 1.0


def answered(url: str) -> float:
    """Predictions the server has answered 200 so far."""
    return value(wrk.scrape(url), "batchserve_requests_total", outcome="ok")


def settings_of(pairs: list[str]) -> dict[str, str]:
    """``name=value`` settings as ``BATCHSERVE_NAME`` environment variables."""
    return {f"BATCHSERVE_{key.upper()}": value
            for key, value in (item.split("=", 1) for item in pairs)}  # fmt: skip


def ratio(pair: dict[str, float]) -> float:
    return pair["served"] / pair["limit"]


def _pipeline_worker(settings: dict[str, str], done: SynchronizedArray[float]) -> None:
    """The offline pipeline, batch after batch, for ever: ``done`` holds the images finished
    and when the last batch finished (``time.perf_counter``, the same clock in every process)."""
    extra: dict[str, Any] = engine_settings(settings)
    batch_size = int(settings["BATCHSERVE_MAX_BATCH_SIZE"])
    engine = offline.make_engine(settings["BATCHSERVE_MODEL"], settings["BATCHSERVE_PRECISION"],
                                 batch_size, **extra)  # fmt: skip
    images = corpus(None, 64)
    with ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="decode") as pool:
        work = offline.pipeline(engine, images, batch_size, pool)
        work()  # first-use costs, before the first slice
        while True:
            images_done = work()
            with done.get_lock():
                done[0] += images_done
                done[1] = time.perf_counter()


class Pipeline:
    """The offline pipeline in a process of its own, stopped except during its slices."""

    def __init__(self, settings: dict[str, str]) -> None:
        context = multiprocessing.get_context("spawn")
        self.done: SynchronizedArray[float] = context.Array("d", [0.0, 0.0])
        self.process = context.Process(target=_pipeline_worker, args=(settings, self.done),
                                       daemon=True)  # fmt: skip

    def __enter__(self) -> Pipeline:
        self.process.start()
        deadline = time.monotonic() + 600
        while self._read()[0] == 0:  # built, warm, and through its first batch
            if not self.process.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the offline pipeline did not start")
            time.sleep(0.2)
        self._signal(signal.SIGSTOP)
        return self

    def __exit__(self, *exc: object) -> None:
        self._signal(signal.SIGCONT)
        self.process.kill()
        self.process.join()

    def _signal(self, which: signal.Signals) -> None:
        assert self.process.pid is not None
        os.kill(self.process.pid, which)
        # A signal is delivered later: the slice that follows starts once every thread stopped.
        while which is signal.SIGSTOP and self.state() != "T":
            time.sleep(0.001)

    def state(self) -> str:
        """The process's state letter (``R`` running, ``S`` sleeping, ``T`` stopped...)."""
        stat = Path(f"/proc/{self.process.pid}/stat").read_text()
        return stat.rpartition(")")[2].split()[0]

    def _read(self) -> tuple[float, float]:
        # Read only while the process runs: stopped, it may hold the array's lock.
        with self.done.get_lock():
            return self.done[0], self.done[1]

    def images_per_second(self, seconds: float) -> float:
        """Continue the pipeline, count its images over the middle ``seconds``, stop it."""
        self._signal(signal.SIGCONT)
        try:
            time.sleep(SETTLE_S)
            first, since = self._read()
            time.sleep(seconds)
            last, until = self._read()
        finally:
            self._signal(signal.SIGSTOP)
        return (last - first) / (until - since)


@contextmanager
def load(command: list[str]) -> Iterator[None]:
    """wrk running ``command`` for as long as the block lasts (then waited for; stopped at once
    when the block fails, rather than waited for to the end of its seconds)."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    except BaseException:
        process.kill()
        raise
    finally:
        process.wait(timeout=60)


def served_per_second(url: str, command: list[str], seconds: float) -> float:
    """Answers per second over the middle ``seconds`` of a wrk load."""
    with load(command):
        time.sleep(SETTLE_S)
        first, since = answered(url), time.perf_counter()
        time.sleep(seconds)
        last, until = answered(url), time.perf_counter()
    return (last - first) / (until - since)


def measure_round(settings: dict[str, str], images: list[bytes], args: argparse.Namespace
                  ) -> list[dict[str, float]]:  # fmt: skip
    pairs = []
    with (
        UvicornProcess(settings, startup_timeout=600) as server,
        Pipeline(settings) as pipeline,
        wrk.command_for(server.url, images, args.clients) as command,
    ):
        wrk_seconds = args.seconds + 2 * SETTLE_S
        served_per_second(server.url, command(wrk_seconds), 1.0)  # the server's warm-up
        for index in range(args.pairs):
            pair: dict[str, float] = {}
            ways = ("limit", "served") if index % 2 == 0 else ("served", "limit")
            for way in ways:
                pair[way] = (pipeline.images_per_second(args.seconds) if way == "limit" else
                             served_per_second(server.url, command(wrk_seconds),
                                               args.seconds))  # fmt: skip
            pairs.append(pair)
            print(
                f"  pair {index + 1}: limit {pair['limit']:.1f}, served "
                f"{pair['served']:.1f} images/s, {ratio(pair):.3f}",
                flush=True,
            )
    return pairs


def run(args: argparse.Namespace) -> dict[str, Any]:
    images = corpus(None, 64)
    settings = {
        **server_env(args.model, args.precision, args.batch_size),
        "BATCHSERVE_BACKEND": "torch",  # as the server process has it unless --set names one
        **settings_of(args.set),
    }
    rounds = []
    for index in range(args.rounds):
        print(f"round {index + 1}/{args.rounds}", flush=True)
        rounds.append(measure_round(settings, images, args))
    ratios = [ratio(pair) for pairs in rounds for pair in pairs]
    return {"machine": machine(), "model": args.model, "precision": args.precision,
            "batch_size": args.batch_size, "clients": args.clients, "set": args.set,
            "seconds": args.seconds, "pairs": args.pairs, "rounds": rounds,
            "median_ratio": median(ratios), "min_ratio": min(ratios),
            "max_ratio": max(ratios)}  # fmt: skip


def markdown(data: dict[str, Any]) -> str:
    rows = [[index + 1, pair_index + 1, pair["limit"], pair["served"], ratio(pair)]
            for index, pairs in enumerate(data["rounds"])
            for pair_index, pair in enumerate(pairs)]  # fmt: skip
    per_round = ", ".join(f"{median([ratio(pair) for pair in pairs]):.3f}"
                          for pairs in data["rounds"])  # fmt: skip
    settings = " ".join(data["set"]) or "defaults"
    return f"""# Served against the pipelined limit, paired: {data["model"]} ({settings})

`python -m benchmarks.served_vs_limit --model {data["model"]} --precision {data["precision"]}
--set {settings}`: batch {data["batch_size"]}, wrk at {data["clients"]} clients on the same
machine. The server and the offline pipeline live side by side, one stopped while the other
runs; {data["pairs"]} pairs of alternating {data["seconds"]} s slices per round, each counted
in its middle, {len(data["rounds"])} rounds of fresh processes.

Served / limit: **{data["median_ratio"]:.3f}** (the median over every pair; pairs
{data["min_ratio"]:.3f} to {data["max_ratio"]:.3f}; median per round {per_round}).

{table(["round", "pair", "limit img/s", "served img/s", "served / limit"], rows)}

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    parser = model_arguments(__doc__, __file__)
    parser.add_argument("--set", nargs="*", default=[], help="settings, e.g. backend=openvino")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=3.0, help="counted per slice")
    parser.add_argument("--pairs", type=int, default=6, help="pairs of slices per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--name", default="served-vs-limit")
    args = parser.parse_args()
    wrk.require()
    data = run(args)
    publish(args.name, data, markdown(data))


if __name__ == "__main__":
    main()
