"""Speed of the prefill attention kernels (flash_prefill.cu, tensor cores) on the Llama-3.1-8B layer
shape (32 query heads, 8 KV heads, head_dim 128), against a cuBLAS bf16 GEMM measured in the same run
(the fp32 SIMT kernel it replaced, git 59ceb35, was compared in the same way: see docs/CUDA_ENGINE.md).  Needs CuPy and a CUDA GPU:

    PYTHONPATH=. python3 -m benchmarks.bench_prefill

Method as bench_kernels: a CUDA graph of N launches (N = 32 for short prompts, fewer for long ones so
the run stays short), rotating input copies so the L2 does not serve repeated reads, CUDA events, the
median of the replays.  FLOPs count the causal work only: 4 * hd * n_heads * (keys seen, summed over
the rows) = 4 * T * T / 2 * hd * heads for start 0.  GB/s counts q + out + K + V once (the attention
is compute bound; the figure is only there to set against the read-only kernel).
"""

from __future__ import annotations

import math
import sys

from benchmarks.bench_kernels import L2_BYTES, _graph_time_ms


def _gemm_tflops(cp, n=4096, reps=20):
    """cuBLAS bf16 GEMM n^3: (a) cupy matmul of ml_dtypes.bfloat16 arrays (bf16 out), (b) gemmEx with
    bf16 operands and fp32 output as engine._gemm calls it.  Eager, timed with events."""
    import ml_dtypes
    import numpy as np
    from cupy_backends.cuda.libs import cublas

    rng = np.random.default_rng(0)
    a = cp.asarray(rng.standard_normal((n, n), dtype=np.float32).astype(ml_dtypes.bfloat16))
    b = cp.asarray(rng.standard_normal((n, n), dtype=np.float32).astype(ml_dtypes.bfloat16))
    res = {}

    def timed(f):
        for _ in range(3):
            f()
        cp.cuda.get_current_stream().synchronize()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        for _ in range(reps):
            f()
        e1.record()
        e1.synchronize()
        return cp.cuda.get_elapsed_time(e0, e1) / reps

    try:
        ms = timed(lambda: a @ b)
        res["cupy matmul bf16"] = 2 * n**3 / (ms * 1e-3) / 1e12
    except Exception as exc:  # pragma: no cover - depends on the CuPy build
        print(f"cupy bf16 matmul failed: {type(exc).__name__}: {exc}")
    out = cp.empty((n, n), cp.float32)
    one, zero = np.array(1.0, np.float32), np.array(0.0, np.float32)
    handle = cp.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cp.cuda.get_current_stream().ptr)

    def gemm_ex():  # CUBLAS_OP_T = 1, CUBLAS_OP_N = 0, CUDA_R_16BF = 14, CUDA_R_32F = 0, COMPUTE_32F = 68
        cublas.gemmEx(handle, 1, 0, n, n, n, one.ctypes.data, a.data.ptr, 14, n, b.data.ptr, 14, n,
                      zero.ctypes.data, out.data.ptr, 0, n, 68, -1)

    try:
        ms = timed(gemm_ex)
        res["gemmEx bf16->f32"] = 2 * n**3 / (ms * 1e-3) / 1e12
    except Exception as exc:  # pragma: no cover
        print(f"cublas gemmEx failed: {type(exc).__name__}: {exc}")
    return res


def main() -> int:
    import cupy as cp

    from metrale_cli.backends.cuda import kernels as km
    from metrale_cli.bench import read_bandwidth_gpu

    K = km.Kernels()
    dev = cp.cuda.Device()
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    read_gbs = read_bandwidth_gpu(cp) / 1e9
    print(f"device: {name}, {K.num_sms} SMs")
    print(f"read-only kernel of metrale bench (4 GiB, uint4 loads): {read_gbs:8.0f} GB/s")
    gemm = _gemm_tflops(cp)
    for k, v in gemm.items():
        print(f"cuBLAS 4096^3 {k}: {v:7.1f} TFLOP/s")
    ref_tflops = max(gemm.values()) if gemm else float("nan")
    sys.stdout.flush()

    nh, n_kv, hd = 32, 8, 128
    scale = hd**-0.5
    print()
    print(f"{'kernel':<22}{'T':>6}{'start':>6}{'ms':>10}{'TFLOP/s':>9}{'% gemm':>8}{'GB/s':>7}{'% read':>8}")
    cases = ((512, 0), (2048, 0), (8192, 0), (2048, 6144))
    for T, start in cases:
        ctx = start + T
        keys_seen = T * start + T * (T + 1) / 2
        flops = 4.0 * hd * nh * keys_seen
        nbytes = 2 * T * nh * hd * 4 + 2 * n_kv * ctx * hd * 2
        copies = max(2, min(8, math.ceil(4 * L2_BYTES / nbytes)))
        sets = []
        for _ in range(copies):
            q = cp.random.standard_normal((T, nh, hd), dtype=cp.float32)
            kc = cp.empty((n_kv, ctx, hd), cp.uint16)
            vc = cp.empty((n_kv, ctx, hd), cp.uint16)
            K.f32_to_bf16(cp.random.standard_normal((n_kv, ctx, hd), dtype=cp.float32), kc)
            K.f32_to_bf16(cp.random.standard_normal((n_kv, ctx, hd), dtype=cp.float32), vc)
            sets.append((q, kc, vc, cp.empty((T, nh, hd), cp.float32)))
        n_launch = 32 if T <= 512 else 8 if T <= 2048 else 2
        results = {}
        for bq in km.PREFILL_BQS:
            launches = [
                (lambda s, st=sets[i % copies], b=bq: K.attention_prefill(
                    st[0], st[1], st[2], start, T, st[3], scale, block_q=b, stream=s))
                for i in range(n_launch)
            ]
            results[f"flash bq={bq}"] = _graph_time_ms(cp, launches, 11)
        for label, ms in results.items():
            tf = flops / (ms * 1e-3) / 1e12
            gbs = nbytes / (ms * 1e-3) / 1e9
            print(f"{label:<22}{T:>6}{start:>6}{ms:>10.3f}{tf:>9.1f}{100 * tf / ref_tflops:>7.0f}%"
                  f"{gbs:>7.0f}{100 * gbs / read_gbs:>7.0f}%")
        sys.stdout.flush()
        del sets
    print("(% gemm: of the best cuBLAS bf16 GEMM rate above; 1 layer = 1 launch; Llama-3.1-8B has 32 layers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
