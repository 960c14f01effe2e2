#!/usr/bin/env bash
# Session 21 run2: GLM-4.7-Flash (glm4_moe_lite) on the GPU: its cases of tests/gpu/test_mla_cuda.py and the
# glm-4.7-flash preset's bench at 1024; then the rest of tests/gpu (the files run1 did not run), to see the whole GPU
# suite pass after session 19's and 20's shared helpers (gpu_helpers, engine_rows) and qgemv.cu / moe.cu.
# Stops at LIMIT (default 585 s).
set -uo pipefail
out=$OUT
export PYTHONPATH=. PYTHONUNBUFFERED=1 METRALE_CUDA_UNVERIFIED=1
LIMIT=${LIMIT:-585}
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
timeout 120 python3 -m pytest -q -s -p no:cacheprovider -rfE --tb=short tests/gpu/test_mla_cuda.py -k glm4_moe_lite \
  > "$out/glm_lite.log" 2>&1
echo "glm4_moe_lite tests exit $? t=$(el)" | tee -a "$out/gpu.txt"; grep -E "rel err|passed|failed" "$out/glm_lite.log" | tail -12
timeout 100 python3 -m metrale_cli bench --device cuda --preset glm-4.7-flash --context 1024 --ks 4 --prefill 128 \
  --repeats 20 --no-transformers --format plain > "$out/bench-glm47.txt" 2>&1
echo "bench glm-4.7-flash exit $? t=$(el)" | tee -a "$out/gpu.txt"; grep -E "decode floor|decode step:|verify k=4" "$out/bench-glm47.txt"
ran="test_fp8.py test_w4.py test_moe_fp8_cuda.py test_moe_mxfp4_cuda.py test_moe_routers_cuda.py test_gpt_oss_cuda.py test_moe_cuda.py"
ignore=(); for f in $ran; do ignore+=(--ignore "tests/gpu/$f"); done
timeout $(( LIMIT - 5 - $(el) )) python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --durations=15 tests/gpu \
  "${ignore[@]}" > "$out/gpu_rest.log" 2>&1
echo "rest exit $? t=$(el)" | tee -a "$out/gpu.txt"
grep -E "^(FAILED|ERROR)| passed| failed" "$out/gpu_rest.log" | tail -30
