"""Admission: requests and the encoded bytes they hold are bounded, raw and multipart alike."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest
from PIL import Image

from app.errors import OverloadedError
from app.serving.admission import Admission
from tests import images
from tests.checks import metric
from tests.conftest import make_settings, serve

JPEG = {"content-type": "image/jpeg"}


class FakeQueue:
    def __init__(self) -> None:
        self.queue_depth = 0
        self.queued_cost = 0

    def retry_after_s(self) -> float:
        return 2.5


def test_tickets_count_requests_and_bytes_until_closed() -> None:
    queue = FakeQueue()
    admission = Admission(max_requests=3, max_bytes=1000)
    admission.add("m", queue)
    first = admission.admit("m", 400)
    second = admission.admit("m")
    second.reserve(300)
    second.reserve(200)  # totals only grow: nothing more to reserve
    assert (admission.requests, admission.bytes) == (2, 700)
    with pytest.raises(OverloadedError) as raised:
        admission.admit("m", 301)  # 700 + 301 > 1000
    assert raised.value.headers == {"Retry-After": "3"}
    assert (admission.requests, admission.bytes) == (2, 700)  # the refused one left no trace
    with pytest.raises(OverloadedError):
        second.reserve(601)
    queue.queue_depth, queue.queued_cost = 1, 250  # what the batcher holds counts too
    with pytest.raises(OverloadedError, match="already hold 3 of 3 requests"):
        admission.admit("m")
    first.close()
    first.close()  # idempotent
    assert (admission.requests, admission.bytes) == (2, 550)
    second.close()
    assert (admission.requests, admission.bytes) == (1, 250)


def test_a_flooded_model_cannot_starve_another_of_admission() -> None:
    admission = Admission(max_requests=10, max_bytes=10_000)
    flooded, quiet = FakeQueue(), FakeQueue()
    admission.add("flooded", flooded)
    admission.add("quiet", quiet)
    # Each of two models is guaranteed half of its half: 2.5 requests. The flooded one may
    # take the rest while the quiet one is idle, but not the quiet one's guarantee...
    tickets = [admission.admit("flooded") for _ in range(4)]
    flooded.queue_depth = 3
    assert admission.held("flooded") == (7, 0)
    with pytest.raises(OverloadedError, match=r"kept for other models' guaranteed 2"):
        admission.admit("flooded")
    # ...which the quiet model gets at once, however full the flooded one keeps the queue.
    quiet_tickets = [admission.admit("quiet") for _ in range(2)]
    assert admission.held("quiet") == (2, 0)
    # Bytes alike: 2500 kept for the quiet model, the rest the flooded one may hold.
    with pytest.raises(OverloadedError, match="guaranteed 2500"):
        tickets[0].reserve(7_501)
    tickets[0].reserve(7_500)
    for ticket in tickets + quiet_tickets:
        ticket.close()
    assert (admission.requests, admission.bytes) == (3, 0)  # the flooded queue's three
    # A model with no batcher left no longer takes a share.
    admission.remove("quiet", quiet)
    assert admission.held("quiet") == (0, 0)
    flooded.queue_depth = 0
    alone = [admission.admit("flooded") for _ in range(10)]
    assert admission.requests == 10
    for ticket in alone:
        ticket.close()


def noise_png(side: int, seed: int = 0) -> bytes:
    """Incompressible: a PNG of about ``3 * side * side`` bytes."""
    rng = random.Random(seed)
    return images.png(Image.frombytes("RGB", (side, side), rng.randbytes(3 * side * side)))


class HeldBody:
    """A chunked upload that sends ``head``, then waits until ``release`` to send the rest."""

    def __init__(self, data: bytes, head: int) -> None:
        self.data, self.head = data, head
        self.sent = asyncio.Event()
        self.go = asyncio.Event()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.data[: self.head]
        self.sent.set()
        await self.go.wait()
        yield self.data[self.head :]


async def test_queued_bytes_are_bounded_while_bodies_are_read() -> None:
    image = images.jpeg(images.photo(200, 150), quality=95)
    budget = int(len(image) * 1.6)  # room for one image, not for two
    settings = make_settings(max_image_bytes=budget, max_queue_bytes=budget)
    async with serve(settings) as (_, client):
        held = HeldBody(image, head=len(image) - 100)
        first = asyncio.ensure_future(client.post("/predict", content=held, headers=JPEG))
        await held.sent.wait()
        await asyncio.sleep(0.05)
        text = (await client.get("/metrics")).text
        assert metric(text, "batchserve_admitted_bytes") == len(image) - 100

        # Declared too large for what is left: refused before a byte of it is read.
        refused = await client.post("/predict", content=image, headers=JPEG)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "overloaded"
        assert "bytes" in refused.json()["error"]["message"]
        assert int(refused.headers["retry-after"]) >= 1

        # Chunked, no length: refused as soon as what it sent does not fit.
        async def chunks() -> AsyncIterator[bytes]:
            for start in range(0, len(image), 1000):
                yield image[start : start + 1000]

        cut = await client.post("/predict", content=chunks(), headers=JPEG)
        assert cut.status_code == 503
        assert cut.json()["error"]["code"] == "overloaded"

        # Multipart within the same budget.
        files = {"file": ("a.jpg", image, "image/jpeg")}
        assert (await client.post("/predict", files=files)).status_code == 503

        held.go.set()
        assert (await first).status_code == 200
        assert (await client.post("/predict", content=image, headers=JPEG)).status_code == 200
        assert (await client.post("/predict", files=files)).status_code == 200
        text = (await client.get("/metrics")).text
    assert metric(text, "batchserve_admitted_bytes") == 0
    assert metric(text, 'batchserve_requests_total{outcome="overloaded",route="predict"}') == 3
    assert metric(text, 'batchserve_rejected_requests_total{reason="overloaded"}') == 3


async def test_multipart_uploads_stay_in_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starlette spools file parts over 1 MB to disk; within our limits we never let it."""
    import tempfile

    import starlette.formparsers as formparsers

    rolled: list[int] = []

    class Spool(tempfile.SpooledTemporaryFile[bytes]):
        def rollover(self) -> None:
            rolled.append(self.tell())
            super().rollover()

    monkeypatch.setattr(formparsers, "SpooledTemporaryFile", Spool)
    big = noise_png(700)
    assert len(big) > 1_400_000
    settings = make_settings(max_image_bytes=4 * 1024 * 1024)
    async with serve(settings) as (_, client):
        response = await client.post("/predict", files={"file": ("big.png", big, "image/png")})
    assert response.status_code == 200, response.text
    assert rolled == []


async def test_admitted_requests_are_bounded_in_count(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = make_settings(max_queue_size=1)
    async with serve(settings) as (_, client):
        held = HeldBody(images.jpeg(), head=100)
        first = asyncio.ensure_future(client.post("/predict", content=held, headers=JPEG))
        await held.sent.wait()
        refused = await client.post("/predict", content=images.jpeg(), headers=JPEG)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "overloaded"
        held.go.set()
        assert (await first).status_code == 200
