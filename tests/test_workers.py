"""Every device of one host: worker processes under supervisord, each with its own CPUs,
port and /metrics, drained together on SIGTERM."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.cpus import available_cpus, pin_worker
from tests import images
from tests.checks import metric
from tests.tools import require_tool

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "deploy" / "host" / "supervisord.conf"


def test_workers_split_the_cpus_between_them() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    try:
        if len(cpus) < 2:
            assert pin_worker(0, 2) is None  # too few CPUs to split: nothing pinned
            return
        first = pin_worker(0, 2)
        assert first == cpus[: len(cpus) // 2]
        assert sorted(os.sched_getaffinity(0)) == first
        assert available_cpus() == len(first)
    finally:
        os.sched_setaffinity(0, cpus)
    assert pin_worker(0, 1) is None


def test_a_container_quota_is_shared_between_workers(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("200000 100000\n")  # 2 CPUs for the whole container
    mask = len(os.sched_getaffinity(0))
    assert available_cpus(tmp_path, workers=1) == min(mask, 2)
    assert available_cpus(tmp_path, workers=2) == 1


def wait_ready(urls: list[str], seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    pending = list(urls)
    while pending and time.monotonic() < deadline:
        for url in list(pending):
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    pending.remove(url)
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    assert not pending, f"not ready: {pending}"


@pytest.fixture
def supervised(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], list[str]]]:
    require_tool("supervisord", Path(sys.executable).parent / "supervisord")
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "BATCHSERVE_WORKERS": "2",
        "BATCHSERVE_RUN_DIR": str(tmp_path),
        "BATCHSERVE_PYTHON": sys.executable,
        "BATCHSERVE_HOST": "127.0.0.1",
        "BATCHSERVE_MODEL": "tests.models:color_classifier",
        "BATCHSERVE_BACKEND": "torch",
        "BATCHSERVE_WEIGHTS": "none",
        "BATCHSERVE_PRECISION": "fp32",
        "BATCHSERVE_LOG_LEVEL": "warning",
        "BATCHSERVE_DRAIN_TIMEOUT_S": "5",
    }
    supervisord = shutil.which("supervisord", path=str(Path(sys.executable).parent))
    assert supervisord is not None
    log = (tmp_path / "supervisord.log").open("wb")
    process = subprocess.Popen(
        [supervisord, "-c", str(CONFIG)], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    urls = ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    try:
        wait_ready(urls)
        yield process, urls
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        log.close()


@pytest.mark.e2e
def test_supervisord_runs_one_worker_per_share_and_drains_them(
    supervised: tuple[subprocess.Popen[bytes], list[str]],
) -> None:
    process, urls = supervised
    jpeg = {"content-type": "image/jpeg"}
    for count, url in enumerate(urls, start=1):
        for _ in range(count):
            response = httpx.post(f"{url}/predict", content=images.jpeg(), headers=jpeg)
            assert response.status_code == 200, response.text
    # Each worker's /metrics counts its own requests: nothing is lost or mixed.
    for count, url in enumerate(urls, start=1):
        text = httpx.get(f"{url}/metrics").text
        assert metric(text, 'batchserve_requests_total{outcome="ok",route="predict"}') == count
    # Each worker has its own gRPC port (9000 + i), serving its own model.
    grpcclient = pytest.importorskip("tritonclient.grpc")
    for index in range(len(urls)):
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{9000 + index}")
        assert client.is_model_ready("color_classifier")
        client.close()
    threads = [httpx.get(f"{url}/v1/models").json()["models"][0] for url in urls]
    assert all(model["state"] == "ready" for model in threads)
    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == 0
    for url in urls:
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/healthz", timeout=1)
