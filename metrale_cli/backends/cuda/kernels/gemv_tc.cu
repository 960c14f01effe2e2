// Tensor-core skinny GEMM for the decode / verify rows path:
//     out[M, N] (=|+=) x[M, K] @ w[N, K]^T (+ bias)           (M = 1..16)
// with the same operands and options as gemv.cu (bias, accumulate, fused RMSNorm prologue, fused
// gate/up + SiLU), computed with mma.sync.m16n8k16 (bf16 x bf16 -> fp32).
//
// Operands: x float32 [M, K] row-major, w bf16 bits [N, K] (HF [out, in]); SwiGLU: w [2N, K] (gate
// rows 0..N-1, up rows N..2N-1) and out[m, n] = silu(x.w[n]) * (x.w[N + n]); bias bf16 [N]; out
// float32 [M, N].  K % 8 == 0, x / w / norm_w 16-byte aligned (checked by Kernels.gemv_tc).
//
// Precision: x (times the norm weight with NORM) is split per element into bf16 hi = bf16(x) and
// lo = bf16(x - hi); both are multiplied with the (exact) bf16 weights into the same fp32
// accumulators (hi first, then lo), so the activation keeps ~16 significant bits plus.
//
// mma mapping (A = 16 weight rows x 16 k, row-major; B = x^T, 16 k x 8 tokens; D = 16 rows x 8
// tokens).  The dot product sums over k, so k may be permuted as long as A and B use the same
// permutation.  Lane = 4 g + q (g = groupID, q = thread in group).  A 32-wide k chunk c is two k16
// steps s = 0, 1; lane (g, q) loads 8 contiguous bf16 (one 16-byte load) of weight rows g and g + 8
// at k = 32 c + 8 q, i.e. words wg.{x,y,z,w} and wg8.{x,y,z,w} (word j = bf16 k+2j | k+2j+1 << 16),
// and uses them as the A fragment of step s:  {wg.word[2s], wg8.word[2s], wg.word[2s+1],
// wg8.word[2s+1]}  (mma k 2q, 2q+1 -> real k 8q+4s, +1;  mma k 2q+8, 2q+9 -> real k 8q+4s+2, +3).
// The B fragment of the same lane then needs token g's x at the same real k: 8 contiguous floats
// x[g][32c + 8q .. +7] (two float4 loads), packed as {bf16x2(x[4s], x[4s+1]), bf16x2(x[4s+2],
// x[4s+3])}.  D: lane (g, q) holds rows g (e = 0, 1) and g + 8 (e = 2, 3), tokens 2q + (e & 1).
// M > 8 uses a second token tile (tokens 8..15, x rows g + 8): NT = 2.  Tokens >= M are zero,
// never stored.  (Checked in float64 by a numpy emulation of the PTX fragment layouts.)
//
// Work split: a block of W warps owns TILES tiles of 16 output rows (SwiGLU: 2 TILES weight tiles,
// gate tile r and up tile TILES + r); its warps split K (split-K inside the block, no atomics).
// The k chunks go to the warps in groups of GEMV_TC_P consecutive chunks, round-robin: warp w
// takes chunks (j / P) W P + w P + (j % P) for j = 0, 1, ... in that order, U chunks per step (all
// weight loads of a step are issued before any mma; x for the step is loaded next).  Rows past N
// are clamped (read, never stored); chunk lanes past K load zeros (K % 32 != 0).  The warps'
// partial tiles go through shared memory and every thread of the block reduces output values
// (warp 0 + warp 1 + ... in that order) and runs the epilogue (inv_rms, bias, SiLU, residual).
//
// M-independence: a token's result depends only on its own x row, N, K and (W, GEMV_TC_P): the
// k partition and accumulation order do not depend on M, TILES or U, tokens sit in the same tile
// column whatever M is (token m: tile m / 8, column m % 8), and the epilogue uses explicitly
// rounded operations (no contraction differences between instances).  So row m of a call with
// M = 8 equals, bit for bit, a call with M = 1 on that row, for any two configs with the same W.
//
// NORM (fused RMSNorm): x is the raw residual stream; each lane multiplies its x values by the
// bf16 norm weight as they are loaded (before the hi/lo split) and accumulates the raw sum of
// squares of its token; the four lanes of a group and then the warps (in order) are summed, and
// inv_rms = rsqrt(ss / K + eps) scales the reduced dot products in the epilogue.
//
// norm_offset is added to the norm weight in fp32 (Gemma's (1 + w): 1.0).  SWIGLU's gate activation
// is `act` (ACT_SILU or ACT_GELU_TANH, common.cu), in explicitly rounded operations as the rest of the
// epilogue.
//
// PDL: the first step's weight loads are issued before pdl_wait(); x, norm_w, bias and out are
// touched only after it.
#include "common.cu"

