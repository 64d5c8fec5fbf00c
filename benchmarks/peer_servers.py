"""batchserve beside the servers users would otherwise pick: LitServe and Ray Serve.

Same model (torchvision's, random weights), same images, same load (wrk, multipart field
``file``, which every server reads), fresh processes, one server at a time, rounds interleaved.
Each peer runs in a virtual environment of its own under ``.peers/`` (made on the first run:
``pip install`` of the pinned release below, with torch and torchvision taken from
batchserve's environment through a ``.pth`` line, so the same torch build runs everywhere and
the peers' own dependencies come first on their path). The peers are written as their
documentation shows (``benchmarks/peer_apps``) with the same batch size as batchserve.

Usage: ``python -m benchmarks.peer_servers --model resnet18 --rounds 3``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from app.engine import resolve_task
from benchmarks import wrk
from benchmarks.backends import prepare_artifacts
from benchmarks.common import (
    DEFAULT_DURATION,
    command_line,
    load_arguments,
    machine,
    machine_markdown,
    median,
    publish,
    table,
)
from benchmarks.compare import server_env, variants
from benchmarks.corpus import camera, corpus, generate
from harness import promtext
from harness.servers import ROOT, ServerProcess, UvicornProcess, first_answer, free_port

PEERS_DIR = ROOT / ".peers"
# What each peer's environment installs, and how its server starts and says it is ready.
PEERS = {
    "litserve": {"install": ["litserve==0.2.19"], "module": "litserve_app",
                 "ready": "/health"},
    "rayserve": {"install": ["ray[serve]==2.60.0"], "module": "rayserve_app",
                 "ready": "/-/healthz"},
}  # fmt: skip
BATCHSERVE = [
    "batchserve fp32:precision=fp32",
    "batchserve int8:backend=openvino,precision=int8",
]
# A detector or a segmenter: batchserve's default beside itself unbatched (one image a pass).
BATCHSERVE_TASKS = ["batchserve:", "batchserve unbatched:max_batch_size=1"]


# Ultralytics YOLO models by name, built offline (``harness.yolo``): their family and task.
YOLO_MODELS = {
    "yolo11n": ("yolo11n", "detect"),
    "yolo11n-seg": ("yolo11n", "segment"),
    "yolo11n-pose": ("yolo11n", "pose"),
    "yolo11n-cls": ("yolo11n", "classify"),
    "yolo26n": ("yolo26n", "detect"),
}


def is_yolo(model: str) -> bool:
    return model in YOLO_MODELS


# Hugging Face transformers models by name, built offline with random weights
# (``harness.hf_models``, transformers' default configurations): their family there.
HF_MODELS = {"vit-b16": "vit_b16", "rt-detr-r50": "rt_detr_r50"}


def made_here(model: str) -> bool:
    """Whether the benchmark builds ``model`` itself (not a torchvision architecture)."""
    return is_yolo(model) or model in HF_MODELS


def peer_python(name: str) -> Path:
    """The peer's environment, made when missing."""
    venv = PEERS_DIR / name
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", *PEERS[name]["install"]], check=True
        )
        site = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        # Appended after the peer's own packages: torch, torchvision and their libraries.
        Path(site, "batchserve-torch.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return python


def peer_server(name: str, model: str, batch_size: int) -> ServerProcess:
    port = free_port()
    env = {
        **os.environ, "PYTHONPATH": str(ROOT), "PEER_MODEL": model, "PEER_PORT": str(port),
        "PEER_MAX_BATCH_SIZE": str(batch_size),
    }  # fmt: skip
    command = [str(peer_python(name)), "-m", f"benchmarks.peer_apps.{PEERS[name]['module']}"]
    ready = str(PEERS[name]["ready"])
    return ServerProcess(command, f"http://127.0.0.1:{port}", env, 300.0, ready)


def loaded(server: ServerProcess, images: list[bytes], clients: int,
           args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, float], int]:  # fmt: skip
    """A warm-up load, then one answer (so that what the warm-up's clients left queued is
    done: a server that does not drop the work of a client that went away would otherwise
    spend the measured window on it, and with a slow model answer nothing in it), then the
    measured load; with the images per forward pass of each canvas in it and the forward
    passes it held (batchserve only)."""
    wrk.run(server.url, images, clients, 0, args.warmup, multipart=True)
    first_answer(server, images[0], timeout_s=600.0)
    before = scrape(server.url)
    result = wrk.run(server.url, images, clients, 0, args.duration, multipart=True)
    after = scrape(server.url)
    return result, canvas_batches(before, after), window_passes(before, after)


