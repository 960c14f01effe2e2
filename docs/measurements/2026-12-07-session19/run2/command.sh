#!/usr/bin/env bash
# Session 19 run2: the GPU tests of what is gated (the quantized GEMV qgemv.cu after its instruction-count change,
# NVFP4's e4m3 scales, FP8 / MXFP4 experts and the MoE kernels' format templates, > 256 experts), test by test
# (-v); then whether the FP8 GEMV is bound by its e4m3 widening (benchmarks/bench_fp8_widen.py) and qwen3-8b-fp8
# decode (run1 measured the tree before qgemv.cu on another H100). Outputs
# under $OUT.
set -uo pipefail
out=$OUT
export PYTHONPATH=. PYTHONUNBUFFERED=1 METRALE_CUDA_UNVERIFIED=1
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee "$out/gpu.txt"
timeout 215 python3 -m pytest -v -s -p no:cacheprovider -rfE --tb=short tests/gpu/test_fp8.py tests/gpu/test_w4.py \
  tests/gpu/test_moe_fp8_cuda.py tests/gpu/test_moe_mxfp4_cuda.py tests/gpu/test_moe_routers_cuda.py \
  tests/gpu/test_moe_cuda.py tests/gpu/test_gpt_oss_cuda.py \
  tests/gpu/test_linear_engine_cuda.py::test_preset_shapes_load_and_decode > "$out/gpu_tests.log" 2>&1
echo "tests exit $? t=$(el)" | tee -a "$out/gpu.txt"
grep -cE " PASSED" "$out/gpu_tests.log"; grep -E " (FAILED|ERROR)|^(FAILED|ERROR)| passed| failed" "$out/gpu_tests.log" | tail -25
timeout 40 python3 -m benchmarks.bench_fp8_widen > "$out/bench-widen.txt" 2>&1; echo "widen exit $? t=$(el)" | tee -a "$out/gpu.txt"
cat "$out/bench-widen.txt" | tail -5
for v in new; do
  d=.
  (cd "$d" && PYTHONPATH=. timeout 55 python3 -m metrale_cli bench --device cuda --preset qwen3-8b-fp8 --context 1024 \
    --ks 4 --prefill 128 --repeats 20 --no-transformers --format plain) > "$out/bench-fp8-$v.txt" 2>&1
  echo "bench fp8 $v exit $? t=$(el)" | tee -a "$out/gpu.txt"; grep -E "decode floor|decode step:|verify" "$out/bench-fp8-$v.txt"
done