#define GEMV_TC_P 4  // k chunks (of 32) per partition group; part of the reduction order

// hi = bf16(x0, x1); lo = bf16(x0 - hi0, x1 - hi1) (the subtractions are exact).
__device__ __forceinline__ void gtc_split(float x0, float x1, unsigned int& hi, unsigned int& lo) {
    hi = pack_bf16x2(x0, x1);
    lo = pack_bf16x2(__fsub_rn(x0, bf16_lo(hi)), __fsub_rn(x1, bf16_hi(hi)));
}

// act(a) with explicitly rounded operations (the same bits in every instance).
__device__ __forceinline__ float gtc_act(float a, int act) {
    if (act == ACT_GELU_TANH) {
        const float cube = __fmul_rn(__fmul_rn(a, a), a);
        const float inner = __fmul_rn(0.7978845608028654f, __fadd_rn(a, __fmul_rn(0.044715f, cube)));
        return __fmul_rn(__fmul_rn(0.5f, a), __fadd_rn(1.0f, tanhf(inner)));
    }
    return __fdiv_rn(a, __fadd_rn(1.0f, expf(-a)));
}

// The chunk index of the j-th chunk of warp `warp` (see the top).
template <int W>
__device__ __forceinline__ int gtc_chunk(int j, int warp) {
    const unsigned int uj = (unsigned int)j;
    return (int)((uj / GEMV_TC_P) * (W * GEMV_TC_P) + (unsigned int)warp * GEMV_TC_P + (uj % GEMV_TC_P));
}

// Predicated 16-byte loads (no branch): zeros when !ok.  Weights: streaming, skip L1.  x and the
// norm weight: through L1 (shared by the blocks of an SM).
__device__ __forceinline__ uint4 gtc_ld_w(const void* p, bool ok) {
    uint4 r;
    asm("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %5, 0;\n\t"
        "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\tmov.b32 %2, 0;\n\tmov.b32 %3, 0;\n\t"
        "@p ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p), "r"((int)ok));
    return r;
}
// volatile: must stay after pdl_wait() (a non-volatile asm without a memory clobber may be hoisted).
__device__ __forceinline__ uint4 gtc_ld_x(const void* p, bool ok) {
    uint4 r;
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %5, 0;\n\t"
        "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\tmov.b32 %2, 0;\n\tmov.b32 %3, 0;\n\t"
        "@p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p), "r"((int)ok));
    return r;
}

// Weight loads of one step: chunks j0 .. j0+U-1 of this warp, rows (g, g+8) of each of the RW tiles.
template <int W, int RW, int U>
__device__ __forceinline__ void gtc_load_w(uint4 (&wv)[U][RW][2], const unsigned short* const (&wrow)[RW][2],
                                           int j0, int warp, int q, int K) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int c = gtc_chunk<W>(j0 + u, warp);
        const bool ok = 32 * c + 8 * q < K;
#pragma unroll
        for (int r = 0; r < RW; ++r)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                wv[u][r][h] = gtc_ld_w(wrow[r][h] + 32 * c, ok);
    }
}

