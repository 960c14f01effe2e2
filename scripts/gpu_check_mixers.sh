#!/usr/bin/env bash
# The GPU checks of the latent-attention / router (issue 37) and Gated DeltaNet (issue 38) CUDA code, in one run on
# the GPU machine (from the source tree, nothing installed):
#   bash scripts/gpu_check_mixers.sh [OUTDIR] [PRESET ...]
# 1. the GPU tests of those kinds (kernels against their definitions, engines against the NumPy engine) and of the
#    FP8 weights (kept as stored, or dequantized to bf16 at load);
# 2. the bench of each preset (default: deepseek-v2-lite, moonlight-16b-a3b, qwen3.5-27b) at 1024 context.
set -uo pipefail
out=${1:-${OUT:-/tmp/metrale-gpu}}
shift || true
presets=("$@")
[ ${#presets[@]} -gt 0 ] || presets=(deepseek-v2-lite moonlight-16b-a3b qwen3.5-27b)
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 METRALE_CUDA_UNVERIFIED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee "$out/gpu.txt"
timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -rs --tb=short -s \
  tests/gpu/test_moe_routers_cuda.py tests/gpu/test_mla_cuda.py tests/gpu/test_moe_cuda.py \
  tests/gpu/test_gated_delta_cuda.py tests/gpu/test_linear_engine_cuda.py tests/gpu/test_fp8.py \
  > "$out/mixer_tests.log" 2>&1
echo "tests exit $?" | tee -a "$out/gpu.txt"
grep -E "^(FAILED|ERROR)|passed|failed" "$out/mixer_tests.log" | tail -30
for p in "${presets[@]}"; do
  timeout "${BENCH_TIMEOUT:-90}" python3 -m metrale_cli bench --device cuda --preset "$p" --context 1024 --ks 1,4 \
    --prefill 2048 --repeats 10 --no-transformers --format plain --json "$out/bench-$p.json" > "$out/bench-$p.txt" 2>&1
  echo "bench $p exit $?" | tee -a "$out/gpu.txt"
  tail -25 "$out/bench-$p.txt"
done
