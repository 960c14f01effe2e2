#!/usr/bin/env bash
# Session 19 run1: the whole GPU suite (the gated quantized GEMV qgemv.cu and FP8-expert kernels included), then
# benches of the quantized presets (qwen3-8b-fp8 against the tree before qgemv.cu, session_base.tgz = `git archive
# cfe5b9c~1 metrale_cli configs`) and a per-kernel profile of MLA decode. Outputs under $OUT.
set -uo pipefail
out=$OUT
export PYTHONPATH=. PYTHONUNBUFFERED=1 METRALE_CUDA_UNVERIFIED=1
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee "$out/gpu.txt"
timeout 330 python3 -m pytest tests/gpu -q -p no:cacheprovider -rs -s --tb=short > "$out/gpu_suite.log" 2>&1
echo "suite exit $? t=$(el)" | tee -a "$out/gpu.txt"
grep -E "^(FAILED|ERROR)|passed|failed" "$out/gpu_suite.log" | tail -30
base=$(mktemp -d); tar xzf session_base.tgz -C "$base"
b() {  # name, dir, timeout, args...
  local n=$1 d=$2 t=$3; shift 3
  (cd "$d" && PYTHONPATH=. timeout "$t" python3 -m metrale_cli bench --device cuda "$@" --no-transformers --format plain) \
    > "$out/b-$n.txt" 2>&1
  echo "bench $n exit $? t=$(el)" | tee -a "$out/gpu.txt"; grep -iE "decode|verify|prefill" "$out/b-$n.txt" | head -6
}
b fp8-base "$base" 60 --preset qwen3-8b-fp8 --context 1024 --ks 4 --prefill 128 --repeats 20
b fp8-new . 60 --preset qwen3-8b-fp8 --context 1024 --ks 4 --prefill 128 --repeats 20
b nvfp4 . 60 --preset llama-3.1-8b-nvfp4 --context 1024 --ks 4 --prefill 512 --repeats 20
b w4a16 . 60 --preset llama-3.1-8b-w4a16 --context 1024 --ks 4 --prefill 512 --repeats 20
timeout 90 python3 benchmarks/activation_quant_kl.py --preset qwen3-8b-fp8 --device cuda --tokens 512 \
  --json "$out/kl-qwen3-8b-fp8.json" > "$out/b-kl.txt" 2>&1; echo "kl exit $? t=$(el)" | tee -a "$out/gpu.txt"; tail -2 "$out/b-kl.txt"
left=$(( 575 - $(el) ))
[ $left -gt 30 ] && { timeout $left python3 benchmarks/profile_decode.py --preset deepseek-v2-lite --context 1024 \
  > "$out/b-profile-mla.txt" 2>&1; echo "profile mla exit $? t=$(el)" | tee -a "$out/gpu.txt"; head -45 "$out/b-profile-mla.txt"; }
cat "$out"/b-*.txt > "$out/bench.txt"; rm -f "$out"/b-*.txt
