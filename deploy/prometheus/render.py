"""Write ``rules.yaml`` as the Prometheus operator's ``PrometheusRule`` for the kustomization.

The rules have one source, ``rules.yaml`` (what ``promtool`` checks and unit-tests, and what a
plain Prometheus loads). In a cluster run by the operator they must be a ``PrometheusRule``
object, or the recording rules that the dashboard and KEDA read never exist there. Run
``python deploy/prometheus/render.py`` after editing ``rules.yaml``; the tests fail while the
two differ.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
RULES = HERE / "rules.yaml"
TARGET = HERE.parent / "kubernetes" / "base" / "prometheusrule.yaml"
HEADER = (
    "# Generated from deploy/prometheus/rules.yaml by `python deploy/prometheus/render.py`:\n"
    "# edit that file and run this, never this one. The operator picks it up when its\n"
    "# ruleSelector matches these labels (kube-prometheus-stack wants `release: <its name>`).\n"
)


class _Dumper(yaml.SafeDumper):  # type: ignore[misc]
    """Multi-line expressions as literal blocks, as in ``rules.yaml``."""


def _string(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _string)


def prometheus_rule() -> dict[str, Any]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "batchserve"},
        "spec": {"groups": groups},
    }


def render() -> str:
    body: str = yaml.dump(prometheus_rule(), Dumper=_Dumper, sort_keys=False, width=100)
    return HEADER + body


if __name__ == "__main__":
    TARGET.write_text(render())
    print("wrote", TARGET)