// x loads, hi/lo split and mmas of one step.
template <int W, int NT, int RW, int U, bool NORM>
__device__ __forceinline__ void gtc_compute(const uint4 (&wv)[U][RW][2], const float* __restrict__ x,
                                            const unsigned short* __restrict__ norm_w, float norm_offset, int M,
                                            int K, int j0, int warp, int g, int q, float (&acc)[RW][NT][4],
                                            float (&ss)[NT]) {
    float xv[U][NT][8];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int k = 32 * gtc_chunk<W>(j0 + u, warp) + 8 * q;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const int m = 8 * nt + g;
            const bool ok = k < K && m < M;
            const float* p = x + (u64)(ok ? m : 0) * K + (ok ? k : 0);
            const uint4 a = gtc_ld_x(p, ok), b = gtc_ld_x(p + 4, ok);
            xv[u][nt][0] = __uint_as_float(a.x);
            xv[u][nt][1] = __uint_as_float(a.y);
            xv[u][nt][2] = __uint_as_float(a.z);
            xv[u][nt][3] = __uint_as_float(a.w);
            xv[u][nt][4] = __uint_as_float(b.x);
            xv[u][nt][5] = __uint_as_float(b.y);
            xv[u][nt][6] = __uint_as_float(b.z);
            xv[u][nt][7] = __uint_as_float(b.w);
        }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if constexpr (NORM) {
            const int k = 32 * gtc_chunk<W>(j0 + u, warp) + 8 * q;
            const uint4 nb = gtc_ld_x(norm_w + (k < K ? k : 0), k < K);
            const float nw[8] = {
                __fadd_rn(bf16_lo(nb.x), norm_offset), __fadd_rn(bf16_hi(nb.x), norm_offset),
                __fadd_rn(bf16_lo(nb.y), norm_offset), __fadd_rn(bf16_hi(nb.y), norm_offset),
                __fadd_rn(bf16_lo(nb.z), norm_offset), __fadd_rn(bf16_hi(nb.z), norm_offset),
                __fadd_rn(bf16_lo(nb.w), norm_offset), __fadd_rn(bf16_hi(nb.w), norm_offset)};
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                float t = ss[nt];
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    t = __fmaf_rn(xv[u][nt][i], xv[u][nt][i], t);
                    xv[u][nt][i] = __fmul_rn(xv[u][nt][i], nw[i]);
                }
                ss[nt] = t;
            }
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            unsigned int hi[4], lo[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) gtc_split(xv[u][nt][2 * i], xv[u][nt][2 * i + 1], hi[i], lo[i]);
#pragma unroll
            for (int r = 0; r < RW; ++r) {
                const uint4 w0 = wv[u][r][0], w1 = wv[u][r][1];
                mma_bf16_16816(acc[r][nt], w0.x, w1.x, w0.y, w1.y, hi[0], hi[1]);
                mma_bf16_16816(acc[r][nt], w0.x, w1.x, w0.y, w1.y, lo[0], lo[1]);
                mma_bf16_16816(acc[r][nt], w0.z, w1.z, w0.w, w1.w, hi[2], hi[3]);
                mma_bf16_16816(acc[r][nt], w0.z, w1.z, w0.w, w1.w, lo[2], lo[3]);
            }
        }
    }
}

// NT token tiles (1: M <= 8, 2: M <= 16); TILES output tiles of 16 rows per block; W warps split K;
// U chunks of 32 k per step.  N = output columns (SwiGLU: I, w has 2N rows).
// The body of gemv_tc_kernel (and of the fused gemv_tc_qkv_rope_kernel).  Block barriers inside: every
// thread of the block must call it.
template <int NT, int TILES, int W, int U, bool SWIGLU, bool NORM>
__device__ __forceinline__ void gemv_tc_body(const float* __restrict__ x, const unsigned short* __restrict__ w,
                                             const unsigned short* __restrict__ bias, float* __restrict__ out, int M,
                                             int N, int K, int accumulate, int has_bias,
                                             const unsigned short* __restrict__ norm_w, float eps,
                                             float norm_offset, int act) {
    constexpr int RW = SWIGLU ? 2 * TILES : TILES;  // weight tiles per block
    constexpr int NV = RW * NT * 4 * 32;            // partial values per warp
    constexpr int NO = TILES * NT * 4 * 32;         // output values per block
    static_assert(W * NV * 4 <= 40 * 1024, "gemv_tc: reduction buffer too large");
    __shared__ float red[W][NV];
    __shared__ float ssred[NORM ? W : 1][NT * 8];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    const int n0 = blockIdx.x * (16 * TILES);
    const int C = (K + 31) >> 5;  // 32-wide k chunks, the last one may be partial

    const unsigned short* wrow[RW][2];
#pragma unroll
    for (int r = 0; r < RW; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int n = min(n0 + 16 * (r % TILES) + g + 8 * h, N - 1);
            const int wr = (SWIGLU && r >= TILES) ? N + n : n;
            wrow[r][h] = w + (u64)wr * K + 8 * q;
        }

    float acc[RW][NT][4];
#pragma unroll
    for (int r = 0; r < RW; ++r)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[r][nt][e] = 0.0f;
    float ss[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) ss[nt] = 0.0f;

    uint4 wv[U][RW][2];
    gtc_load_w<W, RW, U>(wv, wrow, 0, warp, q, K);  // weights only: before the PDL wait
    pdl_wait();
    pdl_trigger();
    gtc_compute<W, NT, RW, U, NORM>(wv, x, norm_w, norm_offset, M, K, 0, warp, g, q, acc, ss);
    for (int j0 = U; gtc_chunk<W>(j0, warp) < C; j0 += U) {
        gtc_load_w<W, RW, U>(wv, wrow, j0, warp, q, K);
        gtc_compute<W, NT, RW, U, NORM>(wv, x, norm_w, norm_offset, M, K, j0, warp, g, q, acc, ss);
    }

    // Split-K reduction through shared memory: red[warp][((r NT + nt) 4 + e) 32 + lane].
#pragma unroll
    for (int r = 0; r < RW; ++r)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) red[warp][((r * NT + nt) * 4 + e) * 32 + lane] = acc[r][nt][e];
    if constexpr (NORM) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            float s = ss[nt];
            s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, 1));
            s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, 2));
            if (q == 0) ssred[warp][nt * 8 + g] = s;
        }
    }
    __syncthreads();

    for (int v = threadIdx.x; v < NO; v += W * 32) {
        const int l = v & 31, e = (v >> 5) & 3, nt = (v >> 7) % NT, r = (v >> 7) / NT;
        const int n = n0 + 16 * r + (l >> 2) + 8 * (e >> 1);
        const int m = 8 * nt + 2 * (l & 3) + (e & 1);
        if (m >= M || n >= N) continue;
        float a = red[0][v];
#pragma unroll
        for (int ww = 1; ww < W; ++ww) a = __fadd_rn(a, red[ww][v]);
        float inv = 1.0f;
        if constexpr (NORM) {
            float s = ssred[0][nt * 8 + (m & 7)];
#pragma unroll
            for (int ww = 1; ww < W; ++ww) s = __fadd_rn(s, ssred[ww][nt * 8 + (m & 7)]);
            inv = rsqrtf(__fadd_rn(__fdiv_rn(s, (float)K), eps));
            a = __fmul_rn(a, inv);
        }
        float val;
        if constexpr (SWIGLU) {
            float u = red[0][v + NO];
#pragma unroll
            for (int ww = 1; ww < W; ++ww) u = __fadd_rn(u, red[ww][v + NO]);
            if constexpr (NORM) u = __fmul_rn(u, inv);
            val = __fmul_rn(gtc_act(a, act), u);
        } else {
            val = a;
            if (has_bias) val = __fadd_rn(val, bf16_to_f32_bits(bias[n]));
        }
        float* o = out + (u64)m * N + n;
        if (accumulate) val = __fadd_rn(val, *o);
        *o = val;
    }
}

