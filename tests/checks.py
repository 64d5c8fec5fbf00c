"""Assertions shared by the tests: predictions, metrics, conditions reached in time."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import httpx
import pytest

from app.engine import Prediction
from harness.promtext import has, parse, value
from harness.servers import UvicornProcess


def assert_same_prediction(
    got: Prediction | BaseException, expected: Prediction | BaseException, tolerance: float = 1e-5
) -> None:
    """Same classes in the same order, scores within ``tolerance`` (kernels for different batch
    sizes round differently)."""
    assert not isinstance(got, BaseException), got
    assert not isinstance(expected, BaseException), expected
    assert [c["index"] for c in got.classes] == [c["index"] for c in expected.classes]
    for a, b in zip(got.classes, expected.classes, strict=True):
        assert a["score"] == pytest.approx(b["score"], abs=tolerance)


def metric(text: str, name: str) -> float:
    """A sample's value from a ``/metrics`` text: ``name`` may include ``{labels}``, and the
    samples that carry them (whatever their other labels: every model and version) are
    added up."""
    match = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?", name)
    assert match, name
    labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
    samples = parse(text)
    assert has(samples, match.group(1), **labels), f"{name} not in /metrics"
    return value(samples, match.group(1), **labels)


def scrape(server: UvicornProcess, name: str) -> float:
    """``metric`` of a real server's ``/metrics`` now."""
    return metric(httpx.get(f"{server.url}/metrics", timeout=5).text, name)


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll ``condition`` until it holds, or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def assert_graceful_exit(server: UvicornProcess, code: int) -> None:
    """The process ended by its own shutdown: uvicorn ran the lifespan's to its end (and says
    so), then re-raised the SIGTERM it handled, which its parent sees as -15 (or 0). A process
    killed by the signal without handling it also shows -15, but never that line."""
    output = server.read_output()
    assert code in (0, -15), output
    assert "Application shutdown complete." in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
