"""Is a quantized GEMV bound by widening its codes to fp32? One question per format, one run on a GPU:

    PYTHONPATH=. python3 -m benchmarks.bench_widen [e4m3|e2m1|all] [N K]   # default all, 28672 4096 (an 8B gate_up)

qgemv.cu widens e4m3 (FP8) with `cvt.rn.f16x2.e4m3x2` and a half-to-float per value, and e2m1 (NVFP4, MXFP4) with a
half-precision multiply per two codes and a half-to-float per value (e2m1.cu): conversions, which sm_90 issues at a
fraction of its FMA rate. This benchmark times stripped one-row GEMVs over the same weights, laid out and walked as
qgemv.cu walks them (a warp owns 4 rows, 16-byte chunks, 2 in flight, each eight values' dot product scaled once):
e4m3 [N, K] with [128, 128] block scales, or e2m1 [N, K] with an fp32 scale per 16 values of a row:
  cvt    e4m3: QE4m3's widening (e4m3.cu's, compiled in);
  int    e4m3: the byte's low 7 bits at bit 20 and its sign at bit 31 are the value times 2^-120, exactly, subnormals
         included; the 2^120 multiplies the eight values' dot product (exact);
  pairs  e4m3: bytes 1 and 3 of a word masked into a bf16 pair in place (sign bits kept, the low 7 bits shifted 4
         lower), bytes 0 and 2 the same from the word shifted 8 up, each bf16 the top half of a float: the values
         times 2^-120 in about three integer operations a value;
  bytes  e4m3 layout, no widening (the bytes summed as integers): what the access pattern alone reads at;
  half   e2m1: e2m1.cu's widening (compiled in);
  shift  e2m1: the code's low 3 bits at bit 22 and its sign at bit 31 are the value times 2^-126, exactly; x is
         scaled by 2^64 when loaded (only products under 2^-64 fall below fp32's normal range) and the dot
         product by 2^62;
  nibbles  e2m1 layout, no widening: what the access pattern alone reads at.
It first checks each widening exact for every code but NaN in each of a word's places, and each GEMV against float64.
Each time is a CUDA graph of 32 launches over rotating weight copies (bench_kernels' timer), beside the read
bandwidth of `metrale bench`'s read-only kernel in the same run. An experiment: the engine's kernels change only if
an integer widening wins."""

from __future__ import annotations

import sys

import numpy as np

KERNELS = r"""
// e4m3 modes: 0 cvt (values); 1 int (values x 2^-120); 3 pairs (values x 2^-120); 2 bytes (no widening).
// e2m1 modes: 4 half (values); 5 shift (values x 2^-126); 6 nibbles (no widening).  v: the chunk's two or four words
// that hold these eight values (e4m3: lo, hi; e2m1: one word, lo).
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
    } else if (MODE == 3) {
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
    } else if (MODE == 4) {
        e2m1x8<0>(lo, w);
    } else if (MODE == 5) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const unsigned int c = lo >> (4 * i);
            w[i] = __uint_as_float(((c & 0x8u) << 28) | ((c & 0x7u) << 22));
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = __int_as_float((int)((lo >> (4 * i)) & 0xfu));
    }
}

// every code in each of the eight places of its word(s): out[8 * code + place], the mode's values
template <int MODE>
__device__ void widen_places(float* out, unsigned int code) {
    float w[8];
    for (int i = 0; i < 8; ++i) {
        unsigned int lo, hi;
        if (MODE >= 4) {
            lo = code << (4 * i), hi = 0u;
        } else {
            lo = i < 4 ? code << (8 * i) : 0u, hi = i < 4 ? 0u : code << (8 * (i - 4));
        }
        widen8<MODE>(lo, hi, w);
        out[8 * code + i] = w[i];
    }
}

extern "C" __global__ void widen_all(float* cvt, float* ints, float* pairs, float* half, float* shift) {
    const unsigned int c = threadIdx.x;  // 256 threads: every byte (e4m3), the first 16 every nibble (e2m1)
    widen_places<0>(cvt, c);
    widen_places<1>(ints, c);
    widen_places<3>(pairs, c);
    if (c < 16) {
        widen_places<4>(half, c);
        widen_places<5>(shift, c);
    }
}

// out[n] = sum_k w[n, k] * scale * x[k], one row of x; a warp owns 4 rows.  e4m3: 16 values a chunk, scale
// [n / 128, k / 128]; e2m1: 32 values a chunk (code k in bits 4 (k % 8) of word (k % 32) / 8), scale [n, k / 16].
template <int MODE>
__global__ void __launch_bounds__(128) gemv1(const float* __restrict__ x, const uint4* __restrict__ w,
                                             const float* __restrict__ scale, float* __restrict__ out, int N, int K) {
    constexpr bool FP4 = MODE >= 4;
    constexpr int VALS = FP4 ? 32 : 16;
    const int lane = threadIdx.x & 31, n0 = (blockIdx.x * 4 + (threadIdx.x >> 5)) * 4;
    if (n0 >= N) return;
    const int C = K / VALS, KB = FP4 ? K / 16 : K / 128;
    // values times 2^-120 (e4m3 int, pairs) or 2^-126 with x times 2^64 (e2m1 shift): the dot product's factor
    const float unit = MODE == 1 || MODE == 3 ? 1.329228e36f : MODE == 5 ? 4.611686e18f : 1.0f;  // 2^120, 2^62
    const float xunit = MODE == 5 ? 1.8446744e19f : 1.0f;  // 2^64
    const uint4* rows[4];
    const float* srow[4];
    for (int r = 0; r < 4; ++r) {
        const int n = min(n0 + r, N - 1);
        rows[r] = w + (u64)n * C;
        srow[r] = scale + (u64)(FP4 ? n : n / 128) * KB;
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
            for (int j = 0; j < VALS / 8; ++j) {
                const int k = VALS * c + 8 * j;
                const float4* xp = reinterpret_cast<const float4*>(x + k);
                const float4 a = __ldg(xp), b = __ldg(xp + 1);
                float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
                for (int i = 0; i < 8; ++i) xv[i] *= xunit;
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const uint4 q = wv[u][r];
                    const unsigned int word[4] = {q.x, q.y, q.z, q.w};
                    float wf[8];
                    if (FP4)
                        widen8<MODE>(word[j], 0u, wf);
                    else
                        widen8<MODE>(word[2 * j], word[2 * j + 1], wf);
                    float dot = 0.f;
#pragma unroll
                    for (int i = 0; i < 8; ++i) dot = fmaf(wf[i], xv[i], dot);
                    acc[r] = fmaf(__ldg(srow[r] + (FP4 ? k >> 4 : k >> 7)), dot * unit, acc[r]);
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
FORMATS = {"e4m3": {"cvt": 0, "int": 1, "pairs": 3, "bytes": 2}, "e2m1": {"half": 4, "shift": 5, "nibbles": 6}}
MODES = {name: m for modes in FORMATS.values() for name, m in modes.items()}
NO_WIDENING = ("bytes", "nibbles")
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def source() -> str:
    """common.cu, e4m3.cu and e2m1.cu (the engine's own widenings), then the kernels above."""
    from metrale_cli.backends.cuda.kernels.nvrtc import joined_source

    return joined_source("e4m3.cu", "e2m1.cu") + KERNELS


def check_widenings(cp, module) -> None:
    """Every widening exact for every code but NaN in each place of its word(s)."""
    import ml_dtypes

    outs = [cp.zeros(256 * 8, cp.float32) for _ in range(5)]
    module.get_function("widen_all")((1,), (256,), tuple(outs))
    e4m3 = np.repeat(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64), 8)
    e2m1 = np.repeat(E2M1, 8)
    nan = np.isnan(e4m3)
    for name, got, unit, want in (("cvt", outs[0], 1.0, e4m3), ("int", outs[1], 2.0**120, e4m3),
                                  ("pairs", outs[2], 2.0**120, e4m3), ("half", outs[3], 1.0, e2m1),
                                  ("shift", outs[4], 2.0**126, e2m1)):
        g = got.get().astype(np.float64)[:want.size] * unit
        ok = ~nan[:want.size] if want is e4m3 else np.ones(want.size, bool)
        assert np.array_equal(g[ok], want[ok]), f"the {name} widening is not exact"
    print("widenings: every e4m3 byte but NaN and every e2m1 code exact in every place of a word")


