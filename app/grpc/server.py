"""Start and stop the gRPC server inside the app's lifespan.

``grpc.aio`` runs on uvicorn's event loop, so gRPC calls reach the same serving core, admission,
batchers and metrics as HTTP requests, with no thread hand-off. One port per process:
``grpc.so_reuseport`` is off, so that a second process asking for a taken port fails at once
(and says so) rather than silently sharing it. Health (``grpc.health.v1``, which Kubernetes' gRPC
probes call) follows the lifecycle: ``SERVING`` while ready, ``NOT_SERVING`` otherwise, for the
empty service name and ``inference.GRPCInferenceService`` both.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from tritonclient.grpc import service_pb2

from app.grpc.guard import KeyInterceptor
from app.grpc.receiving import ReceiveSlots, receive_slots
from app.grpc.service import ROUTE, InferenceService, message_limit
from app.serving.lifecycle import Phase
from app.serving.server import ServerState
from app.settings import Settings

logger = logging.getLogger("batchserve")

_DESCRIPTOR = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
SERVICE: str = _DESCRIPTOR.full_name
HEALTH: str = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# Calls in progress beyond MAX_QUEUE_SIZE (each inference call holds at least one image):
# room for health, metadata and repository calls. More are refused (RESOURCE_EXHAUSTED).
EXTRA_CALLS = 64
# Streams one HTTP/2 connection may open at once (the protocol's suggested minimum is 100).
STREAMS_PER_CONNECTION = 128


class GrpcBindError(RuntimeError):
    """The gRPC address cannot be listened on."""


def http_host(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The address uvicorn was told to listen on (``--host``, or ``UVICORN_HOST``), else
    uvicorn's own default. The app is not told its address, and uvicorn binds only after the
    lifespan has started, so its command line is where the answer is."""
    argv = sys.argv if argv is None else argv
    environ = os.environ if environ is None else environ
    for index, arg in enumerate(argv):
        if arg == "--host" and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith("--host="):
            return arg.removeprefix("--host=")
    return environ.get("UVICORN_HOST", "127.0.0.1")


def max_calls(settings: Settings) -> int:
    """Calls in progress at once."""
    return settings.max_queue_size + EXTRA_CALLS


def handlers(service: InferenceService) -> dict[str, grpc.RpcMethodHandler]:
    """Every method of the service, each as its generated code would register it, except
    ``ModelInfer``: a stream of (one) request, so that its message is read when the service
    asks for it (``ReceiveSlots``)."""
    registered = {}
    for method in _DESCRIPTOR.methods:
        request = getattr(service_pb2, method.input_type.name)
        response = getattr(service_pb2, method.output_type.name)
        behaviour = getattr(service, method.name)
        if method.name == "ModelInfer":
            kind = grpc.stream_unary_rpc_method_handler
        elif method.client_streaming:
            kind = grpc.stream_stream_rpc_method_handler
        else:
            kind = grpc.unary_unary_rpc_method_handler
        registered[method.name] = kind(
            behaviour,
            request_deserializer=request.FromString,
            response_serializer=response.SerializeToString,
        )
    return registered


def listen_address(settings: Settings) -> str:
    host = settings.grpc_host or http_host()
    return f"[{host}]:{settings.grpc_port}" if ":" in host else f"{host}:{settings.grpc_port}"


class GrpcFrontEnd:
    """The gRPC server of one app: started once the models are ready to be asked about."""

    def __init__(self, server: ServerState, version: str) -> None:
        self._state = server
        self._version = version
        self._server: Any = None
        self._health = health.aio.HealthServicer()
        self._pending: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.port = 0

    async def start(self) -> None:
        """Listen (``GrpcBindError`` when the address is taken or wrong) and serve."""
        settings = self._state.settings
        limit = message_limit(settings)
        metrics = self._state.metrics

        def refused(seconds: float) -> None:
            metrics.count_request(ROUTE, "unauthorized", "", seconds)

        server = grpc.aio.server(
            interceptors=[KeyInterceptor(settings, on_refused_infer=refused)],
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.max_concurrent_streams", STREAMS_PER_CONNECTION),
                ("grpc.http2.bdp_probe", 0),
            ],
            maximum_concurrent_rpcs=max_calls(settings),
        )  # fmt: skip
        receiving = ReceiveSlots(receive_slots(settings, limit))
        methods = handlers(InferenceService(self._state, self._version, receiving))
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, methods),))
        server.add_registered_method_handlers(SERVICE, methods)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection((SERVICE, HEALTH, reflection.SERVICE_NAME), server)
        address = listen_address(settings)
        try:
            self.port = server.add_insecure_port(address)
        except RuntimeError:  # grpcio raises where older versions returned 0
            self.port = 0
        if self.port == 0:
            raise GrpcBindError(
                f"cannot listen for gRPC on {address}: the port is taken or the address is "
                f"wrong (GRPC_PORT, GRPC_HOST; GRPC_PORT=0 turns gRPC off)"
            )
        await server.start()
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._state.lifecycle.subscribe(self._follow)
        logger.info("gRPC on %s", address)

    def _follow(self, phase: Phase) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        status = serving if phase is Phase.READY else health_pb2.HealthCheckResponse.NOT_SERVING
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        # Phases change on the event loop, but a failing engine may report from its thread.
        loop.call_soon_threadsafe(self._set_health, status)

    def _set_health(self, status: Any) -> None:
        for name in ("", SERVICE):
            task = asyncio.ensure_future(self._health.set(name, status))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls, let the accepted ones finish within ``grace_s``, then close."""
        if self._server is None:
            return
        await asyncio.gather(*self._pending, return_exceptions=True)
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace_s)
        self._server = None
