#!/usr/bin/env bash
# Issue 16, second step (fused path = qkv + rope + KV append, attention split + combine; split argmax), on the
# H200 in one run (< 6 minutes) from the repo root:
#   PYTHONPATH=. bash scripts/gpu_fuse16.sh [WORKDIR]      (WORKDIR defaults to /tmp/metrale-fuse16)
# 1. GPU tests: tests/gpu/test_fused_path.py, the argmax tests (tests/gpu/test_argmax.py and test_kernels.py's
#    test_argmax), tests/gpu/test_attention_decode.py, tests/gpu/test_cuda_engine.py;
# 2. `metrale bench --path rows,fused --ks 4,8 --repeats 30`: llama-3.1-8b at 1024 and 8192, qwen3-8b and
#    llama-3.2-1b at 1024;
# 3. scripts/decode_breakdown.py: per-launch times of one decode step on both paths, llama-3.1-8b at 1024.
# A step that would start after 300 s is skipped (and listed); each step's timeout is cut so the whole run
# ends by 345 s.  Logs and JSON go to WORKDIR, a summary to WORKDIR/summary.txt; with $OUT set (the device
# machine), $OUT gets only results.tgz (all of WORKDIR) and summary.txt.
set -uo pipefail
work=${1:-/tmp/metrale-fuse16}
rm -rf "$work" && mkdir -p "$work"
export PYTHONPATH=. PYTHONUNBUFFERED=1
start=$SECONDS
sum="$work/summary.txt"
note() { echo "$*" | tee -a "$sum"; }
# left NAME SECONDS: 0 (and sets $t, the step's timeout) when the step may start, else records the skip
left() {
  local el=$((SECONDS - start))
  if (( el >= 300 )); then note "skipped (past 300 s at ${el} s): $1"; return 1; fi
  t=$(( $2 < 345 - el ? $2 : 345 - el ))
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader 2>&1 | tee -a "$sum"
python3 -c "import time; t = time.time(); from metrale_cli.backends.cuda.kernels import Kernels; k = Kernels(); \
a = time.time(); k.load_fused(); print(f'kernel compile: core module {a - t:.1f} s, fused (qkv) module {time.time() - a:.1f} s')" \
  2>&1 | tee -a "$sum"

tests() {  # NAME TIMEOUT pytest-args...
  local name=$1 limit=$2; shift 2
  left "tests $name" "$limit" || return 0
  timeout "$t" python3 -m pytest -q -p no:cacheprovider -rs "$@" > "$work/gpu_tests_$name.log" 2>&1
  note "tests $name: exit $? ($((SECONDS - start)) s): $(grep -E '^[0-9]+ (passed|failed)|passed|failed|error' "$work/gpu_tests_$name.log" | tail -1)"
  grep -E "^FAILED|^ERROR" "$work/gpu_tests_$name.log" | head -10 | tee -a "$sum"
}
tests fused 150 tests/gpu/test_fused_path.py -s
grep -E "fused vs|@3000" "$work/gpu_tests_fused.log" | head -12 | tee -a "$sum"
tests argmax 60 tests/gpu/test_argmax.py tests/gpu/test_kernels.py -k "argmax"
tests attention_engine 100 tests/gpu/test_attention_decode.py tests/gpu/test_cuda_engine.py

bench() {  # preset context
  left "bench $1 $2" 75 || return 0
  timeout "$t" python3 -m metrale_cli bench --device cuda --preset "$1" --context "$2" --path rows,fused --ks 4,8 \
    --repeats 30 --no-transformers --format plain --json "$work/bench-$1-$2.json" 2>"$work/bench-$1-$2.err" \
    > "$work/bench-$1-$2.txt"
  note "bench $1 $2: exit $? ($((SECONDS - start)) s)"
}
bench llama-3.1-8b 1024
bench llama-3.1-8b 8192
bench qwen3-8b 1024
bench llama-3.2-1b 1024
if left "breakdown" 90; then
  timeout "$t" python3 scripts/decode_breakdown.py --preset llama-3.1-8b --context 1024 --paths rows,fused \
    --repeats 20 --json "$work/breakdown-llama-3.1-8b-1024.json" > "$work/breakdown-llama-3.1-8b-1024.txt" 2>&1
  note "breakdown: exit $? ($((SECONDS - start)) s)"
  tail -40 "$work/breakdown-llama-3.1-8b-1024.txt" | tee -a "$sum"
fi
python3 - "$work" <<'PY' 2>&1 | tee -a "$sum"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("preset           context path   decode ms  x floor  %bw   k=4 ms (x)       k=8 ms (x)       logits vs rows")
for f in sorted(out.glob("bench-*.json")):
    d = json.loads(f.read_text())
    fl = next((x["value"] for x in d["figures"] if x["name"] == "decode floor"), float("nan"))
    pre = next((x for x in d["figures"] if x["name"].startswith("prefill")), None)
    for p in d.get("paths", []):
        v = lambda k: f"{p['verify_ms'].get(k, float('nan')):.3f} ({p['verify_ratio'].get(k, float('nan')):.3f})"
        diff = "" if p["logits_max_abs_diff"] is None else f"{p['logits_max_abs_diff']:.2e} argmax {'ok' if p['argmax_matches'] else 'DIFF'}"
        print(f"{d['preset']:16} {d['context']:>7} {p['path']:6} {p['decode_ms']:9.3f} {p['floor_ratio']:8.3f} "
              f"{100 * p['bandwidth_fraction']:5.1f} {v('4'):16} {v('8'):16} {diff}  (floor {fl:.3f})")
    if pre is not None:
        print(f"{'':24} {pre['name']}: {pre['value']:.1f} {pre['unit']}" + (f" ({pre['ratio']:.3f})" if pre.get("ratio") else ""))
PY
note "total $((SECONDS - start)) s"
if [[ -n "${OUT:-}" && -d "${OUT:-}" ]]; then
  tar czf "$OUT/results.tgz" -C "$(dirname "$work")" "$(basename "$work")" && cp "$sum" "$OUT/summary.txt"
  ls -la "$OUT"
fi
