"""A real uvicorn process, for end-to-end tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A port nothing listens on, for a server about to start, outside the kernel's ephemeral
    range and never handed out twice by this process.

    Binding port 0 gives a port of the ephemeral range, which the kernel may hand again, before
    the server binds it, as the local end of any outgoing connection (a load client's, a
    scraper's): the server then fails with "address already in use"."""
    low, high = _ephemeral_range()
    below, above = range(10_000, low), range(high + 1, 65_536)
    ports = below if len(below) >= len(above) else above
    for _ in range(1000):
        port = random.choice(ports)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {ports}")


_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32_768, 60_999  # Linux's default


class ServerProcess:
    """A server started as ``command`` in its own process group, ready when ``url`` +
    ``ready_path`` answers 200; ``stop`` kills the whole group (servers that fork workers)."""

    def __init__(
        self,
        command: list[str],
        url: str,
        env: dict[str, str] | None = None,
        startup_timeout: float = 120.0,
        ready_path: str = "/readyz",
        root: Path = ROOT,
    ) -> None:
        self.command = command
        self.url = url
        self.root = root  # the working directory: a checkout of the project
        self._env = env
        self._startup_timeout = startup_timeout
        self._ready_path = ready_path
        self.process: subprocess.Popen[bytes] | None = None
        # A file, not a pipe: an unread pipe fills up and blocks the server's logging.
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()

    def __enter__(self) -> Self:
        self.start()
        return self.wait_ready()

    def start(self) -> Self:
        """Spawn the process without waiting (start several, then wait for each)."""
        self.process = subprocess.Popen(
            self.command, cwd=self.root, env=self._env, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        return self

    def wait_ready(self) -> Self:
        assert self.process is not None, "start() first"
        deadline = time.monotonic() + self._startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.command[0]} exited early:\n{self.read_output()}")
            try:
                if httpx.get(f"{self.url}{self._ready_path}", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        output = self.read_output()  # before stop(), which closes the log
        self.stop()
        waited = f"{self._startup_timeout:g} s"
        raise RuntimeError(f"{self.command} did not become ready in {waited}:\n{output}")

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def terminate(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        self._log.close()

    def read_output(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")


class UvicornProcess(ServerProcess):
    """``python -m uvicorn <app>`` with ``BATCHSERVE_*`` settings from ``env``, from the checkout
    at ``root`` (this one by default).

    Ready when ``ready_path`` answers 200. uvicorn's access log is off unless ``access_log``
    (``make serve`` and the image leave it on).
    """

    def __init__(
        self,
        env: dict[str, str],
        startup_timeout: float = 120.0,
        app: str = "app.main:app",
        ready_path: str = "/readyz",
        root: Path = ROOT,
        access_log: bool = False,
    ) -> None:
        self.port = free_port()
        # gRPC on a port of its own too (``env`` may say otherwise, 0 to turn it off).
        self.grpc_port = int(env.get("BATCHSERVE_GRPC_PORT", free_port()))
        self.grpc_target = f"127.0.0.1:{self.grpc_port}"
        # The torch backend unless the environment or ``env`` names one: BACKEND=auto would
        # measure every runtime at each fresh start (and export what the tests' models cannot
        # run, like a sleep).
        full_env = {
            "BATCHSERVE_BACKEND": "torch", **os.environ, "PYTHONPATH": str(root),
            "BATCHSERVE_GRPC_PORT": str(self.grpc_port), **env,
        }  # fmt: skip
        command = [
            sys.executable, "-m", "uvicorn", app,
            "--host", "127.0.0.1", "--port", str(self.port),
            *([] if access_log else ["--no-access-log"]),
        ]  # fmt: skip
        super().__init__(command, f"http://127.0.0.1:{self.port}", full_env, startup_timeout,
                         ready_path, root)  # fmt: skip


def first_answer(server: ServerProcess, image: bytes, timeout_s: float = 120.0) -> None:
    """Until ``server`` answers one real prediction (``image`` as multipart field ``file``)
    with 200, polled every 50 ms: a health route can answer before the model is deployed.
    Fails at once if the process exits."""
    deadline = time.monotonic() + timeout_s
    files = {"file": ("image.jpg", image, "image/jpeg")}
    while time.monotonic() < deadline:
        assert server.process is not None, "start() first"
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.command} exited:\n{server.read_output()[-3000:]}")
        try:
            if httpx.post(f"{server.url}/predict", files=files, timeout=60).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"no answer from {server.command} in {timeout_s} s")
