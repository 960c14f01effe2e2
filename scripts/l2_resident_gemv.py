"""Is a decode GEMV faster when its weights were requested into L2 while the memory bus was idle, and do they
survive the expert weights streamed between?  (The question behind prefetching the next layer's qkv weights during
a MoE layer's routing.)  Random bf16 weights, CUDA-event medians of the engine's one-row GEMV (gemv_ring, RMSNorm
fused, as the rows path's qkv projection) after each preparation:

    PYTHONPATH=. python3 scripts/l2_resident_gemv.py --preset qwen3-30b-a3b [--stream-mb 75] [--repeats 50]

- cold: STREAM MB of other weights read first (ld.global.nc, default L2 priority), then the GEMV;
- pf-normal: the GEMV's weights prefetched into L2 (cp.async.bulk.prefetch.L2, default priority), then the stream,
  then the GEMV;
- pf-last+stream-first: the prefetch with an evict_last policy, the stream with evict_first, then the GEMV;
- pf-last, no stream: the prefetch, then the GEMV at once (the most L2 can give);
and the time of the stream alone with each policy (does the prefetch slow what runs beside it?)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metrale_cli import bench  # noqa: E402
from metrale_cli.config import load_config  # noqa: E402

SOURCE = r"""
extern "C" __global__ void stream_read(const uint4* __restrict__ p, long long n16, int evict_first, float* sink) {
    unsigned long long pol;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    unsigned int acc = 0u;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += step) {
        uint4 r;
        if (evict_first)
            asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                         : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p + i), "l"(pol));
        else
            asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p + i));
        acc ^= r.x ^ r.y ^ r.z ^ r.w;
    }
    if (acc == 0x12345678u) sink[0] = 1.0f;
}

// bytes [0, n) at p (n a multiple of 16), in pieces of `piece` bytes, one thread per piece
extern "C" __global__ void l2_prefetch(const char* __restrict__ p, long long n, int piece, int evict_last) {
    unsigned long long pol;
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
    const long long pieces = (n + piece - 1) / piece;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < pieces; i += step) {
        const long long off = i * piece;
        const unsigned int size = (unsigned int)min((long long)piece, n - off);
        if (evict_last)
            asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;"
                         :: "l"(p + off), "r"(size), "l"(pol) : "memory");
        else
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p + off), "r"(size) : "memory");
    }
}
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--stream-mb", type=float, default=75.0)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--piece", type=int, default=16384, help="bytes per bulk prefetch instruction")
    a = ap.parse_args()
    import cupy as cp

    from metrale_cli.backends.cuda.kernels import Kernels

    cfg = load_config(bench.preset_path(a.preset))
    att = cfg.definition.layers[0].attention
    H = cfg.hidden_size
    shapes = {"qkv": (att.q_size + 2 * att.kv_size, H, True), "o": (H, att.q_size, False)}
    kern = Kernels()
    mod = cp.RawModule(code=SOURCE, options=("-std=c++17",))
    stream_read, prefetch = mod.get_function("stream_read"), mod.get_function("l2_prefetch")
    s = cp.cuda.Stream(non_blocking=True)
    sink = cp.zeros(1, cp.float32)
    n16 = int(a.stream_mb * 1e6) // 16
    big = cp.random.randint(0, 2**31, size=(n16, 4), dtype=cp.int64).astype(cp.uint32)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]

    def stream(first: bool):
        stream_read((sms * 4,), (512,), (big, np.int64(n16), np.int32(first), sink), stream=s)

    def pf(w, last: bool):
        n = w.size * 2
        pieces = (n + a.piece - 1) // a.piece
        prefetch(((pieces + 255) // 256,), (256,), (w, np.int64(n), np.int32(a.piece), np.int32(last)), stream=s)

    def timed(before, fn, repeats):
        out = []
        for _ in range(repeats + 3):
            before()
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(s)
            fn()
            e1.record(s)
            e1.synchronize()
            out.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
        return float(np.median(out[3:]))

    print(f"{a.preset}: stream {n16 * 16 / 1e6:.1f} MB between prefetch and GEMV; bulk prefetch pieces of {a.piece} B")
    with s:
        for name, (N, K, norm) in shapes.items():
            w = ((cp.random.standard_normal((N, K), dtype=cp.float32) * 0.02).view(cp.uint32) >> 16).astype(cp.uint16)
            x = cp.random.standard_normal((1, K), dtype=cp.float32)
            g = ((cp.random.standard_normal(K, dtype=cp.float32) * 0.1 + 1).view(cp.uint32) >> 16).astype(cp.uint16)
            out = cp.empty((1, N), cp.float32)

            def gemv():
                kern.gemv_ring(x, w, out, norm_weight=g if norm else None, stream=s)

            mb = N * K * 2 / 1e6
            rows = {
                "cold (stream, then GEMV)": timed(lambda: stream(False), gemv, a.repeats),
                "pf-normal, stream, GEMV": timed(lambda: (pf(w, False), stream(False)), gemv, a.repeats),
                "pf-last, stream evict_first, GEMV": timed(lambda: (pf(w, True), stream(True)), gemv, a.repeats),
                "pf-last, GEMV at once": timed(lambda: pf(w, True), gemv, a.repeats),
                "GEMV again (hot)": timed(gemv, gemv, a.repeats),
            }
            for k, v in rows.items():
                print(f"  {name} GEMV [{N} x {K}] {mb:.1f} MB: {k:36s} {v:7.2f} us  ({mb / v:.2f} TB/s)")
        flush = lambda: stream(False)  # noqa: E731
        wq = cp.zeros(shapes["qkv"][0] * shapes["qkv"][1], cp.uint16)
        print(f"  stream alone: {timed(flush, lambda: stream(False), a.repeats):.2f} us (default), "
              f"{timed(flush, lambda: stream(True), a.repeats):.2f} us (evict_first)")
        print(f"  prefetch of qkv ({wq.size * 2 / 1e6:.1f} MB) then stream: "
              f"{timed(flush, lambda: (pf(wq, True), stream(True)), a.repeats):.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
