"""Worker threads that answer straight on the event loop.

``loop.run_in_executor`` wraps every job in a ``concurrent.futures.Future`` (a condition
variable and its lock, done callbacks taken under it) and chains that to an asyncio future
with two more callbacks. On the serving path a job runs for every image decoded and every
batch, so that wrapping is event-loop CPU spent per request. Here a job is one tuple in a
``queue.SimpleQueue`` and the thread that ran it resolves its asyncio future with one
``call_soon_threadsafe``: about half the event loop's CPU per job of ``run_in_executor``.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

Result = TypeVar("Result")

_Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[..., Any], tuple[Any, ...]]


class LoopThreads:
    """Up to ``workers`` threads named ``{name}_{i}`` that run functions for coroutines,
    started as jobs need them.

    Jobs start in the order they were given. A job whose future was cancelled before a thread
    took it does not run; one already running finishes and its result is dropped.
    """

    def __init__(self, workers: int, name: str) -> None:
        if workers < 1:
            raise ValueError("at least one worker thread")
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._idle: queue.SimpleQueue[None] = queue.SimpleQueue()  # a token per idle thread
        self._closed = False
        self._lock = threading.Lock()  # shutdown against a job put at the same time
        self._name = name
        self._workers = workers
        self._threads: list[threading.Thread] = []

    @property
    def workers(self) -> int:
        return self._workers

    def run(self, function: Callable[..., Result], *args: Any) -> asyncio.Future[Result]:
        """``function(*args)`` in one of the threads; await the future for its outcome. Call
        it from a coroutine (it uses the running loop)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Result] = loop.create_future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the worker threads are shut down")
            self._jobs.put((loop, future, function, args))
            try:
                self._idle.get_nowait()
            except queue.Empty:
                if len(self._threads) < self._workers:
                    self._start()
        return future

    def _start(self) -> None:
        # On demand, as a ThreadPoolExecutor starts its threads: with every thread started up
        # front, the peak memory of a burst of large bodies measured about a third higher
        # (past its bound; likely more malloc arenas keeping freed buffers).
        thread = threading.Thread(
            target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True
        )
        thread.start()
        self._threads.append(thread)

    def shutdown(self, wait: bool = False) -> None:
        """Take no more jobs, cancel those not started, and stop the threads once their running
        job is done (waiting for that with ``wait``). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    _answer(job[0], job[1].cancel)
            for _ in self._threads:
                self._jobs.put(None)
        if wait:
            for thread in self._threads:
                if thread is not threading.current_thread():
                    thread.join()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            loop, future, function, args = job
            del job
            # Read across threads, at worst stale: a job cancelled just now runs for nothing.
            if future.cancelled():
                del loop, future, function, args
                self._idle.put(None)
                continue
            settle: Callable[[asyncio.Future[Any], Any], None] = _succeed
            try:
                outcome = function(*args)
            except BaseException as exc:  # handed to the awaiting coroutine, as an executor does
                outcome, settle = exc, _fail
                if isinstance(exc, StopIteration):  # a future cannot hold one
                    outcome = RuntimeError("the job raised StopIteration")
                    outcome.__cause__ = exc
            # The arguments go now, not when the next job arrives; the thread counts as idle
            # before it answers, so that the job the answer lets in finds it free.
            del function, args
            self._idle.put(None)
            _answer(loop, settle, future, outcome)
            del loop, future, outcome


def _answer(loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody awaits any more
        loop.call_soon_threadsafe(callback, *args)


def _succeed(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _fail(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
