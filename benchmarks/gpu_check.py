"""One call on a CUDA machine: tests, correctness of the GPU path, throughput, profile.

In one run of a few minutes it:

1. runs the ``@pytest.mark.cuda`` tests;
2. compares nvjpeg decoding with CPU decoding (mean absolute pixel difference), and times
   nvjpeg's batched decode beside the CPU's (``DECODE_DEVICE=cpu``: decode, resize and crop in
   the decode threads), saying which GPU kernels the decode launched (none, or next to none,
   when the hardware JPEG decoder ran);
3. compares fp16 (bf16 on a CPU) with fp32: top-1 agreement, largest probability difference,
   on random weights (the numerics) and on EfficientNet-Lite0's ImageNet weights and real
   photos (what a user's answers would lose);
4. compares CUDA-graph replay with eager execution;
5. checks the batch pipeline: readback buffers pinned and contiguous, batch N+1's forward
   pass queued before batch N's results are back, concurrent batches giving the answers of
   sequential ones, and what padding a batch of 17 to its bucket of 32 costs;
6. measures offline throughput per batch size and precision (forward only, and the whole
   pipeline without HTTP): the ceiling;
7. measures served throughput over HTTP (a real uvicorn, ``benchmarks.loadgen`` in a process
   of its own): 64 clients, then open-loop arrivals at 70% of that for a p99 that queueing
   does not hide, and served / the offline pipelined limit in the same precision and
   graph mode;
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
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from app.engine import ImageRequest
from benchmarks import accuracy, offline
from benchmarks.common import RESULTS, command_line, machine, machine_markdown, table
from benchmarks.corpus import generate
from benchmarks.profile import profile_batches
from harness.pipeline_checks import (
    ReportLog,
    concurrent_agreement,
    padding_cost,
    readback_overlap,
)
from harness.servers import ROOT, UvicornProcess
from preprocessing import ImageLimits, TransformConfig, decode_cpu, prepare, read_header
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
    differences, fallbacks = [], decoded.fallbacks
    for (data, header), result in zip(items, decoded.results, strict=True):
        if isinstance(result, BaseException):
            raise result
        reference = decode_cpu(data, header)
        differences.append(float((result.cpu().float() - reference.float()).abs().mean()))
    return {
        "images": len(images),
        "mean_abs_pixel_difference": sum(differences) / len(differences),
        "max_image_mean_abs_difference": max(differences),
        "cpu_fallbacks": fallbacks,
    }


def timed_rate(work: Callable[[], int], seconds: float) -> float:
    """Items per second of ``work`` (which returns how many it did) over about ``seconds``."""
    work()  # once to warm up
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        done += work()
    return done / (time.perf_counter() - started)


def decode_rates(images: list[bytes], batch: int, seconds: float) -> dict[str, Any]:
    """nvjpeg's batched decode (and the fit to 224) against the CPU's decode threads."""
    gpu, config = torch.device("cuda"), TransformConfig()
    items = [(data, read_header(data)) for data in images[:batch]]

    def on_gpu() -> int:
        decoded = decode_jpegs(items, gpu)
        torch.cuda.synchronize(gpu)
        return len(decoded.results)

    threads = os.cpu_count() or 1
    limits = ImageLimits(resize_size=config.resize_size)
    with ThreadPoolExecutor(threads) as pool:

        def on_cpu() -> int:
            return len(list(pool.map(lambda data: prepare(data, config, limits), images)))

        cpu_rate = timed_rate(on_cpu, seconds)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        fallbacks = decode_jpegs(items, gpu).fallbacks
        torch.cuda.synchronize(gpu)
    kernels = sorted({event.name for event in profile.events()
                      if event.device_type.name == "CUDA"})  # fmt: skip
    return {
        "batch": len(items),
        "nvjpeg_images_per_s": timed_rate(on_gpu, seconds),
        "cpu_decode_threads": threads,
        "cpu_images_per_s": cpu_rate,
        "cpu_fallbacks": fallbacks,
        "decode_kernels": kernels[:20],
        "kernel_count": len(kernels),
    }


def real_precision_agreement(low: str, batch: int) -> dict[str, Any]:
    """fp16 against fp32 on EfficientNet-Lite0's ImageNet weights and twenty real photos."""
    from tests.real_model import FACTORY, photos

    samples = [accuracy.Sample(name, data) for name, data in photos().items()]
    engines = [accuracy.engine_for(FACTORY, "pretrained", {"precision": precision,
                                                            "compile": "none"}, batch)
               for precision in ("fp32", low)]  # fmt: skip
    report = accuracy.compare_on(
        accuracy.predict_all(engines[0], samples, batch),
        accuracy.predict_all(engines[1], samples, batch),
        samples,
        engines[0],
    )
    report["compared"] = f"{low} vs fp32, {FACTORY} with its ImageNet weights, real photos"
    return report


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


