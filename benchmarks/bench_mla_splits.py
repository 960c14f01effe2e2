"""Decode and verify times of a latent-attention preset for several key-split counts of the MLA attention kernel
(mla_attend_kernel's grid; mla_out_kernel combines the splits), one engine per context, CUDA graphs as the engine
runs them (bench's timer, CUDA events):

    PYTHONPATH=. python3 benchmarks/bench_mla_splits.py --preset deepseek-v2-lite --contexts 1024,8192

The shipped count is kernels/mla.py's splits_for (rows, heads, SMs); each other count is set in the engine's latent
cache (`LatentCache.splits`) and its graphs captured again. The logits of each count are checked against the shipped
count's for decode (the same sums in another grouping: fp32 rounding)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from metrale_cli import bench  # noqa: E402
from metrale_cli.config import load_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="deepseek-v2-lite")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--splits", default="64,32,16,8,4,2")
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    cfg = load_config(bench.preset_path(a.preset))
    for ctx in (int(c) for c in a.contexts.split(",")):
        eng = bench.build_engine(cfg, "cuda", ctx + 17)
        cache = eng.states["mla"]
        shipped = dict(cache.splits)
        rng = np.random.default_rng(0)
        eng.prefill([int(t) for t in rng.integers(0, cfg.vocab_size, ctx)])
        drafts = [int(t) for t in rng.integers(0, cfg.vocab_size, 16)]
        timer = bench._Timer(eng)
        for m in (int(r) for r in a.rows.split(",")):
            def step():
                eng.trim(ctx)
                if m == 1:
                    eng.decode(drafts[0])
                else:
                    eng.verify(drafts[:m])
            ref = None
            line = []
            for s in [shipped[m]] + [int(x) for x in a.splits.split(",") if int(x) != shipped[m]]:
                d = cache.dims
                if m * s * d.heads * d.rank > cache.ws_o.size:  # the partials' workspace is sized for shipped
                    cache.ws_o = eng.cp.zeros((m * s * d.heads * d.rank,), eng.cp.float32)
                    cache.ws_ml = eng.cp.zeros((m * s * d.heads * 2,), eng.cp.float32)
                cache.splits[m] = s
                eng.graphs.clear()
                ms = timer.time(step, a.repeats) * 1e3
                if m > 1:
                    line.append(f"{s}{'*' if s == shipped[m] else ''}: {ms:.3f} ms")
                    continue
                got = bench._decode_logits(eng)
                ref = got if ref is None else ref
                diff = float(np.max(np.abs(got - ref)))
                line.append(f"{s}{'*' if s == shipped[m] else ''}: {ms:.3f} ms (logits max diff {diff:.1e})")
            print(f"{a.preset} context {ctx}, {'decode' if m == 1 else f'verify k={m}'}: " + ", ".join(line))
            cache.splits[m] = shipped[m]
        eng.graphs.clear()
        del eng


if __name__ == "__main__":
    main()
