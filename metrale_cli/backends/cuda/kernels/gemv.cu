// Small-M GEMV for the decode / verify path:  out[M, N] (=|+=) x[M, K] @ w[N, K]^T (+ bias)
//
// x: float32 [M, K] (row-major), w: bf16 [N, K] (Hugging Face [out, in] layout),
// bias: bf16 [N] (optional), out: float32 [M, N].  fp32 accumulation.
// Requirements (checked by Kernels.gemv): K % 8 == 0, x and w 16-byte aligned,
// 1 <= M <= 16, x does not overlap out.
//
// Work split: a block has GEMV_WARPS warps; each warp owns R consecutive output
// rows (2R weight rows in the SwiGLU variant) and walks K in 16-byte chunks of 8
// bf16, lane l taking chunks l, l+32, ... .  Every weight byte is loaded once
// (16-byte streaming loads, U chunks per row in flight per lane) and used for
// all M rows of x; x comes through L1 (it is small and shared by all warps).
// Partial sums are reduced with warp shuffles.
//
// NORM (fused RMSNorm prologue): x is the un-normalised residual stream and the
// kernel computes  out = (w_norm * x * inv_rms(x)) @ w^T  with
// inv_rms = rsqrt(mean(x^2) + eps) per row, i.e. the same function as rmsnorm
// followed by the plain GEMV (rounding differs by a few fp32 ulps).  x is
// multiplied by the bf16 norm weight as it is loaded; the sum of squares of each
// row is accumulated from the same loads (every warp reads all of x, so it needs
// no extra pass and no barrier), and the per-row factor inv_rms, being a scalar,
// is applied to the reduced dot products in the epilogue.  norm_offset is added to the
// norm weight in fp32 (Gemma's (1 + w): 1.0; Llama: 0).
// SWIGLU's gate activation is `act` (ACT_SILU or ACT_GELU_TANH, common.cu).
#include "common.cu"

#define GEMV_WARPS 4

// Weight-row pointers of a warp that owns output rows n0 .. n0+R-1 (and, for SwiGLU,
// the matching up rows N + n).  Rows past N-1 are clamped to N-1: read, never stored.
template <int R, bool SWIGLU>
__device__ __forceinline__ void gemv_rows(const unsigned short* __restrict__ w, int n0, int N, int K,
                                          const uint4* (&wrow)[SWIGLU ? 2 * R : R]) {
#pragma unroll
    for (int r = 0; r < (SWIGLU ? 2 * R : R); ++r) {
        const int rr = SWIGLU ? (r % R) : r;
        const int n = min(n0 + rr, N - 1);
        const int wr = (SWIGLU && r >= R) ? N + n : n;
        wrow[r] = reinterpret_cast<const uint4*>(w + (u64)wr * K);
    }
}

// Warp-reduce the per-lane partial sums and store (every lane ends with all sums; the
// stores are spread over the lanes).
template <int M, int R, bool SWIGLU, bool NORM>
__device__ __forceinline__ void gemv_epilogue(float (&acc)[SWIGLU ? 2 * R : R][M],
                                              const float (&inv)[M], int lane, int n0,
                                              int N, const unsigned short* __restrict__ bias,
                                              float* __restrict__ out, int accumulate, int has_bias, int act) {
    constexpr int RW = SWIGLU ? 2 * R : R;
#pragma unroll
    for (int r = 0; r < RW; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = warp_sum(acc[r][m]);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int n = n0 + r;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            if (lane == ((r * M + m) & 31) && n < N) {
                float* o = out + (u64)m * N + n;
                float val;
                if (SWIGLU) {
                    const float g = NORM ? acc[r][m] * inv[m] : acc[r][m];
                    const float u = NORM ? acc[R + r][m] * inv[m] : acc[R + r][m];
                    val = gate_act(g, act) * u;
                } else {
                    val = NORM ? acc[r][m] * inv[m] : acc[r][m];
                    if (has_bias) val += bf16_to_f32_bits(bias[n]);
                }
                if (accumulate) val += *o;
                *o = val;
            }
        }
    }
}

