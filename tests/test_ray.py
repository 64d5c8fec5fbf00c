"""batchserve on a real two-node Ray cluster (two ``ray start`` processes on 127.0.0.10 and
127.0.0.20), deployed with ``serve deploy`` from ``deploy/ray/serve.yaml``: a replica on each
node, both answering; one killed by PID and replaced with no accepted request lost; autoscaling
from one replica to two under load and back to one when idle."""

from __future__ import annotations

import copy
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from app.first_try import EMBEDDED
from harness.ray_cluster import Node, RayCluster
from harness.servers import ROOT
from tests.real_model import EXPECTED, photos

pytest.importorskip("ray.serve")
pytestmark = [pytest.mark.slow, pytest.mark.e2e]

SERVE_YAML = ROOT / "deploy" / "ray" / "serve.yaml"
ONE_PER_NODE: dict[str, float] = {"batchserve": 1}


def config(tmp: Path, **args: Any) -> dict[str, Any]:
    """``deploy/ray/serve.yaml`` with a quick start (the embedded model on PyTorch, nothing
    measured) and these builder args."""
    document: dict[str, Any] = copy.deepcopy(yaml.safe_load(SERVE_YAML.read_text()))
    application = document["applications"][0]
    application["runtime_env"]["env_vars"] = {
        "BATCHSERVE_MODEL": EMBEDDED, "BATCHSERVE_BACKEND": "torch",
        "BATCHSERVE_PRECISION": "fp32", "BATCHSERVE_SHARDS": "1",
        "BATCHSERVE_MAX_BATCH_SIZE": "8", "BATCHSERVE_DRAIN_TIMEOUT_S": "10",
        "BATCHSERVE_ARTIFACTS_DIR": str(tmp / "artifacts"),
    }  # fmt: skip
    application["args"] = {"num_cpus": 1, "resources": ONE_PER_NODE, "health_check_period_s": 2,
                           **args}  # fmt: skip
    return document


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    nodes = [Node("127.0.0.10", cpus=2, resources=dict(ONE_PER_NODE)),
             Node("127.0.0.20", cpus=2, resources=dict(ONE_PER_NODE))]  # fmt: skip
    with RayCluster(nodes) as started:
        yield started


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the replicas share: the artefact cache."""
    return tmp_path_factory.mktemp("ray")


@dataclass
class Answer:
    status: int | str  # the HTTP status, or the transport error's name
    replica: str = ""
    node: str = ""
    label: str = ""


def predict(url: str, name: str = "chelsea") -> Answer:
    try:
        answer = httpx.post(f"{url}/predict?top_k=1", content=photos()[name],
                            headers={"content-type": "image/jpeg"}, timeout=120)  # fmt: skip
    except httpx.ConnectError as error:
        return Answer(type(error).__name__)
    label = answer.json()["predictions"][0]["label"] if answer.status_code == 200 else ""
    return Answer(answer.status_code, answer.headers.get("x-batchserve-replica", ""),
                  answer.headers.get("x-batchserve-node", ""), label)  # fmt: skip


@dataclass
class Load:
    """``clients`` threads sending photos back to back until stopped; a refused connection is
    retried (the client's part), anything else is recorded as it came."""

    url: str
    clients: int
    answers: list[Answer] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Load:
        for _ in range(self.clients):
            thread = threading.Thread(target=self._run, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=180)

    def _run(self) -> None:
        while not self._stop.is_set():
            answer = predict(self.url)
            if answer.status == "ConnectError":
                time.sleep(0.2)
                continue
            self.answers.append(answer)


CLIENTS = 16


@pytest.mark.parametrize("kill", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_replica_on_each_node_answers_and_a_killed_one_is_replaced(
    cluster: RayCluster, shared: Path, kill: signal.Signals
) -> None:
    cluster.deploy(config(shared, num_replicas=2))
    cluster.wait_for(2)
    assert {replica["node_ip"] for replica in cluster.replicas()} == {"127.0.0.10", "127.0.0.20"}
    pids = cluster.replica_pids()
    with Load(cluster.url, clients=CLIENTS) as load:
        deadline = time.monotonic() + 60
        while len({answer.node for answer in load.answers}) < 2:
            assert time.monotonic() < deadline, Counter(a.node for a in load.answers)
            time.sleep(0.5)
        before = len(load.answers)
        os.kill(pids[0], kill)
        # Ray notices, starts a replacement on the node that has room, and routes to it.
        deadline = time.monotonic() + 180
        while not (set(cluster.replica_pids()) - set(pids) and cluster.running_replicas() == 2):
            assert time.monotonic() < deadline, cluster.status()
            time.sleep(1)
        replaced = len(load.answers)
        time.sleep(5)
    assert {answer.node for answer in load.answers[:before]} == {"127.0.0.10", "127.0.0.20"}
    assert len({answer.replica for answer in load.answers[replaced:]}) == 2
    statuses = Counter(answer.status for answer in load.answers[before:])
    if kill == signal.SIGTERM:
        # The replica's worker exits as Ray's workers do on SIGTERM, after what it holds.
        assert statuses == {200: statuses.total()}, statuses
    else:
        # Nothing answers what a SIGKILLed replica held: Ray's proxy answers those 500 (at most
        # one per client), and every other request is answered.
        assert set(statuses) <= {200, 500}, statuses
        assert statuses[500] <= CLIENTS, statuses
    assert {answer.label for answer in load.answers if answer.status == 200} == {
        EXPECTED["chelsea"]
    }


def test_replicas_autoscale_from_one_to_two_under_load_and_back_when_idle(
    cluster: RayCluster, shared: Path
) -> None:
    cluster.deploy(config(shared, min_replicas=1, max_replicas=2, target_ongoing_requests=2,
                          upscale_delay_s=1, downscale_delay_s=5))  # fmt: skip
    cluster.wait_for(1)
    with Load(cluster.url, clients=16) as load:
        cluster.wait_for(2, timeout=180)
        served = len(load.answers)
        time.sleep(3)
        assert len({answer.replica for answer in load.answers[served:]}) == 2
    assert {answer.status for answer in load.answers} == {200}
    cluster.wait_for(1, timeout=180)
    assert predict(cluster.url).status == 200
