#!/usr/bin/env bash
# Session 20 run1b (a short call: what the device budget left after refused starts): the gated GPU tests of the
# quantized GEMV and the FP8 / MXFP4 experts and > 256 experts' routers, then, while time is left, the branch
# mla-tc's MLA kernel tests (session_mlatc.tgz). Outputs under $OUT.
set -uo pipefail
out=$OUT
export PYTHONPATH=. PYTHONUNBUFFERED=1 METRALE_CUDA_UNVERIFIED=1
T0=$(date +%s)
trees=$(mktemp -d)  # the compared trees, unpacked
LIMIT=${LIMIT:-200}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
timeout $(( LIMIT - 40 )) python3 -m pytest -v -p no:cacheprovider -rfE --tb=short tests/gpu/test_fp8.py tests/gpu/test_w4.py \
  tests/gpu/test_moe_fp8_cuda.py tests/gpu/test_moe_mxfp4_cuda.py tests/gpu/test_moe_routers_cuda.py > "$out/gpu_tests.log" 2>&1
echo "tests exit $? t=$(( $(date +%s) - T0 ))" | tee -a "$out/gpu.txt"
grep -cE " PASSED" "$out/gpu_tests.log"; grep -E " (FAILED|ERROR)|^(FAILED|ERROR)| passed| failed" "$out/gpu_tests.log" | tail -20
left=$(( LIMIT - ($(date +%s) - T0) ))
if [ $left -gt 25 ]; then
  mkdir -p $trees/mlatc && tar -xzf session_mlatc.tgz -C $trees/mlatc
  (cd $trees/mlatc && timeout $(( left - 5 )) python3 -m pytest -q -s -p no:cacheprovider -rfE --tb=short -x \
    tests/gpu/test_mla_cuda.py -k "match_numpy" > "$out/mlatc_tests.log" 2>&1); echo "mla-tc tests exit $?" | tee -a "$out/gpu.txt"
  grep -E "absorbed vs naive" "$out/mlatc_tests.log" | tail -4; tail -4 "$out/mlatc_tests.log"
fi
