"""The event loop's CPU per prediction, without sockets: the whole app, and the serving core.

One process loads a model through the app's real lifespan, then, in alternating rounds,
sends ``--requests`` images from ``--clients`` concurrent callers in two ways:

- **app**: ``POST /predict`` through the ASGI app in-process (middleware, routing, the route,
  the serving core), as uvicorn would call it, but without its socket I/O and HTTP parsing;
- **core**: straight to the serving core (admission, decoding, the batcher), as a front end
  calls it.

``time.thread_time()`` of the event loop's thread, divided by the requests, is its CPU per
request: decoding and batches run in other threads and are not counted. The difference is
what the HTTP layers cost the event loop per request.

Usage: ``python -m benchmarks event_loop --model tests.models:color_classifier`` (needs the
``dev`` extra, for asgi-lifespan and the test models).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import uvloop
from asgi_lifespan import LifespanManager
from starlette.types import ASGIApp, Message

from app.main import create_app
from app.serving.inference import InferenceRequest, Inputs, ModelFacts, Parsed, Reserve
from app.serving.predict import Predictor
from app.settings import Settings
from benchmarks.common import command_line, machine, machine_markdown, median, publish, table
from benchmarks.corpus import corpus

HERE = Path(__file__).resolve().parent  # the study's report and its runs


async def through_app(app: ASGIApp, data: bytes) -> None:
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": data, "more_body": False}
        await asyncio.Event().wait()  # the client never hangs up
        raise AssertionError("unreachable")

    started: list[Message] = []

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            started.append(message)

    headers = [(b"host", b"bench"), (b"content-type", b"image/jpeg"),
               (b"content-length", str(len(data)).encode())]  # fmt: skip
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/predict", "raw_path": b"/predict",
             "root_path": "", "query_string": b"", "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "state": {}}  # fmt: skip
    await app(scope, receive, send)
    if started[0]["status"] != 200:
        raise RuntimeError(f"/predict answered {started[0]['status']}")


class _Given:
    """A body already in memory."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def read(self, reserve: Reserve, limit: int) -> bytes:
        reserve(len(self.data))
        return self.data


def _one_image(data: bytes, facts: ModelFacts) -> Parsed:
    return Parsed(Inputs("encoded", [data]))


async def through_core(predictor: Predictor, data: bytes) -> None:
    await predictor.infer(
        InferenceRequest(
            None, None, _Given(data), _one_image, parse_off_loop=False, declared_bytes=len(data)
        )
    )


async def cpu_per_request(send: Callable[[bytes], Awaitable[None]], images: list[bytes],
                          requests: int, clients: int) -> float:  # fmt: skip
    """Microseconds of the event loop's CPU per request."""
    indices = iter(range(requests))

    async def caller() -> None:
        for index in indices:
            await send(images[index % len(images)])

    started = time.thread_time()
    await asyncio.gather(*(caller() for _ in range(clients)))
    return (time.thread_time() - started) / requests * 1e6


async def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    settings = Settings(_env_file=None, model=args.model, weights="none", precision="fp32",
                        backend="torch", max_batch_size=args.batch_size, grpc_port=0,
                        log_level="warning")  # fmt: skip
    images = corpus(None, 64)
    app = create_app(settings)
    samples: dict[str, list[float]] = {"app": [], "core": []}
    async with LifespanManager(app, startup_timeout=600) as manager:
        predictor = app.state.server.started()
        ways: dict[str, Callable[[bytes], Awaitable[None]]] = {
            "app": lambda data: through_app(manager.app, data),
            "core": lambda data: through_core(predictor, data),
        }
        for way in ways.values():  # warm both paths up
            await cpu_per_request(way, images, args.clients * 4, args.clients)
        for _ in range(args.rounds):
            for name, way in ways.items():
                samples[name].append(
                    await cpu_per_request(way, images, args.requests, args.clients)
                )
    return samples


def markdown(data: dict[str, Any]) -> str:
    app, core = median(data["samples"]["app"]), median(data["samples"]["core"])
    rows = [
        ["the whole app (`POST /predict` over ASGI)", app],
        ["the serving core alone", core],
        ["the HTTP layers (the difference)", app - core],
    ]
    return f"""# The event loop's CPU per prediction: {data["model"]}

`python -m benchmarks event_loop --model {data["model"]}`: {data["requests"]} requests per
round from {data["clients"]} concurrent callers, batch {data["batch_size"]}, medians of
{data["rounds"]} alternating rounds in one process. No sockets: uvicorn's own reading,
parsing and writing are not counted.

{table(["path", "event loop µs per request"], rows)}

Rounds (µs): app {", ".join(f"{v:.0f}" for v in data["samples"]["app"])}; core
{", ".join(f"{v:.0f}" for v in data["samples"]["core"])}.

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    parser = command_line(__doc__, __file__)
    parser.add_argument("--model", default="tests.models:color_classifier")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--name", default="event-loop")
    args = parser.parse_args()
    samples = uvloop.run(measure(args))
    data = {"machine": machine(), "model": args.model, "batch_size": args.batch_size,
            "clients": args.clients, "requests": args.requests, "rounds": args.rounds,
            "samples": samples}  # fmt: skip
    publish(args.name, data, markdown(data), folder=HERE)


if __name__ == "__main__":
    main()
