"""A real Ray cluster of several nodes on this machine, for the tests and the benchmark.

Each node is a ``ray start`` of its own on a loopback address of its own (``127.0.0.1`` would
be replaced by the machine's address), optionally pinned to some CPUs (its processes inherit
the affinity). Ray's processes outlive ``ray start`` and ignore polite signals: ``stop`` kills
every process started with this cluster's mark in its environment, and their children, by PID.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx
import psutil
import yaml

from harness.servers import ROOT, free_port

RAY = Path(sys.executable).with_name("ray")
SERVE = Path(sys.executable).with_name("serve")
MARK = "BATCHSERVE_TEST_RAY_CLUSTER"


@dataclass
class Node:
    address: str  # a loopback address of its own: 127.0.0.10, 127.0.0.20, ...
    cpus: int = 1  # Ray's logical CPUs
    resources: dict[str, float] = field(default_factory=dict)
    pin: list[int] | None = None  # the machine's CPUs its processes run on


class RayCluster:
    """``nodes[0]`` is the head; Serve's one HTTP proxy runs there (``proxy_location:
    HeadOnly``), routing to every node's replicas."""

    def __init__(self, nodes: list[Node], env: dict[str, str] | None = None) -> None:
        self.nodes = nodes
        self.mark = uuid.uuid4().hex
        self.temp_dir = Path(tempfile.mkdtemp(prefix="bsray-", dir="/tmp"))  # short: sockets
        self.gcs_port = free_port()
        self.dashboard_port = free_port()
        self.http_port = free_port()
        # Ray's workers take ports from a range of their own (10002-19999 by default): one that
        # holds none of the ports above, per node.
        taken = {self.gcs_port, self.dashboard_port, self.http_port}
        windows = (range(start, start + 500) for start in range(20_000, 65_000, 500))
        self._worker_ports = [w for w in windows if not taken & set(w)][: len(nodes)]
        self._env = {**os.environ, **(env or {}), MARK: self.mark}
        # One proxy for every node: it must not keep every request on its own node's replica.
        self._env.setdefault("RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING", "0")

    @property
    def head(self) -> str:
        return self.nodes[0].address

    @property
    def url(self) -> str:
        return f"http://{self.head}:{self.http_port}"

    @property
    def dashboard(self) -> str:
        return f"http://{self.head}:{self.dashboard_port}"

    def __enter__(self) -> Self:
        try:
            for index, node in enumerate(self.nodes):
                self._start(node, head=index == 0)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _start(self, node: Node, head: bool) -> None:
        ports = self._worker_ports[self.nodes.index(node)]
        command = [str(RAY), "start", f"--node-ip-address={node.address}",
                   f"--num-cpus={node.cpus}", f"--resources={json.dumps(node.resources)}",
                   f"--min-worker-port={ports.start}", f"--max-worker-port={ports.stop - 1}",
                   "--disable-usage-stats", f"--temp-dir={self.temp_dir}"]  # fmt: skip
        if head:
            command += ["--head", f"--port={self.gcs_port}", "--include-dashboard=true",
                        f"--dashboard-host={node.address}",
                        f"--dashboard-port={self.dashboard_port}"]  # fmt: skip
        else:
            command += [f"--address={self.head}:{self.gcs_port}"]
        if node.pin is not None:
            command = ["taskset", "--cpu-list", ",".join(map(str, node.pin)), *command]
        done = subprocess.run(command, env=self._env, capture_output=True, text=True,
                              timeout=180, check=False, cwd=ROOT)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"ray start on {node.address} failed:\n{done.stdout}{done.stderr}")

    def deploy(self, config: dict[str, Any]) -> None:
        """``serve deploy`` a Serve config (its HTTP options set to this cluster's proxy)."""
        config = {**config, "proxy_location": "HeadOnly",
                  "http_options": {"host": self.head, "port": self.http_port}}  # fmt: skip
        path = self.temp_dir / "serve.yaml"
        path.write_text(yaml.safe_dump(config))
        self._serve("deploy", str(path))

    def status(self) -> dict[str, Any]:
        """The application's details from the dashboard's REST API, which ``serve status``
        reads too (the command itself costs a second of CPU per call, too much to poll)."""
        answer = httpx.get(f"{self.dashboard}/api/serve/applications/", timeout=30)
        answer.raise_for_status()
        details: dict[str, Any] = answer.json().get("applications", {}).get("batchserve", {})
        return details

    def replicas(self) -> list[dict[str, Any]]:
        """The running replicas: ``replica_id``, ``pid``, ``node_ip``, ..."""
        deployment = self.status().get("deployments", {}).get("batchserve", {})
        return [each for each in deployment.get("replicas", []) if each["state"] == "RUNNING"]

    def running_replicas(self) -> int:
        return len(self.replicas())

    def wait_for(self, replicas: int, timeout: float = 300) -> None:
        """Until exactly ``replicas`` replicas run and the application does."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.status()
            if status.get("status") == "RUNNING" and self.running_replicas() == replicas:
                return
            if status.get("status") == "DEPLOY_FAILED":
                raise RuntimeError(f"the deployment failed: {status.get('message')}")
            time.sleep(1)
        raise TimeoutError(f"{replicas} replica(s) not running in {timeout:.0f} s: {self.status()}")

    def replica_pids(self) -> list[int]:
        return [int(each["pid"]) for each in self.replicas()]

    def _serve(self, *args: str) -> str:
        done = subprocess.run([str(SERVE), *args, f"--address={self.dashboard}"], env=self._env,
                              capture_output=True, text=True, timeout=120, check=False,
                              cwd=ROOT)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"serve {args[0]} failed:\n{done.stdout}{done.stderr}")
        return done.stdout

    def processes(self) -> list[psutil.Process]:
        """Every process of this cluster now (marked by the environment it was started with)."""
        marked = []
        for process in psutil.process_iter():
            try:
                if process.environ().get(MARK) == self.mark:
                    marked.append(process)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return marked

    def stop(self) -> None:
        """SIGKILL by PID every process of this cluster and their children, until none is left."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            processes = self.processes()
            for process in list(processes):
                try:
                    processes += process.children(recursive=True)
                except psutil.NoSuchProcess:
                    continue
            if not processes:
                break
            for process in processes:
                try:
                    process.kill()
                except psutil.NoSuchProcess:
                    continue
            psutil.wait_procs(processes, timeout=5)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