def scrape(url: str) -> promtext.Samples:
    """batchserve's metrics; nothing for a peer."""
    return promtext.from_response(httpx.get(f"{url}/metrics", timeout=30))


# A window that holds fewer forward passes than this counts its images in whole batches too
# coarsely to compare: ViT-B/16's 1.6 s batches in 10 s windows read 0.808x unbatched, 0.984x
# in 40 s windows (benchmarks/results/peers-vit-b16-amd-epyc-fp32*.md).
FEW_PASSES = 20


def window_passes(before: promtext.Samples, after: promtext.Samples) -> int:
    """The forward passes (of every input shape) between two scrapes."""
    return round(sum(passes for passes, _ in _canvas_counts(before, after).values()))


def canvas_batches(before: promtext.Samples, after: promtext.Samples) -> dict[str, float]:
    """The mean images per forward pass of each input shape between two scrapes."""
    return {canvas: images / passes
            for canvas, (passes, images) in _canvas_counts(before, after).items()}  # fmt: skip


def _canvas_counts(
    before: promtext.Samples, after: promtext.Samples
) -> dict[str, tuple[float, float]]:
    """The forward passes and their images of each input shape between two scrapes, for each
    shape that ran at least one."""
    delta = promtext.ServerDelta(before, after, 0.0)
    canvases = {dict(labels)["canvas"] for name, labels in after
                if name == "batchserve_canvas_batch_size_count"}  # fmt: skip
    counts = {}
    for canvas in sorted(canvases):
        passes = delta.delta("batchserve_canvas_batch_size_count", canvas=canvas)
        if passes:
            counts[canvas] = (passes, delta.delta("batchserve_canvas_batch_size_sum",
                                                  canvas=canvas))  # fmt: skip
    return counts


