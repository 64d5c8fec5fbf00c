"""The documentation check ``make test`` runs fails on what MkDocs warns of: a broken link or
anchor stops the build, and no option of the command hides the warning that counts."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def docs_command() -> list[str]:
    """The MkDocs command of the Makefile's ``test`` target, as arguments."""
    recipe = re.search(r"^test:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert recipe is not None, "the Makefile has no test target"
    (line,) = [each for each in recipe.group(1).splitlines() if "mkdocs build" in each]
    words = shlex.split(line.strip())
    words = words[words.index(next(w for w in words if w.endswith("mkdocs"))) :]
    return [str(Path(sys.executable).parent / "mkdocs"), *words[1:]]


def test_the_docs_build_fails_on_a_broken_anchor(tmp_path: Path) -> None:
    for name in ("mkdocs.yml", "docs", "app"):
        source = ROOT / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, tmp_path / name)
    page = tmp_path / "docs" / "tasks.md"
    page.write_text(page.read_text() + "\nSee [nowhere](runtimes.md#no-such-section).\n")
    command = docs_command()
    at = command.index("--site-dir")
    command[at + 1] = str(tmp_path / "site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    broken = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300, check=False)  # fmt: skip
    assert broken.returncode != 0, broken.stderr
    assert "no-such-section" in broken.stderr
