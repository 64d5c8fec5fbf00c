"""The ceiling served throughput is judged against: the model and the pipeline without HTTP.

Per batch size and precision, images per second of:

- **forward**: the model alone on a ready input batch (no decoding at all);
- **sequential**: decode a batch (decode threads), then run it, then the next: no overlap;
- **pipelined**: the next batch is decoded (one thread per image, ``--decode-threads``) while
  the current one runs. This is what a server can at best achieve: the cores are split
  between decoding and the batched forward pass, and decoding overlaps the forward.

Usage: ``python -m benchmarks.offline --model resnet18 --precision bf16 fp32 --batch-sizes 1 8 32``
"""

from __future__ import annotations

# First: the server's environment for the runtimes (its OpenMP wait policy), which torch
# reads when it loads, so that the limit is measured as the server runs.
import app  # noqa: F401

# isort: split

import json
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from app.engine import (
    EngineObserver,
    ImageRequest,
    InferenceEngine,
    build_engine,
    resolve_device,
)
from app.settings import Settings
from benchmarks.common import command_line, machine, machine_markdown, median, publish, table
from benchmarks.corpus import corpus
from preprocessing import PreparedImage


def make_engine(
    model: str, precision: str, max_batch_size: int, *, weights: str = "none", warm: bool = True,
    observer: EngineObserver | None = None, **extra: Any,
) -> InferenceEngine:  # fmt: skip
    """An engine built from settings as the server builds it (seeded random weights by default)."""
    settings = Settings(
        _env_file=None, model=model, weights=weights, precision=precision,
        max_batch_size=max_batch_size, log_level="warning", **extra,
    )  # fmt: skip
    config = settings.own_model().batch_config(resolve_device(settings.device).type)
    engine = build_engine(settings.own_model(), config, observer)
    if warm:
        engine.warmup()
    return engine


def _sync(engine: InferenceEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def _rate(work: Callable[[], int], seconds: float) -> float:
    """Images per second of repeated ``work()`` calls (each returns images done)."""
    work()  # one untimed round: first-use costs stay out of the figure
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        done += work()
    return done / (time.perf_counter() - started)


def forward_only(engine: InferenceEngine, batch_size: int, seconds: float) -> float:
    backend = engine.backend
    batch = torch.randn(batch_size, *engine.input_shape, device=engine.device)
    layout = torch.channels_last if backend.channels_last else torch.contiguous_format
    batch = batch.to(backend.input_dtype).contiguous(memory_format=layout)

    def work() -> int:
        with torch.inference_mode():
            backend.forward(batch)
        _sync(engine)
        return batch_size

    return _rate(work, seconds)


def sequential(
    engine: InferenceEngine, images: Sequence[bytes], batch_size: int, seconds: float,
    pool: ThreadPoolExecutor,
) -> float:  # fmt: skip
    position = 0

    def work() -> int:
        nonlocal position
        chunk = [images[(position + i) % len(images)] for i in range(batch_size)]
        position += batch_size
        prepared = list(pool.map(engine.prepare, chunk))
        _check(engine.run_batch([ImageRequest(image, 5) for image in prepared]))
        return batch_size

    return _rate(work, seconds)


def pipelined(
    engine: InferenceEngine, images: Sequence[bytes], batch_size: int, seconds: float,
    pool: ThreadPoolExecutor,
) -> float:  # fmt: skip
    return _rate(pipeline(engine, images, batch_size, pool), seconds)


def pipeline(
    engine: InferenceEngine, images: Sequence[bytes], batch_size: int, pool: ThreadPoolExecutor
) -> Callable[[], int]:
    """One batch per call (returns its images), the next batch decoded while it runs."""
    feed = iter(range(1 << 62))
    pending: deque[Future[PreparedImage]] = deque(
        pool.submit(engine.prepare, images[next(feed) % len(images)]) for _ in range(batch_size)
    )

    def work() -> int:
        prepared = [pending.popleft().result() for _ in range(batch_size)]
        for _ in range(batch_size):  # decode the next batch while this one runs
            pending.append(pool.submit(engine.prepare, images[next(feed) % len(images)]))
        _check(engine.run_batch([ImageRequest(image, 5) for image in prepared]))
        return batch_size

    return work


def _check(results: Sequence[object]) -> None:
    for result in results:
        if isinstance(result, BaseException):
            raise result


def measure(
    model: str, precisions: Sequence[str], batch_sizes: Sequence[int], images: Sequence[bytes],
    seconds: float, runs: int, decode_threads: int, **extra: Any,
) -> list[dict[str, Any]]:  # fmt: skip
    rows = []
    with ThreadPoolExecutor(decode_threads, thread_name_prefix="decode") as pool:
        for precision in precisions:
            engine = make_engine(model, precision, max(batch_sizes), **extra)
            for batch_size in batch_sizes:
                samples: dict[str, list[float]] = {"forward": [], "sequential": [], "pipelined": []}
                for _ in range(runs):
                    samples["forward"].append(forward_only(engine, batch_size, seconds))
                    samples["sequential"].append(
                        sequential(engine, images, batch_size, seconds, pool)
                    )
                    samples["pipelined"].append(
                        pipelined(engine, images, batch_size, seconds, pool)
                    )
                row = {"model": model, "precision": engine.precision, "device": str(engine.device),
                       "batch_size": batch_size, "samples": samples}  # fmt: skip
                row.update({name: median(values) for name, values in samples.items()})
                rows.append(row)
                print(f"  {model} {engine.precision} batch {batch_size}: forward "
                      f"{row['forward']:.1f}, sequential {row['sequential']:.1f}, pipelined "
                      f"{row['pipelined']:.1f} images/s", flush=True)  # fmt: skip
    return rows


def markdown(data: dict[str, Any]) -> str:
    body = table(
        ["model", "precision", "batch", "forward img/s", "sequential img/s", "pipelined img/s"],
        [[r["model"], r["precision"], r["batch_size"], r["forward"], r["sequential"],
          r["pipelined"]] for r in data["rows"]],
    )  # fmt: skip
    return f"""# Offline limits

Medians of {data["runs"]} runs of {data["seconds"]} s each; {data["images"]} generated photo-like
JPEGs; {data["decode_threads"]} decode threads (`python -m benchmarks.offline`).

{body}

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    parser = command_line(__doc__, __file__)
    parser.add_argument("--model", nargs="+", default=["resnet18"])
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 8, 16, 32])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--decode-threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--images", type=Path)
    parser.add_argument("--name", default="offline", help="results/<name>.md and .json")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON, write nothing")
    parser.add_argument(
        "--set", nargs="*", default=[], help="more settings, e.g. backend=onnxruntime"
    )
    args = parser.parse_args()
    images = corpus(args.images, 64)
    extra = dict(item.split("=", 1) for item in args.set)
    rows = []
    for model in args.model:
        rows += measure(model, args.precision, args.batch_sizes, images, args.seconds, args.runs,
                        args.decode_threads, **extra)  # fmt: skip
    if args.json:
        print(json.dumps(rows))
        return
    data = {"machine": machine(), "runs": args.runs, "seconds": args.seconds,
            "images": len(images), "decode_threads": args.decode_threads, "rows": rows}  # fmt: skip
    publish(args.name, data, markdown(data))


if __name__ == "__main__":
    main()
