"""A batch in parts side by side on a CPU (``backends.sharded``, ``SHARDS``): each part on its
own thread with its share of torch's threads, joined in order into what the batch answers
whole; batches smaller than the parts run whole; ``SHARDS=auto`` measured, kept, and
refused where a backend cannot split."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from app.engine import build_engine
from app.engine.backends import Backend, ShardedBackend
from app.engine.backends.sharded import joined
from app.engine.errors import StartupError
from app.engine.machine import Machine, fixed_rates
from app.engine.sharding import FOLDER, parts_wanted
from app.settings import SettingsError, load_settings
from tests.conftest import make_settings, serve
from tests.test_tasks import DETECTOR, SHAPES, SIZE, outputs_of, picture, tolerance, v2_body


class Recording(Backend):
    """Answers each row's sum, and records each call: its rows, thread, torch's threads there
    and whether inference mode was on. With ``side_by_side``, every call waits for the others
    of its batch: calls made one after the other never get past the barrier."""

    name = "recording"

    def __init__(self, side_by_side: threading.Barrier | None = None) -> None:
        self.device = torch.device("cpu")
        self.input_dtype = torch.float32
        self.precision = "fp32"
        self.calls: list[tuple[int, str, int, bool]] = []
        self.side_by_side = side_by_side

    def forward(self, batch: torch.Tensor, sizes: Any = None) -> torch.Tensor:
        self.calls.append((batch.shape[0], threading.current_thread().name,
                           torch.get_num_threads(), torch.is_inference_mode_enabled()))  # fmt: skip
        if self.side_by_side is not None:
            self.side_by_side.wait()
        return batch.sum(dim=(1, 2, 3))[:, None]


def rows(count: int) -> torch.Tensor:
    return torch.arange(count, dtype=torch.float32).view(count, 1, 1, 1).expand(count, 3, 2, 2)


def test_a_batch_runs_in_parts_side_by_side_each_with_its_share_of_torchs_threads() -> None:
    whole, part = Recording(), Recording(threading.Barrier(2, timeout=10))
    sharded = ShardedBackend(whole, part, shards=2, threads_each=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            answer = sharded.forward(rows(7))
        assert torch.get_num_threads() == 2  # the batch's thread gets its count back
    finally:
        torch.set_num_threads(threads)
    assert answer.squeeze(1).tolist() == [12.0 * row for row in range(7)]  # in order
    assert whole.calls == []
    # Four pieces (twice as many as threads), each taken by whichever thread is free.
    assert sorted(rows for rows, _, _, _ in part.calls) == [1, 2, 2, 2]
    assert {name.split("_")[0] for _, name, _, _ in part.calls} == {"MainThread", "shard"}
    assert {(threads, inference) for _, _, threads, inference in part.calls} == {(1, True)}


def test_a_batch_smaller_than_the_parts_runs_whole_on_every_thread() -> None:
    whole, part = Recording(), Recording()
    sharded = ShardedBackend(whole, part, shards=2, threads_each=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        sharded.forward(rows(1))
    finally:
        torch.set_num_threads(threads)
    assert part.calls == []
    assert [(rows, threads) for rows, _, threads, _ in whole.calls] == [(1, 2)]


class FailsFirst(Recording):
    """The batch's own thread fails once the pool's has started a piece, which takes a while
    and says when it has ended."""

    def __init__(self) -> None:
        super().__init__()
        self.started, self.ended = threading.Event(), threading.Event()

    def forward(self, batch: torch.Tensor, sizes: Any = None) -> torch.Tensor:
        if threading.current_thread() is threading.main_thread():
            assert self.started.wait(timeout=10)
            raise ValueError("a piece failed")
        self.calls.append((batch.shape[0], threading.current_thread().name, 1, True))
        self.started.set()
        time.sleep(0.3)
        self.ended.set()
        return batch.sum(dim=(1, 2, 3))[:, None]


def test_a_failed_piece_fails_the_batch_once_every_piece_has_ended() -> None:
    """The batch's memory goes back to the engine when ``forward`` returns: no piece may
    still be reading it; and once one has failed, no further piece is started."""
    part = FailsFirst()
    sharded = ShardedBackend(Recording(), part, shards=2, threads_each=1)
    with pytest.raises(ValueError, match="a piece failed"):
        sharded.forward(rows(8))
    assert part.ended.is_set()
    assert len(part.calls) == 1  # the pool's thread took its first piece, and no other


def test_parts_outputs_join_as_the_whole_batchs() -> None:
    # A detector's padded (boxes, scores, labels): each part as wide as its most boxes.
    first = (torch.ones(2, 1, 4), torch.full((2, 1), 0.75), torch.ones(2, 1, dtype=torch.int64))
    second = (torch.ones(1, 3, 4), torch.full((1, 3), 0.5), torch.full((1, 3), 2))
    boxes, scores, labels = joined([first, second])
    assert boxes.shape == (3, 3, 4)
    assert scores.tolist() == [[0.75, 0, 0], [0.75, 0, 0], [0.5, 0.5, 0.5]]  # 0 pads
    assert labels.dtype == torch.int64
    assert labels.tolist() == [[1, 0, 0], [1, 0, 0], [2, 2, 2]]
    assert joined([[{"a": 1}], [{"a": 2}, {"a": 3}]]) == [{"a": 1}, {"a": 2}, {"a": 3}]
    out = joined([{"out": torch.zeros(1, 2)}, {"out": torch.ones(2, 2)}])
    assert out["out"].tolist() == [[0, 0], [1, 1], [1, 1]]
    with pytest.raises(TypeError, match="cannot join"):
        joined(["text"])


@pytest.mark.parametrize("backend", ["torch", "onnxruntime", "openvino"])
async def test_boxes_of_a_batch_in_parts_are_each_images_own(tmp_path: Path, backend: str) -> None:
    """Four images of different sizes in one request: one batch, two parts of two images on
    two threads, each image's box in its own pixels, as the batch answers it whole."""
    settings = make_settings(model=DETECTOR, task="detect", image_size=SIZE, backend=backend,
                             artifacts_dir=tmp_path, shards=2, torch_threads=2)  # fmt: skip
    async with serve(settings) as (_, client):
        (served,) = (await client.get("/v1/models")).json()["models"]
        assert served["backend"]["shards"]["count"] == 2
        assert served["backend"]["shards"]["threads_each"] == 1
        assert served["backend"]["shards"]["reason"] == "SHARDS=2"
        pictures = [picture(size, box) for size, box in SHAPES] + [picture((90, 40), None)]
        found = outputs_of(await client.post("/v2/models/bright_box_detector/infer",
                                             content=v2_body(*pictures)))  # fmt: skip
    assert found["num_detections"]["data"] == [2, 2, 2, 0]
    boxes = np.array(found["boxes"]["data"]).reshape(4, 2, 4)
    for row, (size, box) in enumerate(SHAPES):
        np.testing.assert_allclose(boxes[row, 0], box, atol=tolerance(size))
        np.testing.assert_allclose(boxes[row, 1], [0, 0, *size], atol=tolerance(size))