def measure(server: ServerProcess, images: list[bytes], args: argparse.Namespace) -> dict[str, Any]:
    with server:
        first_answer(server, images[0])
        many, batches, passes = loaded(server, images, args.clients, args)
        one, _, _ = loaded(server, images, 1, args)
    if many["errors"] or one["errors"]:
        print(f"    errors: {many['errors']} {one['errors']}", flush=True)
    return {
        "throughput": many["throughput"], "p50_ms": many["latency_ms"]["p50"],
        "p99_ms": many["latency_ms"]["p99"], "one_client_p50_ms": one["latency_ms"]["p50"],
        "one_client_p99_ms": one["latency_ms"]["p99"],
        "errors": sum(many["errors"].values()) + sum(one["errors"].values()),
        "canvas_batches": batches, "passes": passes,
    }  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    images = camera(64) if args.shapes == "one" else corpus(args.images, 64)
    stack = ExitStack()
    scratch = Path(stack.enter_context(tempfile.TemporaryDirectory()))
    calibration = scratch / "calibration"
    calibration.mkdir()
    for index, data in enumerate(generate(32, seed=500)):
        (calibration / f"{index}.jpg").write_bytes(data)
    model = args.model
    if is_yolo(model):  # a checkpoint of spread weights, as `yolo train` leaves one
        from harness import yolo

        family, task = YOLO_MODELS[model]
        model = str(yolo.checkpoint(task, scratch, name=model, family=family))
    elif model in HF_MODELS:  # a directory as save_pretrained writes one
        from harness import hf_models

        model = "hf:" + str(hf_models.saved(HF_MODELS[model], scratch))
    shared = {
        **server_env(model, "fp32", args.batch_size),
        "BATCHSERVE_BACKEND": "auto",
        "BATCHSERVE_ARTIFACTS_DIR": str(scratch / "artifacts"),
        "BATCHSERVE_CALIBRATION_DIR": str(calibration),
        # Random weights cannot pass a meaningful gate: INT8 here is for throughput only.
        "BATCHSERVE_ALLOW_UNGATED_INT8": "true",
    }
    ours = {name: {**shared, **settings} for name, settings in variants(args.configs).items()}
    for name in args.peers:
        peer_python(name)
    samples: dict[str, list[dict[str, Any]]] = {}
    with stack:
        if not made_here(args.model) and resolve_task("auto", args.model) == "classify":
            prepare_artifacts(args.model, args.batch_size, ours)
        # One start each before the rounds: BACKEND=auto and SHARDS=auto measure once and
        # keep their choice, which every round serves.
        served: dict[str, str] = {}
        for name, settings in ours.items():
            with UvicornProcess(settings, startup_timeout=600) as first:
                served[name] = serving(first.url)
            print(f"  {name}: {served[name]}", flush=True)
        for round_index in range(args.rounds):
            print(f"round {round_index + 1}/{args.rounds}", flush=True)
            servers: dict[str, ServerProcess] = {
                # Generous: a large model's ONNX Runtime session builds for minutes on 2 cores.
                name: UvicornProcess(settings, startup_timeout=600)
                for name, settings in ours.items()
            }
            servers |= {name: peer_server(name, model, args.batch_size) for name in args.peers}
            for name, server in servers.items():
                sample = measure(server, images, args)
                samples.setdefault(name, []).append(sample)
                print(f"  {name}: {sample['throughput']:.1f} images/s @{args.clients}, "
                      f"p50 @1 {sample['one_client_p50_ms']:.1f} ms", flush=True)  # fmt: skip
    medians = {
        name: {key: median([sample[key] for sample in rows])
               for key in rows[0] if key != "canvas_batches"}
        for name, rows in samples.items()
    }  # fmt: skip
    return {
        "machine": machine(), "model": args.model, "batch_size": args.batch_size,
        "clients": args.clients, "rounds": args.rounds, "duration_s": args.duration,
        "shapes": args.shapes,
        "configs": args.configs, "configs_given": args.configs_given,
        "peers": {name: PEERS[name]["install"] for name in args.peers},
        "served": served,
        "medians": medians, "ratios": ratios(samples, args.peers), "samples": samples,
    }  # fmt: skip


def serving(url: str) -> str:
    """What a batchserve server serves its model with: backend, precision, and the parts a
    batch runs in."""
    (model,) = httpx.get(f"{url}/v1/models", timeout=10).json()["models"]
    backend = model["backend"]
    shards = backend.get("shards")
    parts = f", {shards['count']} parts" if shards else ", whole batches"
    return f"{backend['name']} {backend['precision']}{parts}"


def ratios(samples: dict[str, list[dict[str, Any]]], peers: list[str]) -> dict[str, float]:
    """Each batchserve configuration against each peer, and the first (the default) against
    each other one (e.g. unbatched), throughput and one-client p50: the median over rounds of
    the ratio within a round (servers measured minutes apart, so a machine whose speed drifts
    over the run moves both sides of a ratio alike)."""
    result: dict[str, float] = {}
    configs = [name for name in samples if name not in peers]
    compared = [(ours, peer) for ours in configs for peer in peers]
    compared += [(configs[0], other) for other in configs[1:]]
    for ours, other in compared:
        pairs = list(zip(samples[ours], samples[other], strict=True))
        for label, key in (("images/s", "throughput"), ("one-client p50", "one_client_p50_ms")):
            # A round where the other answered nothing has no ratio (it is not infinite): its
            # zero stays in the table, the median is over the other rounds.
            within = [mine[key] / theirs[key] for mine, theirs in pairs if theirs[key] > 0]
            result[f"{ours} vs {other} {label}"] = median(within) if within else float("nan")
    return result


