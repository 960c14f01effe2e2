"""Decode step time with every ring GEMV of the rows / fused paths at one ring depth (an experiment: the engine's
choice is Kernels.ring_engine_config, one 16-byte chunk per thread and slot below GEMV_RING_DEEP_BYTES, two from
there).  P chunks per thread and slot put 3 P x 16 KiB in flight per SM before pdl_wait (1024 threads, 4 slots).

    PYTHONPATH=. python3 scripts/ring_depth.py --preset qwen3-30b-a3b --context 1024 --chunks 0,1,2,3

--chunks 0 is the engine's own choice.  One process and one engine: per depth the engine's graphs are dropped
(set_path) and recaptured, and the ring GEMVs take the depth's launch geometry at that capture.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from metrale_cli import bench  # noqa: E402
from metrale_cli.backends.cuda.kernels.launch import Kernels  # noqa: E402
from metrale_cli.config import load_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--chunks", default="0,1,2,3")
    ap.add_argument("--path", default="fused")
    a = ap.parse_args()
    cfg = load_config(bench.preset_path(a.preset))
    own = Kernels.ring_engine_config
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, cfg.vocab_size, a.context)]
    eng = None
    for p in [int(c) for c in a.chunks.split(",")]:
        Kernels.ring_engine_config = staticmethod(own) if p == 0 else staticmethod(
            lambda k, n, gated, p=p: dict(threads=own(k, n, gated)["threads"], chunks=p))
        if eng is None:
            eng = bench.build_engine(cfg, "cuda", a.context + 8)
            eng.kern.load_extra()  # the 3-chunk rings: compiled now, never during a capture
            eng.prefill(prompt)
            timer = bench._Timer(eng)
        eng.set_path(a.path)  # drops the captured graphs: the next capture takes the new depth

        def decode_once():
            eng.decode(5)
            eng.trim(a.context)

        ms = timer.time(decode_once, a.repeats) * 1e3
        print(f"{a.preset} ctx {a.context} path {a.path} ring chunks {p or 'engine'}: decode {ms:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