def weights(fmt: str, n: int, k: int, rng):
    """(stored bytes [n, k * bits / 8], fp32 scales, the float64 weight) of a random matrix in `fmt`."""
    import ml_dtypes

    if fmt == "e4m3":
        q = rng.uniform(-448, 448, (n, k)).astype(ml_dtypes.float8_e4m3fn)
        scale = np.exp(rng.uniform(-10, -5, (-(-n // 128), k // 128))).astype(np.float32)
        return q.view(np.uint8), scale, q.astype(np.float64) * np.repeat(np.repeat(scale, 128, 0)[:n], 128, 1)
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)  # two a byte, the low nibble first
    scale = np.exp(rng.uniform(-6, -2, (n, k // 16))).astype(np.float32)
    return packed, scale, E2M1[codes] * np.repeat(scale, 16, 1)


def main() -> int:
    import cupy as cp

    from benchmarks.bench_kernels import L2_BYTES, _graph_time_ms
    from metrale_cli.bench import read_bandwidth_gpu

    args = sys.argv[1:]
    fmts = list(FORMATS) if not args or args[0] == "all" else [args[0]]
    n, k = (int(a) for a in args[1:3]) if len(args) >= 3 else (28672, 4096)
    module = cp.RawModule(code=source(), options=("-std=c++17",),
                          name_expressions=[f"gemv1<{m}>" for m in MODES.values()])
    check_widenings(cp, module)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(k).astype(np.float32)
    dx, out = cp.asarray(x), cp.zeros(n, cp.float32)
    grid = (-(-n // 16),)
    bw = read_bandwidth_gpu(cp)
    for fmt in fmts:
        stored, scale, w64 = weights(fmt, n, k, rng)
        want = w64 @ x.astype(np.float64)
        copies = max(2, -(-2 * L2_BYTES // stored.nbytes))
        ws = [cp.asarray(stored) for _ in range(copies)]
        ds = cp.asarray(scale)
        floor_us = (stored.nbytes + scale.nbytes) / bw * 1e6
        print(f"{fmt} N={n} K={k}: {stored.nbytes / 2**20:.0f} MiB of codes, {scale.nbytes / 2**20:.1f} MiB of scales, "
              f"read bandwidth {bw / 1e9:.0f} GB/s, floor {floor_us:.1f} us")
        for name, m in FORMATS[fmt].items():
            f = module.get_function(f"gemv1<{m}>")
            f(grid, (128,), (dx, ws[0], ds, out, np.int32(n), np.int32(k)))
            err = None
            if name not in NO_WIDENING:
                err = float(np.abs(out.get().astype(np.float64) - want).max() / np.abs(want).max())
                assert err < 1e-5, (name, err)
            launches = [lambda s, w=w: f(grid, (128,), (dx, w, ds, out, np.int32(n), np.int32(k)), stream=s)
                        for w in ws * (32 // copies + 1)][:32]
            us = _graph_time_ms(cp, launches) * 1e3
            print(f"  {name:7s}: {us:7.1f} us = {us / floor_us:.2f} x floor"
                  + ("" if err is None else f", rel err against float64 {err:.1e}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
