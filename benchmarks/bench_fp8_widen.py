"""Is the FP8 GEMV bound by its e4m3 -> fp32 widening? One question, one run on a GPU:

    PYTHONPATH=. python3 -m benchmarks.bench_fp8_widen [N K]      # default 28672 4096 (an 8B model's gate_up)

qgemv.cu's QE4m3 policy widens with `cvt.rn.f16x2.e4m3x2` and a half-to-float per value. This benchmark times three
stripped one-row GEMVs over the same e4m3 weight [N, K] with [128, 128] block scales, laid out and walked as qgemv.cu
walks them (a warp owns 4 rows, 16-byte chunks, 2 in flight, each eight values' dot product scaled once):
  cvt    QE4m3's widening (e4m3.cu's, compiled in);
  int    an integer widening: the byte's low 7 bits at bit 20 and its sign at bit 31 are the value times 2^-120,
         exactly, subnormals included; the 2^120 joins the eight values' scale (exact for scales below 2^8);
  pairs  bytes 1 and 3 of a word masked into a bf16 pair in place (sign bits kept, the low 7 bits shifted 4 lower),
         bytes 0 and 2 the same from the word shifted 8 up, then each bf16 the top half of a float: the values
         times 2^-120 in about three integer operations a value;
  bytes  no widening (the bytes summed as integers): what the access pattern alone reads at.
It first checks that the widenings are exact on every e4m3 byte but NaN in each of a word's places, and that both GEMVs match float64. Each
time is a CUDA graph of 32 launches over rotating weight copies (bench_kernels' timer), beside the read bandwidth of
`metrale bench`'s read-only kernel in the same run. An experiment: the engine's kernel changes only if `int` or `pairs` wins."""

from __future__ import annotations

import sys

import numpy as np

KERNELS = r"""
// MODE 0: cvt (values); 1: int (values x 2^-120); 2: bytes (no widening); 3: pairs (values x 2^-120)
template <int MODE>
__device__ __forceinline__ void widen8(unsigned int lo, unsigned int hi, float (&w)[8]) {
    if (MODE == 0) {
        const float2 a = e4m3x2_to_f32(lo & 0xffffu), b = e4m3x2_to_f32(lo >> 16);
        const float2 c = e4m3x2_to_f32(hi & 0xffffu), d = e4m3x2_to_f32(hi >> 16);
        w[0] = a.x, w[1] = a.y, w[2] = b.x, w[3] = b.y, w[4] = c.x, w[5] = c.y, w[6] = d.x, w[7] = d.y;
    } else if (MODE == 1) {
        const unsigned int v[2] = {lo, hi};
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const unsigned int b = v[h] >> (8 * i);
                w[4 * h + i] = __uint_as_float(((b & 0x80u) << 24) | ((b & 0x7fu) << 20));
            }
    } else if (MODE == 2) {
        const unsigned int v[2] = {lo, hi};
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i = 0; i < 4; ++i) w[4 * h + i] = __int_as_float((int)((v[h] >> (8 * i)) & 0xffu));
    } else {
        const unsigned int v[2] = {lo, hi};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            // bytes 1 and 3 as a bf16 pair (sign in place, the low 7 bits 4 lower), bytes 0 and 2 the same from
            // the word 8 higher; a bf16 is the top half of a float
            const unsigned int odd = (v[h] & 0x80008000u) | ((v[h] >> 4) & 0x07f007f0u);
            const unsigned int s = v[h] << 8;
            const unsigned int even = (s & 0x80008000u) | ((s >> 4) & 0x07f007f0u);
            w[4 * h] = __uint_as_float(even << 16), w[4 * h + 1] = __uint_as_float(odd << 16);
            w[4 * h + 2] = __uint_as_float(even & 0xffff0000u), w[4 * h + 3] = __uint_as_float(odd & 0xffff0000u);
        }
    }
}

extern "C" __global__ void widen_all(float* cvt, float* ints, float* pairs) {
    const unsigned int b = threadIdx.x;  // 256 threads: every byte, in each of the eight places
    float w[8];
    for (int i = 0; i < 8; ++i) {
        const unsigned int lo = i < 4 ? b << (8 * i) : 0u, hi = i < 4 ? 0u : b << (8 * (i - 4));
        widen8<0>(lo, hi, w);
        cvt[8 * b + i] = w[i];
        widen8<1>(lo, hi, w);
        ints[8 * b + i] = w[i];
        widen8<3>(lo, hi, w);
        pairs[8 * b + i] = w[i];
    }
}

// out[n] = sum_k w[n, k] * scale[n / 128, k / 128] * x[k], one row of x; a warp owns 4 rows.
template <int MODE>
__global__ void __launch_bounds__(128) gemv1(const float* __restrict__ x, const uint4* __restrict__ w,
                                             const float* __restrict__ scale, float* __restrict__ out, int N, int K) {
    const int lane = threadIdx.x & 31, n0 = (blockIdx.x * 4 + (threadIdx.x >> 5)) * 4;
    if (n0 >= N) return;
    const int C = K / 16, KB = K / 128;
    const float bias = MODE == 1 || MODE == 3 ? 1.329228e36f : 1.0f;  // 2^120
    const uint4* rows[4];
    const float* srow[4];
    for (int r = 0; r < 4; ++r) {
        const int n = min(n0 + r, N - 1);
        rows[r] = w + (u64)n * C;
        srow[r] = scale + (u64)(n / 128) * KB;
    }
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int c0 = lane; c0 < C; c0 += 64) {
        uint4 wv[2][4];
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
            for (int r = 0; r < 4; ++r)
                if (c0 + 32 * u < C) wv[u][r] = __ldcs(rows[r] + c0 + 32 * u);
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int c = c0 + 32 * u;
            if (c >= C) break;
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int k = 16 * c + 8 * j;
                const float4 a = __ldg(reinterpret_cast<const float4*>(x + k)), b = __ldg(reinterpret_cast<const float4*>(x + k) + 1);
                const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    float wf[8];
                    widen8<MODE>(j ? wv[u][r].z : wv[u][r].x, j ? wv[u][r].w : wv[u][r].y, wf);
                    float dot = 0.f;
#pragma unroll
                    for (int i = 0; i < 8; ++i) dot = fmaf(wf[i], xv[i], dot);
                    acc[r] = fmaf(__ldg(srow[r] + (k >> 7)) * bias, dot, acc[r]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        float v = acc[r];
        for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == r && n0 + r < N) out[n0 + r] = v;
    }
}
"""
MODES = {"cvt": 0, "int": 1, "pairs": 3, "bytes": 2}


