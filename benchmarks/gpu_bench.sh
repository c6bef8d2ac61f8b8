#!/usr/bin/env bash
# The prepared GPU benchmark: planned at about 4 minutes on one GPU, capped by a 390 s budget
# (steps that no longer fit are skipped and marked; each command has its own timeout).
#
# Measures the small CNN and a ResNet-50-sized model in fp32 and fp16: a bare torch loop
# (the ceiling) against one fleet worker driven by `inferfleet bench`, with the same device,
# precision and torch threads, and GPU memory sampled during the run (torch's peak allocated
# and reserved in both, nvidia-smi in the background). Writes $OUT/gpu.md, the table for
# docs/benchmarks.md's GPU rows, $OUT/results.json and $OUT/logs/. See benchmarks/gpu_bench.py.
#
# A GPU machine with torch but not the rest: put the missing wheels (pip download redis
# cachetools python-json-logger prometheus-client msgpack click rich) and a redis-server
# binary in .gpu/ and carry .gpu. Every wheel there is installed (errors shown, not hidden).
#
#     OUT=/some/dir bash benchmarks/gpu_bench.sh                  # on the GPU
#     bash benchmarks/gpu_bench.sh --device cpu --models cnn --precisions fp32 --batches 1,8 \
#         --seconds 0.5 --requests cnn=300 --concurrency 16     # the same run, small, on the CPU
#
# Extra arguments go to benchmarks/gpu_bench.py. Exit status: 0 all steps passed, 1 some failed
# (marked in the table, the others measured), 2 a preflight check failed (nothing run).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-bench-out/gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if [ -d .gpu ]; then
  shopt -s nullglob
  wheels=(.gpu/*.whl)
  if [ ${#wheels[@]} -gt 0 ]; then
    "$PYTHON" -m pip install -q --no-index --find-links .gpu "${wheels[@]}" 2>&1 \
      | tee "$OUT/pip.txt" \
      || echo "gpu_bench: installing .gpu/*.whl failed (see $OUT/pip.txt);" \
              "the preflight says what is missing"
  fi
  [ -x .gpu/redis-server ] && export PATH="$PWD/.gpu:$PATH"
fi

# inferfleet.producer and inferfleet.worker live in producer/ and worker/ (setuptools' package-dir):
# where inferfleet is not installed, a package of symlinks maps them.
if ! "$PYTHON" -c "import inferfleet.worker" 2>/dev/null; then
  shim="$(mktemp -d)"
  mkdir -p "$shim/inferfleet"
  for f in inferfleet/*.py inferfleet/py.typed; do ln -s "$PWD/$f" "$shim/inferfleet/"; done
  ln -s "$PWD/producer" "$shim/inferfleet/producer"
  ln -s "$PWD/worker" "$shim/inferfleet/worker"
  export PYTHONPATH="$shim:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
fi
exec "$PYTHON" -m benchmarks.gpu_bench --out "$OUT" "$@"
