"""One launch of each decode kernel worth a look, on fresh random data, for Nsight Compute to profile
(the first launch of each is profiled; nothing here is timed):

    ncu --clock-control none -k regex:'attn_decode|gemv' --section SpeedOfLight --section WarpStateStats \
        --section Occupancy python3 benchmarks/profile_kernels.py

Attention at 1025 keys of a 2048-position cache for the gemma-2-9b (head_dim 256, SIMT, softcap 50),
llama-3.1-8b (head_dim 128, tensor cores) and phi-3-mini (head_dim 96, SIMT) layer shapes; the qkv GEMV of
llama-3.1-8b with its fused norm and the o GEMV, each on the fp32-FMA GEMV (gemv) and on the ring GEMV the rows
path takes for one row (gemv_ring, at the engine's ring depth, Kernels.ring_chunks)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import cupy as cp

    from metrale_cli.backends.cuda.kernels import Kernels

    k = Kernels()
    rs = cp.random.RandomState(1)

    def bf16(shape, scale=0.05):
        out = cp.empty(shape, cp.uint16)
        k.f32_to_bf16((rs.standard_normal(shape, dtype=cp.float32) * scale).reshape(shape[0], -1),
                      out.reshape(shape[0], -1))
        return out

    pos = cp.asarray([1024], dtype=cp.int32)
    for name, hd, n_kv, nh, cap in (("gemma2", 256, 8, 16, 50.0), ("llama", 128, 8, 32, None),
                                    ("phi3", 96, 32, 32, None)):
        kc, vc = bf16((n_kv, 2048, hd), 1.0), bf16((n_kv, 2048, hd), 1.0)
        q = rs.standard_normal((1, nh, hd), dtype=cp.float32)
        out = cp.empty_like(q)
        splits = k.decode_splits(1088, n_kv, 1, nh)
        ws = cp.zeros(k.decode_workspace_size(1, nh, hd, splits), cp.float32)
        k.attention_decode(q, kc, vc, pos, out, hd ** -0.5, n_splits=splits, workspace=ws, softcap=cap)
        cp.cuda.Device().synchronize()
        print(name, "attention", splits, "splits", flush=True)
    x = rs.standard_normal((1, 4096), dtype=cp.float32)
    nw = bf16((4096,), 1.0)
    for n in (6144, 4096):
        w = bf16((n, 4096))
        o = cp.empty((1, n), cp.float32)
        norm = dict(norm_weight=nw) if n == 6144 else {}
        k.gemv(x, w, o, **norm)
        ring = k.ring_fits(1, 4096, n)
        if ring:
            k.gemv_ring(x, w, o, chunks=k.ring_chunks(4096, n, False), **norm)
        cp.cuda.Device().synchronize()
        print("qkv" if n == 6144 else "o", "gemv" + (" and gemv_ring" if ring else " (the ring GEMV does not fit)"),
              flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
