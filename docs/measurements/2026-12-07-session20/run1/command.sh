#!/usr/bin/env bash
# Session 20 run1 (not run: every start was refused; the next session's first call). In priority order, each step
# only while the call has time for it (LIMIT seconds, default 585); the compared trees come from ../make_trees.sh:
# 1. session 19's gated GPU tests (the quantized GEMV qgemv.cu, FP8 / MXFP4 experts, > 256 experts), test by test;
# 2. qwen3-8b-fp8 decode of this tree and of the branch int-widen (qgemv.cu's e4m3, e2m1 and int4 widened in integer
#    operations), same machine, then int-widen's tests/gpu/test_fp8.py and test_w4.py;
# 3. the branch mla-tc (mla_attend_kernel on tensor cores): tests/gpu/test_mla_cuda.py, then deepseek-v2-lite
#    decode at 8192 positions against this tree;
# 4. NVFP4 and int4 decode of this tree and of int-widen; the tree before qgemv.cu (41c7a1e) on qwen3-8b-fp8; the
#    e4m3 / e2m1 widening bench; mla-tc at 1024;
# 5. on an H200: qwen3-next-80b-a3b-fp8 (1024, 8192) and glm-4.5-air-fp8.
set -uo pipefail
out=$OUT
export PYTHONPATH=. PYTHONUNBUFFERED=1 METRALE_CUDA_UNVERIFIED=1
T0=$(date +%s)
trees=$(mktemp -d)  # the compared trees, unpacked
el() { echo $(( $(date +%s) - T0 )); }
LIMIT=${LIMIT:-585}  # the call's seconds, less a margin
fits() { [ $(( LIMIT - $(el) )) -ge "$1" ]; }  # at least $1 seconds left
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee "$out/gpu.txt"
for t in base intw mlatc; do mkdir -p $trees/$t && tar -xzf session_$t.tgz -C $trees/$t; done
timeout 200 python3 -m pytest -v -s -p no:cacheprovider -rfE --tb=short tests/gpu/test_fp8.py tests/gpu/test_w4.py \
  tests/gpu/test_moe_fp8_cuda.py tests/gpu/test_moe_mxfp4_cuda.py tests/gpu/test_moe_routers_cuda.py \
  tests/gpu/test_gpt_oss_cuda.py tests/gpu/test_moe_cuda.py > "$out/gpu_tests.log" 2>&1
echo "tests exit $? t=$(el)" | tee -a "$out/gpu.txt"
grep -cE " PASSED" "$out/gpu_tests.log"; grep -E " (FAILED|ERROR)|^(FAILED|ERROR)| passed| failed" "$out/gpu_tests.log" | tail -25
bench() {  # name dir preset context timeout
  fits "$5" || { echo "bench $1 $4: no time" | tee -a "$out/gpu.txt"; return; }
  (cd "$2" && PYTHONPATH=. timeout "$5" python3 -m metrale_cli bench --device cuda --preset "$3" --context "$4" \
    --ks 4 --prefill 128 --repeats 20 --no-transformers --format plain) > "$out/bench-$1-$4.txt" 2>&1
  echo "bench $1 $4 exit $? t=$(el)" | tee -a "$out/gpu.txt"; grep -E "decode floor|decode step:|verify k=4" "$out/bench-$1-$4.txt"
}
bench fp8-new . qwen3-8b-fp8 1024 50
bench fp8-intw $trees/intw qwen3-8b-fp8 1024 50
fits 80 && { (cd $trees/intw && timeout 80 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/gpu/test_fp8.py \
  tests/gpu/test_w4.py > "$out/intw_tests.log" 2>&1); echo "int-widen tests exit $? t=$(el)" | tee -a "$out/gpu.txt"; tail -4 "$out/intw_tests.log"; }
fits 90 && { (cd $trees/mlatc && timeout 90 python3 -m pytest -q -s -p no:cacheprovider -rfE --tb=short -x \
  tests/gpu/test_mla_cuda.py > "$out/mlatc_tests.log" 2>&1); echo "mla-tc tests exit $? t=$(el)" | tee -a "$out/gpu.txt"
  grep -E "absorbed vs naive" "$out/mlatc_tests.log" | sort -k9 -g | tail -3; tail -4 "$out/mlatc_tests.log"; }
bench v2lite-main . deepseek-v2-lite 8192 55
bench v2lite-mlatc $trees/mlatc deepseek-v2-lite 8192 55
bench nvfp4 . llama-3.1-8b-nvfp4 1024 50
bench nvfp4-intw $trees/intw llama-3.1-8b-nvfp4 1024 50
bench w4a16 . llama-3.1-8b-w4a16 1024 50
bench w4a16-intw $trees/intw llama-3.1-8b-w4a16 1024 50
bench fp8-base $trees/base qwen3-8b-fp8 1024 50
fits 40 && { timeout 40 python3 -m benchmarks.bench_widen > "$out/bench-widen.txt" 2>&1; echo "widen exit $? t=$(el)" | tee -a "$out/gpu.txt"; tail -12 "$out/bench-widen.txt"; }
bench v2lite-mlatc $trees/mlatc deepseek-v2-lite 1024 55
# 5. on an H200 only (more than 100 GB): the H200 presets of issues 38 and 37
if nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | awk '{exit !($1 > 100000)}'; then
  bench next80b . qwen3-next-80b-a3b-fp8 1024 80
  bench next80b . qwen3-next-80b-a3b-fp8 8192 80
  bench glm-air . glm-4.5-air-fp8 1024 80
fi
