"""The benchmark tools' own logic, on tiny models: they must measure what they claim."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from benchmarks import accuracy, commits, gpu_check, offline, sweep
from benchmarks.corpus import generate, load
from benchmarks.loadgen import LoadSpec, run
from benchmarks.studies.handoff import study as handoff
from harness.promtext import ServerDelta, parse
from harness.servers import ROOT
from preprocessing import read_header
from tests import images
from tests.conftest import COLOR_MODEL, make_settings, serve


@contextlib.asynccontextmanager
async def clients(count: int) -> AsyncIterator[list[httpx.AsyncClient]]:
    async with serve(make_settings(max_batch_size=8, max_queue_delay_ms=5)) as (app, _):
        transport = httpx.ASGITransport(app=app)
        async with contextlib.AsyncExitStack() as stack:
            yield [
                await stack.enter_async_context(
                    httpx.AsyncClient(transport=transport, base_url="http://bench")
                )
                for _ in range(count)
            ]


@pytest.mark.slow
async def test_loadgen_closed_and_open_loop() -> None:
    images = generate(4)
    async with clients(8) as pool:
        closed = await run(pool, images, LoadSpec(concurrency=8, warmup_s=0.3, duration_s=1.0))
        opened = await run(pool, images, LoadSpec(None, rate=30, warmup_s=0.3, duration_s=1.5))
    for report in (closed, opened):
        assert report["ok"] > 0
        assert report["errors"] == {}
        assert 0 < report["latency_ms"]["p50"] <= report["latency_ms"]["p99"]
        assert report["latency_ms"]["p99"] <= report["latency_ms"]["max"]
        assert report["server"]["mean_batch_size"] >= 1
        assert report["server"]["outcomes"]["ok"] >= report["ok"]
    assert closed["mode"] == "closed"
    assert opened["mode"] == "open"
    # Poisson arrivals at 30/s for 1.5 s: about 45 requests, not a closed loop's hundreds.
    assert 15 <= opened["completed"] <= 90


def test_server_delta_from_two_scrapes() -> None:
    before = parse(
        "batchserve_batch_size_count 2\nbatchserve_batch_size_sum 6\n"
        'batchserve_batch_size_bucket{le="4.0"} 1\nbatchserve_batch_size_bucket{le="8.0"} 2\n'
        "batchserve_device_busy_seconds_total 1\n"
        'batchserve_requests_total{outcome="ok",route="predict"} 6\n'
    )
    after = parse(
        "batchserve_batch_size_count 6\nbatchserve_batch_size_sum 30\n"
        'batchserve_batch_size_bucket{le="4.0"} 2\nbatchserve_batch_size_bucket{le="8.0"} 6\n'
        "batchserve_device_busy_seconds_total 3\n"
        'batchserve_requests_total{outcome="ok",route="predict"} 30\n'
        'batchserve_stage_seconds_count{stage="forward"} 4\n'
        'batchserve_stage_seconds_sum{stage="forward"} 0.2\n'
    )
    summary = ServerDelta(before, after, seconds=4.0).summary()
    assert summary["mean_batch_size"] == 6
    assert summary["device_busy_ratio"] == 0.5
    assert summary["batch_size_histogram"] == {"4": 1, "8": 3}
    assert summary["mean_stage_ms"]["forward"] == pytest.approx(50)
    assert summary["outcomes"] == {"ok": 24}


def test_offline_measures_positive_rates() -> None:
    engine = offline.make_engine(COLOR_MODEL, "fp32", 4)
    images = generate(6)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        assert offline.forward_only(engine, 4, 0.2) > 0
        assert offline.sequential(engine, images, 4, 0.2, pool) > 0
        assert offline.pipelined(engine, images, 4, 0.2, pool) > 0


def test_sweep_answers_the_best_configuration_for_a_target() -> None:
    def row(name: str, throughput: float, p99: float, errors: dict[str, int] | None = None) -> Any:
        return {"name": name, "throughput": throughput, "latency_ms": {"p99": p99},
                "errors": errors or {}, "ok": 10}  # fmt: skip

    rows = [row("off", 40, 50), row("a", 70, 90), row("b", 90, 140), row("c", 95, 80, {"503": 3})]
    best = sweep.best_for(rows, 100)
    assert best is not None
    assert best["name"] == "a"  # c is faster but failed requests
    assert sweep.best_for(rows, 10) is None
    # Equal throughput (within 2%): the lower p99 wins.
    tied = [row("d", 70.5, 95), row("e", 70, 60), row("f", 60, 40)]
    assert sweep.best_for(tied, 100)["name"] == "e"  # type: ignore[index]


def test_corpus_loads_a_folder(tmp_path: Path) -> None:
    for index, data in enumerate(generate(3)):
        (tmp_path / f"{index}.jpg").write_bytes(data)
    (tmp_path / "notes.txt").write_text("not an image")
    assert len(load(tmp_path)) == 3


# -- accuracy gate -------------------------------------------------------------------------


def test_accuracy_gate_passes_close_precisions_and_fails_impossible_bounds() -> None:
    base = ["--model", COLOR_MODEL, "--count", "24", "--batch-size", "8"]
    assert accuracy.main(base) == 0
    assert accuracy.main([*base, "--max-prob-diff", "0"]) == 1


def test_the_accuracy_gates_default_reference_is_eager_pytorch_in_fp32() -> None:
    args = accuracy.parser().parse_args(["--model", COLOR_MODEL, "--count", "8"])
    report, _ = accuracy.run(args)
    assert report["reference"] == "torch eager, fp32"  # not what BACKEND=auto would pick


def test_accuracy_with_labelled_folders(tmp_path: Path) -> None:
    images = generate(24)
    reference = accuracy.engine_for(
        COLOR_MODEL, "none", {"precision": "fp32", "compile": "none"}, 8
    )
    samples = [accuracy.Sample(str(i), data) for i, data in enumerate(images)]
    probabilities = accuracy.predict_all(reference, samples, 8)
    for index, (data, row) in enumerate(zip(images, probabilities, strict=True)):
        # Every 4th image gets a wrong label: the least likely class.
        truth = int(row.argmax()) if index % 4 else int(row.argmin())
        folder = tmp_path / str(truth)
        folder.mkdir(exist_ok=True)
        (folder / f"{index}.jpg").write_bytes(data)
    args = accuracy.parser().parse_args(
        ["--model", COLOR_MODEL, "--images", str(tmp_path), "--batch-size", "8"]
    )
    report, failures = accuracy.run(args)
    assert report["labelled"]
    assert report["reference_top1"] == pytest.approx(18 / 24)
    assert report["candidate_top1"] == pytest.approx(18 / 24, abs=1 / 24)
    assert failures == []


# -- the GPU check in its degraded CPU mode ------------------------------------------------


@pytest.mark.slow
def test_gpu_check_runs_degraded_without_cuda(tmp_path: Path) -> None:
    code = gpu_check.main(
        ["--smoke", "--skip-tests", "--model", COLOR_MODEL, "--out", str(tmp_path)]
    )
    assert code == 0
    report = (tmp_path / "gpu_check.md").read_text()
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    if data["mode"] == "full":
        pytest.skip("CUDA is present: the full check ran")
    assert "degraded" in report
    assert data["decode"] == data["graphs"] == gpu_check.SKIPPED
    assert data["precision"]["top1_agreement"] >= 0.9
    assert {row["batch_size"] for row in data["offline"]} == {1, 4}
    assert data["served"]["closed"]["ok"] > 0
    assert data["served"]["open_70"]["mode"] == "open"
    assert data["served"]["open_70"]["ok"] > 0
    assert data["served_over_limit"] > 0
    assert data["failures"] == {}
    assert (tmp_path / "gpu_check_trace.json.gz").stat().st_size > 0
    assert "## 8. Profile" in report


async def test_the_multipart_body_the_peer_benchmark_sends_is_one_file_field() -> None:
    from benchmarks.wrk import _BOUNDARY, form_body

    image = images.jpeg(images.solid((200, 30, 30)))
    headers = {"content-type": f"multipart/form-data; boundary={_BOUNDARY}"}
    async with serve(make_settings()) as (_, client):
        raw = await client.post("/predict", content=image, headers={"content-type": "image/jpeg"})
        form = await client.post("/predict", content=form_body(image), headers=headers)
    assert form.status_code == 200, form.text
    assert form.json()["predictions"] == raw.json()["predictions"]


def test_the_served_profile_counts_each_threads_cpu_and_names_its_role() -> None:
    import os
    import threading
    import time

    from benchmarks import served_profile

    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    worker = threading.Thread(target=spin)
    before = served_profile.thread_ticks(os.getpid())
    worker.start()
    time.sleep(0.5)
    after = served_profile.thread_ticks(os.getpid())
    stop.set()
    worker.join()
    assert worker.native_id in after
    assert after[worker.native_id] - before.get(worker.native_id, 0) > 0  # it used the CPU
    assert served_profile.role("MainThread") == "event loop"
    assert served_profile.role("decode_1") == "decode threads"
    assert served_profile.role("run-batch_0") == "batch threads"
    assert served_profile.role("shard_0") == "batch parts' threads"
    assert served_profile.role(None) == "runtime threads (intra-op pool)"
    assert served_profile.package("guarded (app/http/calls.py:40)") == (
        "batchserve middleware and HTTP helpers"
    )
    assert served_profile.package("send (uvicorn/protocols/http/httptools_impl.py:524)") == (
        "uvicorn"
    )


def test_the_served_profile_counts_the_load_generators_cpu_too() -> None:
    import subprocess
    import time

    from benchmarks import served_profile

    busy = subprocess.Popen(["sh", "-c", "while :; do :; done"])  # as wrk: a child process
    try:
        time.sleep(0.1)
        assert served_profile.children_named("sh") == [busy.pid]
        before = served_profile.process_ticks([busy.pid])
        time.sleep(0.5)
        assert served_profile.process_ticks([busy.pid]) - before > 0
    finally:
        busy.kill()
        busy.wait()
    assert served_profile.process_ticks([busy.pid]) == 0  # gone: counts nothing


def test_the_resize_benchmarks_alternatives_make_the_served_image() -> None:
    import numpy as np

    from app.engine.warmup import synthetic_photo
    from benchmarks.studies.resize import study as resize

    image = torch.from_numpy(np.array(synthetic_photo(400, 300, 0))).permute(2, 0, 1)
    served = resize.served(image)
    assert tuple(served.shape) == (3, 256, 341)
    for name, method in resize.METHODS.items():
        resized = method(image)
        assert resized.shape == served.shape, name
        assert resized.dtype == torch.uint8, name
        # Every method makes the same picture, up to a few pixel values.
        assert (resized.float() - served.float()).abs().mean() < 4, name


def test_the_decode_benchmarks_ways_scale_as_they_say() -> None:
    from benchmarks.studies.decode import study as decode

    sizes = {}
    for width, height in ((640, 480), (1024, 768), (4032, 3024)):
        (data,) = decode.jpegs(width, height, 1)
        header = read_header(data)
        sizes[width] = {way: tuple(way_of(data, header).shape[1:])
                        for way, way_of in decode.WAYS.items()}  # fmt: skip
    # Below four times the target the server decodes whole; from twice it the cheaper way
    # scales down to the target (never below it), and the fast IDCT scales as served.
    assert sizes[640] == dict.fromkeys(decode.WAYS, (480, 640))
    assert sizes[1024] == {"whole": (768, 1024), "served": (768, 1024),
                           "from twice": (384, 512), "fast IDCT": (768, 1024)}  # fmt: skip
    assert sizes[4032] == {"whole": (3024, 4032), "served": (756, 1008),
                           "from twice": (378, 504), "fast IDCT": (756, 1008)}  # fmt: skip


def test_commits_compares_each_round_with_the_first_commits_same_round() -> None:
    def sample(served: float, pipelined: float) -> dict[str, float]:
        return {"forward": 2 * pipelined, "pipelined": pipelined, "served": served,
                "one_client_p50_ms": 10.0}  # fmt: skip

    # The machine slows down over the rounds; the change is worth 1.2x in each of them.
    samples = {
        "old": {"int8": [sample(100, 120), sample(50, 60), sample(80, 90)]},
        "new": {"int8": [sample(120, 120), sample(60, 60), sample(96, 90)]},
    }
    compared = commits.compare(samples, ["old", "new"])["int8"]
    assert compared["new"]["served_vs_first"] == pytest.approx(1.2)
    assert compared["old"]["served_vs_first"] == 1.0
    assert compared["new"]["served_vs_limit"] == pytest.approx(1.0)
    assert compared["old"]["served_vs_limit"] == pytest.approx(100 / 120)
    assert compared["new"]["served"] == 96  # a median of the rounds, not a ratio
    # The forward pass is the same code at both: its ratio shows only the machine's drift.
    assert compared["new"]["forward_vs_first"] == pytest.approx(1.0)


def test_commits_alternate_their_order_between_rounds() -> None:
    assert commits.round_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert commits.round_order(["a", "b", "c"], 1) == ["c", "b", "a"]
    assert commits.round_order(["a", "b"], 2) == ["a", "b"]


def test_handoff_measures_both_ways_in_alternating_rounds() -> None:
    import argparse

    import uvloop

    args = argparse.Namespace(jobs=200, clients=8, rounds=2)
    samples = uvloop.run(handoff.measure(args))
    assert {name: len(values) for name, values in samples.items()} == {
        "run_in_executor": 2, "LoopThreads": 2,
    }  # fmt: skip
    assert all(value > 0 for values in samples.values() for value in values)
    text = handoff.markdown({"machine": {}, "jobs": 200, "clients": 8, "rounds": 2,
                             "samples": samples})  # fmt: skip
    assert "| `loop.run_in_executor` (a `ThreadPoolExecutor`) |" in text


def test_a_cold_start_beside_another_revision_is_judged_round_by_round() -> None:
    from benchmarks.coldstart import paired_ratios

    samples = {
        "resnet18 batchserve openvino cached": [2.0, 1.0],
        "resnet18 batchserve openvino cached at abc1234": [4.0, 1.0],
        "resnet18 litserve": [6.0, 6.0],
    }
    # Each round's own ratio (0.5, then 1.0), not the ratio of the medians (1.5 / 2.5).
    assert paired_ratios(samples, "abc1234") == {"resnet18 batchserve openvino cached": 0.75}


@pytest.mark.slow
def test_the_paired_limit_counts_the_pipeline_only_while_it_runs() -> None:
    from benchmarks.compare import server_env
    from benchmarks.served_vs_limit import Pipeline

    settings = {**server_env(COLOR_MODEL, "fp32", 4), "BATCHSERVE_BACKEND": "torch"}
    with Pipeline(settings) as pipeline:
        assert pipeline.images_per_second(0.3) > 0
        # Stopped between its slices: it takes no CPU and finishes no batch.
        assert pipeline.state() == "T"
        finished = pipeline.done.get_obj()[0]  # without the lock, which it may hold
        time.sleep(0.3)
        assert pipeline.done.get_obj()[0] == finished
        assert pipeline.images_per_second(0.3) > 0


def test_two_configurations_are_judged_pair_by_pair() -> None:
    from benchmarks import served_ab

    pairs = [{"a": 100.0, "b": 110.0}, {"a": 50.0, "b": 40.0}, {"a": 200.0, "b": 210.0}]
    # Each pair's own ratio (1.1, 0.8, 1.05), not the ratio of the totals (360 / 350).
    assert served_ab.summary(pairs) == {"median_ratio": 1.05, "min_ratio": 0.8,
                                        "max_ratio": 1.1, "b_won": 2}  # fmt: skip
    text = served_ab.markdown({"machine": {}, "model": "m", "precision": "fp32",
                               "batch_size": 8, "clients": 64, "set": [], "b": ["x=1"],
                               "b_env": [], "seconds": 3.0, "pairs": pairs,
                               "summary": served_ab.summary(pairs)})  # fmt: skip
    assert "B / A: **1.050**" in text
    assert "B faster in 2 of\n3" in text


def test_the_b_server_can_log_access_as_make_serve_does() -> None:
    from benchmarks import served_ab
    from harness.servers import UvicornProcess

    for access_log in (False, True):
        server = UvicornProcess({}, access_log=access_log)
        server.stop()  # never started: closes its log file
        assert ("--no-access-log" in server.command) is not access_log
    pairs = [{"a": 100.0, "b": 99.0}]
    text = served_ab.markdown({"machine": {}, "model": "m", "precision": "fp32",
                               "batch_size": 8, "clients": 64, "set": [], "b": [],
                               "b_env": [], "b_access_log": True, "seconds": 3.0,
                               "pairs": pairs, "summary": served_ab.summary(pairs)})  # fmt: skip
    assert "--b-access-log" in text
    assert "B: A with uvicorn's access log on" in text


def test_a_slice_that_fails_stops_its_load_at_once() -> None:
    from benchmarks.served_vs_limit import load

    started = time.monotonic()
    with pytest.raises(RuntimeError), load(["sleep", "30"]):
        raise RuntimeError("the scrape failed")
    assert time.monotonic() - started < 10  # not left to run its 30 s


def test_the_busy_ratio_counts_overlapping_kernels_once() -> None:
    from benchmarks.profile import busy_ratio

    # Two streams: 0-10 and 5-15 overlap (15 us busy), 20-30 alone, 22-25 inside it.
    kernels = [(20.0, 30.0), (0.0, 10.0), (5.0, 15.0), (22.0, 25.0)]
    assert busy_ratio(kernels, wall_s=50e-6) == pytest.approx(25 / 50)
    assert busy_ratio([], wall_s=1.0) == 0


def test_a_failing_step_is_recorded_and_the_rest_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report exists after each step: a step that raises leaves its failure in it, and
    every later step still runs."""
    ran: list[str] = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        ran.append("pipeline")
        assert (tmp_path / "gpu_check.json").is_file()  # the earlier steps' report is there
        raise RuntimeError("no such stream")

    def quick(name: str) -> Any:
        def step(*args: Any, **kwargs: Any) -> Any:
            ran.append(name)
            return {"ok": name}

        return step

    monkeypatch.setattr(gpu_check, "precision_agreement", quick("precision"))
    monkeypatch.setattr(gpu_check, "pipeline", failing)
    monkeypatch.setattr(offline, "measure", lambda *a, **k: [])
    monkeypatch.setattr(gpu_check, "runtimes", lambda *a, **k: [])
    monkeypatch.setattr(gpu_check, "served_http", quick("served"))
    monkeypatch.setattr(gpu_check, "profiled", quick("profile"))
    code = gpu_check.main(["--smoke", "--skip-tests", "--out", str(tmp_path)])
    assert code == 1
    assert ran == ["precision", "pipeline", "served", "profile"]
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["pipeline"] == "failed: RuntimeError: no such stream"
    assert "no such stream" in data["failures"]["pipeline"]
    assert "failed: RuntimeError" in (tmp_path / "gpu_check.md").read_text()


