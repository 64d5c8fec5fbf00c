"""MkDocs hook: the settings page's reference table, made from ``Settings`` at build time."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.settings_reference import MARKER, reference, undocumented


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if MARKER not in markdown:
        return markdown
    missing = undocumented()
    if missing:
        raise ValueError(f"settings without a docstring: {', '.join(missing)}")
    return markdown.replace(MARKER, reference())
