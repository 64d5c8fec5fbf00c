"""Accuracy gate: does a faster configuration (fp16, bf16, TorchScript, inductor, another
backend, INT8...) give the same answers as the fp32 eager reference? Exits non-zero when it
does not, so it can gate a deployment. The comparison is the server's own
(``app.engine.checks.gate``, the same the INT8 gate and the start-up check use).

With a labelled folder (ImageFolder layout: ``<root>/<class>/<image>``, the class a label or an
index), both configurations' top-1 and top-5 accuracy are reported and the candidate's top-1
may not fall more than ``--max-top1-drop`` below the reference's. Always: top-1 agreement,
mean top-5 overlap and the largest difference of any class probability.

Usage::

    python -m benchmarks.accuracy --model resnet50 --weights auto --images val/ \\
        --candidate precision=bf16 --reference backend=torch precision=fp32 compile=none
    python -m benchmarks.accuracy --model resnet50 --candidate backend=openvino
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from app.engine import Bounds, InferenceEngine, compare, probabilities, verdict
from benchmarks.common import command_line, machine, machine_markdown, table, write_results
from benchmarks.corpus import IMAGE_SUFFIXES, generate
from benchmarks.offline import make_engine


@dataclass
class Sample:
    name: str
    data: bytes
    label: str | None = None


def load_samples(folder: Path | None, count: int) -> list[Sample]:
    """Images under ``folder`` (labelled when they sit in class folders), or generated ones."""
    if folder is None:
        return [Sample(f"generated-{i}", data) for i, data in enumerate(generate(count))]
    samples = []
    for path in sorted(folder.rglob("*")):
        if path.suffix.lower() in IMAGE_SUFFIXES:
            label = path.parent.name if path.parent != folder else None
            samples.append(Sample(str(path.relative_to(folder)), path.read_bytes(), label))
    if not samples:
        raise SystemExit(f"no images under {folder}")
    return samples[:count]


def parse_overrides(items: list[str]) -> dict[str, str]:
    pairs = dict(item.split("=", 1) for item in items)
    return {key.lower().removeprefix("batchserve_"): value for key, value in pairs.items()}


def engine_for(model: str, weights: str, overrides: dict[str, str], batch: int) -> InferenceEngine:
    settings: dict[str, Any] = dict(overrides)
    precision = settings.pop("precision", "auto")
    return make_engine(model, precision, batch, weights=weights, warm=False, **settings)


def predict_all(engine: InferenceEngine, samples: list[Sample], batch: int) -> torch.Tensor:
    """Every class's probability for every sample, ``[samples, classes]``."""
    return probabilities(engine, [sample.data for sample in samples], batch)


def label_index(engine: InferenceEngine, label: str) -> int:
    if label.isdigit():
        return int(label)
    try:
        return engine.labels.index(label)
    except ValueError:
        raise SystemExit(f"class folder {label!r} is neither an index nor a model label") from None


def compare_on(
    reference: torch.Tensor, candidate: torch.Tensor, samples: list[Sample],
    engine: InferenceEngine,
) -> dict[str, Any]:  # fmt: skip
    """``app.engine.checks.gate.compare``, with the true classes when every sample has a label."""
    labelled = all(sample.label is not None for sample in samples)
    truth = [label_index(engine, sample.label or "") for sample in samples] if labelled else None
    return compare(reference, candidate, truth)


def bounds(args: argparse.Namespace) -> Bounds:
    return Bounds(min_top1_agreement=args.min_agreement,
                  max_probability_difference=args.max_prob_diff,
                  max_top1_drop=args.max_top1_drop)  # fmt: skip


def run(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    samples = load_samples(args.images, args.count)
    reference_engine = engine_for(args.model, args.weights, parse_overrides(args.reference),
                                  args.batch_size)  # fmt: skip
    candidate_engine = engine_for(args.model, args.weights, parse_overrides(args.candidate),
                                  args.batch_size)  # fmt: skip
    reference = predict_all(reference_engine, samples, args.batch_size)
    candidate = predict_all(candidate_engine, samples, args.batch_size)
    report = compare_on(reference, candidate, samples, reference_engine)
    report.update({
        "model": args.model, "weights": reference_engine.weights,
        "reference": describe(reference_engine), "candidate": describe(candidate_engine),
    })  # fmt: skip
    return report, verdict(report, bounds(args))


def describe(engine: InferenceEngine) -> str:
    return f"{engine.backend.name} {engine.backend.variant}, {engine.precision}"


def markdown(report: dict[str, Any], failures: list[str], info: dict[str, Any]) -> str:
    rows = [[key.replace("_", " "), value] for key, value in report.items()]
    result = "PASS" if not failures else "FAIL: " + "; ".join(failures)
    return f"""# Accuracy gate: {report["model"]} ({report["candidate"]} vs {report["reference"]})

{table(["measure", "value"], rows)}

**{result}**

## Machine

{machine_markdown(info)}
"""


def parser() -> argparse.ArgumentParser:
    p = command_line(__doc__, __file__)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--weights", default="none")
    p.add_argument("--images", type=Path, help="a folder (default: generated images)")
    p.add_argument("--count", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--candidate", nargs="*", default=["precision=bf16"])
    # Eager fp32 PyTorch: named in full, since BACKEND=auto would pick a runtime instead.
    p.add_argument("--reference", nargs="*",
                   default=["backend=torch", "precision=fp32", "compile=none"])  # fmt: skip
    p.add_argument("--min-agreement", type=float, default=0.98)
    p.add_argument("--max-prob-diff", type=float, default=0.05)
    p.add_argument("--max-top1-drop", type=float, default=0.005)
    p.add_argument("--name", help="also write results/<name>.md and .json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    report, failures = run(args)
    text = markdown(report, failures, machine())
    print(text)
    if args.name:
        write_results(args.name, {"report": report, "failures": failures}, text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
