"""The GPU data path's device-agnostic parts, run on the CPU: staging ring, buckets, EXIF
orientation, batched decoding with fallbacks, and the engine's device-decode route.

The same tests run on a GPU where one is present (``@pytest.mark.cuda`` ones only there)."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from app.engine import ImageRequest, InferenceEngine
from app.engine.device import DeviceError, resolve_decode_device
from app.engine.pipeline.graphs import bucket_for
from app.metrics import Metrics
from harness.pipeline_checks import (
    ReportLog,
    concurrent_agreement,
    padding_cost,
    readback_overlap,
)
from preprocessing import InvalidImageError, TransformConfig, decode_cpu, prepare, read_header
from preprocessing import device as device_decode
from preprocessing.decode import apply_orientation
from preprocessing.device import decode_jpegs
from preprocessing.staging import PinnedStaging, host_buffer
from tests import images
from tests.checks import assert_same_prediction
from tests.engines import torch_engine

CPU = torch.device("cpu")


# -- staging ring --------------------------------------------------------------------------


def test_staging_ring_hands_out_each_slot_once() -> None:
    ring = PinnedStaging(lambda index: {"index": index}, size=2)
    first, second = ring.acquire(), ring.acquire()
    assert {first["index"], second["index"]} == {0, 1}
    assert ring.available == 0
    with pytest.raises(TimeoutError):
        ring.acquire(timeout=0.01)
    ring.release(first)
    assert ring.acquire(timeout=0.01) is first
    with pytest.raises(ValueError, match="does not belong"):
        ring.release({"index": 0})
    ring.release(second)
    with pytest.raises(ValueError, match="released twice"):
        ring.release(second)


def test_staging_ring_blocks_until_a_slot_is_released() -> None:
    ring = PinnedStaging(lambda index: [index], size=1)
    slot = ring.acquire()
    got: list[list[int]] = []
    waiter = threading.Thread(target=lambda: got.append(ring.acquire(timeout=5)))
    waiter.start()
    waiter.join(0.05)
    assert got == []
    ring.release(slot)
    waiter.join(5)
    assert got == [slot]


def test_host_buffers() -> None:
    buffer = host_buffer((2, 3), torch.uint8, pinned=False)
    assert buffer.shape == (2, 3)
    assert not buffer.is_pinned()


# -- buckets -------------------------------------------------------------------------------


def test_bucket_for() -> None:
    buckets = (1, 2, 4, 8, 12, 16)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 8, 9, 13, 16)] == [
        1, 2, 4, 8, 8, 12, 16, 16,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="exceeds"):
        bucket_for(17, buckets)


# -- EXIF orientation ----------------------------------------------------------------------


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orientation_matches_pillow(orientation: int) -> None:
    source = images.photo(40, 24, seed=orientation)
    exif = Image.Exif()
    exif[0x0112] = orientation
    tagged = Image.open(io.BytesIO(images.encode(source, "PNG", exif=exif.tobytes())))
    expected = torch.from_numpy(np.array(ImageOps.exif_transpose(tagged)))
    pixels = torch.from_numpy(np.array(source)).permute(2, 0, 1)
    assert torch.equal(apply_orientation(pixels, orientation), expected.permute(2, 0, 1))


# -- batched decoding ----------------------------------------------------------------------


def encoded(data: bytes) -> tuple[bytes, object]:
    return data, read_header(data)


def test_batched_decode_equals_per_image_cpu_decode() -> None:
    batch = [
        images.jpeg(images.photo(64, 48, seed=1)),
        images.with_exif_orientation(images.photo(60, 40, seed=2), 6),
        images.with_exif_orientation(images.photo(50, 30, seed=3), 3),
    ]
    decoded = decode_jpegs([encoded(data) for data in batch], CPU)  # type: ignore[misc]
    assert decoded.fallbacks == 0
    for data, result in zip(batch, decoded.results, strict=True):
        assert isinstance(result, torch.Tensor)
        assert torch.equal(result, decode_cpu(data, read_header(data)))


def test_a_failing_batch_is_retried_per_image_with_a_cpu_fallback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As nvjpeg does with a CMYK image: the batched call fails, then that image alone."""
    cmyk = images.jpeg(images.photo(40, 30, seed=4).convert("CMYK"))
    good = images.jpeg(images.photo(40, 30, seed=5))
    corrupt = good[:600] + b"\x00" * 100
    real = device_decode._decode
    calls: list[int] = []

    def picky(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        calls.append(len(data))
        if any(bytes(tensor[:].numpy()) in (cmyk, corrupt) for tensor in data):
            raise RuntimeError("nvjpeg: unsupported")
        return real(data, device)

    monkeypatch.setattr(device_decode, "_decode", picky)
    decoded = decode_jpegs([encoded(good), encoded(cmyk), encoded(corrupt)], CPU)  # type: ignore[list-item]
    assert calls == [3, 1, 1, 1]  # the batch, then each image on its own
    results = decoded.results
    assert decoded.fallbacks == 2  # the CMYK image decoded, the corrupt one tried
    assert isinstance(results[0], torch.Tensor)
    assert isinstance(results[1], torch.Tensor)  # decoded by the CPU fallback
    assert torch.equal(results[1], decode_cpu(cmyk, read_header(cmyk)))
    assert isinstance(results[2], InvalidImageError)


# -- the engine's device-decode route ------------------------------------------------------


def engine(*, decode_on_device: bool, max_batch_size: int = 8) -> InferenceEngine:
    return torch_engine(
        max_batch_size=max_batch_size, buckets=(1, 2, 4, 8), decode_on_device=decode_on_device
    )


def test_device_decode_route_gives_the_cpu_route_results() -> None:
    pictures = [
        images.jpeg(images.photo(300, 200, seed=7)),
        images.png(images.photo(200, 300, seed=8)),
        images.with_exif_orientation(images.photo(320, 240, seed=9), 8),
        images.jpeg(images.photo(300, 200, seed=10))[:900],  # corrupt: found at batch time
    ]
    on_device = engine(decode_on_device=True)
    on_cpu = engine(decode_on_device=False)
    prepared = [on_device.prepare(data) for data in pictures]
    assert prepared[0].pixels is None  # JPEG bytes kept for the device decoder
    assert prepared[1].pixels is not None  # PNG decoded on the CPU
    results = on_device.run_batch([ImageRequest(image, 12) for image in prepared])
    assert isinstance(results[3], InvalidImageError)
    for data, result in zip(pictures[:3], results[:3], strict=True):
        (reference,) = on_cpu.run_batch([ImageRequest(on_cpu.prepare(data), 12)])
        assert_same_prediction(result, reference)
        assert not isinstance(result, BaseException)
        assert result.batch_size == 3
        assert "device_decode" in result.timings


def test_padding_to_buckets_changes_no_result() -> None:
    exact, padded = engine(decode_on_device=False), engine(decode_on_device=False)
    padded.backend.fixed_shapes = True  # what CUDA graphs need, checked here on the CPU
    requests = [
        ImageRequest(prepare(images.jpeg(images.photo(90, 90, seed=s)), TransformConfig()), 5)
        for s in range(5)  # 5 rows: padded to the bucket of 8
    ]
    for a, b in zip(exact.run_batch(requests), padded.run_batch(requests), strict=True):
        assert not isinstance(a, BaseException)
        assert not isinstance(b, BaseException)
        assert a.classes == b.classes


def test_more_requests_than_the_capacity_are_refused() -> None:
    small = engine(decode_on_device=False, max_batch_size=2)
    request = ImageRequest(prepare(images.jpeg(), TransformConfig()), 1)
    with pytest.raises(ValueError, match="exceed"):
        small.run_batch([request] * 3)


def test_decode_device_setting() -> None:
    assert resolve_decode_device("auto", CPU) is False
    assert resolve_decode_device("cpu", torch.device("cuda")) is False
    assert resolve_decode_device("auto", torch.device("cuda"), lambda device: None) is True
    with pytest.raises(DeviceError, match="needs the model on a CUDA device"):
        resolve_decode_device("cuda", CPU)


# -- on a GPU only -------------------------------------------------------------------------


@pytest.mark.cuda
def test_nvjpeg_decode_is_close_to_cpu_decode() -> None:
    gpu = torch.device("cuda")
    pictures = [images.jpeg(images.photo(640, 480, seed=s), quality=90) for s in range(8)]
    pictures.append(images.with_exif_orientation(images.photo(300, 200, seed=9), 6))
    decoded = decode_jpegs([encoded(data) for data in pictures], gpu)  # type: ignore[misc]
    assert decoded.fallbacks == 0
    for data, result in zip(pictures, decoded.results, strict=True):
        assert isinstance(result, torch.Tensor)
        assert result.device.type == "cuda"
        reference = decode_cpu(data, read_header(data))
        assert result.shape == reference.shape
        assert (result.cpu().float() - reference.float()).abs().mean() < 2.0


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", [False, True])
def test_cuda_engine_matches_the_cpu_engine(graphs: bool) -> None:
    cpu = engine(decode_on_device=False)
    gpu = torch_engine(
        device=torch.device("cuda"), cuda_graphs=graphs, max_batch_size=8, buckets=(1, 2, 4, 8),
        decode_on_device=True,
    )  # fmt: skip
    gpu.warmup()
    assert gpu.backend.describe()["cuda_graphs"] == ([1, 2, 4, 8] if graphs else [])
    assert gpu.pads_to_buckets == graphs  # padding only where captured graphs need it
    pictures = [images.jpeg(images.photo(300, 200, seed=s), quality=95) for s in range(5)]
    results = gpu.run_batch([ImageRequest(gpu.prepare(data), 3) for data in pictures])
    for data, result in zip(pictures, results, strict=True):
        assert not isinstance(result, BaseException)
        stages = {"device_decode", "h2d", "collate", "forward", "postprocess", "d2h"}
        assert stages <= set(result.timings)
        (reference,) = cpu.run_batch([ImageRequest(cpu.prepare(data), 3)])
        assert not isinstance(reference, BaseException)
        assert result.classes[0]["index"] == reference.classes[0]["index"]
        assert result.classes[0]["score"] == pytest.approx(reference.classes[0]["score"], abs=0.02)


def test_device_decode_is_a_stage_of_its_own() -> None:
    metrics = Metrics()
    view = metrics.version("m", "1")
    on_device = torch_engine(decode_on_device=True, buckets=(1, 2, 4, 8), observer=view)
    pictures = [images.jpeg(images.photo(300, 200, seed=s)) for s in range(3)]
    on_device.run_batch([ImageRequest(on_device.prepare(data), 3) for data in pictures])

    def count(stage: str) -> float | None:
        labels = {"stage": stage, "model": "m", "version": "1"}
        return metrics.registry.get_sample_value("batchserve_stage_seconds_count", labels)

    assert count("device_decode") == 1  # once per batch
    assert count("decode") == 0  # the per-request CPU decode did not happen


def test_pipeline_checks_run_on_the_cpu() -> None:
    log = ReportLog()
    cpu = torch_engine(max_batch_size=4, buckets=(1, 2, 4), observer=log, max_inflight_batches=2)
    pictures = [images.jpeg(images.photo(120, 90, seed=s)) for s in range(6)]
    overlap = readback_overlap(cpu, log, pictures, batch_size=3, batches=4)
    assert overlap["batches"] == 4
    assert overlap["readback_contiguous"]
    assert not overlap["readback_pinned"]  # pinned memory only pays (and exists) with CUDA
    agreement = concurrent_agreement(cpu, pictures, batch_size=3, batches=4)
    assert agreement["same_top1"] == agreement["images"] == 12
    cost = padding_cost(cpu, 3, repeats=2)
    assert (cost["rows"], cost["bucket"]) == (3, 4)


@pytest.mark.cuda
def test_readback_is_pinned_contiguous_and_never_serialises_two_batches() -> None:
    """Batch N+1's forward pass is queued before batch N's results are back on the host."""
    log = ReportLog()
    gpu = torch_engine(
        "resnet50", torch.float16, device=torch.device("cuda"), max_batch_size=32,
        buckets=(32,), decode_on_device=True, max_inflight_batches=2, observer=log,
    )  # fmt: skip
    gpu.warmup()
    pictures = [images.jpeg(images.photo(640, 480, seed=s), quality=90) for s in range(32)]
    overlap = readback_overlap(gpu, log, pictures, batch_size=32, batches=10)
    assert overlap["readback_pinned"]
    assert overlap["readback_contiguous"]
    assert overlap["overlapping_pairs"] >= overlap["pairs"] - 1, overlap


@pytest.mark.cuda
def test_concurrent_batches_on_the_gpu_give_the_answers_of_sequential_ones() -> None:
    gpu = torch_engine(
        "resnet18", torch.float16, device=torch.device("cuda"), max_batch_size=16,
        buckets=(16,), decode_on_device=True, max_inflight_batches=2,
    )  # fmt: skip
    gpu.warmup()
    pictures = [images.jpeg(images.photo(500, 375, seed=s), quality=90) for s in range(48)]
    agreement = concurrent_agreement(gpu, pictures, batch_size=16, batches=12)
    assert agreement["same_top1"] == agreement["images"]
    assert agreement["max_top1_score_difference"] < 1e-3
