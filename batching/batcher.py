"""An asyncio dynamic batcher: many concurrent ``submit`` calls, few batched ``run_batch`` calls."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar, cast

from batching.clock import Cancellable, Clock, LoopClock
from batching.config import BatchConfig
from batching.errors import BatcherClosedError, DeadlineExceededError, QueueFullError
from batching.observer import BatchObserver, DropReason, RejectReason
from batching.policy import decide
from batching.threads import LoopThreads
from batching.timing import ExecutionTimeModel

T = TypeVar("T")
R = TypeVar("R")

RunBatch = Callable[[list[T]], Sequence["R | BaseException"]]

logger = logging.getLogger("batching")

_NEVER = math.inf


class _Request(Generic[T, R]):
    __slots__ = ("arrival", "cost", "deadline", "future", "item", "key", "priority", "queued")

    def __init__(
        self,
        item: T,
        future: asyncio.Future[R],
        arrival: float,
        deadline: float | None,
        cost: int,
        priority: int,
        key: Hashable,
    ) -> None:
        self.item: T | None = item  # let go once answered: the request may outlive its answer
        self.future = future
        self.arrival = arrival
        self.deadline = deadline
        self.cost = cost
        self.priority = priority
        self.key = key
        self.queued = True


class _GuardedObserver(BatchObserver):
    """Forwards to the real observer and swallows what it raises.

    Hooks run in the middle of the batcher's bookkeeping: a failing metrics hook must never
    leave a request without an answer, so each failure is logged (once per hook) and ignored.
    """

    def __init__(self, inner: BatchObserver) -> None:
        self._inner = inner
        self._reported: set[str] = set()

    def _failed(self, hook: str) -> None:
        if hook not in self._reported:
            self._reported.add(hook)
            logger.exception("the batch observer's %s hook failed (ignored from now on)", hook)

    def on_reject(self, reason: RejectReason) -> None:
        try:
            self._inner.on_reject(reason)
        except Exception:
            self._failed("on_reject")

    def on_drop(self, reason: DropReason, queue_wait_s: float) -> None:
        try:
            self._inner.on_drop(reason, queue_wait_s)
        except Exception:
            self._failed("on_drop")

    def on_dispatch(self, batch_size: int, queue_waits_s: Sequence[float]) -> None:
        try:
            self._inner.on_dispatch(batch_size, queue_waits_s)
        except Exception:
            self._failed("on_dispatch")

    def on_complete(self, batch_size: int, duration_s: float, error: BaseException | None) -> None:
        try:
            self._inner.on_complete(batch_size, duration_s, error)
        except Exception:
            self._failed("on_complete")

    def on_expired_in_flight(self) -> None:
        try:
            self._inner.on_expired_in_flight()
        except Exception:
            self._failed("on_expired_in_flight")


class DynamicBatcher(Generic[T, R]):
    """Groups concurrent requests into batches for a synchronous ``run_batch``.

    ``run_batch(items)`` runs in a worker thread (at most ``max_inflight_batches`` at once) and
    returns one result or one exception per item, in order; an exception raised by
    ``run_batch`` itself fails that batch only. Every ``submit`` ends with a result or an error,
    whatever the observer or ``run_batch`` raise.

    ``on_failure`` is called once if the batching loop itself dies (a bug): from then on the
    batcher refuses work, and whoever owns the process should let it be restarted.

    A request may carry a ``key``: a batch holds requests of one key only (images of one
    input shape, say). The batch that forms is the oldest request's key's, unless another key
    already has a full batch waiting; the window, the preferred sizes and the wake-ups count
    the requests of that key.
    """

    def __init__(
        self,
        run_batch: RunBatch[T, R],
        config: BatchConfig | None = None,
        observer: BatchObserver | None = None,
        *,
        clock: Clock | None = None,
        timings: ExecutionTimeModel | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.config = config or BatchConfig()
        self.timings = timings or ExecutionTimeModel()
        self._run_batch = run_batch
        self._observer: BatchObserver = _GuardedObserver(observer or BatchObserver())
        self._on_failure = on_failure
        self._clock = clock or LoopClock()
        # One FIFO per priority level, level 0 first.
        self._queues: list[deque[_Request[T, R]]] = [
            deque() for _ in range(self.config.priority_levels)
        ]
        self._waiting = 0  # live requests in the queue (cancelled ones are removed lazily)
        self._waiting_cost = 0
        self._waiting_by_key: dict[Hashable, int] = {}
        self._inflight = 0
        # Each running execution and its batch, so that none is left unanswered on shutdown.
        self._executions: dict[asyncio.Task[None], list[_Request[T, R]]] = {}
        self._wake = asyncio.Event()
        self._wake_count = _NEVER
        self._last_finished = float("-inf")
        self._loop_task: asyncio.Task[None] | None = None
        self._threads: LoopThreads | None = None
        self._closing = False
        self._closed = asyncio.Event()
        self._failure: BaseException | None = None
        # One timer for the earliest deadline, not one per request: a heap of deadlines.
        self._deadlines: list[tuple[float, int, _Request[T, R]]] = []
        self._watched = 0  # unfinished requests in the deadline heap
        self._deadline_sequence = itertools.count()
        self._deadline_timer: Cancellable | None = None
        self._deadline_timer_at = _NEVER

    # -- state ---------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        """Requests waiting to be dispatched."""
        return self._waiting

    @property
    def queued_cost(self) -> int:
        """The sum of the ``cost`` of the requests waiting to be dispatched."""
        return self._waiting_cost

    @property
    def inflight_batches(self) -> int:
        return self._inflight

    @property
    def failure(self) -> BaseException | None:
        """What killed the batching loop, if it died."""
        return self._failure

    @property
    def accepting(self) -> bool:
        """True while ``submit`` takes new work: started, not draining, loop alive."""
        return self._loop_task is not None and not self._closing and self._failure is None

    def now(self) -> float:
        """The batcher's clock, the time base of ``submit``'s ``deadline``."""
        return self._clock.now()

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the batching loop on the running event loop."""
        if self._loop_task is not None:
            raise RuntimeError("the batcher is already started")
        self._threads = LoopThreads(self.config.max_inflight_batches, "run-batch")
        self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="batcher")

    async def aclose(self, drain_timeout: float | None = None) -> None:
        """Stop taking work, finish what was accepted (up to ``drain_timeout`` s), then stop.

        What is still unfinished at the timeout fails with ``BatcherClosedError``. Idempotent:
        later or concurrent calls wait for the first to finish.
        """
        if self._closing:
            await self._closed.wait()
            return
        self._closing = True
        self._wake.set()
        try:
            if self._loop_task is not None:
                await asyncio.wait_for(self._drained(), drain_timeout)
        except TimeoutError:
            logger.warning("drain timed out after %ss; failing unfinished requests", drain_timeout)
        finally:
            await self._abort(BatcherClosedError("the server is shutting down"))
            self._closed.set()

    async def _drained(self) -> None:
        assert self._loop_task is not None
        await asyncio.shield(self._loop_task)
        while self._executions:
            await asyncio.wait(set(self._executions))

    async def _abort(self, error: BaseException) -> None:
        if self._loop_task is not None and not self._loop_task.done():
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self._fail_queued(error)
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        executions = dict(self._executions)
        for task in executions:
            task.cancel()
        if executions:
            await asyncio.gather(*executions, return_exceptions=True)
        for batch in executions.values():
            # A task cancelled before its first step never ran its own error handling.
            for request in batch:
                self._settle(request, BatcherClosedError("the server is shutting down"))
        if self._threads is not None:
            # A batch still running in a thread finishes there; nobody waits for it.
            self._threads.shutdown()

    # -- submitting ----------------------------------------------------------------------

    async def submit(
        self,
        item: T,
        deadline: float | None = None,
        *,
        cost: int = 0,
        priority: int | None = None,
        key: Hashable = None,
    ) -> R:
        """Queue ``item`` and wait for its result.

        ``deadline`` is absolute, on ``now()``'s clock. ``cost`` is what the request holds while
        it waits (bytes, say), summed in ``queued_cost`` until it is dispatched or dropped.
        ``priority`` is its level (0 first; ``config.default_priority`` when None); a level out
        of range raises ``ValueError``. ``key``: the batches it may join hold its key alone.
        Raises ``QueueFullError`` at once when the queue is full, ``DeadlineExceededError`` when
        the deadline passes first, ``BatcherClosedError`` when draining or closed, or what
        ``run_batch`` gave this item. Cancelling the caller removes a queued request before
        dispatch.
        """
        return await self.enqueue(item, deadline, cost=cost, priority=priority, key=key)

    def enqueue(
        self,
        item: T,
        deadline: float | None = None,
        *,
        cost: int = 0,
        priority: int | None = None,
        key: Hashable = None,
    ) -> asyncio.Future[R]:
        """``submit`` without waiting: the request is in the queue when this returns (or it
        raised at once), and the future gives its outcome. Cancelling the future removes the
        request if it is still queued."""
        level = self.config.default_priority if priority is None else priority
        if not 0 <= level < self.config.priority_levels:
            raise ValueError(
                f"priority must be between 0 and {self.config.priority_levels - 1}, not {level}"
            )
        if not self.accepting:
            self._observer.on_reject("closed")
            raise BatcherClosedError(self._closed_reason())
        if self._waiting >= self.config.max_queue_size and not self.displace_below(level):
            self._observer.on_reject("overloaded")
            raise QueueFullError(self.config.max_queue_size, self.retry_after_s())
        now = self._clock.now()
        if deadline is not None and deadline <= now:
            self._observer.on_drop("deadline_exceeded", 0.0)
            raise DeadlineExceededError(dispatched=False)

        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        request = _Request(item, future, now, deadline, cost, level, key)
        future.add_done_callback(lambda _: self._withdraw(request))
        if deadline is not None:
            self._watch_deadline(request, deadline)
        self._queues[level].append(request)
        self._waiting += 1
        self._waiting_cost += cost
        same = self._waiting_by_key[key] = self._waiting_by_key.get(key, 0) + 1
        if same >= self._wake_count:
            self._wake.set()
        return future

    def displace_below(self, level: int) -> bool:
        """Make room for a request of priority ``level``: the newest waiting request of the
        lowest priority below it leaves the queue with ``QueueFullError`` (its client may
        retry, as when it is refused at once). False when none waits below ``level``."""
        for lower in range(self.config.priority_levels - 1, level, -1):
            queue = self._queues[lower]
            for index in range(len(queue) - 1, -1, -1):
                victim = queue[index]
                if not victim.queued:
                    continue  # cancelled, removed lazily
                del queue[index]
                self._dequeue(victim)
                self._observer.on_drop("displaced", self._clock.now() - victim.arrival)
                victim.future.set_exception(
                    QueueFullError(self.config.max_queue_size, self.retry_after_s())
                )
                return True
        return False

    def _withdraw(self, request: _Request[T, R]) -> None:
        """A request's future is done: if it is still queued, it was cancelled there. Either
        way its item goes now, though the request itself may wait in the queues (removed
        lazily) and in the deadline heap (behind earlier deadlines) for a while."""
        request.item = None
        if request.queued:
            self._dequeue(request)
            self._observer.on_drop("cancelled", self._clock.now() - request.arrival)
        if request.deadline is not None:
            self._watched -= 1
            heap = self._deadlines
            # Behind one long-waiting request, finished ones pile up: keep at most half.
            if len(heap) > 64 and len(heap) > 2 * self._watched:
                heap[:] = [entry for entry in heap if not entry[2].future.done()]
                heapq.heapify(heap)

    def _closed_reason(self) -> str:
        if self._failure is not None:
            return "the batching loop failed"
        if self._loop_task is None:
            return "the batcher is not started"
        return "the server is shutting down"

    def retry_after_s(self) -> float:
        """A guess at how long the current queue takes to clear (at least 1 s)."""
        cap = self.config.max_batch_size
        per_batch = self.timings.estimate(cap) or 1.0
        batches = math.ceil(self._waiting / cap) / self.config.max_inflight_batches
        return max(1.0, batches * per_batch)

    def _dequeue(self, request: _Request[T, R]) -> None:
        request.queued = False
        self._waiting -= 1
        self._waiting_cost -= request.cost
        left = self._waiting_by_key[request.key] - 1
        if left:
            self._waiting_by_key[request.key] = left
        else:
            del self._waiting_by_key[request.key]

    def _watch_deadline(self, request: _Request[T, R], deadline: float) -> None:
        heap = self._deadlines
        while heap and heap[0][2].future.done():  # finished requests leave from the top
            heapq.heappop(heap)
        heapq.heappush(heap, (deadline, next(self._deadline_sequence), request))
        self._watched += 1
        if deadline < self._deadline_timer_at:
            self._arm_deadline_timer(deadline)

    def _arm_deadline_timer(self, when: float) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        self._deadline_timer_at = when
        self._deadline_timer = self._clock.call_at(when, self._deadlines_due)

    def _deadlines_due(self) -> None:
        self._deadline_timer, self._deadline_timer_at = None, _NEVER
        now = self._clock.now()
        heap = self._deadlines
        while heap and (heap[0][0] <= now or heap[0][2].future.done()):
            _, _, request = heapq.heappop(heap)
            self._expire(request)
        if heap:
            self._arm_deadline_timer(heap[0][0])

    def _expire(self, request: _Request[T, R]) -> None:
        if request.future.done():
            return
        dispatched = not request.queued
        if request.queued:
            self._dequeue(request)
        request.future.set_exception(DeadlineExceededError(dispatched=dispatched))
        if dispatched:
            self._observer.on_expired_in_flight()
        else:
            self._observer.on_drop("deadline_exceeded", self._clock.now() - request.arrival)

    def _fail_queued(self, error: BaseException) -> None:
        for queue in self._queues:
            while queue:
                request = queue.popleft()
                if request.queued:
                    self._dequeue(request)
                    self._settle(request, error)

    # -- the batching loop ---------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._form_batches()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            logger.exception("the batching loop crashed; failing waiting requests")
            self._failure = exc
            self._fail_queued(BatcherClosedError("the batching loop failed"))
            if self._on_failure is not None:
                self._on_failure(exc)

    async def _form_batches(self) -> None:
        config = self.config
        while True:
            head = self._head()
            if head is None:
                if self._closing:
                    return
                await self._sleep(None, wake_count=1)
                continue
            if self._inflight >= config.max_inflight_batches:
                await self._sleep(None, wake_count=_NEVER)  # a finishing batch wakes us
                continue
            now = self._clock.now()
            key = self._batch_key(head.key)
            decision = decide(
                config,
                now=now,
                waiting=self._waiting_by_key[key],
                oldest_arrival=head.arrival,
                inflight=self._inflight,
                closing=self._closing,
                estimate=self.timings.estimate,
            )
            if decision.size == 0:
                await self._sleep(decision.wake_at, decision.wake_count)
                continue
            batch: list[_Request[T, R]] = []
            try:
                self._take(batch, decision.size, now, key)
                if batch:
                    self._launch(batch, now)
            except BaseException:
                # Taken from the queue but never handed to an execution: answer them here.
                for request in batch:
                    self._settle(request, BatcherClosedError("the batching loop failed"))
                raise

    def _head(self) -> _Request[T, R] | None:
        """The longest-waiting live request of any level: the one whose window runs."""
        oldest: _Request[T, R] | None = None
        for queue in self._queues:
            while queue and not queue[0].queued:
                queue.popleft()
            while queue and queue[0].future.done():  # cancelled, its callback still to come
                self._withdraw(queue.popleft())
            if queue and (oldest is None or queue[0].arrival < oldest.arrival):
                oldest = queue[0]
        return oldest

    def _batch_key(self, oldest: Hashable) -> Hashable:
        """The key of the batch to form: the oldest request's, unless another key has a full
        batch waiting."""
        cap = self.config.max_batch_size
        if self._waiting_by_key[oldest] >= cap or len(self._waiting_by_key) == 1:
            return oldest
        return next((key for key, count in self._waiting_by_key.items() if count >= cap), oldest)

    async def _sleep(self, wake_at: float | None, wake_count: float) -> None:
        self._wake.clear()
        self._wake_count = wake_count
        timer = self._clock.call_at(wake_at, self._wake.set) if wake_at is not None else None
        try:
            await self._wake.wait()
        finally:
            self._wake_count = _NEVER
            if timer is not None:
                timer.cancel()

    def _take(self, batch: list[_Request[T, R]], size: int, now: float, key: Hashable) -> None:
        """Move up to ``size`` live requests of ``key`` into ``batch``, level 0 first, FIFO
        within one; requests of other keys keep their places.

        A request whose deadline comes before the batch could finish (by the learned batch
        time) is answered ``DeadlineExceededError`` now instead: computing it would only waste
        the device on an answer nobody gets, which under overload starves the requests that
        could still make it."""
        finish = now + (self.timings.estimate(size) or 0.0)
        for queue in self._queues:
            passed: list[_Request[T, R]] = []
            while queue and len(batch) < size:
                request = queue.popleft()
                if not request.queued:
                    continue
                if request.future.done():  # cancelled, its callback still to come
                    self._withdraw(request)
                    continue
                if request.key != key:
                    passed.append(request)
                    continue
                if request.deadline is not None and request.deadline <= finish:
                    self._expire(request)  # too late already, or by the time it would finish
                    continue
                batch.append(request)
                self._dequeue(request)
            queue.extendleft(reversed(passed))

    def _launch(self, batch: list[_Request[T, R]], now: float) -> None:
        task = asyncio.get_running_loop().create_task(self._execute(batch))
        self._inflight += 1
        self._executions[task] = batch
        task.add_done_callback(self._forget)
        self._observer.on_dispatch(len(batch), [now - request.arrival for request in batch])

    async def _execute(self, batch: list[_Request[T, R]]) -> None:
        started = self._clock.now()
        error: BaseException | None = None
        try:
            assert self._threads is not None
            # Dispatched requests are unanswered, so each still has its item.
            items = [cast(T, request.item) for request in batch]
            results = await self._threads.run(self._run_batch, items)
            if len(results) != len(batch):
                raise RuntimeError(
                    f"run_batch returned {len(results)} results for {len(batch)} items"
                )
        except asyncio.CancelledError:
            for request in batch:
                self._settle(request, BatcherClosedError("the server is shutting down"))
            raise
        except Exception as exc:
            error = exc
            for request in batch:
                self._settle(request, exc)
        except BaseException as exc:
            # SystemExit or the like from inside run_batch's thread: it must not stop the event
            # loop, and the requests still need an answer they can be mapped to.
            logger.error("run_batch raised %s; failing its batch", type(exc).__name__, exc_info=exc)
            error = RuntimeError(f"run_batch raised {type(exc).__name__}")
            error.__cause__ = exc
            for request in batch:
                self._settle(request, error)
        else:
            for request, result in zip(batch, results, strict=True):
                self._settle(request, result)
        finally:
            self._inflight -= 1
            self._wake.set()
        finished = self._clock.now()
        if self.config.serial_execution:
            # Dispatched ahead, it waited for the batch before it: that wait is not its own.
            started = max(started, self._last_finished)
            self._last_finished = finished
        duration = finished - started
        if error is None:
            self.timings.observe(len(batch), duration)
        self._observer.on_complete(len(batch), duration, error)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._executions.pop(task, None)

    @staticmethod
    def _settle(request: _Request[T, R], outcome: R | BaseException) -> None:
        if request.future.done():
            return  # cancelled, or failed by its deadline: the result is discarded
        if isinstance(outcome, BaseException):
            request.future.set_exception(outcome)
        else:
            request.future.set_result(outcome)
