"""A real Prometheus scraping a real batchserve under load, evaluating the shipped rules: the
recording rules, the dashboard's queries and the autoscaling queries agree with what the load
did, and the replica count KEDA or an HPA would ask for follows it."""

from __future__ import annotations

import asyncio
import math
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from harness.servers import UvicornProcess, free_port
from tests import images
from tests.test_deploy import DEPLOY, dashboard_queries
from tests.tools import require_tool

pytestmark = pytest.mark.e2e


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict[str, Any]]:
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = response.json()
        assert body["status"] == "success", (expr, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def value(self, expr: str) -> float:
        samples = self.query(expr)
        return float(samples[0]["value"][1]) if samples else 0.0

    def wait_for(self, expr: str, check: Any, seconds: float = 40) -> float:
        deadline = time.monotonic() + seconds
        value = math.nan
        while time.monotonic() < deadline:
            value = self.value(expr)
            if check(value):
                return value
            time.sleep(0.5)
        raise AssertionError(f"{expr} stayed at {value}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[UvicornProcess, Prometheus]]:
    binary = require_tool("prometheus")
    env = {
        "BATCHSERVE_MODEL": "tests.models:slow_from_env",
        "BATCHSERVE_TEST_SLOW_SECONDS": "0.1",  # 8 images per 100 ms batch: a slow device
        "BATCHSERVE_WEIGHTS": "none",
        "BATCHSERVE_COMPILE": "none",
        "BATCHSERVE_PRECISION": "fp32",
        "BATCHSERVE_MAX_BATCH_SIZE": "8",
        "BATCHSERVE_LOG_LEVEL": "warning",
    }
    folder = tmp_path_factory.mktemp("prometheus")
    with UvicornProcess(env) as server:
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(DEPLOY / "prometheus" / "rules.yaml")],
            "scrape_configs": [{
                "job_name": "batchserve",
                "static_configs": [{"targets": [server.url.removeprefix("http://")]}],
            }],
        }  # fmt: skip
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        log = (folder / "prometheus.log").open("wb")
        process = subprocess.Popen(
            [str(binary), f"--config.file={folder / 'prometheus.yml'}",
             f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            prometheus = Prometheus(f"http://127.0.0.1:{port}")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if httpx.get(f"{prometheus.url}/-/ready", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            prometheus.wait_for('up{job="batchserve"}', lambda up: up == 1)
            yield server, prometheus
        finally:
            process.terminate()
            process.wait(20)
            log.close()


async def load(url: str, clients: int, seconds: float) -> int:
    data = images.jpeg()
    stop = time.monotonic() + seconds
    done = 0

    async def client() -> None:
        nonlocal done
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            while time.monotonic() < stop:
                response = await http.post("/predict", content=data,
                                           headers={"content-type": "image/jpeg"})  # fmt: skip
                assert response.status_code == 200
                done += 1

    await asyncio.gather(*(client() for _ in range(clients)))
    return done


def triggers() -> list[dict[str, Any]]:
    scaled = yaml.safe_load((DEPLOY / "kubernetes" / "base" / "scaledobject.yaml").read_text())
    result: list[dict[str, Any]] = scaled["spec"]["triggers"]
    return result


def desired_replicas(prometheus: Prometheus, trigger: dict[str, Any], replicas: int) -> int:
    """What the HPA behind KEDA asks for: ceil(replicas x value / target) for a Value target;
    for an AverageValue target the query's total over the replicas, ceil(total / target)."""
    value = prometheus.value(trigger["metadata"]["query"])
    target = float(trigger["metadata"]["threshold"])
    if trigger["metricType"] == "AverageValue":
        return math.ceil(value / target)
    return math.ceil(replicas * value / target)


def test_rules_and_autoscaling_follow_the_load(stack: tuple[UvicornProcess, Prometheus]) -> None:
    server, prometheus = stack
    queue, busy = triggers()
    # Idle: nothing waits, the device does nothing: fewer replicas than the one running.
    prometheus.wait_for('batchserve:device_busy:ratio_rate1m{job="batchserve"}', lambda v: v == 0)
    assert desired_replicas(prometheus, queue, replicas=1) < 1
    assert desired_replicas(prometheus, busy, replicas=1) < 1

    async def overload_and_watch() -> dict[str, float]:
        # Long enough for the busy ratio's one-minute window to be almost all under load.
        loader = asyncio.ensure_future(load(server.url, 64, 66))
        await asyncio.sleep(62)
        seen = {
            "queue": desired_replicas(prometheus, queue, replicas=1),
            "busy": desired_replicas(prometheus, busy, replicas=1),
            "mean_batch": prometheus.value('batchserve:batch_size:mean_rate1m{job="batchserve"}'),
        }
        assert await loader > 0
        return seen

    seen = asyncio.run(overload_and_watch())
    # 64 clients on a device that takes 8 at a time: batches are full, the device never
    # idles, dozens wait: both triggers ask for more replicas.
    assert seen["mean_batch"] > 1
    assert seen["queue"] > 1
    assert seen["busy"] > 1
    # Idle again: nothing waits, the queue trigger asks for fewer at once.
    prometheus.wait_for('sum(batchserve_queue_depth{job="batchserve"})', lambda v: v == 0)
    assert desired_replicas(prometheus, queue, replicas=1) < 1

    # The rest of the rules and every dashboard query evaluate, and agree with the load.
    ok = prometheus.value('sum(batchserve:requests:rate1m{job="batchserve",outcome="ok"})')
    assert ok > 0
    assert prometheus.value('batchserve:requests_5xx:ratio_rate5m{job="batchserve"}') == 0
    forward = prometheus.query('batchserve:stage_seconds:p99_rate5m{stage="forward"}')
    assert float(forward[0]["value"][1]) >= 0.1  # the slow device's 100 ms per batch
    for query in dashboard_queries():
        assert prometheus.query(query.replace("$job", "batchserve")), query
