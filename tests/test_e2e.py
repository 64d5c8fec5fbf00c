"""End to end against a real uvicorn process: serving, SIGTERM drain, clients that hang up."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from pathlib import Path

import httpx
import orjson
import pytest

from harness.servers import UvicornProcess
from tests import images
from tests.checks import assert_graceful_exit, scrape, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

JPEG = {"content-type": "image/jpeg"}
BASE_ENV = {
    "BATCHSERVE_MODEL": "tests.models:color_classifier",
    "BATCHSERVE_WEIGHTS": "none",
    "BATCHSERVE_PRECISION": "fp32",
    "BATCHSERVE_LOG_LEVEL": "warning",
}
SLOW_ENV = {
    **BASE_ENV,
    "BATCHSERVE_MODEL": "tests.models:slow_from_env",
    "BATCHSERVE_MAX_BATCH_SIZE": "1",
    "BATCHSERVE_MAX_INFLIGHT_BATCHES": "1",
    "BATCHSERVE_COMPILE": "none",  # tracing would drop the model's sleep
}


def test_serves_batches_and_exits_on_sigterm() -> None:
    env = {**BASE_ENV, "BATCHSERVE_MAX_BATCH_SIZE": "16", "BATCHSERVE_MAX_QUEUE_DELAY_MS": "10"}
    with UvicornProcess(env) as server:
        response = httpx.post(f"{server.url}/predict", content=images.jpeg(), headers=JPEG)
        assert response.status_code == 200
        assert response.json()["predictions"]

        async def burst() -> list[int]:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                data = images.jpeg()
                replies = await asyncio.gather(
                    *(client.post("/predict", content=data, headers=JPEG) for _ in range(32))
                )
            return [reply.status_code for reply in replies]

        assert asyncio.run(burst()) == [200] * 32
        requests = scrape(server, "batchserve_batch_size_sum")
        batches = scrape(server, "batchserve_batch_size_count")
        assert requests == 33
        assert requests / batches > 1

        server.terminate()
        code = server.wait(timeout=30)
        assert_graceful_exit(server, code)
        assert "Traceback" not in server.read_output()


def test_sigterm_refuses_new_work_and_finishes_accepted_requests() -> None:
    env = {
        **SLOW_ENV,
        "BATCHSERVE_TEST_SLOW_SECONDS": "0.3",
        "BATCHSERVE_DRAIN_TIMEOUT_S": "20",
    }
    with UvicornProcess(env) as server:

        async def scenario() -> tuple[list[int], int, int, str]:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                accepted = [
                    asyncio.ensure_future(
                        client.post("/predict", content=images.jpeg(), headers=JPEG)
                    )
                    for _ in range(4)
                ]
                # One request runs, three wait in the queue: all four are accepted.
                await asyncio.to_thread(
                    wait_for, lambda: scrape(server, "batchserve_queue_depth") == 3
                )
                server.terminate()
                await asyncio.sleep(0.05)
                async with httpx.AsyncClient(base_url=server.url, timeout=10) as fresh:
                    ready = await fresh.get("/readyz")
                    refused = await fresh.post("/predict", content=images.jpeg(), headers=JPEG)
                replies = await asyncio.gather(*accepted)
            return (
                [reply.status_code for reply in replies],
                ready.status_code,
                refused.status_code,
                refused.text,
            )

        statuses, ready, refused, refused_body = asyncio.run(scenario())
        assert statuses == [200, 200, 200, 200]
        assert ready == 503
        assert refused == 503
        assert '"not_ready"' in refused_body
        started = time.monotonic()
        code = server.wait(timeout=20)
        assert_graceful_exit(server, code)
        assert time.monotonic() - started < 10


def raw_request(url: str, head: str, body: bytes = b"") -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(head.encode() + body)
    return sock


def raw_predict(url: str, body: bytes) -> socket.socket:
    """Send a complete POST and return the socket without reading the answer."""
    head = (
        "POST /predict HTTP/1.1\r\n"
        f"Host: x\r\nContent-Type: image/jpeg\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return raw_request(url, head, body)


def test_clients_that_hang_up_are_dropped_before_any_work() -> None:
    env = {**SLOW_ENV, "BATCHSERVE_TEST_SLOW_SECONDS": "0.5"}
    with UvicornProcess(env) as server:

        async def scenario() -> int:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                running = asyncio.ensure_future(
                    client.post("/predict", content=images.jpeg(), headers=JPEG)
                )
                await asyncio.to_thread(
                    wait_for, lambda: scrape(server, "batchserve_inflight_batches") == 1
                )
                quitters = [raw_predict(server.url, images.jpeg()) for _ in range(2)]
                await asyncio.to_thread(
                    wait_for, lambda: scrape(server, "batchserve_queue_depth") == 2
                )
                for sock in quitters:
                    sock.close()
                await asyncio.to_thread(
                    wait_for, lambda: scrape(server, "batchserve_queue_depth") == 0
                )
                reply = await running
            return reply.status_code

        assert asyncio.run(scenario()) == 200
        wait_for(
            lambda: (
                scrape(server, 'batchserve_requests_total{outcome="cancelled",route="predict"}')
                == 2
            )
        )
        assert scrape(server, 'batchserve_dropped_requests_total{reason="cancelled"}') == 2
        time.sleep(0.6)  # had they been dispatched, their batches would have finished by now
        assert scrape(server, 'batchserve_batches_total{result="ok"}') == 1
        assert scrape(server, "batchserve_batch_size_sum") == 1


def test_drain_timeout_bounds_the_exit() -> None:
    env = {
        **SLOW_ENV,
        "BATCHSERVE_TEST_SLOW_SECONDS": "1.5",
        "BATCHSERVE_DRAIN_TIMEOUT_S": "0.5",
    }
    with UvicornProcess(env, startup_timeout=120) as server:

        async def scenario() -> list[int]:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                pending = [
                    asyncio.ensure_future(
                        client.post("/predict", content=images.jpeg(), headers=JPEG)
                    )
                    for _ in range(3)
                ]
                await asyncio.to_thread(
                    wait_for, lambda: scrape(server, "batchserve_queue_depth") == 2
                )
                server.terminate()
                replies = await asyncio.gather(*pending)
            return [reply.status_code for reply in replies]

        started = time.monotonic()
        statuses = asyncio.run(scenario())
        code = server.wait(timeout=20)
        elapsed = time.monotonic() - started
        assert_graceful_exit(server, code)
        # Everything still unfinished is answered 503 once the drain timeout passes. The
        # running forward pass cannot be interrupted: the exit waits for it (one batch time).
        assert statuses == [503, 503, 503]
        assert elapsed < 0.5 + 1.5 + 3.0


def test_a_client_that_hangs_up_mid_upload_leaves_nothing_behind() -> None:
    with UvicornProcess(BASE_ENV) as server:
        body = images.jpeg(images.photo(640, 480), quality=95)
        head = (
            "POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        sock = raw_request(server.url, head, body[: len(body) // 3])
        time.sleep(0.2)
        sock.close()
        wait_for(
            lambda: (
                scrape(server, 'batchserve_requests_total{outcome="cancelled",route="predict"}')
                == 1
            )
        )
        assert scrape(server, 'batchserve_requests_total{outcome="error",route="predict"}') == 0
        assert scrape(server, "batchserve_queue_depth") == 0
        ok = httpx.post(f"{server.url}/predict", content=images.jpeg(), headers=JPEG)
        assert ok.status_code == 200
        assert "unhandled error" not in server.read_output()


def test_an_oversized_chunked_body_is_refused_before_it_is_all_sent() -> None:
    env = {**BASE_ENV, "BATCHSERVE_MAX_IMAGE_BYTES": str(64 * 1024)}
    with UvicornProcess(env) as server:
        head = (
            "POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
            "Transfer-Encoding: chunked\r\n\r\n"
        )
        sock = raw_request(server.url, head)
        chunk = b"\xff" * 16 * 1024
        sock.settimeout(10)
        reply = b""
        for _ in range(12):  # 192 KiB, never the final zero-length chunk
            try:
                sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            except OSError:
                break  # the server already answered and closed
            time.sleep(0.02)
        sock.settimeout(2)
        with contextlib.suppress(OSError):  # read until the server closes, or a quiet moment
            while data := sock.recv(65536):
                reply += data
        sock.close()
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert b'"too_large"' in reply


def test_large_json_tensors_do_not_stall_the_probes_or_other_requests() -> None:
    """A v2 JSON body of millions of numbers takes seconds of CPU to parse and flatten: off the
    event loop, /healthz and a small /predict keep answering while several arrive at once."""
    import numpy as np

    pixels = np.random.default_rng(0).integers(0, 256, (1, 1000, 1000, 3), dtype=np.uint8)
    body = orjson.dumps({"inputs": [{"name": "pixels", "datatype": "UINT8",
                                     "shape": list(pixels.shape),
                                     "data": pixels.ravel().tolist()}]})  # fmt: skip
    env = {**BASE_ENV, "BATCHSERVE_MAX_IMAGE_BYTES": str(len(body) + 1024)}
    with UvicornProcess(env) as server:

        async def scenario() -> tuple[list[float], list[int], list[int]]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                url = "/v2/models/color_classifier/infer"
                heavy = [asyncio.ensure_future(client.post(url, content=body)) for _ in range(3)]
                probes: list[float] = []
                small: list[int] = []
                while not all(task.done() for task in heavy):
                    started = time.monotonic()
                    # A liveness probe with Kubernetes' default 1 s timeout, and a small request.
                    health = await client.get("/healthz", timeout=1.0)
                    assert health.status_code == 200
                    probes.append(time.monotonic() - started)
                    reply = await client.post("/predict", content=images.jpeg(), headers=JPEG,
                                              timeout=5.0)  # fmt: skip
                    small.append(reply.status_code)
                    await asyncio.sleep(0.05)
                statuses = [(await task).status_code for task in heavy]
            return probes, small, statuses

        probes, small, statuses = asyncio.run(scenario())
        assert statuses == [200] * 3
        assert len(probes) >= 3  # the heavy requests took a while: the probes really overlapped
        assert set(small) == {200}


def test_many_large_v2_bodies_stay_within_the_memory_bound() -> None:
    """Every admitted request's memory is counted until it is let go: a burst of large bodies
    (each past its admission once read) cannot pile up behind a slow model."""
    mib = 1024 * 1024
    shape = [1, 2000, 2000, 3]  # 12 MB of pixels each
    pixels = bytes(range(256)) * (2000 * 2000 * 3 // 256)
    tensor = {"name": "pixels", "datatype": "UINT8", "shape": shape,
              "parameters": {"binary_data_size": len(pixels)}}  # fmt: skip
    header = orjson.dumps({"inputs": [tensor]})
    body = header + pixels
    queue_bytes = 64 * mib
    env = {
        **SLOW_ENV,
        "BATCHSERVE_TEST_SLOW_SECONDS": "0.2",
        "BATCHSERVE_MODEL_NAME": "slow",
        "BATCHSERVE_MAX_IMAGE_BYTES": str(16 * mib),
        "BATCHSERVE_MAX_QUEUE_BYTES": str(queue_bytes),
        "BATCHSERVE_REQUEST_TIMEOUT_MS": "120000",
    }
    with UvicornProcess(env) as server:
        assert server.process is not None
        status = Path(f"/proc/{server.process.pid}/status")
        Path(f"/proc/{server.process.pid}/clear_refs").write_text("5")  # resets the peak
        before = kib(status, "VmRSS")

        async def burst() -> list[httpx.Response]:
            headers = {"inference-header-content-length": str(len(header))}
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:

                def post() -> asyncio.Future[httpx.Response]:
                    url = "/v2/models/slow/infer"
                    return asyncio.ensure_future(client.post(url, content=body, headers=headers))

                sent = []
                for _ in range(28):  # twice as fast as the model answers: a queue builds up
                    sent.append(post())
                    await asyncio.sleep(0.1)
                sent += [post() for _ in range(12)]  # then more at once than admission holds
                return await asyncio.gather(*sent)

        replies = asyncio.run(burst())
        peak = kib(status, "VmHWM")
    statuses = [reply.status_code for reply in replies]
    assert set(statuses) <= {200, 503}, statuses
    assert all('"overloaded"' in r.text or "capacity" in r.text
               for r in replies if r.status_code == 503)  # fmt: skip
    assert statuses.count(200) >= 28
    assert statuses.count(503) >= 1  # the excess of the burst
    grown = (peak - before) * 1024
    assert grown <= 4 * queue_bytes, f"peak RSS grew by {grown / mib:.0f} MiB"


def kib(status: Path, field: str) -> int:
    """A ``/proc/<pid>/status`` memory figure, in KiB."""
    for line in status.read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in {status}")
