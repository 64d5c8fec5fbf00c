"""The environment batchserve gives the runtimes it loads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def openmp_environment(**env: str) -> str:
    """What torch's OpenMP runtime says it was started with, when the server's app is imported
    as uvicorn imports it (libgomp prints its settings with ``OMP_DISPLAY_ENV``; unset, the
    policy shows as passive too, but its threads spin 300000 rounds before they sleep)."""
    inherited = {key: value for key, value in os.environ.items() if not key.startswith("OMP_")}
    shown = subprocess.run(
        [sys.executable, "-c", "import app.main"], cwd=ROOT, capture_output=True, text=True,
        env={**inherited, "OMP_DISPLAY_ENV": "VERBOSE", **env}, check=True, timeout=120,
    )  # fmt: skip
    return shown.stderr


def test_torchs_openmp_threads_wait_passively() -> None:
    shown = openmp_environment()
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in shown
    assert "GOMP_SPINCOUNT = '0'" in shown


def test_an_openmp_wait_policy_in_the_environment_wins() -> None:
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in openmp_environment(OMP_WAIT_POLICY="ACTIVE")
