#!/usr/bin/env bash
# Prepare this machine for the compose end-to-end test (tests/e2e/test_compose.py) where
# the public container registry cannot be reached: a Docker engine, and stand-ins for the
# three public images docker-compose.yml and the Dockerfile start from, built from Debian's
# own packages. Writes the variables the test (and `docker compose`) need to the file named
# by $1 (default: $CACHE/compose.env), as KEY=VALUE lines to source:
#
#   PYTHON_IMAGE, REDIS_IMAGE, PROMETHEUS_IMAGE   stand-ins for python:3.11-slim, redis:7,
#   prom/prometheus
#   INFERFLEET_TEST_WHEELHOUSE                    torch and its dependencies, which the test serves
#   on
#                                                 127.0.0.1 as the image build's TORCH_INDEX_URL
#
# On a machine that reaches the public registries none of this is needed: the test then
# builds from the official images. Run as root (apt-get, dockerd). Every step prints its
# time. The stand-ins are cached in Docker itself, keyed by a hash of this script and the
# machine's CA bundle; the wheels in $CACHE. A second run only checks them.
#
#   scripts/compose_env.sh [ENV_FILE]
#   START_DOCKERD=0 scripts/compose_env.sh      # never start dockerd; fail if none answers
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${INFERFLEET_CI_CACHE:-/var/cache/inferfleet-ci}"
ENV_FILE="${1:-$CACHE/compose.env}"
SUITE=bookworm                                  # Debian 12: python3.11, as python:3.11-slim
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt    # pip inside a build trusts what this machine trusts
TORCH_SPEC="torch==2.13.0"                       # the Dockerfile's pin
PREFIX=inferfleet-standin
mkdir -p "$CACHE"

step() {  # step NAME COMMAND...: run it, print how long it took
  local name="$1" start=$SECONDS
  shift
  echo "==> compose-env: $name"
  "$@"
  echo "==> compose-env: $name: $((SECONDS - start)) s"
}

install_tools() {
  local missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  command -v iptables >/dev/null || missing+=(iptables)
  if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null; then
    missing+=(docker-compose)
  fi
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "    apt-get install ${missing[*]}"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends "${missing[@]}") >"$CACHE/apt.log" 2>&1 || {
    tail -20 "$CACHE/apt.log" >&2; echo "could not install ${missing[*]}" >&2; return 1; }
}

start_engine() {
  docker info >/dev/null 2>&1 && { echo "    a Docker engine answers"; return 0; }
  if [ "${START_DOCKERD:-1}" != 1 ]; then
    echo "no Docker engine answers (START_DOCKERD=0)" >&2
    return 1
  fi
  local old
  old="$(cat /var/run/docker.pid 2>/dev/null || true)"
  if [ -n "$old" ] && kill -0 "$old" 2>/dev/null; then  # a dockerd still starting or stopping
    echo "    waiting for dockerd $old to answer or exit"
    for _ in $(seq 60); do
      docker info >/dev/null 2>&1 && return 0
      kill -0 "$old" 2>/dev/null || break
      sleep 0.5
    done
  fi
  echo "    starting dockerd (log: $CACHE/dockerd.log)"
  nohup dockerd >"$CACHE/dockerd.log" 2>&1 &
  local pid=$!
  echo "$pid" >"$CACHE/dockerd.pid"
  for _ in $(seq 120); do
    docker info >/dev/null 2>&1 && return 0
    kill -0 "$pid" 2>/dev/null || break  # it exited: say why now, not in a minute
    sleep 0.5
  done
  tail -20 "$CACHE/dockerd.log" >&2
  echo "dockerd did not answer within 60 s" >&2
  return 1
}

# what the stand-ins are built from: the functions that build them and the CA bundle they carry
recipe() {
  { declare -f build_base build_standin build_python build_redis build_prometheus
    echo "$SUITE $MIRROR"; cat "$CA_BUNDLE"; } | sha256sum | cut -c1-16
}

have_image() {  # have_image TAG: it exists and was built by this recipe
  local label='{{index .Config.Labels "inferfleet.standin.recipe"}}'
  [ "$(docker image inspect -f "$label" "$1" 2>/dev/null)" = "$RECIPE" ]
}

