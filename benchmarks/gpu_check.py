"""One call on a CUDA machine: tests, correctness of the GPU path, throughput, profile.

In one run of a few minutes it:

1. runs the ``@pytest.mark.cuda`` tests;
2. compares nvjpeg decoding with CPU decoding (mean absolute pixel difference);
3. compares fp16 (bf16 on a CPU) with fp32: top-1 agreement, largest probability difference;
4. compares CUDA-graph replay with eager execution;
5. checks the batch pipeline: readback buffers pinned and contiguous, batch N+1's forward
   pass queued before batch N's results are back, concurrent batches giving the answers of
   sequential ones, and what padding a batch of 17 to its bucket of 32 costs;
6. measures offline throughput per batch size and precision (forward only, and the whole
   pipeline without HTTP): the ceiling;
7. measures served throughput in-process through the real app (ASGI, 64 clients);
8. profiles a few batches with ``torch.profiler`` and reports the GPU busy ratio;

and writes everything to ``gpu_check.md`` and ``gpu_check.json`` under ``--out`` after every
step (a step that fails is recorded, and the others still run). Without CUDA
it runs in a clearly labelled degraded mode: the CUDA parts are skipped, the rest runs on the
CPU (that is how CI checks this script).

Usage: ``python -m benchmarks.gpu_check --out $OUT`` (about 5 minutes; ``--full`` for every
precision and batch size, ``--smoke`` for a tiny CPU run)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch
from asgi_lifespan import LifespanManager

from app.engine import ImageRequest
from app.main import create_app
from app.settings import Settings
from benchmarks import accuracy, offline
from benchmarks.common import RESULTS, machine, machine_markdown, table
from benchmarks.corpus import generate
from benchmarks.loadgen import LoadSpec, run
from benchmarks.profile import profile_batches
from harness.pipeline_checks import (
    ReportLog,
    concurrent_agreement,
    padding_cost,
    readback_overlap,
)
from preprocessing import decode_cpu, read_header
from preprocessing.device import decode_jpegs

SKIPPED = "skipped (no CUDA)"


def run_cuda_tests(timeout_s: float = 240.0) -> dict[str, Any]:
    """The ``@pytest.mark.cuda`` tests alone (collection of the others is skipped by the
    marker; test files whose tools the device image lacks skip themselves)."""
    command = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
               "tests/test_device_path.py", "tests/test_runtimes.py"]  # fmt: skip
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout
        return {"returncode": "timeout", "summary": f"stopped after {timeout_s:.0f} s",
                "tail": (output or "")[-3000:]}  # fmt: skip
    lines = (result.stdout + result.stderr).strip().splitlines()
    return {"returncode": result.returncode, "summary": lines[-1] if lines else "",
            "tail": "\n".join(lines[-30:])}  # fmt: skip


def decode_agreement(images: list[bytes]) -> dict[str, Any]:
    gpu = torch.device("cuda")
    items = [(data, read_header(data)) for data in images]
    decoded = decode_jpegs(items, gpu)
    differences, fallbacks = [], 0
    for (data, header), result in zip(items, decoded, strict=True):
        if isinstance(result, BaseException):
            raise result
        fallbacks += result.device.type == "cpu"
        reference = decode_cpu(data, header)
        differences.append(float((result.cpu().float() - reference.float()).abs().mean()))
    return {
        "images": len(images),
        "mean_abs_pixel_difference": sum(differences) / len(differences),
        "max_image_mean_abs_difference": max(differences),
        "cpu_fallbacks": fallbacks,
    }


def precision_agreement(model: str, low: str, images: list[bytes], batch: int) -> dict[str, Any]:
    samples = [accuracy.Sample(str(i), data) for i, data in enumerate(images)]
    reference = accuracy.engine_for(model, "none", {"precision": "fp32", "compile": "none"}, batch)
    candidate = accuracy.engine_for(model, "none", {"precision": low, "compile": "none"}, batch)
    report = accuracy.compare_on(
        accuracy.predict_all(reference, samples, batch),
        accuracy.predict_all(candidate, samples, batch),
        samples,
        reference,
    )
    report["compared"] = f"{low} vs fp32 (random weights unless cached: a numerics check)"
    return report


def graphs_agreement(model: str, images: list[bytes], batch: int) -> dict[str, Any]:
    results = {}
    for graphs in (False, True):
        engine = offline.make_engine(model, "fp16", batch, cuda_graphs=graphs, compile="none")
        requests = [ImageRequest(engine.prepare(data), 5) for data in images[:batch]]
        results[graphs] = engine.run_batch(requests)
    differences, same_top1 = [], 0
    for eager, replayed in zip(results[False], results[True], strict=True):
        assert not isinstance(eager, BaseException)
        assert not isinstance(replayed, BaseException)
        same_top1 += eager.classes[0]["index"] == replayed.classes[0]["index"]
        differences.append(abs(eager.classes[0]["score"] - replayed.classes[0]["score"]))
    return {"images": len(differences), "same_top1": same_top1,
            "max_top1_probability_difference": max(differences)}  # fmt: skip


def pipeline(model: str, precision: str, images: list[bytes], batch: int) -> dict[str, Any]:
    log = ReportLog()
    engine = offline.make_engine(model, precision, batch, compile="none", observer=log)
    size = min(batch, 32)
    result: dict[str, Any] = {
        "overlap": readback_overlap(engine, log, images, size, batches=10),
        "concurrent": concurrent_agreement(engine, images, size, batches=8),
    }
    padded = offline.make_engine(model, precision, 32, compile="none", warm=False)
    result["padding"] = padding_cost(padded, 17)
    result["pads_to_buckets"] = engine.pads_to_buckets
    return result


def runtimes(args: argparse.Namespace, images: list[bytes], cuda: bool) -> list[dict[str, Any]]:
    """ONNX Runtime on this device (CUDA and TensorRT execution providers on a GPU, fp32 and
    fp16): offline throughput at the largest batch size and the start-up check's figures."""
    rows: list[dict[str, Any]] = []
    try:
        import onnxruntime
    except ImportError:
        return [{"backend": "onnxruntime", "result": "not installed"}]
    providers = onnxruntime.get_available_providers()
    if cuda and "CUDAExecutionProvider" not in providers:
        # The image's onnxruntime is the CPU build: exporting for a minute would measure the
        # CPU, not this device.
        return [{"backend": "onnxruntime", "result": "skipped: no CUDAExecutionProvider",
                 "providers": providers}]  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        for precision in ("fp32", "fp16") if cuda else ("fp32",):
            try:
                (row,) = offline.measure(
                    args.model, [precision], [args.batch_sizes[-1]], images, args.seconds, 1,
                    args.decode_threads, backend="onnxruntime", artifacts_dir=folder,
                )  # fmt: skip
            except Exception as exc:  # a missing provider, TensorRT failing to build, ...
                rows.append({"backend": "onnxruntime", "precision": precision,
                             "result": f"failed: {exc}", "providers": providers})  # fmt: skip
                continue
            rows.append({"backend": "onnxruntime", "providers": providers, **row})
    return rows


