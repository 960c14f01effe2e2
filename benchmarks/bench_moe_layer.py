"""Decode and verify times of a mixture-of-experts preset on each rows path, one engine, one run (CUDA-event
medians, metrale.bench's timer), without metrale bench's prefill and reference figures:

    PYTHONPATH=. python3 benchmarks/bench_moe_layer.py --preset qwen3-30b-a3b --context 1024 [--json out.json]

- fused (the default): rope + KV append in the attention split kernel; a sparse layer is the router GEMV, route,
  gate_up and down (four launches);
- rows: the same four launches per sparse layer after the rows path's attention.
A path may be named more than once (--paths fused,rows,fused) to see the run-to-run spread.
The decode floor is the step's bytes (the chosen experts only) over the read bandwidth measured in the run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from metrale_cli import bench, floors  # noqa: E402
from metrale_cli.config import load_config  # noqa: E402

PATHS = ("fused", "rows")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--ks", default="4,8")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--json")
    a = ap.parse_args()
    paths = a.paths.split(",")
    for p in paths:
        if p not in PATHS:
            raise SystemExit(f"--paths: {p!r} is not one of {', '.join(PATHS)}")
    ks = [int(k) for k in a.ks.split(",") if k]
    cfg = load_config(bench.preset_path(a.preset))
    if cfg.moe is None:
        raise SystemExit(f"{a.preset} has no sparse layers")
    eng = bench.build_engine(cfg, "cuda", a.context + max(ks, default=0) + 1)
    bw = bench.read_bandwidth_gpu(eng.cp)
    one, total = floors.expert_params(cfg)  # a decode step reads top_k experts per sparse layer
    unread = total - one * cfg.moe.spec.top_k * len(cfg.moe.sparse_layers)
    streamed, xb = floors.weight_bytes(eng, cfg, 2)
    floor = ((streamed - xb * unread) + floors.kv_bytes_read(cfg, a.context, 2)) / bw
    rng = np.random.default_rng(0)
    eng.prefill([int(t) for t in rng.integers(0, cfg.vocab_size, a.context)])
    timer = bench._Timer(eng)
    drafts = {k: [int(t) for t in rng.integers(0, cfg.vocab_size, k)] for k in ks}
    results = {"preset": a.preset, "context": a.context, "bandwidth_GBs": bw / 1e9, "floor_ms": floor * 1e3,
               "runs": []}
    print(f"{a.preset} ctx {a.context}: read bandwidth {bw / 1e9:.0f} GB/s, decode floor {floor * 1e3:.3f} ms")
    for path in paths:
        eng.set_path(path)

        def decode_once():
            eng.decode(5)
            eng.trim(a.context)

        row = {"decode": timer.time(decode_once, a.repeats) * 1e3}
        for k in ks:
            def verify_once(k=k):
                eng.verify(drafts[k])
                eng.trim(a.context)

            row[f"verify{k}"] = timer.time(verify_once, a.repeats) * 1e3
        eng.check_fused()
        results["runs"].append({"path": path, **row})
        v = "  ".join(f"k={k} {row[f'verify{k}']:.3f} ms" for k in ks)
        print(f"{path:10s} decode {row['decode']:.3f} ms ({row['decode'] / (floor * 1e3):.3f} x floor)  {v}",
              flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
