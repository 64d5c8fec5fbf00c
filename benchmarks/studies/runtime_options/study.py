"""Which runtime options pay: the choices the backends make, measured against the defaults.

Forward passes only (a ready input batch), several rounds, medians:

- ONNX Runtime: graph optimisation level (all vs basic), I/O binding into our tensors vs
  ``session.run`` with NumPy arrays (which copies the output);
- OpenVINO: the LATENCY hint with one caller vs the THROUGHPUT hint with two callers at once
  (what ``MAX_INFLIGHT_BATCHES=2`` gives), and synchronous ``infer`` vs asynchronous requests.

Usage: ``python -m benchmarks runtime_options --model resnet50``
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.engine import ONNX_FILE, OPENVINO_FILE, convert_to_openvino, export_onnx, load_model
from app.settings import Settings
from benchmarks.common import command_line, machine, machine_markdown, median, table, write_results

HERE = Path(__file__).resolve().parent  # the study's report and its runs


def rate(work: Callable[[], int], seconds: float) -> float:
    work()
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        done += work()
    return done / (time.perf_counter() - started)


def concurrent_rate(work: Callable[[], int], callers: int, seconds: float) -> float:
    counts = [0] * callers
    stop = time.perf_counter() + seconds

    def loop(index: int) -> None:
        work()
        while time.perf_counter() < stop:
            counts[index] += work()

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(callers)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / (time.perf_counter() - started)


def onnxruntime_options(path: Path, batch: np.ndarray[Any, Any], threads: int,
                        seconds: float) -> dict[str, float]:  # fmt: skip
    import onnxruntime as ort

    results = {}
    rows: int = batch.shape[0]
    tensor = torch.from_numpy(batch)
    for level_name, level in (("all", ort.GraphOptimizationLevel.ORT_ENABLE_ALL),
                              ("basic", ort.GraphOptimizationLevel.ORT_ENABLE_BASIC)):  # fmt: skip
        options = ort.SessionOptions()
        options.graph_optimization_level = level
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        output = torch.empty((rows, session.get_outputs()[0].shape[1]), dtype=torch.float32)

        def bound(session: Any = session, output: torch.Tensor = output) -> int:
            binding = session.io_binding()
            binding.bind_input("input", "cpu", 0, np.float32, tuple(tensor.shape),
                               tensor.data_ptr())  # fmt: skip
            binding.bind_output("logits", "cpu", 0, np.float32, tuple(output.shape),
                                output.data_ptr())  # fmt: skip
            session.run_with_iobinding(binding)
            return rows

        def plain(session: Any = session) -> int:
            session.run(None, {"input": batch})
            return rows

        results[f"optimisation {level_name}, I/O binding"] = rate(bound, seconds)
        results[f"optimisation {level_name}, session.run"] = rate(plain, seconds)
    return results


def openvino_options(path: Path, batch: np.ndarray[Any, Any], threads: int,
                     seconds: float) -> dict[str, float]:  # fmt: skip
    import openvino as ov

    core = ov.Core()
    model = core.read_model(str(path))
    rows: int = batch.shape[0]
    results = {}
    local = threading.local()
    for hint, callers in (("LATENCY", 1), ("THROUGHPUT", 2)):
        config: dict[str, Any] = {"PERFORMANCE_HINT": hint, "INFERENCE_NUM_THREADS": threads,
                                  "INFERENCE_PRECISION_HINT": "f32"}  # fmt: skip
        if hint == "THROUGHPUT":
            config["NUM_STREAMS"] = callers
        compiled = core.compile_model(model, "CPU", config)

        def request(compiled: Any = compiled) -> Any:
            if not hasattr(local, "request") or local.compiled is not compiled:
                local.request, local.compiled = compiled.create_infer_request(), compiled
            return local.request

        def sync(request: Callable[[], Any] = request) -> int:
            request().infer({0: batch}, share_inputs=True)
            return rows

        def asynchronous(request: Callable[[], Any] = request) -> int:
            infer = request()
            infer.start_async({0: batch}, share_inputs=True)
            infer.wait()
            return rows

        results[f"{hint.lower()} hint, {callers} caller(s), sync"] = concurrent_rate(
            sync, callers, seconds
        )
        results[f"{hint.lower()} hint, {callers} caller(s), async"] = concurrent_rate(
            asynchronous, callers, seconds
        )
    return results


def main() -> None:
    parser = command_line(__doc__, __file__)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--name", help="results/<name>.* (default: runtime-options-<model>)")
    args = parser.parse_args()
    threads = Settings(_env_file=None).intra_op_threads
    loaded = load_model(args.model, "none")
    shape = (3, loaded.transform.crop_size, loaded.transform.crop_size)
    batch = torch.randn((args.batch_size, *shape), generator=torch.Generator().manual_seed(0))
    array = batch.numpy()
    samples: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        onnx_path, xml_path = Path(folder) / ONNX_FILE, Path(folder) / OPENVINO_FILE
        export_onnx(loaded.module, shape, onnx_path)
        convert_to_openvino(onnx_path, xml_path)
        for round_index in range(args.rounds):
            print(f"round {round_index + 1}/{args.rounds}", flush=True)
            measured = {
                **{f"onnxruntime: {k}": v for k, v in
                   onnxruntime_options(onnx_path, array, threads, args.seconds).items()},
                **{f"openvino: {k}": v for k, v in
                   openvino_options(xml_path, array, threads, args.seconds).items()},
            }  # fmt: skip
            for key, value in measured.items():
                samples.setdefault(key, []).append(value)
                print(f"  {key}: {value:.1f} images/s", flush=True)
    medians = {key: median(values) for key, values in samples.items()}
    data = {"machine": machine(), "model": args.model, "batch_size": args.batch_size,
            "threads": threads, "rounds": args.rounds, "medians": medians,
            "samples": samples}  # fmt: skip
    text = f"""# Runtime options: {args.model}, batch {args.batch_size}, {threads} threads

`python -m benchmarks runtime_options`: forward passes on a ready batch, medians of
{args.rounds} rounds of {args.seconds} s.

{table(["option", "images/s"], [[k, v] for k, v in medians.items()])}

## Machine

{machine_markdown(data["machine"])}
"""
    print(text)
    write_results(args.name or f"runtime-options-{args.model}", data, text, folder=HERE)


if __name__ == "__main__":
    main()