// s + the sum of squares of v's four values, in order (the NORM prologue).
__device__ __forceinline__ float sumsq4(float4 v, float s) {
    s = fmaf(v.x, v.x, s);
    s = fmaf(v.y, v.y, s);
    s = fmaf(v.z, v.z, s);
    s = fmaf(v.w, v.w, s);
    return s;
}

// One step of a lane: UU chunks (c, c+32, ..., c+32*(UU-1)) of each of the RW
// weight rows, all loaded before any is used.  All chunks must be < K/8.
// NORM: ss[m] += x^2 over the loaded x values, and x is multiplied by norm_w.
template <int M, int RW, int UU, bool NORM>
__device__ __forceinline__ void gemv_step(const float* __restrict__ x, const uint4* const (&wrow)[RW],
                                          const unsigned short* __restrict__ norm_w, float norm_offset, int K,
                                          int c, float (&acc)[RW][M], float (&ss)[M]) {
    uint4 wv[UU][RW];
#pragma unroll
    for (int u = 0; u < UU; ++u)
#pragma unroll
        for (int r = 0; r < RW; ++r) wv[u][r] = ld_stream_u4(wrow[r] + c + 32 * u);
#pragma unroll
    for (int u = 0; u < UU; ++u) {
        float nw[8];
        if constexpr (NORM) {
            const uint4 g = __ldg(reinterpret_cast<const uint4*>(norm_w) + c + 32 * u);
            nw[0] = bf16_lo(g.x) + norm_offset;
            nw[1] = bf16_hi(g.x) + norm_offset;
            nw[2] = bf16_lo(g.y) + norm_offset;
            nw[3] = bf16_hi(g.y) + norm_offset;
            nw[4] = bf16_lo(g.z) + norm_offset;
            nw[5] = bf16_hi(g.z) + norm_offset;
            nw[6] = bf16_lo(g.w) + norm_offset;
            nw[7] = bf16_hi(g.w) + norm_offset;
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float4* xp = reinterpret_cast<const float4*>(x + (u64)m * K) + 2 * (c + 32 * u);
            float4 xa = __ldg(xp);
            float4 xb = __ldg(xp + 1);
            if constexpr (NORM) {
                ss[m] = sumsq4(xb, sumsq4(xa, ss[m]));
                xa = make_float4(xa.x * nw[0], xa.y * nw[1], xa.z * nw[2], xa.w * nw[3]);
                xb = make_float4(xb.x * nw[4], xb.y * nw[5], xb.z * nw[6], xb.w * nw[7]);
            }
#pragma unroll
            for (int r = 0; r < RW; ++r) acc[r][m] = dot8_bf16(wv[u][r], xa, xb, acc[r][m]);
        }
    }
}

// The body of gemv_kernel (and of the fused gemv_qkv_rope_kernel): a warp whose rows are all past N
// returns from it at once (no block barrier inside).
template <int M, int R, int U, bool SWIGLU, bool NORM>
__device__ __forceinline__ void gemv_body(const float* __restrict__ x, const unsigned short* __restrict__ w,
                                          const unsigned short* __restrict__ bias, float* __restrict__ out, int N,
                                          int K, int accumulate, int has_bias,
                                          const unsigned short* __restrict__ norm_w, float eps, float norm_offset,
                                          int act) {
    // N: number of output columns.  SWIGLU: w has 2N rows (gate rows 0..N-1, up
    // rows N..2N-1) and out[m, n] = silu(x.w[n]) * (x.w[N + n]).  NORM: see the top.
    constexpr int RW = SWIGLU ? 2 * R : R;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int n0 = (blockIdx.x * GEMV_WARPS + warp) * R;
    if (n0 >= N) return;  // whole warp; the kernel has no block barrier
    const int C = K >> 3;  // 16-byte chunks per weight row

    const uint4* wrow[RW];
    gemv_rows<R, SWIGLU>(w, n0, N, K, wrow);
    // PDL: start pulling this warp's first weight chunks into L2 while the previous kernel
    // (which produced x) finishes; x and out are touched only after pdl_wait.
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < RW; ++r)
            if (lane + 32 * u < C) prefetch_l2(wrow[r] + lane + 32 * u);
    pdl_wait();
    pdl_trigger();

    float acc[RW][M];
