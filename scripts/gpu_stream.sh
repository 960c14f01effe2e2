#!/usr/bin/env bash
# The streaming qkv GEMV and the SIMT attention splits on the GPU machine, from the source tree (< 9 min):
#   bash scripts/gpu_stream.sh [OUTDIR] [PRESET:CONTEXT ...]   (default: $OUT, else /tmp/metrale-gpu-stream)
# 1. the whole GPU test suite (failures printed); 2. bench_kernels --stream (gemv vs the streaming configs on
# the presets' qkv) and bench_attention --simt (the SIMT attention's split counts, old and new); 3. metrale
# bench --path rows,rows-fma (the step with and without the streaming GEMV, same run) on the given presets;
# 4. the per-launch breakdown of the rows path, phi-3-mini and llama-3.1-8b at 1024 context.
# The logs go into OUTDIR/results.tgz (the device tool returns at most 8 files); a summary is printed last.
set -uo pipefail
out=${1:-${OUT:-/tmp/metrale-gpu-stream}}
shift || true
presets=${*:-gemma-2-9b:1024 phi-3-mini:1024 gemma-3-12b:1024 phi-4-mini:8192}
logs=$(mktemp -d)
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader > "$logs/gpu.txt"
timeout 330 python3 -m pytest tests/gpu -q -p no:cacheprovider -rfs --tb=short > "$logs/gpu_tests.log" 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s" >> "$logs/times.txt"
timeout 60 python3 -m benchmarks.bench_kernels --stream > "$logs/stream.txt" 2>&1
echo "bench_kernels rc=$? $(( $(date +%s) - t0 )) s" >> "$logs/times.txt"
timeout 60 python3 -m benchmarks.bench_attention --simt > "$logs/simt.txt" 2>&1
echo "bench_attention rc=$? $(( $(date +%s) - t0 )) s" >> "$logs/times.txt"
for pc in $presets; do
  p=${pc%:*}; c=${pc#*:}
  timeout 75 python3 -m metrale_cli bench --device cuda --preset "$p" --context "$c" --path rows,rows-fma --ks 4,8 \
    --prefill 256 --no-transformers --repeats 20 --format plain > "$logs/bench-$p-$c.txt" 2> "$logs/bench-$p-$c.err"
  echo "bench $p $c rc=$? $(( $(date +%s) - t0 )) s" >> "$logs/times.txt"
done
for p in phi-3-mini llama-3.1-8b; do
  timeout 60 python3 scripts/decode_breakdown.py --preset "$p" --context 1024 --paths rows --repeats 15 > "$logs/bd-$p.txt" 2>&1
  echo "breakdown $p rc=$? $(( $(date +%s) - t0 )) s" >> "$logs/times.txt"
done
tar -czf "$out/results.tgz" -C "$logs" .
{
  cat "$logs/times.txt"; grep -E "passed|failed" "$logs/gpu_tests.log" | tail -2
  sed -n '/= FAILURES =/,/short test summary/p' "$logs/gpu_tests.log" | head -60; grep -E "^FAILED|^ERROR" "$logs/gpu_tests.log"
  tail -21 "$logs/stream.txt"; tail -9 "$logs/simt.txt"
  for f in "$logs"/bench-*.txt; do echo "== $(basename "$f")"; grep -E "floor:|rows paths|decode step:|x floor|verify k" "$f"; done
  for f in "$logs"/bd-*.txt; do echo "== $(basename "$f")"; cat "$f"; done
} > "$out/summary.txt"
cat "$out/summary.txt"
