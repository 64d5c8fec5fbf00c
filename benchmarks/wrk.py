"""Closed-loop load with wrk, the C load generator, when it is installed.

On a small machine the load generator shares the CPU with the server; wrk needs about a
tenth of the CPU per request that a Python client needs, so the server is measured, not the
client. Same report shape as ``benchmarks.loadgen``.
"""

from __future__ import annotations

import contextlib
import json
import resource
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from harness.promtext import Samples, ServerDelta, from_response

_SCRIPT = r"""
local bodies, types, counter = {}, {}, 0
function init(args)
  for _, path in ipairs(args) do
    local f = assert(io.open(path, "rb"))
    bodies[#bodies + 1] = f:read("*all")
    f:close()
  end
end
function request()
  counter = counter + 1
  local body = bodies[(counter % #bodies) + 1]
  return wrk.format("POST", "/predict", {["Content-Type"] = "CONTENT_TYPE"}, body)
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'RESULT {"requests": %d, "duration_us": %d, "connect": %d, "read": %d, "write": %d, ' ..
    '"status": %d, "timeout": %d, "p50": %d, "p90": %d, "p99": %d, "p999": %d, "max": %d}\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9), latency.max))
end
"""


_BOUNDARY = "batchserve-benchmark-boundary"


def form_body(image: bytes) -> bytes:
    """``image`` as the one file field ``file`` of a multipart/form-data body."""
    head = (
        f'--{_BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="image.jpg"'
        f"\r\nContent-Type: image/jpeg\r\n\r\n"
    )
    return head.encode() + image + f"\r\n--{_BOUNDARY}--\r\n".encode()


def scrape(url: str) -> Samples:
    """The server's metrics, or nothing when it has none (a baseline server)."""
    return from_response(httpx.get(f"{url}/metrics"))


def available() -> bool:
    return shutil.which("wrk") is not None


def require() -> None:
    """Stops a benchmark that loads its servers with wrk before it starts any of them."""
    if not available():
        raise SystemExit("wrk is needed for the load (Debian/Ubuntu: apt-get install wrk)")


@contextlib.contextmanager
def command_for(url: str, images: list[bytes], concurrency: int, timeout_s: float = 60.0,
                target: str = "/predict", multipart: bool = False,
                ) -> Iterator[Callable[[float], list[str]]]:  # fmt: skip
    """While open, ``command(seconds)`` is the wrk command line of a load of ``seconds`` with
    ``concurrency`` connections posting to ``target``, each image as the raw ``image/jpeg``
    body or, with ``multipart``, as the form field ``file``; it prints a ``RESULT`` line."""
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        content_type = f"multipart/form-data; boundary={_BOUNDARY}" if multipart else "image/jpeg"
        script = _SCRIPT.replace('"/predict"', json.dumps(target))
        (root / "load.lua").write_text(script.replace("CONTENT_TYPE", content_type))
        paths = []
        for index, data in enumerate(images):
            path = root / f"{index:04d}.jpg"
            path.write_bytes(form_body(data) if multipart else data)
            paths.append(str(path))

        def command(seconds: float) -> list[str]:
            return [
                "wrk", "-t1", f"-c{concurrency}", f"-d{max(1, round(seconds))}s",
                f"--timeout={round(timeout_s)}s", "-s", str(root / "load.lua"), url, "--", *paths,
            ]  # fmt: skip

        yield command


def run(url: str, images: list[bytes], concurrency: int, warmup_s: float, duration_s: float,
        timeout_s: float = 60.0, target: str = "/predict", multipart: bool = False,
        ) -> dict[str, Any]:  # fmt: skip
    """Warm up, then measure ``duration_s`` with ``concurrency`` connections posting to
    ``target`` (e.g. ``/predict?model=resnet18``): each image as the raw ``image/jpeg`` body,
    or with ``multipart`` as the form field ``file`` (what servers without a raw-body route,
    such as LitServe's, read)."""
    with command_for(url, images, concurrency, timeout_s, target, multipart) as command:

        def wrk(seconds: float) -> dict[str, Any]:
            output = subprocess.run(command(seconds), capture_output=True, text=True,
                                    check=True).stdout  # fmt: skip
            line = next(row for row in output.splitlines() if row.startswith("RESULT "))
            result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
            return result

        if warmup_s > 0:
            wrk(warmup_s)
        before = scrape(url)
        cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        result = wrk(duration_s)
        elapsed = time.perf_counter() - started
        cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
        after = scrape(url)
    seconds = result["duration_us"] / 1e6
    errors = {k: result[k] for k in ("connect", "read", "write", "status", "timeout") if result[k]}
    ok = result["requests"] - result["status"]
    client_cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (
        cpu_after.ru_stime - cpu_before.ru_stime
    )
    return {
        "mode": "closed",
        "client": "wrk",
        "concurrency": concurrency,
        "offered_rate": None,
        "duration_s": seconds,
        "completed": result["requests"],
        "ok": ok,
        "throughput": ok / seconds,
        "errors": errors,
        "client_cpu_cores": client_cpu / elapsed,
        "latency_ms": {
            "p50": result["p50"] / 1000,
            "p90": result["p90"] / 1000,
            "p99": result["p99"] / 1000,
            "p99.9": result["p999"] / 1000,
            "max": result["max"] / 1000,
        },
        "server": ServerDelta(before, after, seconds).summary(),
    }
