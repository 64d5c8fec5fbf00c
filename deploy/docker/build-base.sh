#!/usr/bin/env bash
# Builds, from Debian's packages alone, a local stand-in for python:3.11-slim, for a machine
# whose Docker cannot pull from a registry:
#
#   deploy/docker/build-base.sh [TAG]          # default: batchserve-base:3.11-bookworm
#   docker build --build-arg BASE_IMAGE=batchserve-base:3.11-bookworm -t batchserve:cpu .
#
# debootstrap makes a minimal Debian bookworm root with its python3.11, `docker import` turns it
# into an image, and base.Dockerfile puts a virtual environment first on PATH, so that `python`
# and `pip` mean what they mean in the official image. The image trusts the CA bundle of the
# machine that builds it (BASE_CA_BUNDLE, default the system's), so that pip in later builds
# reaches the package index through that network's TLS proxy. Needs root, debootstrap and docker.
set -euo pipefail

tag="${1:-batchserve-base:3.11-bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
ca_bundle="${BASE_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
here="$(cd "$(dirname "$0")" && pwd)"

if docker image inspect "$tag" >/dev/null 2>&1 && [ -z "${REBUILD:-}" ]; then
    echo "$tag exists (REBUILD=1 builds it again)"
    exit 0
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
log="$work/build.log"
fail() { tail -20 "$log"; exit 1; }
debootstrap --variant=minbase bookworm "$work/root" "$mirror" >"$log" 2>&1 || fail
# Python by apt inside the new root: debootstrap's --include does not resolve python3.11-venv's
# dependencies.
chroot "$work/root" sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install \
    -y -qq --no-install-recommends python3.11 python3.11-venv ca-certificates netbase tzdata \
    && apt-get clean' >>"$log" 2>&1 || fail
# What python:3.11-slim also leaves out: the package lists, documentation and manual pages.
rm -rf "$work/root/var/lib/apt/lists/"* "$work/root/usr/share/doc" "$work/root/usr/share/man"
tar -C "$work/root" -c . | docker import - "${tag%%:*}-rootfs:bookworm" >/dev/null

mkdir "$work/context"
cp "$ca_bundle" "$work/context/ca-certificates.crt"
docker build --quiet -t "$tag" --build-arg ROOTFS="${tag%%:*}-rootfs:bookworm" \
    -f "$here/base.Dockerfile" "$work/context" >/dev/null
docker image rm "${tag%%:*}-rootfs:bookworm" >/dev/null
echo "$tag built"
