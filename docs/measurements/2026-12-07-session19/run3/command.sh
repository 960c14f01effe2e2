#!/usr/bin/env bash
# Session 19 run3 (what the device budget left): the quantized GEMV's GPU tests as it stands (qgemv.cu after its
# instruction-count change, NVFP4's e4m3 scales), test by test. Outputs under $OUT.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 METRALE_CUDA_UNVERIFIED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 115 python3 -m pytest -v -s -p no:cacheprovider -rfE --tb=short tests/gpu/test_fp8.py tests/gpu/test_w4.py \
  > "$OUT/gpu_tests.log" 2>&1
echo "tests exit $?" | tee -a "$OUT/gpu.txt"
grep -cE " PASSED" "$OUT/gpu_tests.log"; grep -E " (FAILED|ERROR)|^(FAILED|ERROR)| passed| failed" "$OUT/gpu_tests.log" | tail -20
