#!/usr/bin/env bash
# Makes sure a Docker engine answers: on a Debian machine without one, installs Debian's
# docker.io (and debootstrap, for build-base.sh) and starts dockerd in the background, as root.
# Exits non-zero, saying why, where no engine can be had.
set -euo pipefail

answers() { timeout 20 docker info >/dev/null 2>&1; }
answers && exit 0

if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        echo "no Docker engine answers, and it cannot be installed here (needs root and apt)" >&2
        exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        docker.io debootstrap >/dev/null
fi
if ! answers; then
    log="${TMPDIR:-/tmp}/dockerd.log"
    nohup dockerd >"$log" 2>&1 &
    for _ in $(seq 60); do
        answers && break
        sleep 1
    done
    answers || { echo "dockerd did not start:" >&2; tail -20 "$log" >&2; exit 1; }
fi
