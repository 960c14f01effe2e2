#!/usr/bin/env bash
# The ring GEMV (gemv_ring.cu) and the engine's default rows path on the GPU machine, from the source tree:
#   bash scripts/gpu_ring.sh [OUTDIR] [PRESET:CONTEXT ... | none]   (default: $OUT, else /tmp/metrale-gpu-ring)
#   RING_KERNELS=0 skips the kernel bench; FULL=1 runs the whole GPU suite instead of test_gemv_ring.py;
#   BREAKDOWN="llama-3.1-8b phi-3-mini" adds scripts/decode_breakdown.py (rows vs rows-stream, BD_CONTEXT or 1024) per preset,
#   BD_ARGS its extra options (e.g. "--ablate"); PATHS the rows paths to bench and break down side by side (default
#   rows,rows-stream); TESTS=0 runs no tests after the smoke test, TESTS="tests/gpu/a.py ..." those files.
# 1. a smoke test (one launch against gemv, graph + PDL chain; stops here on failure or hang); 2. bench_kernels
# --ring (each projection alone, then 16-layer chains, rows path kernels vs ring, PDL off / on); 3. metrale bench --path
# rows,rows-stream on the given presets; 4. tests/gpu/test_gemv_ring.py whole (FULL=1: the GPU suite).
# The logs go into OUTDIR/results.tgz (the device tool returns at most 8 files); a summary is printed last.
set -uo pipefail
out=${1:-${OUT:-/tmp/metrale-gpu-ring}}
shift || true
presets=${*:-llama-3.1-8b:1024 phi-3-mini:1024 gemma-2-9b:1024}
logs=$(mktemp -d)
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
t0=$(date +%s)
finish() {
  tar -czf "$out/results.tgz" -C "$logs" .
  {
    cat "$logs/times.txt"
    for f in "$logs"/tests*.log; do echo "== $(basename "$f")"; grep -E "passed|failed|error" "$f" | tail -2
      sed -n '/= FAILURES =/,/short test summary/p' "$f" | head -80; grep -E "^FAILED|^ERROR" "$f"; done
    cat "$logs/ring.txt" 2>/dev/null
    for f in "$logs"/bd-*.txt; do [ -e "$f" ] && { echo "== $(basename "$f")"; cat "$f"; }; done
    for f in "$logs"/bench-*.txt; do echo "== $(basename "$f")"; grep -E "floor:|rows paths|decode step:|x floor|verify k|path" "$f"; tail -3 "$logs/$(basename "$f" .txt).err"; done
  } > "$out/summary.txt"
  cat "$out/summary.txt"
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader > "$logs/gpu.txt"
timeout 150 python3 -m pytest tests/gpu/test_gemv_ring.py -x -q -p no:cacheprovider -rfs --tb=short \
  -k "same_bits or refusals" > "$logs/tests-smoke.log" 2>&1
rc=$?
echo "smoke rc=$rc $(( $(date +%s) - t0 )) s" >> "$logs/times.txt"
if [ $rc -ne 0 ]; then finish; exit 1; fi
if [ "${RING_KERNELS:-1}" != 0 ]; then  # RING_KERNELS=0: skip the kernel bench
  timeout 170 python3 -m benchmarks.bench_kernels --ring > "$logs/ring.txt" 2>&1
  echo "bench_kernels --ring rc=$? $(( $(date +%s) - t0 )) s" >> "$logs/times.txt"
fi
for pc in ${presets/none/}; do
  p=${pc%:*}; c=${pc#*:}
  timeout 150 python3 -m metrale_cli bench --device cuda --preset "$p" --context "$c" --path "${PATHS:-rows,rows-stream}" --ks 4,8 \
    --prefill 256 --no-transformers --repeats 20 --format plain > "$logs/bench-$p-$c.txt" 2> "$logs/bench-$p-$c.err"
  echo "bench $p $c rc=$? $(( $(date +%s) - t0 )) s" >> "$logs/times.txt"
done
for p in ${BREAKDOWN:-}; do
  timeout 150 python3 scripts/decode_breakdown.py --preset "$p" --context "${BD_CONTEXT:-1024}" --paths "${PATHS:-rows,rows-stream}" --repeats 15 \
    ${BD_ARGS:-} > "$logs/bd-$p.txt" 2>&1
  echo "breakdown $p rc=$? $(( $(date +%s) - t0 )) s" >> "$logs/times.txt"
done
if [ "${TESTS:-1}" = 0 ]; then
  true
elif [ "${TESTS:-1}" != 1 ]; then
  timeout 300 python3 -m pytest $TESTS -q -p no:cacheprovider -rfs --tb=short > "$logs/tests-some.log" 2>&1
elif [ "${FULL:-0}" = 1 ]; then
  timeout 400 python3 -m pytest tests/gpu -q -p no:cacheprovider -rfs --tb=short > "$logs/tests-all.log" 2>&1
else
  timeout 150 python3 -m pytest tests/gpu/test_gemv_ring.py -q -p no:cacheprovider -rfs --tb=short > "$logs/tests-ring.log" 2>&1
fi
echo "tests rc=$? $(( $(date +%s) - t0 )) s" >> "$logs/times.txt"
finish
