"""Download, here, the wheels the GPU machine's Python 3.12 image lacks, into ``.whl/``.

That image has torch and torchvision but not the serving stack. The versions are the ones
installed in this environment, so both machines run the same code. Then, there::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.

Usage: ``python -m benchmarks.gpu_wheels [--dest .whl]``
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

# The serving stack and what it needs beyond the image's own packages (anyio, h11, httpx,
# numpy, pillow, prometheus-client, pytest and hypothesis are there; these are not, or too old).
PACKAGES = [
    "fastapi", "starlette", "annotated-doc", "pydantic", "pydantic-core", "pydantic-settings",
    "python-dotenv", "annotated-types", "typing-inspection", "typing-extensions", "uvicorn",
    "orjson", "python-multipart", "prometheus-fastapi-instrumentator", "prometheus-client",
    "asgi-lifespan", "pytest-asyncio", "pytest", "pluggy", "iniconfig",
]  # fmt: skip
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


def download(dest: Path) -> list[str]:
    dest.mkdir(parents=True, exist_ok=True)
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    pinned = [f"{name}=={version(name)}" for name in PACKAGES]
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
        "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
        *platforms, "--dest", str(dest), *pinned,
    ]  # fmt: skip
    subprocess.run(command, check=True)
    return pinned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=Path(".whl"))
    args = parser.parse_args()
    for requirement in download(args.dest):
        print(requirement)
    total = sum(path.stat().st_size for path in args.dest.glob("*.whl"))
    print(f"{len(list(args.dest.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB in {args.dest}")


if __name__ == "__main__":
    main()