# How each peer is named in a report.
PEER_NAMES = {"litserve": "LitServe", "rayserve": "Ray Serve"}


def title(data: dict[str, Any]) -> str:
    """The report's title: the peers that ran, and the model."""
    names = [PEER_NAMES.get(name, name) for name in data["peers"]]
    beside = " and ".join(names) if names else "itself"
    return f"batchserve beside {beside}: {data['model']}"


def markdown(data: dict[str, Any]) -> str:
    rows = [
        [name, m["throughput"], m["p50_ms"], m["p99_ms"], m["one_client_p50_ms"],
         m["one_client_p99_ms"], m["errors"]]
        for name, m in data["medians"].items()
    ]  # fmt: skip
    peers = ", ".join(" ".join(spec) for spec in data["peers"].values())
    model_text = (
        "Ultralytics' own `YOLO(checkpoint).predict(list_of_images)` on the batch (a "
        "checkpoint of spread weights built offline from Ultralytics' YAML, the same file "
        "batchserve serves), boxes above 0.3, at most 100"
        if is_yolo(data["model"])
        else "timm's `create_model` with random weights and `create_transform` of its "
        "`resolve_model_data_config` on each image, the batch's top 5"
        if data["model"].startswith("timm:")
        else "transformers' `AutoImageProcessor` on the batch's images and the model (random "
        "weights, the library's default configuration, the same directory batchserve serves), "
        "the top 5, or boxes of the processor's `post_process_object_detection` above 0.3"
        if data["model"] in HF_MODELS
        else "eager torchvision model with its own preprocessing (a detector called on the list "
        "of images, a segmenter on the images of each shape stacked)"
    )
    peer_text = (
        f"Peers ({peers}) written as their documentation shows (`benchmarks/peer_apps`): "
        f"{model_text}, dynamic batching with the same batch size and a 10 ms window."
        if peers
        else "No peer ran."
    )
    chosen = "" if set(data["peers"]) == set(PEERS) else f" --peers {' '.join(data['peers'])}"
    if data["duration_s"] != DEFAULT_DURATION:
        chosen += f" --duration {data['duration_s']:g}"
    if data.get("configs_given"):
        chosen += " --configs " + " ".join(f"'{config}'" for config in data["configs"])
    shapes = data.get("shapes", "mixed")
    images = (
        "64 photo-like JPEGs of one size, 640x480 (one camera's frames)"
        if shapes == "one"
        else "64 photo-like JPEGs of six sizes in turn (500x375, 640x480, 375x500, 800x600, "
        "500x333, 1024x768: mixed traffic)"
    )
    configs = ", ".join(
        f"{name} ({settings or 'defaults'})"
        for name, _, settings in (config.partition(":") for config in data["configs"])
    )
    return f"""# {title(data)}

`python -m benchmarks.peer_servers --model {data["model"]} --batch-size {data["batch_size"]} \\
--clients {data["clients"]} --rounds {data["rounds"]} --shapes {shapes}{chosen}`, on {images}.
Medians of {data["rounds"]}
interleaved rounds, a fresh process for every server in every round, {data["duration_s"]} s per
load after a warm-up whose queued requests were answered first; wrk on the same machine posting
the same images as multipart field `file`.
batchserve: {configs} (`BACKEND=auto` unless a configuration names a
backend; INT8 built from random weights and served ungated, for throughput only). {peer_text}
{"".join(f"{chr(10)}- {name} served: {how}" for name, how in data.get("served", {}).items())}

{
        table(
            [
                "server",
                f"images/s @{data['clients']}",
                "p50 ms",
                "p99 ms",
                "p50 ms @1",
                "p99 ms @1",
                "errors",
            ],
            rows,
        )
    }

Ratios: the median over rounds of each round's ratio.

{table(["ratio", "value"], [[name, value] for name, value in data["ratios"].items()])}

{batches_text(data)}
Per round (images/s @{data["clients"]}; one-client p50 ms):

{
        table(
            ["server", *(f"round {i + 1}" for i in range(data["rounds"]))],
            [
                [name, *(f"{r['throughput']:.1f}; {r['one_client_p50_ms']:.0f}" for r in rows)]
                for name, rows in data["samples"].items()
            ],
        )
    }

## Machine

{machine_markdown(data["machine"])}
"""


