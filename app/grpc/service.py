"""``inference.GRPCInferenceService``: the Open Inference Protocol over gRPC, with Triton's
additions that its client uses (repository RPCs, statistics).

Messages are those of Triton's ``grpc_service.proto`` as ``tritonclient`` ships them compiled
(``tritonclient.grpc.service_pb2``); every call translates into the serving core, as the REST
routes do. Inputs come as ``raw_input_contents`` (what Triton's client always sends; BYTES
elements are 4-byte little-endian lengths then the bytes) or typed ``contents``; outputs go out
as ``raw_output_contents``, the only form Triton's client reads. The call's deadline is the
request's deadline too, and a cancelled call withdraws its images from the queue (its task is
cancelled, and the prediction path withdraws what it enqueued).
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from app.errors import NotFoundError, NotReadyError
from app.grpc.errors import abort_with
from app.grpc.messages import parameter, read_request
from app.grpc.receiving import ReceiveSlots, Slot
from app.protocol.model_io import (
    EXTENSIONS,
    detection_parameter,
    metadata,
    render,
    schedule_parameter,
    top_k_for,
    wants_dense,
    wants_masks,
)
from app.protocol.tensors import MalformedTensorError, raw_values
from app.requestid import HEADER, current_request_id, request_id_from
from app.serving.inference import InferenceRequest, ModelFacts, Parsed, Reserve
from app.serving.repository import refuse_without_control
from app.serving.server import ServerState
from app.settings import Settings

ROUTE = "grpc_infer"
Reply = TypeVar("Reply")


class InferenceService(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """The protocol's RPCs over the serving core of ``server``."""

    def __init__(self, server: ServerState, version: str, receiving: ReceiveSlots) -> None:
        self.server = server
        self.version = version
        self.receiving = receiving

    # -- health and metadata ----------------------------------------------------------------

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerLiveResponse(live=self.server.lifecycle.live)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerReadyResponse(ready=self.server.lifecycle.ready)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        async def answer() -> Any:
            try:
                version = self._registry().resolve(request.name, request.version or None)
            except (NotFoundError, NotReadyError):  # no: as Triton answers, not an error
                return service_pb2.ModelReadyResponse(ready=False)
            ready = version.ready and self.server.lifecycle.ready
            return service_pb2.ModelReadyResponse(ready=ready)

        return await self._guarded(context, answer)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerMetadataResponse(
            name="batchserve", version=self.version, extensions=EXTENSIONS
        )

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        async def answer() -> Any:
            core = self.server.started()
            described = metadata(core.describe(request.name, request.version or None))
            tensor = service_pb2.ModelMetadataResponse.TensorMetadata
            return service_pb2.ModelMetadataResponse(
                name=described["name"],
                versions=described["versions"],
                platform=described["platform"],
                inputs=[tensor(**each) for each in described["inputs"]],
                outputs=[tensor(**each) for each in described["outputs"]],
            )

        return await self._guarded(context, answer)

    # -- inference --------------------------------------------------------------------------

    async def ModelInfer(self, requests: AsyncIterator[Any], context: Any) -> Any:
        """Served as a stream of (one) request, so that its message is read only once a
        receive slot is free (``ReceiveSlots``)."""
        arrived = time.perf_counter()
        # A call the client cancels ends in CancelledError at whatever it awaits: counted so.
        scope = {"outcome": "cancelled"}
        self.server.enter()
        try:
            response = await self._guarded(
                context, lambda: self._infer(requests, context, arrived, scope), scope=scope
            )
            scope["outcome"] = "ok"
            return response
        finally:
            self.server.metrics.count_request(ROUTE, scope["outcome"], scope.get("model", ""),
                                              time.perf_counter() - arrived)  # fmt: skip
            self.server.leave()

    async def _infer(
        self, requests: AsyncIterator[Any], context: Any, arrived: float, scope: dict[str, str]
    ) -> Any:
        predictor = self.server.require_ready()
        slot = await self.receiving.take()
        try:
            message = await _only_message(requests)
            timeout, priority = _schedule(message, context)
            min_score = detection_parameter("min_score", parameter(message.parameters, "min_score"))
            max_detections = detection_parameter(
                "max_detections", parameter(message.parameters, "max_detections"))  # fmt: skip
            request_id, model = message.id, message.model_name

            def parse(received: Any, facts: ModelFacts) -> Parsed:
                inputs, outputs = read_request(received, facts.max_images, facts.max_bytes,
                                               facts.classes, facts.task,
                                               facts.instances)  # fmt: skip
                return Parsed(inputs, top_k=top_k_for(outputs), dense=wants_dense(outputs),
                              min_score=min_score, max_detections=max_detections,
                              masks=wants_masks(outputs), detail=outputs)  # fmt: skip

            def named(name: str) -> None:
                scope["model"] = name

            request = InferenceRequest(
                model=model, version=message.model_version or None,
                body=ReceivedMessage(message, slot), parse=parse, timeout_s=timeout,
                priority=priority, named=named, arrived=arrived,
            )  # fmt: skip
            del message  # the core reads it, and lets it go once parsed
            answer = await predictor.infer(request)
        finally:
            slot.release()
        started = time.perf_counter()
        response = service_pb2.ModelInferResponse(
            model_name=answer.model, model_version=answer.version, id=request_id
        )
        for output in answer.detail:
            tensor = render(output, answer.predictions, answer.classes, answer.task)
            entry = response.outputs.add(name=tensor.name, datatype=tensor.datatype)
            entry.shape[:] = tensor.shape
            response.raw_output_contents.append(raw_values(tensor))
        answer.observe_stage("serialize", time.perf_counter() - started)
        return response

    # -- the model repository ---------------------------------------------------------------

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        async def answer() -> Any:
            index = service_pb2.RepositoryIndexResponse.ModelIndex
            entries = [entry for entry in self._registry().index()
                       if not request.ready or entry["state"] == "READY"]  # fmt: skip
            return service_pb2.RepositoryIndexResponse(
                models=[
                    index(
                        name=e["name"],
                        version=e.get("version", ""),
                        state=e["state"],
                        reason=e["reason"],
                    )
                    for e in entries
                ]
            )

        return await self._guarded(context, answer)

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        async def answer() -> Any:
            refuse_without_control(self.server.settings)
            if request.parameters:
                raise MalformedTensorError(
                    "this server loads models from its repository: a config or files in the "
                    "request are not supported"
                )
            await self._registry().load(request.model_name)
            return service_pb2.RepositoryModelLoadResponse()

        return await self._guarded(context, answer)

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        async def answer() -> Any:
            refuse_without_control(self.server.settings)
            await self._registry().unload(request.model_name)
            return service_pb2.RepositoryModelUnloadResponse()

        return await self._guarded(context, answer)

    # -- shared ------------------------------------------------------------------------------

    def _registry(self) -> Any:
        return self.server.started().registry

    async def _guarded(
        self,
        context: Any,
        answer: Callable[[], Awaitable[Reply]],
        *,
        scope: dict[str, str] | None = None,
    ) -> Reply:
        """Run ``answer`` (the API key was checked before the call's message was read:
        ``app.grpc.guard``) and turn any error into the call's status (an unexpected one
        logged with the request id, never a traceback to the client)."""
        metadata_ = dict(context.invocation_metadata() or ())
        given = metadata_.get(HEADER)
        request_id = request_id_from(given if isinstance(given, str) else None)
        token = current_request_id.set(request_id)
        try:
            return await answer()
        except Exception as exc:
            await abort_with(context, exc, request_id, scope if scope is not None else {})
        finally:
            current_request_id.reset(token)