#pragma unroll
    for (int r = 0; r < RW; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;
    float ss[M], inv[M];
#pragma unroll
    for (int m = 0; m < M; ++m) ss[m] = 0.0f;

    int c = lane;
    for (; c + 32 * (U - 1) < C; c += 32 * U)
        gemv_step<M, RW, U, NORM>(x, wrow, norm_w, norm_offset, K, c, acc, ss);
    for (; c < C; c += 32) gemv_step<M, RW, 1, NORM>(x, wrow, norm_w, norm_offset, K, c, acc, ss);

    // The lanes of the warp together loaded every chunk of x once: ss sums to the
    // whole row.
#pragma unroll
    for (int m = 0; m < M; ++m) inv[m] = NORM ? rsqrtf(warp_sum(ss[m]) / (float)K + eps) : 1.0f;
    gemv_epilogue<M, R, SWIGLU, NORM>(acc, inv, lane, n0, N, bias, out, accumulate, has_bias, act);
}

template <int M, int R, int U, bool SWIGLU, bool NORM>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_kernel(const float* __restrict__ x, const unsigned short* __restrict__ w,
            const unsigned short* __restrict__ bias, float* __restrict__ out, int N, int K,
            int accumulate, int has_bias, const unsigned short* __restrict__ norm_w, float eps,
            float norm_offset, int act) {
    gemv_body<M, R, U, SWIGLU, NORM>(x, w, bias, out, N, K, accumulate, has_bias, norm_w, eps, norm_offset, act);
}

// The fused rows path's qkv projection (engine path "fused"): gemv_kernel with the RMSNorm prologue
// (qkv = rmsnorm(x) @ w^T + bias, written to qkv [M, N] as gemv would), then, in the block that
// finishes a head slot's last rows, rope (+ q/k norm) and the KV-cache append of that slot
// (qkv_rope_tail, common.cu): rope_kv_append_kernel's work without its launch.  counters: int32
// [n_heads + 2 n_kv], zero before the launch and after it.
template <int M, int R, int U>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_qkv_rope_kernel(const float* __restrict__ x, const unsigned short* __restrict__ w,
                     const unsigned short* __restrict__ bias, float* __restrict__ qkv, int N, int K, int has_bias,
                     const unsigned short* __restrict__ norm_w, float eps, float norm_offset,
                     const int* __restrict__ positions, const float* __restrict__ inv_freq,
                     const unsigned short* __restrict__ q_norm, const unsigned short* __restrict__ k_norm,
                     float* __restrict__ q_out, unsigned short* __restrict__ k_cache,
                     unsigned short* __restrict__ v_cache, int n_heads, int n_kv, int head_dim, int max_ctx,
                     float rope_eps, int has_q_norm, int has_k_norm, float attn_scaling, float rope_norm_offset,
                     int rot_dim, int* __restrict__ counters) {
    gemv_body<M, R, U, false, true>(x, w, bias, qkv, N, K, 0, has_bias, norm_w, eps, norm_offset, ACT_SILU);
    qkv_rope_tail<GEMV_WARPS>(GEMV_WARPS * R, qkv, N, M, positions, inv_freq, q_norm, k_norm, q_out, k_cache,
                              v_cache, n_heads, n_kv, head_dim, max_ctx, rope_eps, has_q_norm, has_k_norm,
                              attn_scaling, rope_norm_offset, rot_dim, counters);
}