async def test_a_classifier_in_parts_answers_what_it_answers_whole(tmp_path: Path) -> None:
    from tests import images

    pictures = [images.jpeg(images.photo(200, 150, seed=seed)) for seed in range(5)]
    answers = []
    for shards in (1, 2):
        settings = make_settings(backend="onnxruntime", artifacts_dir=tmp_path, shards=shards,
                                 torch_threads=2)  # fmt: skip
        async with serve(settings) as (_, client):
            body = v2_body(*pictures, classification=3)
            response = await client.post("/v2/models/color_classifier/infer", content=body)
            answers.append(outputs_of(response))
    whole, parts = answers
    assert whole.keys() == parts.keys()
    for name, output in whole.items():
        assert output["shape"] == parts[name]["shape"]
        assert output["data"] == parts[name]["data"]


def auto(tmp_path: Path, **overrides: Any) -> Any:
    return make_settings(backend="onnxruntime", artifacts_dir=tmp_path, shards="auto",
                         torch_threads=2, **overrides).own_model()  # fmt: skip


def kept(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / FOLDER).glob("*.json"))


def never(*args: object) -> float:
    raise AssertionError("measured again")


def test_shards_auto_splits_a_batch_when_its_parts_measure_faster_and_remembers(
    tmp_path: Path,
) -> None:
    machine = fixed_rates(lambda backend: 200.0 if isinstance(backend, ShardedBackend) else 100.0)
    engine = build_engine(auto(tmp_path), machine=machine)
    assert isinstance(engine.backend, ShardedBackend)
    shards = engine.backend.describe()["shards"]
    assert (shards["count"], shards["threads_each"]) == (2, 1)
    assert shards["rates"] == {"whole": 100.0, "2 parts": 200.0}
    assert shards["reason"] == "faster in parts beyond the noise"
    assert engine.check is not None
    assert engine.check["passed"]  # the artefact's check, whichever way it runs
    assert len(kept(tmp_path)) == 1
    again = build_engine(auto(tmp_path), machine=Machine(native_bf16=False, rate=never))
    assert isinstance(again.backend, ShardedBackend)
    assert again.backend.describe()["shards"]["reused"]
    with pytest.raises(AssertionError, match="measured again"):  # another batch: measured
        build_engine(auto(tmp_path, max_batch_size=4), machine=Machine(False, never))


