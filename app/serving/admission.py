"""Admission control: bound what admitted, not yet dispatched requests hold, in count and bytes,
for the whole process, with a fair share for each model.

A request is admitted before its body is read. From then until its batch is dispatched it
holds memory: its encoded bytes while it is read and decoded, and, when the device decodes
it, until dispatch. ``MAX_QUEUE_SIZE`` bounds how many such requests exist and
``MAX_QUEUE_BYTES`` how many encoded bytes they hold together, across every model (the memory
is the process's); past either, the answer is 503 ``overloaded`` with ``Retry-After``, at once,
before anything more is read.

Fair share: with N models, each is guaranteed half of its fair share (1/N) of each limit; the
rest is pooled. A busy model may use the pool and the guarantees of models that already use
theirs, never the unused guarantee of another model: a flooded model cannot starve the others
of admission, and a model alone at work still gets most of the capacity.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from app.errors import OverloadedError

# Of each model's fair share (1/N of a limit), the part no other model may take.
GUARANTEED_SHARE = 0.5


class QueueState(Protocol):
    """What admission reads from a batcher."""

    @property
    def queue_depth(self) -> int: ...

    @property
    def queued_cost(self) -> int: ...

    def retry_after_s(self) -> float: ...


class _Model:
    def __init__(self) -> None:
        self.queues: list[QueueState] = []
        self.preparing = 0
        self.preparing_bytes = 0

    @property
    def requests(self) -> int:
        return self.preparing + sum(queue.queue_depth for queue in self.queues)

    @property
    def bytes(self) -> int:
        return self.preparing_bytes + sum(queue.queued_cost for queue in self.queues)


class Admission:
    """Counts requests being read or decoded (``preparing``) and the bytes they hold, per
    model; the models' batchers count the rest (``queue_depth`` and ``queued_cost``) until
    dispatch."""

    def __init__(self, max_requests: int, max_bytes: int) -> None:
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self._models: dict[str, _Model] = {}

    def add(self, model: str, queue: QueueState) -> None:
        """Count ``queue`` (a version's batcher) as ``model``'s."""
        self._models.setdefault(model, _Model()).queues.append(queue)

    def remove(self, model: str, queue: QueueState) -> None:
        entry = self._models.get(model)
        if entry is not None and queue in entry.queues:
            entry.queues.remove(queue)
        self.forget_if_idle(model)

    def forget_if_idle(self, model: str) -> None:
        """A model with no batcher and nothing being read no longer takes a share."""
        entry = self._models.get(model)
        if entry is not None and not entry.queues and not entry.preparing:
            del self._models[model]

    @property
    def requests(self) -> int:
        """Admitted requests not yet dispatched, every model's."""
        return sum(entry.requests for entry in self._models.values())

    @property
    def bytes(self) -> int:
        """Encoded bytes those requests hold."""
        return sum(entry.bytes for entry in self._models.values())

    def held(self, model: str) -> tuple[int, int]:
        """``model``'s admitted requests and their bytes."""
        entry = self._models.get(model)
        return (entry.requests, entry.bytes) if entry is not None else (0, 0)

    def admit(self, model: str, declared_bytes: int = 0) -> Ticket:
        """A ticket for one more request of ``model`` that will read ``declared_bytes`` (its
        ``Content-Length``, when it has one), or ``OverloadedError``."""
        entry = self._models.setdefault(model, _Model())
        why = self._refusal(model, lambda each: each.requests, self.max_requests, 1, "requests")
        if why is not None:
            raise self.overloaded(model, why)
        ticket = Ticket(self, model, entry)
        try:
            ticket.reserve(declared_bytes)
        except OverloadedError:
            ticket.close()
            raise
        return ticket

    def _refusal(
        self, model: str, used: Callable[[_Model], int], limit: int, extra: int, what: str
    ) -> str | None:
        """Why ``extra`` more of a resource cannot be admitted for ``model`` (None: it can)."""
        usage = {name: used(entry) for name, entry in self._models.items()}
        total = sum(usage.values()) + extra
        if total > limit:
            return f"admitted requests already hold {total - extra} of {limit} {what}"
        guaranteed = GUARANTEED_SHARE * limit / max(1, len(usage))
        kept_for_others = sum(max(0.0, guaranteed - held) for name, held in usage.items()
                              if name != model)  # fmt: skip
        if total + kept_for_others > limit:
            return (
                f"{model!r} holds {usage.get(model, 0)} {what}; the rest of the {limit} is "
                f"kept for other models' guaranteed {math.floor(guaranteed)}"
            )
        return None

    def overloaded(self, model: str, why: str) -> OverloadedError:
        entry = self._models.get(model)
        waits = [queue.retry_after_s() for queue in entry.queues] if entry else []
        retry = max(1, math.ceil(max(waits, default=1.0)))
        return OverloadedError(
            f"the server is at capacity ({why}); retry later",
            headers={"Retry-After": str(retry)},
        )


class Ticket:
    """One admitted request's share: counted from ``admit`` until ``close`` (idempotent)."""

    def __init__(self, admission: Admission, model: str, entry: _Model) -> None:
        self._admission = admission
        self._model = model
        self._entry = entry
        self.reserved = 0
        self.images = 1
        self._open = True
        entry.preparing += 1

    def count_images(self, count: int) -> None:
        """The request carries ``count`` images: each counts against ``MAX_QUEUE_SIZE``, as
        it will in the batcher's queue; ``OverloadedError`` when they do not fit."""
        extra = count - self.images
        if extra <= 0 or not self._open:
            return
        admission = self._admission
        why = admission._refusal(self._model, lambda each: each.requests,
                                 admission.max_requests, extra, "requests")  # fmt: skip
        if why is not None:
            raise admission.overloaded(self._model, why)
        self._entry.preparing += extra
        self.images = count

    def reserve(self, total_bytes: int) -> None:
        """Make sure ``total_bytes`` are counted for this request (they only ever grow while it
        is read); ``OverloadedError`` when they do not fit."""
        extra = total_bytes - self.reserved
        if extra <= 0 or not self._open:
            return
        admission = self._admission
        why = admission._refusal(self._model, lambda each: each.bytes, admission.max_bytes,
                                 extra, "bytes")  # fmt: skip
        if why is not None:
            raise admission.overloaded(self._model, why)
        self._entry.preparing_bytes += extra
        self.reserved = total_bytes

    def close(self) -> None:
        """Stop counting this request here (it failed, or it is handed to the batcher, which
        counts what it still holds from then on)."""
        if self._open:
            self._open = False
            self._entry.preparing -= self.images
            self._entry.preparing_bytes -= self.reserved
            self._admission.forget_if_idle(self._model)
