"""Assertions shared by the engine tests."""

from __future__ import annotations

import re

import pytest

from app.engine import Prediction


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
    """One sample's value from a ``/metrics`` text (``name`` may include ``{labels}``)."""
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))
