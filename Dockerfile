# syntax=docker/dockerfile:1
# CPU image. For CUDA, start from an image with a CUDA build of torch (see the README).
FROM python:3.11-slim

# The CPU build of torch; point it at a CUDA index (e.g. .../whl/cu128) for a GPU image.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /srv

# Dependencies first, in their own layer: code changes do not reinstall torch.
COPY pyproject.toml README.md ./
RUN mkdir -p app batching preprocessing \
    && touch app/__init__.py batching/__init__.py preprocessing/__init__.py \
    && pip install --extra-index-url "$TORCH_INDEX" . \
    && pip uninstall -y batchserve

COPY app ./app
COPY batching ./batching
COPY preprocessing ./preprocessing
RUN pip install --no-deps .

RUN useradd --create-home --uid 10001 batchserve
USER batchserve
ENV TORCH_HOME=/home/batchserve/.cache/torch

EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=120s --retries=3 \
    CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2).status != 200)"

CMD ["uvicorn", "app.main:app", "--host", "0.0.0.0", "--port", "8000", "--timeout-graceful-shutdown", "40"]
