#!/usr/bin/env bash
# Builds the CPU image (make image): deploy/docker/build-image.sh [TAG]
#
# BASE_IMAGE (default python:3.11-slim) is used where it is present or can be pulled; otherwise
# build-base.sh builds a stand-in from Debian's packages. TORCH_INDEX (default PyTorch's CPU
# index) is used where it answers; otherwise torch comes from the package index, whose Linux
# x86-64 build is the CUDA one: it runs on a CPU the same, in an image several GB larger.
set -euo pipefail
cd "$(dirname "$0")/../.."

deploy/docker/ensure-engine.sh

tag="${1:-batchserve:cpu}"
base="${BASE_IMAGE:-python:3.11-slim}"
torch_index="${TORCH_INDEX-https://download.pytorch.org/whl/cpu}"

if ! docker image inspect "$base" >/dev/null 2>&1 \
        && ! timeout 60 docker pull --quiet "$base" >/dev/null 2>&1; then
    echo "$base cannot be pulled: building a stand-in from Debian's packages"
    base="batchserve-base:3.11-bookworm"
    deploy/docker/build-base.sh "$base"
fi
if [ -n "$torch_index" ] && ! curl -fsS -m 20 -o /dev/null "$torch_index/torch/"; then
    echo "$torch_index cannot be reached: torch from the package index"
    torch_index=""
fi

# The host's network: the build's pip then reaches the index as this machine does.
docker build --network host -t "$tag" \
    --build-arg BASE_IMAGE="$base" --build-arg TORCH_INDEX="$torch_index" .
docker image inspect --format "$tag: {{.Size}} bytes, user {{.Config.User}}" "$tag"
