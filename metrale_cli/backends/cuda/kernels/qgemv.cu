// Weights kept in a quantized format (backends/cuda/fp8.py, w4.py): the rows path's GEMV, which reads the stored
// bytes and dequantizes in registers, and the prefill path's dequantization to bf16 for cuBLAS.  One kernel body for
// every format; a format is a policy (below) that says how many values a 16-byte chunk holds and widens eight of
// them to floats, exactly.
//
// Weight: rows of 16-byte chunks [N, C], C = ceil(K / F::VALS), value k of a row in chunk k / VALS (a row's last
// chunk may end in padding, never read as a value).  Scales (policy S, below): the scale of weight (n, k) is entry
// (n / srow) * ld + k / group of the scale array, ld = ceil(K / group), group a multiple of 8 (eight values never
// straddle two scale groups); srow is a block format's block height (FP8 block), else 1.  A weight's value is one
// fp32 product, code value * scale, the scale formed as the NumPy engine forms it, so the value is the NumPy
// engine's dequantized value bit for bit.
//
// Scales (S):
//   SF32      fp32 scales;
//   SE4m3Mul  e4m3 bytes, the scale fp32(e4m3) * factor[n] (ModelOpt NVFP4: weight_scale * weight_scale_2);
//   SE4m3Div  e4m3 bytes, the scale fp32(e4m3) / factor[n] (compressed-tensors NVFP4: / weight_global_scale);
// factor: fp32 [N], a row's second-level scale (a fused weight's parts each have their own).
//
// Formats (F):
//   QE4m3  FP8 e4m3, 16 values a chunk (e4m3.cu's exact conversion);
//   QE2m1  NVFP4's e2m1, 32 values a chunk as eight 32-bit words, value k in bits 4 (k % 8) .. of word k / 8
//          (e2m1.cu's exact conversion, two codes a half-precision multiply);
//   QInt4  symmetric int4 (pack-quantized: q + 8 stored), the same packing, value code - 8.
//
// qgemv_kernel<F, S, M, R, SWIGLU>:  out[M, N] (=|+=) x[M, K] @ (w * scale)[N, K]^T (+ bias), fp32 accumulation,
// with gemv.cu's options: has_norm (x is the un-normalised residual and the product is that of rmsnorm(x) with the
// bf16 norm weight, norm_offset added, the factor rsqrt(mean(x^2) + eps) applied to the reduced sums) and SWIGLU
// (w holds 2N rows, gate then up; out = act(gate) * up).  Requirements (checked by QuantKernels._gemv): K % 8 == 0,
// 1 <= M <= 16, w, x and the norm weight 16-byte aligned.
#include "common.cu"
#include "e4m3.cu"
#include "e2m1.cu"
#include "gemv.cu"

struct QE4m3 {
    static constexpr int VALS = 16;
    // values 8 j .. 8 j + 7 of the chunk (j = 0, 1)
    static __device__ __forceinline__ void widen8(const uint4& q, int j, float (&w)[8]) {
        const unsigned int lo = j == 0 ? q.x : q.z, hi = j == 0 ? q.y : q.w;
        const float2 a = e4m3x2_to_f32((unsigned short)(lo & 0xffffu)), b = e4m3x2_to_f32((unsigned short)(lo >> 16));
        const float2 c = e4m3x2_to_f32((unsigned short)(hi & 0xffffu)), d = e4m3x2_to_f32((unsigned short)(hi >> 16));
        w[0] = a.x, w[1] = a.y, w[2] = b.x, w[3] = b.y, w[4] = c.x, w[5] = c.y, w[6] = d.x, w[7] = d.y;
    }
};

__device__ __forceinline__ unsigned int u4_word(const uint4& q, int j) {
    return j == 0 ? q.x : j == 1 ? q.y : j == 2 ? q.z : q.w;
}

struct QE2m1 {
    static constexpr int VALS = 32;
    static __device__ __forceinline__ void widen8(const uint4& q, int j, float (&w)[8]) { e2m1x8<0>(u4_word(q, j), w); }
};

struct QInt4 {
    static constexpr int VALS = 32;
    static __device__ __forceinline__ void widen8(const uint4& q, int j, float (&w)[8]) {
        const unsigned int word = u4_word(q, j);
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = (float)((int)((word >> (4 * i)) & 0xFu) - 8);
    }
};