template <int NT, int TILES, int W, int U, bool SWIGLU, bool NORM>
__global__ void __launch_bounds__(W * 32)
gemv_tc_kernel(const float* __restrict__ x, const unsigned short* __restrict__ w,
               const unsigned short* __restrict__ bias, float* __restrict__ out, int M, int N, int K,
               int accumulate, int has_bias, const unsigned short* __restrict__ norm_w, float eps,
               float norm_offset, int act) {
    gemv_tc_body<NT, TILES, W, U, SWIGLU, NORM>(x, w, bias, out, M, N, K, accumulate, has_bias, norm_w, eps,
                                                norm_offset, act);
}

// The fused rows path's qkv projection from GEMV_TC_MIN_ROWS rows on: gemv_tc_kernel with the RMSNorm
// prologue, then rope + KV append in the block that finishes a head slot (qkv_rope_tail, common.cu;
// as gemv.cu's gemv_qkv_rope_kernel).  counters: int32 [n_heads + 2 n_kv], zero before and after.
template <int NT, int TILES, int W, int U>
__global__ void __launch_bounds__(W * 32)
gemv_tc_qkv_rope_kernel(const float* __restrict__ x, const unsigned short* __restrict__ w,
                        const unsigned short* __restrict__ bias, float* __restrict__ qkv, int M, int N, int K,
                        int has_bias, const unsigned short* __restrict__ norm_w, float eps, float norm_offset,
                        const int* __restrict__ positions, const float* __restrict__ inv_freq,
                        const unsigned short* __restrict__ q_norm, const unsigned short* __restrict__ k_norm,
                        float* __restrict__ q_out, unsigned short* __restrict__ k_cache,
                        unsigned short* __restrict__ v_cache, int n_heads, int n_kv, int head_dim, int max_ctx,
                        float rope_eps, int has_q_norm, int has_k_norm, float attn_scaling, float rope_norm_offset,
                        int rot_dim, int* __restrict__ counters) {
    gemv_tc_body<NT, TILES, W, U, false, true>(x, w, bias, qkv, M, N, K, 0, has_bias, norm_w, eps, norm_offset,
                                               ACT_SILU);
    qkv_rope_tail<W>(16 * TILES, qkv, N, M, positions, inv_freq, q_norm, k_norm, q_out, k_cache, v_cache, n_heads,
                     n_kv, head_dim, max_ctx, rope_eps, has_q_norm, has_k_norm, attn_scaling, rope_norm_offset,
                     rot_dim, counters);
}