def test_one_entry_point_lists_every_tool_and_study() -> None:
    """Every runnable module of ``benchmarks`` is a tool of ``python -m benchmarks``, every
    study's script sits beside its report, and a name that is neither is refused."""
    import subprocess
    import sys

    from benchmarks.__main__ import STUDIES, TOOLS

    folder = ROOT / "benchmarks"
    main_guard = 'if __name__ == "__main__":'
    tools = {path.stem for path in folder.glob("*.py")
             if main_guard in path.read_text() and path.stem != "__main__"}  # fmt: skip
    studies = {path.parent.name for path in (folder / "studies").glob("*/study.py")}
    assert tools == set(TOOLS)
    assert studies == set(STUDIES)
    assert all((folder / "studies" / name / "README.md").is_file() for name in studies)
    listed = subprocess.run([sys.executable, "-m", "benchmarks"], capture_output=True, text=True,
                            cwd=ROOT, check=True).stdout  # fmt: skip
    assert all(f"  {name} " in listed for name in tools | studies)
    helped = subprocess.run([sys.executable, "-m", "benchmarks", "handoff", "--help"],
                            capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert helped.returncode == 0
    assert "--rounds" in helped.stdout
    wrong = subprocess.run([sys.executable, "-m", "benchmarks", "nothing"], capture_output=True,
                           text=True, cwd=ROOT)  # fmt: skip
    assert wrong.returncode == 2


def test_every_result_file_is_linked_from_a_page() -> None:
    """A figure that no page, report or README links to is not kept: each result file under
    ``benchmarks/`` is named by the docs, the README, a study's report or another result."""
    import re

    pages = [*(ROOT / "docs").glob("*.md"), ROOT / "README.md",
             *(ROOT / "benchmarks").glob("**/*.md")]  # fmt: skip
    texts = {page: page.read_text() for page in pages}
    results = [path for path in (ROOT / "benchmarks").glob("**/*")
               if path.suffix in (".md", ".json", ".png") and path.name != "README.md"
               and ("results" in path.parts or "studies" in path.parts)]  # fmt: skip
    unlinked = []
    for path in results:
        stem = re.escape(path.name.rsplit(".", 1)[0])
        if not any(re.search(rf"(^|[/(]){stem}\.(md|json|png)", text, re.M)
                   for page, text in texts.items() if page != path):  # fmt: skip
            unlinked.append(str(path.relative_to(ROOT)))
    assert not unlinked


def test_a_round_where_the_peer_answered_nothing_has_no_ratio() -> None:
    from benchmarks.peer_servers import ratios

    def round_of(throughput: float, p50: float) -> dict[str, float]:
        return {"throughput": throughput, "one_client_p50_ms": p50}

    samples = {
        "batchserve": [round_of(10, 20), round_of(12, 30), round_of(9, 25)],
        "litserve": [round_of(5, 40), round_of(0, 0), round_of(3, 50)],
    }
    result = ratios(samples, ["litserve"])
    assert result["batchserve vs litserve images/s"] == 2.5  # the median of 2 and 3
    assert result["batchserve vs litserve one-client p50"] == 0.5 * (0.5 + 0.5)


def test_the_default_is_compared_round_by_round_with_each_other_configuration() -> None:
    from benchmarks.peer_servers import ratios

    def round_of(throughput: float) -> dict[str, float]:
        return {"throughput": throughput, "one_client_p50_ms": 10.0}

    samples = {
        "batchserve": [round_of(90), round_of(80), round_of(96)],
        "batchserve unbatched": [round_of(60), round_of(40), round_of(64)],
        "litserve": [round_of(10), round_of(10), round_of(12)],
    }
    result = ratios(samples, ["litserve"])
    assert result["batchserve vs batchserve unbatched images/s"] == 1.5  # 1.5, 2 and 1.5
    assert "batchserve unbatched vs batchserve images/s" not in result
    assert result["batchserve unbatched vs litserve images/s"] == 5.3333333333333333


def test_the_peers_reports_title_names_the_peers_that_ran() -> None:
    from benchmarks.peer_servers import title

    model = "ssdlite320_mobilenet_v3_large"
    assert title({"model": model, "peers": {"litserve": []}}) == (
        f"batchserve beside LitServe: {model}"
    )
    both = title({"model": model, "peers": {"litserve": [], "rayserve": []}})
    assert both == f"batchserve beside LitServe and Ray Serve: {model}"
    assert title({"model": model, "peers": {}}) == f"batchserve beside itself: {model}"


def test_the_peers_report_gives_the_images_per_pass_of_each_shape_in_the_measured_load() -> None:
    from benchmarks.peer_servers import canvas_batches, window_passes
    from harness import promtext

    def scrape(*rows: tuple[str, float, float]) -> promtext.Samples:
        text = "# TYPE batchserve_canvas_batch_size histogram\n"
        for canvas, count, passes in rows:
            labels = f'canvas="{canvas}",model="m",version="1"'
            text += (
                f'batchserve_canvas_batch_size_bucket{{{labels},le="+Inf"}} {passes}\n'
                f"batchserve_canvas_batch_size_sum{{{labels}}} {count}\n"
                f"batchserve_canvas_batch_size_count{{{labels}}} {passes}\n"
            )
        return promtext.parse(text)

    before = scrape(("320x448", 10, 10))
    after = scrape(("320x448", 10 + 64, 10 + 8), ("448x320", 6, 3))
    assert canvas_batches(before, after) == {"320x448": 8.0, "448x320": 2.0}
    assert canvas_batches({}, {}) == {}
    assert window_passes(before, after) == 11
    assert window_passes({}, {}) == 0


def test_the_peers_report_warns_where_a_window_held_too_few_forward_passes() -> None:
    from benchmarks.peer_servers import FEW_PASSES, passes_text

    def data(*passes: int) -> dict[str, Any]:
        return {"samples": {"batchserve": [{"passes": each} for each in passes],
                            "litserve": [{}, {}]}}  # fmt: skip

    enough = passes_text(data(FEW_PASSES, FEW_PASSES + 5))
    assert f"batchserve {FEW_PASSES}, {FEW_PASSES + 5}." in enough
    assert "Fewer than" not in enough
    assert "Fewer than" in passes_text(data(FEW_PASSES + 5, FEW_PASSES - 1))
    assert passes_text(data()) == ""  # no batchserve server ran: nothing to say
