"""External tools the tests drive (kubectl, promtool, prometheus, supervisord).

Locally a missing tool skips its tests with the reason; on CI (``BATCHSERVE_REQUIRE_TOOLS=1``,
set by ``.ci/run``, which installs them) a missing tool is a failure, never a skip.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest


def require_tool(name: str, *candidates: Path) -> Path:
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(name)
    if found is not None:
        return Path(found)
    message = f"{name} is not installed (.ci/run installs it)"
    if os.environ.get("BATCHSERVE_REQUIRE_TOOLS"):
        pytest.fail(message)
    pytest.skip(message)
