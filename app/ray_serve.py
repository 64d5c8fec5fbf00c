"""batchserve on a Ray cluster: a Ray Serve deployment whose every replica runs the whole ASGI
app (its own batcher, backend and metrics) as the deployment's ingress.

``deploy/ray/serve.yaml`` points ``import_path`` at ``build``, Ray Serve's application builder:
the settings come as ``BATCHSERVE_*`` environment variables (the config's ``runtime_env``), the
replicas' resources, number and autoscaling as the builder's ``args``. Each replica sizes its
threads to the CPUs Ray gave it, answers with headers naming itself and its node, reports
healthy exactly while ``/readyz`` says ready, and on its way out drains as on SIGTERM: Ray stops
routing to it, waits for what it holds (``graceful_shutdown_timeout_s``, the drain budget),
then the lifespan's shutdown runs. Requires the ``ray`` extra (``ray[serve]``).
"""

from __future__ import annotations

import math
import os
from typing import Any

import httpx
import ray
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve import Application
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.settings import Settings, load_settings

# Replica identity on every answer: which replica (and node) served a request.
REPLICA_HEADER = b"x-batchserve-replica"
NODE_HEADER = b"x-batchserve-node"


class ClusterOptions(BaseModel):
    """The builder's ``args``: where replicas run and how many."""

    model_config = ConfigDict(extra="forbid")

    num_cpus: float = Field(1.0, gt=0)
    num_gpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom resources a replica needs, e.g. ``{"batchserve": 1}`` on nodes started with
    ``--resources '{"batchserve": 1}'``: at most one replica per node."""
    num_replicas: int | None = Field(None, ge=1)
    """A fixed count; unset, the replicas autoscale between the two bounds below."""
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float | None = Field(None, gt=0)
    """Unset: two batches' worth (one running, one forming) of ``MAX_BATCH_SIZE``."""
    max_ongoing_requests: int | None = Field(None, ge=1)
    """Unset: ``MAX_QUEUE_SIZE``, the replica's own admission bound (503 past it). Ray's
    default (5) starves the batcher, and any cap the load reaches leaves Ray's router holding
    requests and probing for room with back-off while the replica idles (see
    docs/deployment.md#ray)."""
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)
    health_check_period_s: float = Field(10.0, gt=0)


def deployment_options(settings: Settings, options: ClusterOptions) -> dict[str, Any]:
    """Ray Serve's deployment options for these settings: concurrency in batches, the drain
    budget as the graceful shutdown."""
    batch = settings.max_batch_size
    target = options.target_ongoing_requests or 2.0 * batch
    most = options.max_ongoing_requests or max(settings.max_queue_size, math.ceil(target))
    actor: dict[str, Any] = {"num_cpus": options.num_cpus, "num_gpus": options.num_gpus}
    if options.resources:
        actor["resources"] = options.resources
    chosen: dict[str, Any] = {
        "ray_actor_options": actor,
        "max_ongoing_requests": most,
        "graceful_shutdown_timeout_s": settings.drain_timeout_s,
        "health_check_period_s": options.health_check_period_s,
    }
    if options.num_replicas is not None:
        chosen["num_replicas"] = options.num_replicas
    else:
        chosen["autoscaling_config"] = {
            "min_replicas": options.min_replicas,
            "initial_replicas": max(1, options.min_replicas),
            "max_replicas": max(options.max_replicas, options.min_replicas),
            "target_ongoing_requests": target,
            "upscale_delay_s": options.upscale_delay_s,
            "downscale_delay_s": options.downscale_delay_s,
        }
    return chosen


def replica_settings(settings: Settings, cpus: float) -> Settings:
    """A replica's settings: threads for the CPUs Ray gave it, unless set; no gRPC port of its
    own (replicas of one node would contend for it; Ray's proxy carries HTTP)."""
    share = max(1, math.ceil(cpus))
    return settings.model_copy(
        update={
            "torch_threads": settings.torch_threads or share,
            "decode_workers": settings.decode_workers or share,
            "grpc_port": 0,
        }
    )


class _NamedAnswers:
    """Adds the replica's and its node's names to every HTTP answer."""

    def __init__(self, app: ASGIApp, replica: str, node: str) -> None:
        self.app = app
        self._headers = [(REPLICA_HEADER, replica.encode()), (NODE_HEADER, node.encode())]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *self._headers]
            await send(message)

        await self.app(scope, receive, named)


def _replica_app() -> ASGIApp:
    """Runs in each replica as it starts: batchserve's app for this replica's share."""
    from app.main import create_app

    context = ray.get_runtime_context()
    cpus = context.get_assigned_resources().get("CPU", os.cpu_count() or 1)
    app = create_app(replica_settings(load_settings(), cpus))
    replica = serve.get_replica_context().replica_id.unique_id
    node = ray.util.get_node_ip_address()
    return _NamedAnswers(app, replica, node)


@serve.deployment(name="batchserve")
@serve.ingress(_replica_app)
class BatchServe:
    """One replica: the ASGI app (its lifespan run by Ray Serve), healthy while ready."""

    async def check_health(self) -> None:
        # The app in-process: readiness as a load balancer would see it, with no socket.
        app: ASGIApp = self.app  # type: ignore[attr-defined]  # set by serve.ingress
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
            answer = await client.get("/readyz")
        if answer.status_code != 200:
            raise RuntimeError(f"/readyz answered {answer.status_code}: {answer.text[:200]}")


def build(args: dict[str, Any]) -> Application:
    """Ray Serve's application builder (``import_path: app.ray_serve:build``)."""
    options = ClusterOptions.model_validate(args)
    settings = load_settings()
    deployment: Any = BatchServe  # a Deployment: serve.deployment's result is untyped
    application: Application = deployment.options(**deployment_options(settings, options)).bind()
    return application
