"""Cycles of the MoE router's softmax + top-k of one row (moe.cu's moe_topk_row) run by one warp, the way
moe_route_kernel and the one-launch layer run it: the question behind a routing phase that took 4.85 us of one
warp in `moe_layer_phases.py`.  clock64 around one call, medians over launches; random logits (fresh draws):

    PYTHONPATH=. python3 scripts/topk_cycles.py [--experts 128] [--topk 8] [--define NAME=VALUE]

Cases: logits in shared memory (the one-launch layer) or read from global memory (the route kernel), in a block
of one warp or of 16 warps whose other 15 wait at a barrier, and a second call in the same launch (code and
data already fetched); each as the softmax alone (k = 0) and with the k rounds.
Each call's chosen experts are checked against NumPy's top-k of the same softmax (ties to the lowest index).
(H200, E = 128, k = 8: the same cycles in shared or global memory, alone or beside 15 waiting warps, and in a
second call: the cost is the warp's own latency chain, per slot a lane holds and per round.)"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SOURCE = r"""
// one call of moe_topk_row by warp 0 (k = 0: the softmax alone), its cycles, its choice
// warm: one untimed call first (its code then in the instruction cache)
extern "C" __global__ void topk_probe(const float* __restrict__ logits, int E, int k, int from_shared, int warm,
                                      long long* __restrict__ cycles, int* __restrict__ idx,
                                      float* __restrict__ wts) {
    __shared__ float s[MOE_MAX_EXPERTS];
    for (int e = threadIdx.x; e < E; e += blockDim.x) s[e] = logits[e];
    __syncthreads();
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        int e;
        float w;
        if (warm) {
            moe_topk_row(from_shared ? s : logits, E, k, 1, e, w);
            if (e == -12345) cycles[1] = (long long)w;
        }
        const long long t0 = clock64();
        moe_topk_row(from_shared ? s : logits, E, k, 1, e, w);
        const int dep = __reduce_add_sync(0xffffffffu, (unsigned int)e ^ (unsigned int)(w > 2.0f));
        const long long t1 = clock64();
        if (lane == 0) cycles[0] = t1 - t0 + (dep == -12345);
        if (lane < k) {
            idx[lane] = e;
            wts[lane] = w;
        }
    }
    __syncthreads();
}
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--define", action="append", default=[], help="a moe.cu macro, NAME=VALUE")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import cupy as cp

    from metrale_cli.backends.cuda.kernels import moe

    moe.define_macros(args.define)
    mod = cp.RawModule(code=moe.module_source() + SOURCE, options=("-std=c++17",))
    fn = mod.get_function("topk_probe")
    E, k = args.experts, args.topk
    rng = np.random.default_rng()
    mhz = cp.cuda.runtime.getDeviceProperties(0)["clockRate"] / 1e3
    cycles = cp.zeros(2, dtype=cp.int64)
    idx = cp.zeros(16, dtype=cp.int32)
    wts = cp.zeros(16, dtype=cp.float32)
    results = {}
    for name, shared, threads, warm in (("shared, 1 warp", 1, 32, 0), ("shared, 16 warps", 1, 512, 0),
                                        ("global, 1 warp", 0, 32, 0), ("global, 16 warps", 0, 512, 0),
                                        ("shared, 1 warp, second call", 1, 32, 1)):
        for kk in (0, k):
            samples = []
            for _ in range(args.launches):
                x = rng.standard_normal(E, dtype=np.float32)
                logits = cp.asarray(x)
                fn((1,), (threads,), (logits, np.int32(E), np.int32(kk), np.int32(shared), np.int32(warm), cycles,
                                      idx, wts))
                samples.append(int(cycles.get()[0]))
                if kk:
                    p = np.exp(x - x.max())
                    p /= p.sum()
                    want = np.argsort(-p, kind="stable")[:kk]
                    got = idx.get()[:kk]
                    if not np.array_equal(got, want):
                        print(f"MISMATCH {name}: {got} vs {want}")
                        return 1
            med = float(np.median(samples))
            label = f"{name}, {'softmax only' if kk == 0 else f'softmax + top-{kk}'}"
            results[label] = {"cycles": med, "us": med / mhz}
            print(f"{label:42s} {med:8.0f} cycles  {med / mhz:6.2f} us at {mhz:.0f} MHz (min {min(samples)})")
    if args.json:
        args.json.write_text(json.dumps({"defines": args.define, "mhz": mhz, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
