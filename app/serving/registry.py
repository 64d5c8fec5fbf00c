"""Every model the process serves, by name and version; loading, reloading and unloading them
without dropping a request.

Loading a model (again) reads its config and versions now, builds every version its policy
serves (export, start-up check or INT8 gate, warm-up) while the versions already loaded keep
serving, and only then switches: a request that found the old version finishes on it, the next
one finds the new. The old versions then stop admitting, answer every request they accepted,
and are freed. A load that fails leaves the serving versions as they were. Forward passes of
models on one device are serialised by one lock per device, so that two models never compete
for the same cores (or the same GPU) inside one batch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from app import heap
from app.errors import NotFoundError, NotReadyError, ServiceError
from app.metrics import Metrics
from app.serving.admission import Admission
from app.serving.repository import ModelSpec, model_names, read_model, single_model
from app.serving.version import ModelVersion, VersionState
from app.settings import Settings

logger = logging.getLogger("batchserve")

Outcome = TypeVar("Outcome")
# How often a collection waiting for an idle moment looks.
IDLE_POLL_S = 0.25


class LoadError(ServiceError):
    """A model could not be loaded: its config, its files, its check or its gate."""

    status, code, outcome = 400, "load_failed", "invalid"


class Registry:
    """Models by name, each a set of loaded versions; the serving ones are swapped whole."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        admission: Admission,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.admission = admission
        self._on_failure = on_failure
        self._serving: dict[str, dict[int, ModelVersion]] = {}
        self._loading: dict[str, list[ModelVersion]] = {}
        self._history: dict[str, list[dict[str, Any]]] = {}  # unloaded or failed, for the index
        self._locks: dict[str, asyncio.Lock] = {}
        self._device_locks: dict[str, threading.Lock] = {}
        self._names: list[str] | None = None  # the repository's models, as last listed
        self._tasks: set[asyncio.Future[Any]] = set()  # loads and unloads under way
        self._collection: asyncio.Future[None] | None = None  # waiting for an idle moment

    # -- what exists -------------------------------------------------------------------

    def available(self) -> list[str]:
        """Every model that can be loaded: the repository's (as last listed: by the index, a
        load or an unload), or the one of the settings. Requests that name an unknown model,
        readiness calls among them, are answered from this list without listing the
        repository's folder on the event loop."""
        if self._names is None:
            self.refresh_names()
        assert self._names is not None
        return self._names

    def refresh_names(self) -> list[str]:
        """List the repository's models again (a folder added or removed since)."""
        root = self.settings.model_repository
        self._names = model_names(root) if root is not None else [self.settings.served_name]
        return self._names

    def spec(self, name: str) -> ModelSpec:
        root = self.settings.model_repository
        if root is None:
            if name != self.settings.served_name:
                raise NotFoundError(f"unknown model {name!r}; this server serves "
                                    f"{self.settings.served_name!r}")  # fmt: skip
            return single_model(self.settings)
        from app.serving.repository import RepositoryError

        if name not in self.refresh_names():
            raise NotFoundError(f"unknown model {name!r}; the repository has "
                                f"{', '.join(model_names(root)) or 'none'}")  # fmt: skip
        try:
            return read_model(root, name, self.settings)
        except RepositoryError as exc:
            raise LoadError(f"cannot load {name!r}: {exc}") from None

    @property
    def models(self) -> dict[str, dict[int, ModelVersion]]:
        """The serving versions of every loaded model."""
        return self._serving

    # -- finding a version for a request ----------------------------------------------

    def resolve(self, name: str | None, version: str | int | None = None) -> ModelVersion:
        """The version that serves a request for ``name`` (None: ``DEFAULT_MODEL``, or the
        only model) and ``version`` (None: the highest ready one)."""
        if name is None:
            name = self.default_name()
        versions = self._serving.get(name)
        if not versions:
            if name in self._loading:
                raise NotReadyError(f"model {name!r} is loading", headers={"Retry-After": "1"})
            if name in self._history or name in self.available():
                raise NotFoundError(f"model {name!r} has no version loaded")
            raise NotFoundError(f"unknown model {name!r}")
        if version is None:
            return max(versions.values(), key=lambda each: each.version)
        number = _version_number(version)
        found = versions.get(number) if number is not None else None
        if found is None:
            served = ", ".join(str(v) for v in sorted(versions))
            raise NotFoundError(f"model {name!r} has no version {version!r} loaded ({served})")
        return found

    def default_name(self) -> str:
        default = self.settings.default_model
        if default is not None:
            return default
        if len(self._serving) == 1:
            return next(iter(self._serving))
        raise NotFoundError(
            f"name a model (?model=...): this server serves {', '.join(sorted(self._serving))}"
        )

    # -- loading and unloading ------------------------------------------------------------

    async def load(self, name: str) -> None:
        """Load ``name`` or reload it (its config and versions read now); ``LoadError`` when
        any version fails, the serving ones untouched. The load is the registry's own task:
        a caller that goes away (a gRPC client's deadline cancels its handler) stops waiting
        for it, never the load itself, which finishes (or cleans up) as if it had stayed."""
        await self._owned(self._load(name))

    async def unload(self, name: str) -> None:
        """Stop serving ``name``: its versions answer what they accepted, then go (the
        registry's own task, as a load is)."""
        if await self._owned(self._unload(name)):
            self._collect_when_idle()

    async def _owned(self, work: Coroutine[Any, Any, Outcome]) -> Outcome:
        """Run ``work`` as a task of the registry's, shielded from the caller's cancellation."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    async def _load(self, name: str) -> None:
        async with self._lock(name):
            spec = self.spec(name)
            if not spec.versions:
                raise LoadError(f"cannot load {name!r}: its version policy selects no version")
            built: list[ModelVersion] = []
            self._loading[name] = built
            try:
                for version_spec in spec.versions:
                    version = ModelVersion(
                        name, version_spec.version, version_spec.config,
                        self.metrics.version(name, str(version_spec.version)),
                    )  # fmt: skip
                    built.append(version)
                    await version.load(self._device_lock(version), self._batching_failed)
            except BaseException as exc:
                # Cancelled too (the process is stopping): no version built here may be left
                # with its engine and batcher, neither serving nor unloaded.
                logger.error("loading %s failed: %s", name, exc or type(exc).__name__)
                for version in built:
                    await version.unload(0, "discarded: the load failed")
                if name not in self._serving:
                    self._history[name] = [version.describe() for version in built]
                self._collect_when_idle()
                if not isinstance(exc, Exception):
                    raise
                raise LoadError(f"cannot load {name!r}: {exc}") from exc
            finally:
                self._loading.pop(name, None)
            previous = self._serving.get(name, {})
            for version in built:
                assert version.batcher is not None
                self.admission.add(name, version.batcher)
            self._serving[name] = {version.version: version for version in built}
            self._history.pop(name, None)
            kept = {version.version for version in built}
            await self._retire(name, list(previous.values()), kept, "replaced by a reload")
            heap.freeze()  # the new versions live until they are unloaded
            if previous:
                self._collect_when_idle()

    async def _unload(self, name: str, drain_timeout_s: float | None = None) -> bool:
        """Whether ``name`` served and is now unloaded."""
        async with self._lock(name):
            versions = self._serving.pop(name, None)
            if versions is None:
                if name in self._history or name in self.refresh_names():
                    return False  # already unloaded: nothing to do, as Triton answers
                raise NotFoundError(f"unknown model {name!r}")
            await self._retire(name, list(versions.values()), set(), "unloaded",
                               drain_timeout_s)  # fmt: skip
            self._history[name] = [version.describe() for version in versions.values()]
            return True

    def _collect_when_idle(self) -> None:
        """Once every model is idle, free what unloaded versions left in reference cycles
        among the frozen objects (``heap``). Their engines, runtimes and batchers are freed
        by reference counting as soon as they go; what waits is small, and a full collection
        holds the GIL for a few tenths of a second: never while a request is in the way."""
        if self._collection is None or self._collection.done():
            self._collection = asyncio.ensure_future(self._collect_once_idle())

    async def _collect_once_idle(self) -> None:
        while True:  # polled: idleness is a state of every model's queues, not an event
            if self._idle():
                break
            await asyncio.sleep(IDLE_POLL_S)
        heap.collect_and_freeze()

    def _idle(self) -> bool:
        """Nothing admitted, queued or computing, in any model."""
        if self.admission.requests:
            return False
        return all(version.batcher is None or (version.batcher.queue_depth == 0
                                               and version.batcher.inflight_batches == 0)
                   for versions in self._serving.values()
                   for version in versions.values())  # fmt: skip

    async def aclose(self, drain_timeout_s: float | None = None) -> None:
        """Unload every model (the process is stopping), each version answering what it
        accepted within ``drain_timeout_s`` (None: ``DRAIN_TIMEOUT_S``): loads still under way
        are cancelled first, and clean up what they built."""
        if self._collection is not None:
            self._collection.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for name in list(self._serving):
            # No collection: the lifespan thaws the heap next.
            await self._unload(name, drain_timeout_s)

    async def abort(self) -> None:
        """Answer every queued request of every version now (503): the drain timed out."""
        batchers = [version.batcher for versions in self._serving.values()
                    for version in versions.values()]  # fmt: skip
        await asyncio.gather(*(batcher.aclose(drain_timeout=0) for batcher in batchers
                               if batcher is not None))  # fmt: skip

    async def _retire(
        self,
        name: str,
        versions: list[ModelVersion],
        kept: set[int],
        reason: str,
        drain_timeout_s: float | None = None,
    ) -> None:
        timeout = self.settings.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        batchers = [version.batcher for version in versions]
        try:
            await asyncio.gather(*(version.unload(timeout, reason) for version in versions))
        except BaseException:  # cancelled (the process is stopping): no drain, but no leak
            for version in versions:
                await version.unload(0, reason)
            raise
        for version, batcher in zip(versions, batchers, strict=True):
            if batcher is not None:
                self.admission.remove(name, batcher)
            if version.version not in kept:
                self.metrics.forget(name, str(version.version))

    # -- the index ------------------------------------------------------------------------

    def index(self) -> list[dict[str, Any]]:
        """Every model of the repository, and each version's state (Triton's repository
        index: ``name``, ``version``, ``state``, ``reason``)."""
        entries: list[dict[str, Any]] = []
        for name in sorted(set(self.refresh_names()) | set(self._serving) | set(self._loading)):
            if name in self._loading:
                entries += [version.describe() for version in self._loading[name]]
            if name in self._serving:
                entries += [version.describe()
                            for _, version in sorted(self._serving[name].items())]  # fmt: skip
            elif name in self._history:
                entries += self._history[name]
            elif name not in self._loading:
                entries.append({"name": name, "state": VersionState.UNAVAILABLE.value,
                                "reason": "not loaded"})  # fmt: skip
        return entries

    # -- internals ------------------------------------------------------------------------

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def _device_lock(self, version: ModelVersion) -> threading.Lock:
        from app.engine import resolve_device

        settings = version.config
        device = str(resolve_device(settings.device, settings.worker_index))
        return self._device_locks.setdefault(device, threading.Lock())

    def _batching_failed(self, version: ModelVersion, error: BaseException) -> None:
        if self._on_failure is not None:
            self._on_failure(f"the batching loop of {version.name} failed")


def _version_number(version: str | int) -> int | None:
    if isinstance(version, int):
        return version
    return int(version) if version.isdigit() else None
