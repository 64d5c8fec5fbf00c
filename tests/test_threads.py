"""Worker threads that answer on the event loop: results, errors, order, cancellation, shutdown."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import pytest

from batching.threads import LoopThreads
from tests.fakes import settle, until


async def test_a_job_runs_in_a_named_thread_and_answers_its_result() -> None:
    threads = LoopThreads(2, "decode")
    try:
        names = await asyncio.gather(
            *(threads.run(lambda: threading.current_thread().name) for _ in range(8))
        )
        assert set(names) <= {"decode_0", "decode_1"}
        assert threading.current_thread().name not in names
        assert await threads.run(divmod, 7, 2) == (3, 1)
    finally:
        threads.shutdown(wait=True)


def live(prefix: str) -> set[str]:
    return {thread.name for thread in threading.enumerate() if thread.name.startswith(prefix)}


async def test_threads_start_only_as_jobs_need_them() -> None:
    threads = LoopThreads(3, "lazy")
    try:
        assert live("lazy_") == set()
        for _ in range(5):  # one job at a time: one thread serves them all
            await threads.run(lambda: None)
        assert live("lazy_") == {"lazy_0"}
        started, gate = threading.Barrier(3, timeout=5), threading.Event()

        def blocks() -> None:
            started.wait()
            gate.wait(10)

        both = [threads.run(blocks) for _ in range(2)]
        await asyncio.to_thread(started.wait)  # two jobs at once need a second thread
        assert live("lazy_") == {"lazy_0", "lazy_1"}
        gate.set()
        await asyncio.gather(*both)
    finally:
        threads.shutdown(wait=True)


async def test_an_error_reaches_the_awaiting_coroutine() -> None:
    threads = LoopThreads(1, "decode")

    def fails() -> None:
        raise ValueError("not an image")

    def stops() -> None:
        raise StopIteration

    try:
        with pytest.raises(ValueError, match="not an image"):
            await threads.run(fails)
        # A future cannot hold StopIteration: it arrives as a RuntimeError, not a hang.
        with pytest.raises(RuntimeError, match="StopIteration"):
            await asyncio.wait_for(threads.run(stops), 5)
        assert await threads.run(lambda: "still serving") == "still serving"
    finally:
        threads.shutdown(wait=True)


async def test_a_job_cancelled_before_a_thread_takes_it_does_not_run() -> None:
    threads = LoopThreads(1, "decode")
    gate = threading.Event()
    ran: list[str] = []
    try:
        busy = threads.run(gate.wait, 10)
        waiting = threads.run(ran.append, "cancelled")
        after = threads.run(ran.append, "after")
        waiting.cancel()
        gate.set()
        await busy
        await after
        assert ran == ["after"]
    finally:
        threads.shutdown(wait=True)


async def test_the_thread_lets_go_of_a_jobs_arguments_once_it_has_answered() -> None:
    class Image:
        pass

    threads = LoopThreads(1, "decode")
    try:
        image = Image()
        alive = weakref.ref(image)
        await threads.run(id, image)
        del image
        # No later job arrives: the idle thread must not keep the last one's arguments.
        await until(lambda: gc.collect() >= 0 and alive() is None)
    finally:
        threads.shutdown(wait=True)


async def test_shutdown_cancels_waiting_jobs_refuses_new_ones_and_stops_the_threads() -> None:
    threads = LoopThreads(1, "decode")
    started, gate = threading.Event(), threading.Event()

    def blocks() -> bool:
        started.set()
        return gate.wait(10)

    running = threads.run(blocks)
    waiting = threads.run(lambda: "never")
    await until(started.is_set)
    threads.shutdown()
    threads.shutdown()  # idempotent
    await settle()
    assert waiting.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        threads.run(lambda: None)
    gate.set()
    assert await running is True  # the running job finishes and answers
    await until(lambda: not any(t.name == "decode_0" for t in threading.enumerate()))
