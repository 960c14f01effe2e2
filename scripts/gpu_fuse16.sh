#!/usr/bin/env bash
# Issue 16, first step (engine path "fused" beside "rows"), on the H200 in one run from the repo root:
#   bash scripts/gpu_fuse16.sh [OUTDIR]          (OUTDIR defaults to $OUT, else /tmp/metrale-fuse16)
# 1. GPU tests: the fused path's (tests/gpu/test_fused_path.py), then the existing rows-path tests the change
#    touches (rope_kv_append now shares rope_kv_slot with the fused epilogue; the split kernels gained the
#    FUSED template flag; engine graph replay / verify / decode parity);
# 2. `metrale bench --path rows,fused` (both paths timed side by side in each run): llama-3.1-8b at 1024 and
#    8192, qwen3-8b and llama-3.2-1b at 1024;
# 3. scripts/decode_breakdown.py: per-launch times of one decode step on both paths, llama-3.1-8b at 1024.
# Logs and JSON under OUTDIR; a summary table last.  Steps are skipped once 450 s have passed (8 min budget).
set -uo pipefail
out=${1:-${OUT:-/tmp/metrale-fuse16}}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
start=$SECONDS
left() { (( SECONDS - start < 450 )) || { echo "skipped (time budget): $*" | tee -a "$out/skipped.txt"; return 1; }; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import time; t = time.time(); from metrale_cli.backends.cuda.kernels import Kernels; k = Kernels(); \
a = time.time(); k.load_fused(); print(f'kernel compile (cold): core module {a - t:.1f} s, fused module {time.time() - a:.1f} s')" \
  2>&1 | tee -a "$out/gpu.txt"
timeout 200 python3 -m pytest tests/gpu/test_fused_path.py -q -p no:cacheprovider -rs -s -x 2>&1 \
  | tee "$out/gpu_tests_fused.log" | grep -E "fused vs|FAILED|Error|passed|failed|error" | tail -30
left "rows-path tests" && timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_attention_decode.py \
  "tests/gpu/test_kernels.py" -k "rope or attention or decode or graph or verify" tests/gpu/test_cuda_engine.py \
  tests/gpu/test_cuda_issue13.py 2>&1 | tee "$out/gpu_tests_rows.log" | grep -E "FAILED|Error|passed|failed|error" | tail -20
bench() {  # preset context
  left "bench $1 $2" || return 0
  timeout 110 python3 -m metrale_cli bench --device cuda --preset "$1" --context "$2" --path rows,fused --repeats 30 \
    --no-transformers --format plain --json "$out/bench-$1-$2.json" 2>"$out/bench-$1-$2.err" > "$out/bench-$1-$2.txt"
  echo "bench $1 $2: exit $?"; tail -3 "$out/bench-$1-$2.err"
}
bench llama-3.1-8b 1024
bench llama-3.1-8b 8192
bench qwen3-8b 1024
bench llama-3.2-1b 1024
left "breakdown" && timeout 100 python3 scripts/decode_breakdown.py --preset llama-3.1-8b --context 1024 --paths rows,fused \
  --repeats 20 --json "$out/breakdown-llama-3.1-8b-1024.json" > "$out/breakdown-llama-3.1-8b-1024.txt" 2>&1
echo "breakdown: exit $?"
cat "$out/breakdown-llama-3.1-8b-1024.txt" 2>/dev/null | tail -40
python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("preset           context path   decode ms  x floor  %bw   k=4 ms (x)       k=8 ms (x)       logits vs rows")
for f in sorted(out.glob("bench-*.json")):
    d = json.loads(f.read_text())
    fl = next((x["value"] for x in d["figures"] if x["name"] == "decode floor"), float("nan"))
    for p in d.get("paths", []):
        v = lambda k: f"{p['verify_ms'].get(k, float('nan')):.3f} ({p['verify_ratio'].get(k, float('nan')):.3f})"
        diff = "" if p["logits_max_abs_diff"] is None else f"{p['logits_max_abs_diff']:.2e} argmax {'ok' if p['argmax_matches'] else 'DIFF'}"
        print(f"{d['preset']:16} {d['context']:>7} {p['path']:6} {p['decode_ms']:9.3f} {p['floor_ratio']:8.3f} "
              f"{100 * p['bandwidth_fraction']:5.1f} {v('4'):16} {v('8'):16} {diff}  (floor {fl:.3f})")
PY
echo "total $((SECONDS - start)) s"
