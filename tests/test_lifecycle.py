"""The server's lifecycle: one state, moves that make sense, and everyone reading it."""

from __future__ import annotations

import logging

import pytest

from app.serving.lifecycle import Lifecycle, Phase


def test_the_normal_life_of_a_server() -> None:
    seen: list[Phase] = []
    lifecycle = Lifecycle()
    lifecycle.subscribe(seen.append)
    assert (lifecycle.phase, lifecycle.ready, lifecycle.live) == (Phase.STARTING, False, True)
    assert lifecycle.reason == "the model is loading"
    lifecycle.serve()
    assert (lifecycle.ready, lifecycle.live, lifecycle.reason) == (True, True, "")
    lifecycle.drain()
    assert (lifecycle.ready, lifecycle.live) == (False, True)
    assert lifecycle.reason == "the server is draining"
    lifecycle.serve()  # no way back to ready once draining
    lifecycle.stop()
    assert lifecycle.phase is Phase.STOPPED
    assert seen == [Phase.STARTING, Phase.READY, Phase.DRAINING, Phase.STOPPED]


def test_failure_is_final_and_turns_liveness_off(caplog: pytest.LogCaptureFixture) -> None:
    lifecycle = Lifecycle()
    lifecycle.serve()
    with caplog.at_level(logging.CRITICAL, logger="batchserve"):
        lifecycle.fail("the batching loop failed")
    assert (lifecycle.phase, lifecycle.ready, lifecycle.live) == (Phase.FAILED, False, False)
    assert lifecycle.reason == "the batching loop failed"
    assert "liveness now fails" in caplog.text
    for move in (lifecycle.serve, lifecycle.drain, lifecycle.stop):
        move()  # a shutdown racing the failure cannot hide it
        assert lifecycle.phase is Phase.FAILED
    lifecycle.fail("again")
    assert lifecycle.reason == "the batching loop failed"