async def served(settings: Settings, images: list[bytes], clients: int,
                 seconds: float) -> dict[str, Any]:  # fmt: skip
    app = create_app(settings)
    async with LifespanManager(app, startup_timeout=600) as manager:
        transport = httpx.ASGITransport(app=manager.app)
        async with contextlib.AsyncExitStack() as stack:
            pool = [
                await stack.enter_async_context(
                    httpx.AsyncClient(transport=transport, base_url="http://served", timeout=120)
                )
                for _ in range(clients)
            ]
            spec = LoadSpec(concurrency=clients, warmup_s=min(3.0, seconds / 2),
                            duration_s=seconds)  # fmt: skip
            return await run(pool, images, spec)


def served_load(settings: Settings, images: list[bytes], clients: int,
                seconds: float) -> dict[str, Any]:  # fmt: skip
    return asyncio.run(served(settings, images, clients, seconds))


def check(args: argparse.Namespace) -> dict[str, Any]:
    """Every step in turn; a step that fails is recorded and the others still run, and the
    report is written after each one (a run cut short keeps what it measured)."""
    cuda = torch.cuda.is_available()
    images = generate(args.images)
    started = time.perf_counter()
    data: dict[str, Any] = {
        "machine": machine(),
        "mode": "full" if cuda else "degraded: no CUDA, GPU parts skipped, the rest on the CPU",
        "model": args.model, "failures": {},
    }  # fmt: skip
    low = "fp16" if cuda else "bf16"
    largest = args.batch_sizes[-1]
    precisions = (["fp16", "bf16", "fp32"] if args.full else ["fp16"]) if cuda else ["bf16"]
    settings = Settings(_env_file=None, model=args.model, weights="none", precision=low,
                        max_batch_size=largest, cuda_graphs=cuda, grpc_port=0,
                        log_level="warning")  # fmt: skip
    trace = Path(args.out) / "gpu_check_trace.json"
    steps: list[tuple[str, str, Callable[[], Any]]] = [
        ("tests", "CUDA tests",
         lambda: SKIPPED if args.skip_tests or not cuda else run_cuda_tests()),
        ("decode", "decode agreement", lambda: decode_agreement(images) if cuda else SKIPPED),
        ("precision", "precision agreement",
         lambda: precision_agreement(args.model, low, images, largest)),
        ("graphs", "CUDA graphs vs eager",
         lambda: graphs_agreement(args.model, images, min(8, largest)) if cuda else SKIPPED),
        ("pipeline", "batch pipeline", lambda: pipeline(args.model, low, images, largest)),
        ("offline", "offline throughput", lambda: offline.measure(
            args.model, precisions, args.batch_sizes, images, args.seconds, 1,
            args.decode_threads)),
        ("runtimes", "ONNX Runtime on this device", lambda: runtimes(args, images, cuda)),
        ("served", "served in-process",
         lambda: served_load(settings, images, args.clients, args.seconds * 2)),
        ("profile", "profile", lambda: profiled(args.model, low, largest, images, trace)),
    ]  # fmt: skip
    for index, (key, title, step) in enumerate(steps, 1):
        print(f"{index}/{len(steps)} {title}", flush=True)
        try:
            data[key] = step()
        except Exception as exc:
            data[key] = f"failed: {type(exc).__name__}: {exc}"
            data["failures"][key] = traceback.format_exc()[-4000:]
        data["elapsed_s"] = time.perf_counter() - started
        write_report(Path(args.out), data)
    return data


