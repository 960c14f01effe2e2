"""Decode and verify times of the CUDA engine under its rows-path variants, one engine, one run:
programmatic dependent launch on/off and the projection kernels (fp32-FMA `gemv`, tensor-core
`gemv_tc`, or "auto": the engine's default choice by row count).  Needs CuPy and a GPU:

    PYTHONPATH=. python3 benchmarks/bench_variants.py --preset llama-3.1-8b --context 1024 [--json out.json]

Each variant recaptures the graphs; times are CUDA-event medians (metrale.bench's timer), the floor
is the step's bytes over the read bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from metrale_cli import bench  # noqa: E402
from metrale_cli.config import load_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--json")
    a = ap.parse_args()
    ks = [int(k) for k in a.ks.split(",")]
    cfg = load_config(bench.preset_path(a.preset))
    eng = bench.build_engine(cfg, "cuda", a.context + max(ks) + 1)
    bw = bench.read_bandwidth_gpu(eng.cp)
    streamed = bench._streamed_bytes(cfg, 2)
    kv = 2 * cfg.num_hidden_layers * cfg.kv_size * 2 * a.context
    floor = (streamed + kv) / bw
    rng = np.random.default_rng(0)
    eng.prefill([int(t) for t in rng.integers(0, cfg.vocab_size, a.context)])
    timer = bench._Timer(eng)
    results = {"preset": a.preset, "context": a.context, "bandwidth_GBs": bw / 1e9, "floor_ms": floor * 1e3,
               "variants": {}}
    print(f"{a.preset} ctx {a.context}: read bandwidth {bw / 1e9:.0f} GB/s, floor {floor * 1e3:.3f} ms")
    for impl in ("simt", "tc", "auto"):
        for pdl in (False, True):
            eng.set_pdl(pdl)
            eng.gemv_impl = impl
            row = {}

            def decode_once():
                eng.decode(5)
                eng.trim(a.context)

            row["decode"] = timer.time(decode_once, a.repeats) * 1e3
            for k in ks:
                drafts = [int(t) for t in rng.integers(0, cfg.vocab_size, k)]

                def verify_once():
                    eng.verify(drafts)
                    eng.trim(a.context)

                row[f"verify{k}"] = timer.time(verify_once, a.repeats) * 1e3
            name = f"{impl}{'+pdl' if pdl else ''}"
            results["variants"][name] = row
            v = "  ".join(f"k={k} {row[f'verify{k}']:.3f} ({row[f'verify{k}'] / row['decode']:.2f}x)" for k in ks)
            print(f"{name:9s} decode {row['decode']:.3f} ms ({row['decode'] / (floor * 1e3):.3f}x floor)  {v}",
                  flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
