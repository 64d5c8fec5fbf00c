"""Read batchserve's /metrics and turn two scrapes into what happened between them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def from_response(response: httpx.Response) -> Samples:
    """A ``/metrics`` answer's samples, or nothing when the server has none (a baseline)."""
    return parse(response.text) if response.status_code == 200 else {}


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` that carry ``labels`` (and any others: every
    model and version, unless they are named)."""
    wanted = set(labels.items())
    return sum(
        sample for (each, carried), sample in samples.items()
        if each == name and wanted <= set(carried)
    )  # fmt: skip


def has(samples: Samples, name: str, **labels: str) -> bool:
    wanted = set(labels.items())
    return any(each == name and wanted <= set(carried) for each, carried in samples)


@dataclass
class ServerDelta:
    """Server-side view of a load run, from the difference of two scrapes."""

    before: Samples
    after: Samples
    seconds: float

    def delta(self, name: str, **labels: str) -> float:
        return value(self.after, name, **labels) - value(self.before, name, **labels)

    def summary(self) -> dict[str, Any]:
        batches = self.delta("batchserve_batch_size_count")
        requests = self.delta("batchserve_batch_size_sum")
        waits = self.delta("batchserve_queue_wait_seconds_count")
        stages: dict[str, float] = {}
        for (name, labels), _ in self.after.items():
            if name == "batchserve_stage_seconds_count":
                stage = dict(labels)["stage"]
                if stage in stages:
                    continue
                count = self.delta("batchserve_stage_seconds_count", stage=stage)
                if count:
                    total = self.delta("batchserve_stage_seconds_sum", stage=stage)
                    stages[stage] = total / count
        busy = self.delta("batchserve_device_busy_seconds_total")
        bounds = {dict(labels)["le"] for name, labels in self.after
                  if name == "batchserve_batch_size_bucket"}  # fmt: skip
        cumulative = sorted(
            (float(le), self.delta("batchserve_batch_size_bucket", le=le)) for le in bounds
        )
        histogram, previous = {}, 0.0
        for bound, count in cumulative:
            if count - previous > 0:
                histogram[f"{bound:g}"] = count - previous
            previous = count
        return {
            "batches": batches,
            "mean_batch_size": requests / batches if batches else 0.0,
            "mean_queue_wait_ms": (
                1000 * self.delta("batchserve_queue_wait_seconds_sum") / waits if waits else 0.0
            ),
            "mean_stage_ms": {stage: seconds * 1000 for stage, seconds in stages.items()},
            "device_busy_ratio": busy / self.seconds if self.seconds else 0.0,
            "batch_size_histogram": histogram,  # batches per bucket (upper bound)
            "outcomes": self.outcomes(),
        }

    def outcomes(self) -> dict[str, float]:
        """Answers of every prediction route in the interval, by outcome."""
        totals: dict[str, float] = {}
        for name, labels in self.after:
            if name == "batchserve_requests_total":
                outcome = dict(labels)["outcome"]
                count = self.delta(name, **dict(labels))
                if count:
                    totals[outcome] = totals.get(outcome, 0.0) + count
        return totals