def profiled(model: str, precision: str, batch_size: int, images: list[bytes],
             trace: Path) -> dict[str, Any]:  # fmt: skip
    """A few batches under ``torch.profiler`` (``benchmarks.profile``), the trace gzipped
    beside the report."""
    result = profile_batches(model, precision, batch_size, 4, images, trace)
    with trace.open("rb") as source, gzip.open(f"{trace}.gz", "wb") as target:
        shutil.copyfileobj(source, target)
    trace.unlink()
    result["trace"] = f"{trace.name}.gz"
    return result


def write_report(out: Path, data: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    (out / "gpu_check.md").write_text(markdown(data))


def markdown(data: dict[str, Any]) -> str:
    """The report so far: a step not run yet says so, a failed one says how it failed."""

    def section(key: str, render: Callable[[Any], str] | None = None) -> str:
        value = data.get(key, "not run (yet)")
        if isinstance(value, str):
            return value
        if render is not None:
            try:
                return render(value)
            except Exception as exc:  # a result shaped otherwise must not cost the report
                shown = json.dumps(value, indent=1, default=str)
                return f"(shown as JSON: {type(exc).__name__}: {exc})\n\n```\n{shown}\n```"
        return table(["measure", "value"], [[k, v] for k, v in value.items() if k != "tail"])

    def tests(value: dict[str, Any]) -> str:
        return f"{value['summary']} (exit {value['returncode']})\n\n```\n{value['tail']}\n```"

    def pipeline(value: dict[str, Any]) -> str:
        def part(name: str) -> str:
            return table(["measure", "value"], list(value[name].items()))

        return f"""Forward pass of 17 rows as they are vs padded to the bucket of 32 (batches
are padded only when CUDA graphs are captured):

{part("padding")}

Readback and overlap (two batches in flight; a pair overlaps when batch N+1's forward pass
was queued before batch N's results were back on the host):

{part("overlap")}

The same batches run one at a time and from two threads at once:

{part("concurrent")}"""

    def offline_rows(rows: list[dict[str, Any]]) -> str:
        return table(["precision", "batch", "forward", "sequential", "overlapped"],
                     [[r["precision"], r["batch_size"], r["forward"], r["sequential"],
                       r["pipelined"]] for r in rows])  # fmt: skip

    def runtime_rows(rows: list[dict[str, Any]]) -> str:
        return "\n".join(
            f"- {row.get('precision', '')}: "
            + (f"forward {row['forward']:.1f}, pipelined {row['pipelined']:.1f} images/s"
               if "forward" in row else str(row.get("result")))
            + f" (providers: {row.get('providers')})"
            for row in rows
        )  # fmt: skip

    def served(value: dict[str, Any]) -> str:
        latency, server = value["latency_ms"], value["server"]
        return table(["images/s", "p50 ms", "p99 ms", "mean batch", "device busy"],
                     [[value["throughput"], latency["p50"], latency["p99"],
                       server["mean_batch_size"], server["device_busy_ratio"]]])  # fmt: skip

    def profile(value: dict[str, Any]) -> str:
        busy = value["gpu_busy_ratio"]
        ratio = "n/a on CPU" if busy is None else f"{busy:.2f}"
        head = "GPU busy ratio (the union of the kernels' intervals over the wall time)"
        trace = value.get("trace")
        return f"{head}: {ratio}. Trace: `{trace}`.\n\n```\n{value['operators']}\n```"

    failures = "".join(f"\n### {key}\n\n```\n{text}\n```\n"
                       for key, text in data.get("failures", {}).items())  # fmt: skip
    return f"""# GPU check: {data["model"]}

Mode: **{data["mode"]}**. Took {data.get("elapsed_s", 0):.0f} s so far.

## 1. CUDA tests

{section("tests", tests)}

## 2. nvjpeg vs CPU decode

{section("decode")}

## 3. Lower precision vs fp32

{section("precision")}

## 4. CUDA graphs vs eager

{section("graphs")}

## 5. Batch pipeline

{section("pipeline", pipeline)}

## 6. Offline throughput (images/s)

{section("offline", offline_rows)}

### ONNX Runtime on this device

{section("runtimes", runtime_rows)}

## 7. Served in-process (real app over ASGI, closed loop)

{section("served", served)}

## 8. Profile

{section("profile", profile)}

## Failures
{failures or chr(10) + "none"}

## Machine

{machine_markdown(data["machine"])}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--decode-threads", type=int, default=8)
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--full", action="store_true",
                        help="fp16, bf16 and fp32 rows at batch sizes up to 128, 3 s each (the "
                        "default, about 5 minutes: fp16 rows only)")  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a CPU smoke run")
    args = parser.parse_args(argv)
    if args.full:
        args.batch_sizes, args.seconds = [1, 16, 64, 128], 3.0
    if args.smoke:
        args.batch_sizes, args.seconds, args.images, args.clients = [1, 4], 0.5, 8, 8
    data = check(args)
    print(markdown(data))
    tests = data["tests"]
    failed = bool(data["failures"]) or (isinstance(tests, dict) and tests["returncode"] != 0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
