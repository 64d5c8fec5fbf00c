"""How many CPUs this process may really use: the thread budget's starting point.

``os.cpu_count()`` and torch's own default count the host's cores. In a container with a CPU
limit (Kubernetes ``resources.limits.cpu``) that is far more than the process gets, and a
forward pass split over 32 threads on a 2-CPU quota spends its time throttled and waiting at
barriers. The affinity mask and the cgroup quota say what is really there.
"""

from __future__ import annotations

import math
import os
import platform
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def available_cpus(cgroup: Path = CGROUP, workers: int = 1) -> int:
    """CPUs in this process's affinity mask, capped by its share of the cgroup CPU quota
    (rounded up) when ``workers`` processes share the container."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        count = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup)
    if quota is not None:
        count = min(count, max(1, math.ceil(quota / workers)))
    return max(1, count)


def pin_worker(index: int, workers: int) -> list[int] | None:
    """Restrict this process (its calling thread and every thread started from it later) to
    the ``index``-th of ``workers`` equal shares of its CPUs, so that workers on one host do
    not compete for cores. Does nothing with one worker, or fewer CPUs than workers."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return None
    if workers <= 1 or len(cpus) < workers:
        return None
    share = cpus[index * len(cpus) // workers : (index + 1) * len(cpus) // workers]
    os.sched_setaffinity(0, share)
    return share


def cgroup_cpu_quota(cgroup: Path = CGROUP) -> float | None:
    """The CPU limit in CPUs (cgroup v2 ``cpu.max``, or v1 ``cfs_quota_us``), None if unlimited."""
    try:
        quota, _, period = (cgroup / "cpu.max").read_text().strip().partition(" ")
        if quota == "max":
            return None
        return int(quota) / int(period or 100_000)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


# What names an Arm core in /proc/cpuinfo, which has no "model name" there.
_ARM_FIELDS = ("CPU implementer", "CPU architecture", "CPU variant", "CPU part", "CPU revision",
               "Features")  # fmt: skip


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model: ``/proc/cpuinfo``'s ``model name`` (x86), else its first core's
    implementer, part, revision and features (Arm, where two different CPUs would otherwise
    share one name), else what the platform says."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    first = cpuinfo.split("\n\n", 1)[0]
    fields = {}
    for line in first.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    if fields.get("model name"):
        return fields["model name"]
    arm = [f"{name} {fields[name]}" for name in _ARM_FIELDS if fields.get(name)]
    if arm:
        return "Arm: " + "; ".join(arm)
    return platform.processor() or platform.machine() or "unknown"