def _unimplemented(name: str) -> Callable[[Any, Any, Any], Awaitable[Any]]:
    async def method(self: Any, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"batchserve does not implement {name}")

    method.__name__ = name
    return method


# Every other RPC of the service (model config, streaming, statistics, tracing, logging, shared
# memory) answers UNIMPLEMENTED from a coroutine: the generated base class's synchronous
# defaults would run in a thread pool and end as UNKNOWN.
for _method in service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
    if _method.name not in vars(InferenceService):
        setattr(InferenceService, _method.name, _unimplemented(_method.name))


def _schedule(request: Any, context: Any) -> tuple[float | None, int | None]:
    """The request's timeout (its ``timeout`` parameter in microseconds, and the call's own
    deadline, the earlier of the two) and priority."""
    timeout_us = schedule_parameter("timeout", parameter(request.parameters, "timeout"))
    priority = schedule_parameter("priority", parameter(request.parameters, "priority"))
    timeout = None if timeout_us is None else timeout_us / 1e6
    remaining = context.time_remaining()
    if remaining is not None and math.isfinite(remaining):
        timeout = remaining if timeout is None else min(timeout, remaining)
        timeout = max(timeout, 1e-6)
    return timeout, priority


class ReceivedMessage:
    """A call's message, already received in its slot: read, it is counted against admission
    (as an HTTP body is while it streams in) and the slot goes to the next call."""

    def __init__(self, message: Any, slot: Slot) -> None:
        self._message = message
        self._slot = slot

    async def read(self, reserve: Reserve, limit: int) -> Any:
        # gRPC itself refused a message over its limit (``message_limit``) before it was read.
        try:
            reserve(self._message.ByteSize())
        finally:
            self._slot.release()
        message, self._message = self._message, None
        return message


async def _only_message(requests: AsyncIterator[Any]) -> Any:
    """The call's one request message (a unary call sends exactly one).

    grpc.aio hands a streaming handler its messages from an async generator that stays
    suspended at its ``yield``, the message in its frame, inside reference cycles that only a
    full collection frees: closed at once here, or every received message would stay in
    memory long after its call (measured: 24 calls of 90 MiB grew the process by 1.9 GiB)."""
    messages = aiter(requests)
    try:
        return await anext(messages)
    except StopAsyncIteration:
        raise MalformedTensorError("the call carries no request message") from None
    finally:
        await messages.aclose()  # type: ignore[attr-defined]


def message_limit(settings: Settings) -> int:
    """The largest message a call may send: what one HTTP request may carry
    (``MAX_IMAGE_BYTES``), with room for the message's own fields (names, shapes,
    parameters) around one image of that size. gRPC refuses anything larger itself
    (``RESOURCE_EXHAUSTED``), before it is read."""
    return settings.max_image_bytes + ENVELOPE_BYTES


# Room for the message around the tensors: names, shapes, parameters.
ENVELOPE_BYTES = 64 * 1024