def source() -> str:
    """common.cu and e4m3.cu (the engine's own widening, `e4m3x2_to_f32`), then the kernels above."""
    from metrale_cli.backends.cuda.kernels.nvrtc import joined_source

    return joined_source("e4m3.cu") + KERNELS


def main() -> int:
    import cupy as cp
    import ml_dtypes

    from benchmarks.bench_kernels import L2_BYTES, _graph_time_ms
    from metrale_cli.bench import read_bandwidth_gpu

    n, k = (int(a) for a in sys.argv[1:3]) if len(sys.argv) >= 3 else (28672, 4096)
    names = [f"gemv1<{m}>" for m in MODES.values()]
    module = cp.RawModule(code=source(), options=("-std=c++17",), name_expressions=names)
    fn = {name: module.get_function(f"gemv1<{m}>") for name, m in MODES.items()}

    cvt, ints, pairs = (cp.zeros(256 * 8, cp.float32) for _ in range(3))
    module.get_function("widen_all")((1,), (256,), (cvt, ints, pairs))
    want = np.repeat(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64), 8)
    nan = np.isnan(want)
    for name, got in (("cvt", cvt.get()), ("int", ints.get() * 2.0**120), ("pairs", pairs.get() * 2.0**120)):
        assert np.array_equal(got.astype(np.float64)[~nan], want[~nan]), f"the {name} widening is not exact"
    print(f"widenings: cvt, int and pairs exact on all {int((~nan).sum()) // 8} non-NaN e4m3 bytes in every place")

    rng = np.random.default_rng(0)
    q = rng.uniform(-448, 448, (n, k)).astype(ml_dtypes.float8_e4m3fn)
    scale = np.exp(rng.uniform(-10, -5, (-(-n // 128), k // 128))).astype(np.float32)
    x = rng.standard_normal(k).astype(np.float32)
    want = (q.astype(np.float64) * np.repeat(np.repeat(scale, 128, 0)[:n], 128, 1)) @ x.astype(np.float64)
    copies = max(2, -(-2 * L2_BYTES // (n * k)))
    ws = [cp.asarray(q.view(np.uint8)) for _ in range(copies)]
    ds, dx = cp.asarray(scale), cp.asarray(x)
    out = cp.zeros(n, cp.float32)
    grid = (-(-n // 16),)
    bw = read_bandwidth_gpu(cp)
    floor_us = n * k / bw * 1e6
    print(f"N={n} K={k}: {n * k / 2**20:.0f} MiB of e4m3, read bandwidth {bw / 1e9:.0f} GB/s, floor {floor_us:.1f} us")
    for name, f in fn.items():
        f(grid, (128,), (dx, ws[0], ds, out, np.int32(n), np.int32(k)))
        if name != "bytes":
            got = out.get().astype(np.float64)
            err = float(np.abs(got - want).max() / np.abs(want).max())
            assert err < 1e-5, (name, err)
        launches = [lambda s, w=w: f(grid, (128,), (dx, w, ds, out, np.int32(n), np.int32(k)), stream=s)
                    for w in ws * (32 // copies + 1)][:32]
        us = _graph_time_ms(cp, launches) * 1e3
        print(f"{name:5s}: {us:7.1f} us = {us / floor_us:.2f} x floor ({n * k / us / 1e3:.0f} GB/s)"
              + ("" if name == "bytes" else f", rel err against float64 {err:.1e}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