build_base() {
  have_image "$PREFIX/debian:$SUITE" && { echo "    cached"; return 0; }
  local rootfs="$CACHE/rootfs"
  rm -rf "$rootfs"
  # One root file system for the three stand-ins: Debian's python3, redis-server, prometheus.
  debootstrap --variant=minbase \
    --include=python3,python3-venv,ca-certificates,redis-server,prometheus \
    "$SUITE" "$rootfs" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 || {
    tail -20 "$CACHE/debootstrap.log" >&2; return 1; }
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
  tar -C "$rootfs" -c . | docker import \
    -c "LABEL inferfleet.standin.recipe=$RECIPE" -c 'ENV LANG=C.UTF-8' -c 'CMD ["bash"]' \
    - "$PREFIX/debian:$SUITE" >/dev/null
  rm -rf "$rootfs"
}

build_standin() {  # build_standin TAG: a Dockerfile on stdin, this script's folder as context
  local tag="$1" ctx
  have_image "$tag" && { echo "    $tag cached"; return 0; }
  ctx="$(mktemp -d)"
  cp "$CA_BUNDLE" "$ctx/ca-certificates.crt"
  cat >"$ctx/Dockerfile"
  DOCKER_BUILDKIT=0 docker build -q --label "inferfleet.standin.recipe=$RECIPE" -t "$tag" "$ctx" \
    >/dev/null
  rm -rf "$ctx"
  echo "    $tag built"
}

build_python() {  # python:3.11-slim: python and pip on PATH from a venv of Debian's python3.11
  build_standin "$PREFIX/python:3.11-slim" <<EOF
FROM $PREFIX/debian:$SUITE
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
RUN python3 -m venv /usr/local/python \
    && printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >/etc/pip.conf
ENV PATH=/usr/local/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
CMD ["python3"]
EOF
}

# redis:7: its entrypoint turns protected mode off for a bare redis-server, as the official one
build_redis() {
  build_standin "$PREFIX/redis:7" <<EOF
FROM $PREFIX/debian:$SUITE
RUN mkdir -p /data && printf '%s\n' '#!/bin/sh' \
      'if [ "\$1" = redis-server ]; then shift; set -- redis-server --protected-mode no "\$@"; fi' \
      'exec "\$@"' >/usr/local/bin/docker-entrypoint.sh \
    && chmod +x /usr/local/bin/docker-entrypoint.sh
VOLUME /data
WORKDIR /data
EXPOSE 6379
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["redis-server"]
EOF
}

build_prometheus() {  # prom/prometheus: the binary as entrypoint, user nobody, data in /prometheus
  build_standin "$PREFIX/prometheus:v2" <<EOF
FROM $PREFIX/debian:$SUITE
RUN mkdir -p /prometheus /etc/prometheus && chown nobody:nogroup /prometheus
USER nobody
WORKDIR /prometheus
VOLUME /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
EOF
}

# torch as `pip install torch==2.13.0` finds it here (pip's find-links or index), with its deps
fetch_wheels() {
  local dir="$CACHE/wheelhouse"
  if [ -f "$dir/.complete" ] && [ "$(cat "$dir/.complete")" = "$TORCH_SPEC" ]; then
    echo "    cached: $(ls "$dir" | grep -c '\.whl$') wheels"; return 0
  fi
  rm -rf "$dir" && mkdir -p "$dir"
  python3 -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version 3.11 \
    --dest "$dir" "$TORCH_SPEC"
  echo "$TORCH_SPEC" >"$dir/.complete"
  echo "    $(ls "$dir" | grep -c '\.whl$') wheels: $(ls "$dir" | grep '^torch-')"
}

write_env() {
  cat >"$ENV_FILE" <<EOF
PYTHON_IMAGE=$PREFIX/python:3.11-slim
REDIS_IMAGE=$PREFIX/redis:7
PROMETHEUS_IMAGE=$PREFIX/prometheus:v2
INFERFLEET_TEST_WHEELHOUSE=$CACHE/wheelhouse
EOF
  echo "    $ENV_FILE"
}

step "install docker.io, debootstrap, docker-compose" install_tools
step "Docker engine" start_engine
RECIPE="$(recipe)"
step "Debian $SUITE base image (debootstrap)" build_base
step "stand-in python:3.11-slim" build_python
step "stand-in redis:7" build_redis
step "stand-in prom/prometheus" build_prometheus
step "torch wheels" fetch_wheels
step "variables" write_env