struct SF32 {
    static constexpr int BYTES = 4;
    static __device__ __forceinline__ float at(const unsigned char* row, int g, float) {
        return __ldg(reinterpret_cast<const float*>(row) + g);
    }
};

struct SE4m3Mul {
    static constexpr int BYTES = 1;
    static __device__ __forceinline__ float at(const unsigned char* row, int g, float f) {
        return e4m3x2_to_f32((unsigned short)__ldg(row + g)).x * f;
    }
};

struct SE4m3Div {
    static constexpr int BYTES = 1;
    static __device__ __forceinline__ float at(const unsigned char* row, int g, float f) {
        return __fdiv_rn(e4m3x2_to_f32((unsigned short)__ldg(row + g)).x, f);
    }
};

#define QGEMV_WARPS 4
#define QGEMV_U 2

// A warp owns R consecutive output rows (2R weight rows with SWIGLU: gate rows n, up rows N + n); lane l walks the
// chunks l, l + 32, ... of all of them (QGEMV_U chunks of each in flight), eight values at a time: each eight
// weights are widened once and used for every row of x, and each eight values of x are loaded once for all the
// weight rows.  The kernel is bound by its instructions as much as by memory (an FP8 value is one byte, about four
// instructions at M = 1), so each eight values' dot product is taken on the codes' values and multiplied by their
// one scale (not each weight scaled first: the NumPy engine's dequantized value, equal in exact arithmetic), and a
// group index is one high multiply: k / group = umulhi(k, group_magic), group_magic = ceil(2^32 / group) (< 2^31 for
// group >= 8), exact for k * group < 2^32 (QuantKernels checks K <= 65536).
template <class F, class S, int M, int R, bool SWIGLU>
__global__ void __launch_bounds__(QGEMV_WARPS * 32)
qgemv_kernel(const float* __restrict__ x, const uint4* __restrict__ w, const unsigned char* __restrict__ scale,
             const float* __restrict__ factor, int srow, int group_magic, int ld,
             const unsigned short* __restrict__ bias, float* __restrict__ out, int N, int K, int accumulate,
             int has_bias, const unsigned short* __restrict__ norm_w, int has_norm, float eps, float norm_offset,
             int act) {
    constexpr int RW = SWIGLU ? 2 * R : R;
    constexpr int P = F::VALS / 8;  // eight-value parts of a chunk
    const int lane = threadIdx.x & 31;
    const int n0 = (blockIdx.x * QGEMV_WARPS + (threadIdx.x >> 5)) * R;
    if (n0 >= N) return;  // whole warp; no block barrier below
    const int C = (K + F::VALS - 1) / F::VALS;
    const bool norm = has_norm != 0;
    const uint4* rows[RW];
    const unsigned char* scales[RW];
    float fac[RW];
#pragma unroll
    for (int r = 0; r < RW; ++r) {
        const int n = min(n0 + (r % R), N - 1);  // rows past N - 1 are read, never stored
        const int wr = (SWIGLU && r >= R) ? N + n : n;
        rows[r] = w + (u64)wr * C;
        scales[r] = scale + (u64)(wr / srow) * ld * S::BYTES;
        fac[r] = S::BYTES == 1 ? __ldg(factor + wr) : 1.0f;
    }
    // PDL (common.cu): pull this warp's first weight chunks into L2 while the kernel that wrote x finishes; x and
    // out are touched only after pdl_wait.
#pragma unroll
    for (int u = 0; u < QGEMV_U; ++u)
#pragma unroll
        for (int r = 0; r < RW; ++r)
            if (lane + 32 * u < C) prefetch_l2(rows[r] + lane + 32 * u);
    pdl_wait();
    pdl_trigger();
    float acc[RW][M], ss[M], inv[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
        ss[m] = 0.f;
#pragma unroll
        for (int r = 0; r < RW; ++r) acc[r][m] = 0.f;
    }
    for (int c0 = lane; c0 < C; c0 += 32 * QGEMV_U) {
        uint4 wv[QGEMV_U][RW];
#pragma unroll
        for (int u = 0; u < QGEMV_U; ++u)
#pragma unroll
            for (int r = 0; r < RW; ++r)
                if (c0 + 32 * u < C) wv[u][r] = ld_stream_u4(rows[r] + c0 + 32 * u);
#pragma unroll
        for (int u = 0; u < QGEMV_U; ++u) {
            const int c = c0 + 32 * u;
            if (c >= C) break;
#pragma unroll
            for (int j = 0; j < P; ++j) {
                const int k = c * F::VALS + 8 * j;  // the first of the eight values
                if (k >= K) break;                  // a padded row's last chunk
                const int g = __umulhi((unsigned)k, (unsigned)group_magic);  // k / group (see the top)
                float wf[RW][8], sc[RW];
#pragma unroll
                for (int r = 0; r < RW; ++r) {
                    F::widen8(wv[u][r], j, wf[r]);
                    sc[r] = S::at(scales[r], g, fac[r]);
                }
                float nw[8];
                if (norm) {
                    const uint4 g = __ldg(reinterpret_cast<const uint4*>(norm_w + k));
                    nw[0] = bf16_lo(g.x) + norm_offset, nw[1] = bf16_hi(g.x) + norm_offset;
                    nw[2] = bf16_lo(g.y) + norm_offset, nw[3] = bf16_hi(g.y) + norm_offset;
                    nw[4] = bf16_lo(g.z) + norm_offset, nw[5] = bf16_hi(g.z) + norm_offset;
                    nw[6] = bf16_lo(g.w) + norm_offset, nw[7] = bf16_hi(g.w) + norm_offset;
                }
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    const float4* xp = reinterpret_cast<const float4*>(x + (u64)m * K + k);
                    const float4 a = __ldg(xp), b = __ldg(xp + 1);
                    float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
                    if (norm) {
                        ss[m] = sumsq4(b, sumsq4(a, ss[m]));
#pragma unroll
                        for (int i = 0; i < 8; ++i) xv[i] *= nw[i];
                    }
#pragma unroll
                    for (int r = 0; r < RW; ++r) {
                        float dot = 0.f;
#pragma unroll
                        for (int i = 0; i < 8; ++i) dot = fmaf(wf[r][i], xv[i], dot);
                        acc[r][m] = fmaf(sc[r], dot, acc[r][m]);
                    }
                }
            }
        }
    }
    // The lanes of the warp together loaded every value of x once: ss sums to the whole row.