def test_shards_auto_runs_whole_batches_when_parts_are_no_faster(tmp_path: Path) -> None:
    slower = fixed_rates(lambda backend: 50.0 if isinstance(backend, ShardedBackend) else 100.0)
    engine = build_engine(auto(tmp_path), machine=slower)
    assert not isinstance(engine.backend, ShardedBackend)
    assert "shards" not in engine.backend.describe()
    assert len(kept(tmp_path)) == 1  # beyond the noise: kept
    again = build_engine(auto(tmp_path), machine=Machine(native_bf16=False, rate=never))
    assert not isinstance(again.backend, ShardedBackend)

    other = tmp_path / "noisy"
    # The parts' median is higher, but by less than their rounds vary.
    rounds = {False: iter([100.0] * 5), True: iter([110.0, 80.0, 120.0, 90.0, 105.0])}
    noisy = fixed_rates(lambda backend: next(rounds[isinstance(backend, ShardedBackend)]))
    engine = build_engine(auto(other), machine=noisy)
    assert not isinstance(engine.backend, ShardedBackend)
    assert len(kept(other)) == 1  # whole, the simpler: not measured at every start


class Placed(Recording):
    def __init__(self, device: str = "cpu", fixed_shapes: bool = False) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.fixed_shapes = fixed_shapes


def test_how_many_parts_shards_asks_for_and_what_it_refuses() -> None:
    def config(**overrides: Any) -> Any:
        return make_settings(**overrides).own_model()

    cpu = Placed()
    assert parts_wanted(config(shards="auto", torch_threads=2), cpu, rows=8) == 2
    assert parts_wanted(config(shards="auto", torch_threads=16), cpu, rows=8) == 8
    assert parts_wanted(config(shards="auto", torch_threads=1), cpu, rows=8) == 1
    assert parts_wanted(config(shards="auto", torch_threads=2), cpu, rows=1) == 1  # unbatched
    assert parts_wanted(config(shards="auto", torch_threads=2), Placed("cuda"), rows=8) == 1
    assert parts_wanted(config(shards="auto", torch_threads=2), Placed(fixed_shapes=True),
                        rows=8) == 1  # fmt: skip
    assert parts_wanted(config(shards=2, torch_threads=4), cpu, rows=8) == 2
    with pytest.raises(StartupError, match="SHARDS=2: on a GPU a batch runs whole"):
        parts_wanted(config(shards=2, torch_threads=2), Placed("cuda"), rows=8)
    with pytest.raises(StartupError, match="pads every batch to a bucket"):
        parts_wanted(config(shards=2, torch_threads=2), Placed(fixed_shapes=True), rows=8)
    with pytest.raises(StartupError, match="SHARDS=3 exceeds the 2 threads"):
        parts_wanted(config(shards=3, torch_threads=2), cpu, rows=8)
    with pytest.raises(StartupError, match="exceeds MAX_BATCH_SIZE=1"):
        parts_wanted(config(shards=2, torch_threads=2, max_batch_size=1), cpu, rows=1)


def test_shards_is_auto_or_a_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCHSERVE_SHARDS")  # which the tests set to 1 unless they ask
    assert load_settings().shards == "auto"
    monkeypatch.setenv("BATCHSERVE_SHARDS", "3")
    assert load_settings().shards == 3
    monkeypatch.setenv("BATCHSERVE_SHARDS", "0")
    with pytest.raises(SettingsError, match="BATCHSERVE_SHARDS"):
        load_settings()
