"""The container image, run as users run it (``make image-test``; skipped unless
``BATCHSERVE_IMAGE`` names a built image): non-root, a read-only root filesystem with the
writable paths the Kubernetes manifests mount, no capabilities, no network beyond the host. It
turns healthy, calls a cat a cat with the embedded model, is scraped, and drains on SIGTERM
with every accepted request answered. Its size and cold start go to ``BATCHSERVE_IMAGE_REPORT``
where that is set."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import torch

from app.cpus import cpu_model
from app.first_try import EMBEDDED
from tests.checks import metric
from tests.real_model import EXPECTED, photos
from tests.tools import require_tool

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

# Read on import: the suite's fixtures clear BATCHSERVE_* from the environment of each test.
IMAGE = os.environ.get("BATCHSERVE_IMAGE", "")
REPORT = os.environ.get("BATCHSERVE_IMAGE_REPORT", "")
USER = "10001"
# What the Deployment mounts writable (deploy/kubernetes/base/deployment.yaml): emptyDirs, which
# allow executables, as tmpfs here.
WRITABLE = ("/tmp", "/var/cache/batchserve")


def docker(*args: str, timeout: float = 120) -> str:
    done = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


@dataclass
class Container:
    name: str
    url: str
    started: float  # monotonic, before `docker run`
    ready_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)

    def health(self) -> str:
        return docker("inspect", "--format", "{{.State.Health.Status}}", self.name)

    def logs(self) -> str:
        done = subprocess.run(["docker", "logs", self.name], capture_output=True, text=True,
                              timeout=30, check=False)  # fmt: skip
        return done.stdout + done.stderr


@pytest.fixture(scope="module")
def image() -> str:
    if not IMAGE:
        pytest.skip("no image to test: make image-test builds one and sets BATCHSERVE_IMAGE")
    require_tool("docker")
    docker("image", "inspect", IMAGE)
    return IMAGE


@pytest.fixture(scope="module")
def offline_network() -> Iterator[str]:
    """A bridge with no route out: the container reaches nothing but its clients on this host."""
    name = f"batchserve-offline-{uuid.uuid4().hex[:8]}"
    docker("network", "create", "--internal", name)
    yield name
    docker("network", "rm", name)


def run(image: str, network: str, *env: str) -> Container:
    name = f"batchserve-test-{uuid.uuid4().hex[:8]}"
    tmpfs = [f"--tmpfs={path}:rw,exec,uid={USER},gid={USER},size=2g" for path in WRITABLE]
    started = time.monotonic()
    docker("run", "--detach", f"--name={name}", f"--network={network}", "--read-only", *tmpfs,
           "--cap-drop=ALL", "--security-opt=no-new-privileges", "--cpus=2", "--memory=6g",
           "--env=BATCHSERVE_MODEL=auto", "--env=BATCHSERVE_GRPC_PORT=0",
           *(f"--env={item}" for item in env), image)  # fmt: skip
    address = docker("inspect", "--format",
                     "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", name)  # fmt: skip
    return Container(name, f"http://{address}:8000", started)


def wait_ready(container: Container, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{container.url}/readyz", timeout=2).status_code == 200:
                container.ready_s = time.monotonic() - container.started
                return
        except httpx.TransportError:
            pass
        if docker("inspect", "--format", "{{.State.Running}}", container.name) != "true":
            raise AssertionError(f"the container exited:\n{container.logs()[-4000:]}")
        time.sleep(0.2)
    raise AssertionError(f"not ready in {timeout:.0f} s:\n{container.logs()[-4000:]}")


@pytest.fixture(scope="module")
def container(image: str, offline_network: str) -> Iterator[Container]:
    started = run(image, offline_network)
    try:
        wait_ready(started)
        yield started
    finally:
        subprocess.run(["docker", "rm", "--force", started.name], capture_output=True,
                       timeout=60, check=False)  # fmt: skip


def test_the_image_runs_as_a_user_and_checks_its_own_health(image: str) -> None:
    config = json.loads(docker("image", "inspect", "--format", "{{json .Config}}", image))
    assert config["User"] == USER
    assert "/healthz" in " ".join(config["Healthcheck"]["Test"])


def test_it_turns_healthy_and_calls_a_cat_a_cat_offline(container: Container) -> None:
    deadline = time.monotonic() + 120
    while container.health() != "healthy":
        assert time.monotonic() < deadline, f"health: {container.health()}"
        time.sleep(1)
    container.timings["healthy_s"] = time.monotonic() - container.started
    assert docker("exec", container.name, "id", "-u") == USER
    for name, label in EXPECTED.items():
        answer = httpx.post(f"{container.url}/predict?top_k=1", content=photos()[name],
                            headers={"content-type": "image/jpeg"}, timeout=60)  # fmt: skip
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["model"] == EMBEDDED
        assert body["predictions"][0]["label"] == label, (name, body)
    logs = container.logs()
    # Each record once, in the server's format, and nothing complaining of the read-only root.
    assert sum(" serving efficientnet_lite0/1: " in line for line in logs.splitlines()) == 1, logs
    assert "Traceback" not in logs, logs
    assert "write access" not in logs, logs
    text = httpx.get(f"{container.url}/metrics", timeout=10).text
    assert metric(text, "batchserve_ready") == 1
    assert metric(text, "batchserve_requests_total") >= len(EXPECTED)
    report(container)


def test_sigterm_answers_every_accepted_request(container: Container) -> None:
    photo = photos()["chelsea"]
    count = 48
    statuses: list[int | str] = []

    def send() -> None:
        try:
            answer = httpx.post(f"{container.url}/predict", content=photo,
                                headers={"content-type": "image/jpeg"}, timeout=120)  # fmt: skip
            statuses.append(answer.status_code)
        except httpx.TransportError as error:
            statuses.append(type(error).__name__)

    threads = [threading.Thread(target=send) for _ in range(count)]
    for thread in threads:
        thread.start()
    # Every request admitted (the gauge counts them) before the signal.
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(f"{container.url}/metrics", timeout=10).text
        if metric(text, "batchserve_admitted_requests") + len(statuses) >= count:
            break
        assert time.monotonic() < deadline, "the requests were not admitted"
        time.sleep(0.05)
    docker("kill", "--signal=TERM", container.name)
    for thread in threads:
        thread.join(timeout=150)
    assert statuses == [200] * count, statuses
    code = docker("wait", container.name, timeout=120)
    assert code == "0", container.logs()[-4000:]
    assert "SIGTERM: draining" in container.logs()


def report(container: Container) -> None:
    if not REPORT:
        return
    size = int(docker("image", "inspect", "--format", "{{.Size}}", IMAGE))
    cpu = f"{cpu_model()} ({torch.backends.cpu.get_cpu_capability()})"
    Path(REPORT).write_text(
        f"image: {IMAGE}\n"
        f"size: {size / 1e9:.2f} GB ({size} bytes)\n"
        f"cold start, docker run to /readyz 200: {container.ready_s:.1f} s\n"
        f"docker run to healthy: {container.timings['healthy_s']:.1f} s\n"
        f"model: MODEL=auto offline ({EMBEDDED}); CPU: {cpu}, --cpus=2\n"
    )