def batches_text(data: dict[str, Any]) -> str:
    """The images per forward pass each batchserve server formed at full load, per input
    shape (the shape the model's own transform gives an image; only equal ones batch)."""
    rows = []
    for name, samples in data["samples"].items():
        canvases = sorted(
            {canvas for sample in samples for canvas in sample.get("canvas_batches", {})}
        )
        for canvas in canvases:
            means = [sample["canvas_batches"].get(canvas, 0.0) for sample in samples]
            rows.append([name, canvas, *(f"{mean:.2f}" for mean in means)])
    if not rows:
        return ""
    heading = ["server", "input shape (h x w)",
               *(f"round {i + 1}" for i in range(data["rounds"]))]  # fmt: skip
    return (
        f"Images per forward pass at {data['clients']} clients, by input shape (the mean over "
        f"the measured load, from `batchserve_canvas_batch_size`):\n\n{table(heading, rows)}\n"
        f"{passes_text(data)}"
    )


def passes_text(data: dict[str, Any]) -> str:
    """How many forward passes each window held, and a warning where too few to count by."""
    counts = {name: [sample["passes"] for sample in samples if "passes" in sample]
              for name, samples in data["samples"].items()}  # fmt: skip
    counts = {name: each for name, each in counts.items() if each}
    if not counts:
        return ""
    text = "\nForward passes in each measured window: " + "; ".join(
        f"{name} {', '.join(map(str, each))}" for name, each in counts.items()
    ) + ".\n"  # fmt: skip
    if min(min(each) for each in counts.values()) < FEW_PASSES:
        text += (
            f"\n**Fewer than {FEW_PASSES} passes in a window**: its images are counted in whole "
            "batches, too coarsely to compare servers by; measure longer (`--duration`).\n"
        )
    return text


def main() -> None:
    parser = command_line(__doc__, __file__)
    parser.add_argument("--model", default="resnet18",
                        help="a torchvision architecture, or one of " + ", ".join(YOLO_MODELS) + " "
                        "(an Ultralytics checkpoint of spread weights, made here) or "
                        + ", ".join(HF_MODELS) + " (transformers, random weights)")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=8)
    load_arguments(parser)
    parser.add_argument("--configs", nargs="*",
                        help="batchserve servers: name:setting=value,... (default: fp32 and "
                        "OpenVINO INT8 for a classifier; the default and unbatched for a "
                        "detector or segmenter)")  # fmt: skip
    parser.add_argument("--peers", nargs="*", default=list(PEERS), choices=list(PEERS))
    parser.add_argument("--shapes", choices=["mixed", "one"], default="mixed",
                        help="the generated images: six sizes in turn, or all 640x480")  # fmt: skip
    parser.add_argument("--name", help="results/<name>.md (default: peers-<model>[-one-shape])")
    args = parser.parse_args()
    wrk.require()
    args.configs_given = args.configs is not None
    if args.configs is None:
        # A model made here is served by default and unbatched, as a detector is.
        classify = not made_here(args.model) and resolve_task("auto", args.model) == "classify"
        args.configs = BATCHSERVE if classify else BATCHSERVE_TASKS
    data = run(args)
    suffix = "-one-shape" if args.shapes == "one" else ""
    publish(args.name or f"peers-{args.model}{suffix}", data, markdown(data))
    print(json.dumps(data["ratios"], indent=1))


if __name__ == "__main__":
    main()
