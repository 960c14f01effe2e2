"""The FP8 GEMV (backends/cuda/kernels/fp8.cu) against the bf16 GEMV at decode shapes, for a grid of its (R, U)
configurations: achieved read bandwidth (weight + scale bytes / time) and time per call, CUDA events, median of
repeats. Run on a GPU from the source tree:

    PYTHONPATH=. python3 benchmarks/bench_fp8_gemv.py
"""

from __future__ import annotations

import numpy as np


def main() -> None:
    import cupy as cp

    from metrale_cli.backends.cuda.kernels import Kernels
    from metrale_cli.backends.cuda.kernels import fp8 as f

    kern = Kernels()
    variants = [(r, u) for r in (1, 2, 4, 8) for u in (1, 2, 4) if r * u <= 16]
    names = [f"gemv_fp8_kernel<{m}, {r}, {u}, false>" for m in (1, 4) for r, u in variants]
    module = cp.RawModule(code=f.module_source(), options=("-std=c++17",), name_expressions=names)
    rng = np.random.default_rng(0)
    shapes = {"qkv 6144x4096": (6144, 4096), "gate_up 24576x4096": (24576, 4096), "down 4096x12288": (4096, 12288)}
    start, stop = cp.cuda.Event(), cp.cuda.Event()

    def timed(fn, reps=50) -> float:
        fn()
        times = []
        for _ in range(reps):
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) * 1e-3)
        return float(np.median(times))

    for label, (n, k) in shapes.items():
        w = cp.asarray(rng.integers(0, 256, (n, k), dtype=np.uint8) & 0xF7)  # no NaN bytes
        s = cp.asarray(np.full((-(-n // 128), -(-k // 128)), 1e-3, np.float32))
        wb = cp.asarray(rng.integers(0, 1 << 14, (n, k), dtype=np.uint16))
        nbytes = w.nbytes + s.nbytes
        for m in (1, 4):
            x = cp.asarray(rng.standard_normal((m, k)).astype(np.float32))
            out = cp.empty((m, n), cp.float32)
            t_bf16 = timed(lambda: kern.gemv(x, wb, out) if m > 1 or not kern.ring_fits(m, k, n, False)
                           else kern.gemv_ring(x, wb, out, None, chunks=kern.ring_chunks(k, n, False)))
            print(f"{label} M={m}: bf16 {t_bf16 * 1e6:7.1f} us ({wb.nbytes / t_bf16 / 1e9:6.0f} GB/s)")
            for r, u in variants:
                fn = module.get_function(f"gemv_fp8_kernel<{m}, {r}, {u}, false>")
                grid = (-(-n // (f.FP8_WARPS * r)),)
                args = (x, w, s, out, out, np.int32(n), np.int32(k), np.int32(128), np.int32(128),
                        np.int32(-(-k // 128)), np.int32(0), np.int32(0), out, np.float32(1e-6), np.float32(0))
                t = timed(lambda: fn(grid, (f.FP8_WARPS * 32,), args))
                print(f"    fp8 R={r} U={u}: {t * 1e6:7.1f} us ({nbytes / t / 1e9:6.0f} GB/s)")


if __name__ == "__main__":
    main()
