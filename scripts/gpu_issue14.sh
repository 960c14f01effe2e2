#!/usr/bin/env bash
# Issue 14 (mixtures of experts) on the GPU machine, from the source tree, nothing installed:
#   bash scripts/gpu_issue14.sh [OUTDIR]        (default: $OUT, else /tmp/metrale-gpu-moe)
# 1. the MoE kernels' cold compile time; 2. the MoE GPU tests (kernels against NumPy, the CUDA engine
# against the NumPy engine for qwen3_moe, qwen2_moe and mixtral), then the rest of tests/gpu (the dense
# paths the MoE ops sit beside); 3. the bench of the qwen3-30b-a3b and mixtral-8x7b presets at 1024
# context (decode against the floor of the experts actually chosen, verify k = 1, 2, 4, 8 against their
# own floors, prefill of 2048 tokens against the GEMM rate). Every log lands in OUTDIR.
set -uo pipefail
out=${1:-${OUT:-/tmp/metrale-gpu-moe}}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import time; from metrale_cli.backends.cuda.kernels import Kernels; k = Kernels(); t = time.time(); \
from metrale_cli.backends.cuda.kernels.moe import MoeKernels; MoeKernels(k); print(f'MoE kernel compile (cold): {time.time() - t:.1f} s')" \
  2>&1 | tee -a "$out/gpu.txt"
timeout 500 python3 -m pytest tests/gpu/test_moe_cuda.py -q -p no:cacheprovider -rs -s 2>&1 | tee "$out/gpu_tests_moe.log" \
  | grep -E "rel err|differs|seed|FAILED|passed|failed|error" | tail -60
timeout 500 python3 -m pytest tests/gpu -q -p no:cacheprovider -rs --ignore=tests/gpu/test_moe_cuda.py 2>&1 \
  | tee "$out/gpu_tests_rest.log" | grep -E "FAILED|passed|failed|error" | tail -20
for preset in qwen3-30b-a3b mixtral-8x7b; do
  timeout 580 python3 -m metrale_cli bench --device cuda --preset "$preset" --context 1024 --ks 1,2,4,8 \
    --prefill 2048 --repeats 50 --no-transformers --format plain --json "$out/bench-$preset-1024.json" \
    2>"$out/bench-$preset-1024.err" | tee "$out/bench-$preset-1024.txt"
  tail -3 "$out/bench-$preset-1024.err"
done