def loadgen(url: str, mode: list[str], seconds: float, out: Path) -> dict[str, Any]:
    """``benchmarks.loadgen`` in a process of its own (it must not share the server's GIL)."""
    command = [sys.executable, "-m", "benchmarks.loadgen", "--url", url, *mode,
               "--warmup", str(min(3.0, seconds / 2)), "--duration", str(seconds),
               "--json", str(out)]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 120,
                          cwd=ROOT, env=env)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the load generator failed: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def served_http(env: dict[str, str], clients: int, seconds: float) -> dict[str, Any]:
    """A real uvicorn: ``clients`` closed-loop clients, then Poisson arrivals at 70% of the
    throughput they reached (the p99 a server at that load answers with)."""
    with tempfile.TemporaryDirectory() as folder, UvicornProcess(env, 600) as server:
        closed = loadgen(server.url, ["--concurrency", str(clients)], seconds,
                         Path(folder) / "closed.json")  # fmt: skip
        rate = 0.7 * closed["throughput"]
        opened = loadgen(server.url, ["--rate", f"{rate:.2f}"], seconds,
                         Path(folder) / "open.json")  # fmt: skip
    return {"closed": closed, "open_70": opened}


def served_over_limit(data: dict[str, Any], precision: str, batch: int) -> float | None:
    """Served images/s over the offline pipelined limit at the largest batch size."""
    served, rows = data.get("served"), data.get("offline")
    if not isinstance(served, dict) or not isinstance(rows, list):
        return None
    limit = [row["pipelined"] for row in rows
             if row.get("precision") == precision and row.get("batch_size") == batch]  # fmt: skip
    return served["closed"]["throughput"] / limit[0] if limit and limit[0] else None


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
    # Offline and served in the same graph mode, so that served / limit compares like with like.
    env = {"BATCHSERVE_MODEL": args.model, "BATCHSERVE_WEIGHTS": "none",
           "BATCHSERVE_PRECISION": low, "BATCHSERVE_MAX_BATCH_SIZE": str(largest),
           "BATCHSERVE_CUDA_GRAPHS": str(cuda).lower(), "BATCHSERVE_GRPC_PORT": "0",
           "BATCHSERVE_LOG_LEVEL": "warning"}  # fmt: skip
    trace = Path(args.out) / "gpu_check_trace.json"
    steps: list[tuple[str, str, Callable[[], Any]]] = [
        ("tests", "CUDA tests",
         lambda: SKIPPED if args.skip_tests or not cuda else run_cuda_tests()),
        ("decode", "decode agreement", lambda: decode_agreement(images) if cuda else SKIPPED),
        ("decode_rates", "decode rates",
         lambda: decode_rates(images, largest, args.seconds) if cuda else SKIPPED),
        ("precision", "precision agreement",
         lambda: precision_agreement(args.model, low, images, largest)),
        ("precision_real", "precision on real weights",
         lambda: "skipped (--smoke)" if args.smoke else real_precision_agreement(low, 20)),
        ("graphs", "CUDA graphs vs eager",
         lambda: graphs_agreement(args.model, images, min(8, largest)) if cuda else SKIPPED),
        ("pipeline", "batch pipeline", lambda: pipeline(args.model, low, images, largest)),
        ("offline", "offline throughput", lambda: offline.measure(
            args.model, precisions, args.batch_sizes, images, args.seconds, 1,
            args.decode_threads, cuda_graphs=cuda)),
        ("runtimes", "ONNX Runtime on this device", lambda: runtimes(args, images, cuda)),
        ("served", "served over HTTP",
         lambda: served_http(env, args.clients, args.seconds * 2)),
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
        data["served_over_limit"] = served_over_limit(data, low, largest)
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
        rows = []
        for label, run in (("closed loop", value["closed"]), ("open loop, 70%", value["open_70"])):
            latency, server = run["latency_ms"], run["server"]
            offered = run["offered_rate"] or run["concurrency"]
            rows.append([label, offered, run["throughput"], latency["p50"], latency["p99"],
                         server["mean_batch_size"], server["device_busy_ratio"],
                         run["errors"] or "none"])  # fmt: skip
        ratio = data.get("served_over_limit")
        limit = "n/a" if ratio is None else f"{ratio:.3f}"
        return table(["load", "clients or rate/s", "images/s", "p50 ms", "p99 ms",
                      "mean batch", "device busy", "errors"], rows) + (
            f"\n\nServed (closed loop) / offline pipelined limit, same precision and graph "
            f"mode, largest batch: **{limit}**"
        )  # fmt: skip

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

### Decode rates (nvjpeg batched vs the CPU's decode threads, each fitted to 224)

{section("decode_rates")}

## 3. Lower precision vs fp32

Random weights (the numerics):

{section("precision")}

EfficientNet-Lite0's ImageNet weights on twenty real photos:

{section("precision_real")}

## 4. CUDA graphs vs eager

{section("graphs")}

## 5. Batch pipeline

{section("pipeline", pipeline)}

## 6. Offline throughput (images/s)

{section("offline", offline_rows)}

### ONNX Runtime on this device

{section("runtimes", runtime_rows)}

## 7. Served over HTTP (uvicorn; the load generator in a process of its own)

{section("served", served)}

## 8. Profile

{section("profile", profile)}

## Failures
{failures or chr(10) + "none"}

## Machine

{machine_markdown(data["machine"])}
"""


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__, __file__)
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
