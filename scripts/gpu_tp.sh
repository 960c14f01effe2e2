#!/usr/bin/env bash
# Issue 17 (tensor parallelism) on the GPU machine, from the source tree (nothing installed):
#   bash scripts/gpu_tp.sh [OUTDIR]          (OUTDIR defaults to $OUT, else /tmp/metrale-gpu-tp; at most
#   240 + 120 + 2 x 100 s on one GPU, more benches where more GPUs are visible)
# 1. the TP tests (tests/gpu/test_tp_cuda.py): --tp 1 through a one-rank NCCL communicator equals the plain
#    engine bit for bit, graph replay equals eager on the TP path, --tp 2/4/8 equals --tp 1 (skipped, with
#    the reason, when fewer GPUs are visible); then the plain engine's GPU tests that the TP hooks touch
#    (engine parity, CLI) as the regression check; 2. `metrale bench` on llama-3.1-8b at context 1024,
#    plain and --tp 1 (the cost of the sharded path on one GPU: the all-reduces of one rank), and --tp N
#    for every N in 2 4 8 that the visible GPUs allow. Logs and JSON go to OUTDIR; a summary at the end.
set -uo pipefail
out=${1:-${OUT:-/tmp/metrale-gpu-tp}}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import cupy; from cupy.cuda import nccl; print('cupy', cupy.__version__, 'nccl', nccl.get_version(), \
'gpus', cupy.cuda.runtime.getDeviceCount())" 2>&1 | tee -a "$out/gpu.txt"
timeout 240 python3 -m pytest tests/gpu/test_tp_cuda.py -q -p no:cacheprovider -rs -s 2>&1 | tee "$out/tp_tests.log" \
  | grep -E "rel err|SKIPPED|FAILED|passed|failed|error" | tail -30
timeout 120 python3 -m pytest tests/gpu/test_cuda_engine.py tests/gpu/test_cli_cuda.py -q -p no:cacheprovider -x 2>&1 \
  | tee "$out/regression_tests.log" | tail -3
bench() {  # name, then extra bench options
  local name=$1; shift
  timeout 100 python3 -m metrale_cli bench --device cuda --preset llama-3.1-8b --context 1024 --repeats 30 \
    --no-transformers --format plain --json "$out/bench-8b-1024-$name.json" "$@" > "$out/bench-8b-1024-$name.txt" 2>&1
  echo "bench $name: exit $?"
}
bench plain
bench tp1 --tp 1
gpus=$(python3 -c "import cupy; print(cupy.cuda.runtime.getDeviceCount())" 2>/dev/null || echo 1)
for n in 2 4 8; do
  if [ "$gpus" -ge "$n" ]; then bench "tp$n" --tp "$n"; fi
done
python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for f in sorted(out.glob("bench-8b-1024-*.json")):
    d = json.loads(f.read_text())
    figs = {x["name"]: x for x in d["figures"]}
    keep = ["decode floor", "decode step", "decode + argmax (host wall)", "verify k=4", "prefill 2048"]
    print(f.stem, " | ".join(f"{k} {figs[k]['value']:.4g} {figs[k]['unit']}" for k in keep if k in figs))
PY
