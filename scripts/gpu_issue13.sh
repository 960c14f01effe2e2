#!/usr/bin/env bash
# Issue 13 on the GPU machine, in one run from the source tree (nothing installed):
#   bash scripts/gpu_issue13.sh [OUTDIR]          (OUTDIR defaults to $OUT, else /tmp/metrale-gpu13)
# 1. the GPU tests: the issue-13 kernels and engine tests, then the whole GPU suite (the changed kernels
#    serve every family); 2. `metrale bench` on the new presets at 1024 and 8192 context (gemma-2-9b and
#    phi-3-mini just under their max_position_embeddings of 8192 and 4096, which must also hold the
#    bench's draft positions), and on llama-3.1-8b at 1024 as the before/after check of the shared kernels. Logs and JSON go to OUTDIR; a summary is printed at the end.
set -uo pipefail
out=${1:-${OUT:-/tmp/metrale-gpu13}}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import time; t = time.time(); from metrale_cli.backends.cuda.kernels import Kernels; k = Kernels(); \
a = time.time(); k.load_extra(); print(f'kernel compile (cold): core module {a - t:.1f} s, extra module {time.time() - a:.1f} s')" \
  2>&1 | tee -a "$out/gpu.txt"
timeout 900 python3 -m pytest tests/gpu/test_cuda_issue13.py -q -p no:cacheprovider -rs -s 2>&1 \
  | tee "$out/gpu_tests_issue13.log" | grep -E "rel err|differs|decode attention|FAILED|passed|failed|error" | tail -60
timeout 1500 python3 -m pytest tests/gpu -q -p no:cacheprovider -rs --deselect tests/gpu/test_cuda_issue13.py 2>&1 \
  | tee "$out/gpu_tests_all.log" | grep -E "FAILED|passed|failed|error" | tail -40
bench() {  # preset context
  timeout 900 python3 -m metrale_cli bench --device cuda --preset "$1" --context "$2" --no-transformers --repeats 20 \
    --format plain --json "$out/bench-$1-$2.json" 2>"$out/bench-$1-$2.err" | tee "$out/bench-$1-$2.txt"
}
for p in gemma-3-12b phi-4-mini; do
  bench "$p" 1024
  bench "$p" 8192
done
bench gemma-2-9b 1024
bench gemma-2-9b 8183  # max_position_embeddings 8192 holds the context plus the bench's 9 draft positions
bench phi-3-mini 1024
bench phi-3-mini 4087  # likewise at its 4096: 8192 is beyond the model
bench llama-3.1-8b 1024
python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("preset            context  decode ms  floor ms  x floor  verify k=8 ms")
for f in sorted(out.glob("bench-*.json")):
    d = json.loads(f.read_text())
    fig = {x["name"]: x for x in d.get("figures", [])}
    dec, floor, v8 = fig.get("decode step", {}), fig.get("decode floor", {}), fig.get("verify k=8", {})
    print(f"{d.get('preset', f.stem):17} {d.get('context', ''):>7}  {dec.get('value', float('nan')):9.3f}  "
          f"{floor.get('value', float('nan')):8.3f}  {dec.get('ratio') or float('nan'):7.2f}  {v8.get('value', float('nan')):9.3f}")
PY
