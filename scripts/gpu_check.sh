#!/usr/bin/env bash
# Everything the GPU issues report, in one run on the GPU machine (from the source tree, nothing installed):
#   bash scripts/gpu_check.sh [OUTDIR]
# 0. the kernels' cold compile time (the core module, then the fused rows path's module); 1. the GPU test
# suite (kernels, engine parity, CLI on cuda); 2. the bench of the llama-3.1-8b shape at 1024 context (both
# rows paths, fused and rows, side by side, with transformers eager) and at 8192; 3. the shipped
# target/draft pair, speculative against plain decoding.
set -uo pipefail
out=${1:-${OUT:-/tmp/metrale-gpu}}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import time; t = time.time(); from metrale_cli.backends.cuda.kernels import Kernels; k = Kernels(); \
a = time.time(); k.load_fused(); print(f'kernel compile (cold): core module {a - t:.1f} s, fused module {time.time() - a:.1f} s')" \
  | tee -a "$out/gpu.txt"
timeout 420 python3 -m pytest tests/gpu -q -p no:cacheprovider -rs -s 2>&1 | tee "$out/gpu_tests.log" \
  | grep -E "rel err|differs|FAILED|passed|failed|error" | tail -40
python3 -m metrale_cli bench --device cuda --preset llama-3.1-8b --context 1024 --repeats 50 --path fused,rows \
  --format plain --json "$out/bench-8b-1024.json" 2>/dev/null | tee "$out/bench-8b-1024.txt"
python3 -m metrale_cli bench --device cuda --preset llama-3.1-8b --context 8192 --repeats 30 --no-transformers \
  --format plain --json "$out/bench-8b-8192.json" 2>/dev/null | tee "$out/bench-8b-8192.txt"
for p in "The while statement" "The for statement" "The import system"; do
  python3 -m metrale_cli decode --device cuda --prompt "$p" --steps 128 --ignore-eos \
    --draft-model metrale_cli/assets/models/default-draft --k 4 --timings --format json > "$out/spec-$(echo $p | tr ' ' _).json"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); s=d['speculative']; t=d.get('timings',{}); print(sys.argv[1].split('/')[-1], 'acceptance', s['acceptance_rate'], 'mean/pass', s['mean_accepted_per_pass'], {k: v for k, v in t.items() if 'per_s' in k or 'match' in k})" "$out/spec-$(echo $p | tr ' ' _).json"
done
