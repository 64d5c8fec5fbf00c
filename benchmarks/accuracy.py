"""Accuracy gate: does a faster configuration (fp16, bf16, TorchScript, inductor...) give the
same answers as the fp32 eager reference? Exits non-zero when it does not, so it can gate a
deployment.

With a labelled folder (ImageFolder layout: ``<root>/<class>/<image>``, the class a label or an
index), both configurations' top-1 and top-5 accuracy are reported and the candidate's top-1
may not fall more than ``--max-top1-drop`` below the reference's. Always: top-1 agreement,
mean top-5 overlap and the largest difference of any class probability.

Usage::

    python -m benchmarks.accuracy --model resnet50 --weights auto --images val/ \\
        --candidate precision=bf16 --reference precision=fp32 compile=none
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.engine import InferenceEngine, InferenceRequest, Prediction
from benchmarks.common import machine, machine_markdown, table, write_results
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


def predict_all(engine: InferenceEngine, samples: list[Sample], batch: int) -> list[Prediction]:
    """Every class's probability for every sample (top_k = number of classes)."""
    results: list[Prediction] = []
    for start in range(0, len(samples), batch):
        chunk = samples[start : start + batch]
        requests = [InferenceRequest(engine.prepare(s.data), engine.num_classes) for s in chunk]
        for outcome in engine.run_batch(requests):
            if isinstance(outcome, BaseException):
                raise outcome
            results.append(outcome)
    return results


def label_index(engine: InferenceEngine, label: str) -> int:
    if label.isdigit():
        return int(label)
    try:
        return engine.labels.index(label)
    except ValueError:
        raise SystemExit(f"class folder {label!r} is neither an index nor a model label") from None


def compare(
    reference: list[Prediction], candidate: list[Prediction], samples: list[Sample],
    engine: InferenceEngine,
) -> dict[str, Any]:  # fmt: skip
    agree, overlap, largest = 0, 0.0, 0.0
    hits = {"reference": [0, 0], "candidate": [0, 0]}
    labelled = all(sample.label is not None for sample in samples)
    for ref, cand, sample in zip(reference, candidate, samples, strict=True):
        ref_order = [c["index"] for c in ref.classes]
        cand_order = [c["index"] for c in cand.classes]
        agree += ref_order[0] == cand_order[0]
        overlap += len(set(ref_order[:5]) & set(cand_order[:5])) / 5
        ref_scores = {c["index"]: c["score"] for c in ref.classes}
        for entry in cand.classes:
            largest = max(largest, abs(entry["score"] - ref_scores[entry["index"]]))
        if labelled:
            truth = label_index(engine, sample.label or "")
            for name, order in (("reference", ref_order), ("candidate", cand_order)):
                hits[name][0] += order[0] == truth
                hits[name][1] += truth in order[:5]
    count = len(samples)
    report: dict[str, Any] = {
        "images": count,
        "top1_agreement": agree / count,
        "top5_overlap": overlap / count,
        "max_probability_difference": largest,
        "labelled": labelled,
    }
    if labelled:
        for name, (top1, top5) in hits.items():
            report[f"{name}_top1"] = top1 / count
            report[f"{name}_top5"] = top5 / count
    return report


def verdict(report: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """The gate's failures (empty when it passes)."""
    failures = []
    if report["top1_agreement"] < args.min_agreement:
        failures.append(f"top-1 agreement {report['top1_agreement']:.4f} < {args.min_agreement}")
    if report["max_probability_difference"] > args.max_prob_diff:
        failures.append(f"probability difference {report['max_probability_difference']:.4f} "
                        f"> {args.max_prob_diff}")  # fmt: skip
    if report["labelled"]:
        drop = report["reference_top1"] - report["candidate_top1"]
        if drop > args.max_top1_drop:
            failures.append(f"top-1 accuracy drops by {drop:.4f} > {args.max_top1_drop}")
    return failures


def run(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    samples = load_samples(args.images, args.count)
    reference_engine = engine_for(args.model, args.weights, parse_overrides(args.reference),
                                  args.batch_size)  # fmt: skip
    candidate_engine = engine_for(args.model, args.weights, parse_overrides(args.candidate),
                                  args.batch_size)  # fmt: skip
    reference = predict_all(reference_engine, samples, args.batch_size)
    candidate = predict_all(candidate_engine, samples, args.batch_size)
    report = compare(reference, candidate, samples, reference_engine)
    report.update({
        "model": args.model, "weights": reference_engine.weights,
        "reference": f"{reference_engine.precision}, {reference_engine.backend.variant}",
        "candidate": f"{candidate_engine.precision}, {candidate_engine.backend.variant}",
    })  # fmt: skip
    return report, verdict(report, args)


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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--weights", default="none")
    p.add_argument("--images", type=Path, help="a folder (default: generated images)")
    p.add_argument("--count", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--candidate", nargs="*", default=["precision=bf16"])
    p.add_argument("--reference", nargs="*", default=["precision=fp32", "compile=none"])
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