#pragma unroll
    for (int m = 0; m < M; ++m) inv[m] = norm ? rsqrtf(warp_sum(ss[m]) / (float)K + eps) : 1.0f;
    if (norm)
        gemv_epilogue<M, R, SWIGLU, true>(acc, inv, lane, n0, N, bias, out, accumulate, has_bias, act);
    else
        gemv_epilogue<M, R, SWIGLU, false>(acc, inv, lane, n0, N, bias, out, accumulate, has_bias, act);
}

// out[n, k] = bf16(value(w[n, k]) * its scale), round to nearest even: the prefill path's weight for cuBLAS, out
// bf16 [N, K] (one thread per eight values: one scale, one 16-byte store; padding is not visited).
template <class F, class S>
__global__ void qdequant_bf16_kernel(const uint4* __restrict__ w, const unsigned char* __restrict__ scale,
                                     const float* __restrict__ factor, int srow, int group, int ld,
                                     uint4* __restrict__ out, int N, int K) {
    pdl_wait();  // its output may be read by a kernel launched before this one finished (common.cu)
    pdl_trigger();
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const int K8 = K >> 3, C = (K + F::VALS - 1) / F::VALS;
    if (i >= (u64)N * K8) return;
    const int n = (int)(i / K8), k = 8 * (int)(i % K8);
    float v[8];
    F::widen8(w[(u64)n * C + k / F::VALS], (k % F::VALS) / 8, v);
    const float s = S::at(scale + (u64)(n / srow) * ld * S::BYTES, k / group, S::BYTES == 1 ? factor[n] : 1.0f);
    out[i] = make_uint4(pack_bf16x2(v[0] * s, v[1] * s), pack_bf16x2(v[2] * s, v[3] * s),
                        pack_bf16x2(v[4] * s, v[5] * s), pack_bf16x2(v[6] * s, v[7] * s));
}
