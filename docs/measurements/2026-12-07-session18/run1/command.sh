#!/usr/bin/env bash
set -uo pipefail
out=$OUT
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee "$out/gpu.txt"
METRALE_CUDA_UNVERIFIED=1 timeout 330 python3 -m pytest tests/gpu -q -p no:cacheprovider -rs -s --tb=short \
  > "$out/gpu_suite.log" 2>&1; echo "suite exit $? t=$(el)" | tee -a "$out/gpu.txt"
grep -E "^(FAILED|ERROR)|passed|failed" "$out/gpu_suite.log" | tail -25
timeout 40 python3 -m benchmarks.bench_gated_delta 2048 512 > "$out/bench-gdn.txt" 2>&1; echo "gdn bench exit $? t=$(el)" | tee -a "$out/gpu.txt"
tail -6 "$out/bench-gdn.txt"
base=$(mktemp -d); cp -r metrale_cli "$base/"; cp session_base/mla.cu session_base/common.cu session_base/mla.py "$base/metrale_cli/backends/cuda/kernels/"
for v in base new; do
  d=.; [ $v = base ] && d=$base
  (cd $d && PYTHONPATH=. timeout 45 python3 -m metrale_cli bench --device cuda --preset deepseek-v2-lite --context 1024 \
    --ks 4 --prefill 128 --repeats 20 --no-transformers --format plain) > "$out/bench-mla-$v.txt" 2>&1
  echo "bench mla $v exit $? t=$(el)" | tee -a "$out/gpu.txt"; grep -iE "decode|verify" "$out/bench-mla-$v.txt" | head -4
done
left=$(( 520 - $(el) ))
if [ $left -gt 30 ]; then
  METRALE_CUDA_UNVERIFIED=1 timeout $left python3 -m metrale_cli bench --device cuda --preset gpt-oss-20b --context 1024 \
    --ks 4 --prefill 512 --repeats 10 --no-transformers --format plain > "$out/bench-gptoss.txt" 2>&1
  echo "bench gpt-oss exit $? t=$(el)" | tee -a "$out/gpu.txt"; tail -12 "$out/bench-gptoss.txt"
fi
cat "$out"/bench-*.txt > "$out/bench.txt"; rm -f "$out"/bench-*.txt
