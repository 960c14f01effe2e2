// Small-M GEMV for the decode / verify path:  out[M, N] (=|+=) x[M, K] @ w[N, K]^T (+ bias)
//
// x: float32 [M, K] (row-major), w: bf16 [N, K] (Hugging Face [out, in] layout),
// bias: bf16 [N] (optional), out: float32 [M, N].  fp32 accumulation.
// Requirements (checked by kernels.py): K % 8 == 0, x and w 16-byte aligned,
// 1 <= M <= 16, x does not overlap out.
//
// Work split: a block has GEMV_WARPS warps; each warp owns R consecutive output
// rows (2R weight rows in the SwiGLU variant) and walks K in 16-byte chunks of 8
// bf16, lane l taking chunks l, l+32, ... .  Every weight byte is loaded once
// (16-byte streaming loads, U chunks per row in flight per lane) and used for
// all M rows of x; x comes through L1 (it is small and shared by all warps).
// Partial sums are reduced with warp shuffles.
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
template <int M, int R, bool SWIGLU>
__device__ __forceinline__ void gemv_epilogue(float (&acc)[SWIGLU ? 2 * R : R][M], int lane, int n0,
                                              int N, const unsigned short* __restrict__ bias,
                                              float* __restrict__ out, int accumulate, int has_bias) {
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
                    const float g = acc[r][m];
                    val = g / (1.0f + expf(-g)) * acc[R + r][m];
                } else {
                    val = acc[r][m];
                    if (has_bias) val += bf16_to_f32_bits(bias[n]);
                }
                if (accumulate) val += *o;
                *o = val;
            }
        }
    }
}

// One step of a lane: UU chunks (c, c+32, ..., c+32*(UU-1)) of each of the RW
// weight rows, all loaded before any is used.  All chunks must be < K/8.
template <int M, int RW, int UU>
__device__ __forceinline__ void gemv_step(const float* __restrict__ x, const uint4* const (&wrow)[RW],
                                          int K, int c, float (&acc)[RW][M]) {
    uint4 wv[UU][RW];
#pragma unroll
    for (int u = 0; u < UU; ++u)
#pragma unroll
        for (int r = 0; r < RW; ++r) wv[u][r] = ld_stream_u4(wrow[r] + c + 32 * u);
#pragma unroll
    for (int u = 0; u < UU; ++u) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float4* xp = reinterpret_cast<const float4*>(x + (u64)m * K) + 2 * (c + 32 * u);
            const float4 xa = __ldg(xp);
            const float4 xb = __ldg(xp + 1);
#pragma unroll
            for (int r = 0; r < RW; ++r) {
                const uint4 q = wv[u][r];
                float s = acc[r][m];
                s = fmaf(bf16_lo(q.x), xa.x, s);
                s = fmaf(bf16_hi(q.x), xa.y, s);
                s = fmaf(bf16_lo(q.y), xa.z, s);
                s = fmaf(bf16_hi(q.y), xa.w, s);
                s = fmaf(bf16_lo(q.z), xb.x, s);
                s = fmaf(bf16_hi(q.z), xb.y, s);
                s = fmaf(bf16_lo(q.w), xb.z, s);
                s = fmaf(bf16_hi(q.w), xb.w, s);
                acc[r][m] = s;
            }
        }
    }
}

template <int M, int R, int U, bool SWIGLU>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_kernel(const float* __restrict__ x, const unsigned short* __restrict__ w,
            const unsigned short* __restrict__ bias, float* __restrict__ out, int N, int K,
            int accumulate, int has_bias) {
    // N: number of output columns.  SWIGLU: w has 2N rows (gate rows 0..N-1, up
    // rows N..2N-1) and out[m, n] = silu(x.w[n]) * (x.w[N + n]).
    constexpr int RW = SWIGLU ? 2 * R : R;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int n0 = (blockIdx.x * GEMV_WARPS + warp) * R;
    if (n0 >= N) return;  // whole warp; the kernel has no block barrier
    const int C = K >> 3;  // 16-byte chunks per weight row

    const uint4* wrow[RW];
    gemv_rows<R, SWIGLU>(w, n0, N, K, wrow);

    float acc[RW][M];
#pragma unroll
    for (int r = 0; r < RW; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;

    int c = lane;
    for (; c + 32 * (U - 1) < C; c += 32 * U) gemv_step<M, RW, U>(x, wrow, K, c, acc);
    for (; c < C; c += 32) gemv_step<M, RW, 1>(x, wrow, K, c, acc);

    gemv_epilogue<M, R, SWIGLU>(acc, lane, n0, N, bias, out, accumulate, has_bias);
}


// ---------------------------------------------------------------------------
// Variant for larger M (the verify path): x is staged in shared memory, one K tile
// of 256 (= 32 chunks, one per lane) at a time, shared by the GEMV_XS_WARPS warps of
// the block, instead of being re-read by every warp through L1/L2 (at M >= 8, x no
// longer fits in L1 and the register variant becomes L2-bound).  The tile is kept
// as two planes of float4 ([half][m][lane]) so that the lanes' reads are
// conflict-free.  Weights of the next tile are loaded before the current one is
// used.  Block-wide barriers: no thread may leave early.
// ---------------------------------------------------------------------------
#define GEMV_XS_WARPS 8

template <int M, int R, bool SWIGLU>
__global__ void __launch_bounds__(GEMV_XS_WARPS * 32)
gemv_xs_kernel(const float* __restrict__ x, const unsigned short* __restrict__ w,
               const unsigned short* __restrict__ bias, float* __restrict__ out, int N, int K,
               int accumulate, int has_bias) {
    constexpr int RW = SWIGLU ? 2 * R : R;
    __shared__ float4 xs[2][M][32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int n0 = (blockIdx.x * GEMV_XS_WARPS + warp) * R;  // may be >= N: computes, never stores
    const int C = K >> 3;
    const int tiles = (C + 31) >> 5;

    const uint4* wrow[RW];
    gemv_rows<R, SWIGLU>(w, n0, N, K, wrow);

    float acc[RW][M];
#pragma unroll
    for (int r = 0; r < RW; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;

    uint4 wn[RW];
#pragma unroll
    for (int r = 0; r < RW; ++r) wn[r] = (lane < C) ? ld_stream_u4(wrow[r] + lane) : make_uint4(0u, 0u, 0u, 0u);

    for (int t = 0; t < tiles; ++t) {
        const int c = t * 32 + lane;
        uint4 wc[RW];
#pragma unroll
        for (int r = 0; r < RW; ++r) {
            wc[r] = wn[r];
            wn[r] = (c + 32 < C) ? ld_stream_u4(wrow[r] + c + 32) : make_uint4(0u, 0u, 0u, 0u);
        }
        __syncthreads();  // the previous tile of x is consumed
        for (int i = threadIdx.x; i < M * 64; i += GEMV_XS_WARPS * 32) {
            const int half = i & 1, m = i >> 6, l = (i >> 1) & 31;
            const int cc = t * 32 + l;
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (cc < C) v = __ldg(reinterpret_cast<const float4*>(x + (u64)m * K) + 2 * cc + half);
            xs[half][m][l] = v;
        }
        __syncthreads();
        if (c < C) {
#pragma unroll
            for (int m = 0; m < M; ++m) {
                const float4 xa = xs[0][m][lane];
                const float4 xb = xs[1][m][lane];
#pragma unroll
                for (int r = 0; r < RW; ++r) {
                    const uint4 q = wc[r];
                    float s = acc[r][m];
                    s = fmaf(bf16_lo(q.x), xa.x, s);
                    s = fmaf(bf16_hi(q.x), xa.y, s);
                    s = fmaf(bf16_lo(q.y), xa.z, s);
                    s = fmaf(bf16_hi(q.y), xa.w, s);
                    s = fmaf(bf16_lo(q.z), xb.x, s);
                    s = fmaf(bf16_hi(q.z), xb.y, s);
                    s = fmaf(bf16_lo(q.w), xb.z, s);
                    s = fmaf(bf16_hi(q.w), xb.w, s);
                    acc[r][m] = s;
                }
            }
        }
    }
    if (n0 >= N) return;  // after the last barrier
    gemv_epilogue<M, R, SWIGLU>(acc, lane, n0, N, bias, out, accumulate, has_bias);
}

// Explicit instantiations for the compile check (kernels.py names its own set
// through NVRTC name expressions).
#ifndef METRALE_NVRTC
template __global__ void gemv_kernel<1, 2, 4, false>(const float*, const unsigned short*, const unsigned short*, float*, int, int, int, int);
template __global__ void gemv_kernel<1, 1, 8, false>(const float*, const unsigned short*, const unsigned short*, float*, int, int, int, int);
template __global__ void gemv_kernel<1, 4, 2, false>(const float*, const unsigned short*, const unsigned short*, float*, int, int, int, int);
template __global__ void gemv_kernel<1, 2, 8, false>(const float*, const unsigned short*, const unsigned short*, float*, int, int, int, int);
template __global__ void gemv_kernel<4, 2, 4, false>(const float*, const unsigned short*, const unsigned short*, float*, int, int, int, int);
template __global__ void gemv_kernel<4, 4, 2, false>(const float*, const unsigned short*, const unsigned short*, float*, int, int, int, int);
template __global__ void gemv_kernel<4, 1, 8, false>(const float*, const unsigned short*, const unsigned short*, float*, int, int, int, int);
template __global__ void gemv_kernel<8, 4, 2, false>(const float*, const unsigned short*, const unsigned short*, float*, int, int, int, int);
template __global__ void gemv_kernel<16, 4, 1, false>(const float*, const unsigned short*, const unsigned short*, float*, int, int, int, int);
template __global__ void gemv_kernel<1, 1, 4, true>(const float*, const unsigned short*, const unsigned short*, float*, int, int, int, int);
template __global__ void gemv_kernel<4, 1, 4, true>(const float*, const unsigned short*, const unsigned short*, float*, int, int, int, int);
template __global__ void gemv_kernel<8, 2, 1, true>(const float*, const unsigned short*, const unsigned short*, float*, int, int, int, int);
template __global__ void gemv_kernel<16, 2, 1, true>(const float*, const unsigned short*, const unsigned short*, float*, int, int, int, int);
template __global__ void gemv_xs_kernel<8, 8, false>(const float*, const unsigned short*, const unsigned short*, float*, int, int, int, int);
template __global__ void gemv_xs_kernel<16, 4, false>(const float*, const unsigned short*, const unsigned short*, float*, int, int, int, int);
template __global__ void gemv_xs_kernel<8, 4, true>(const float*, const unsigned short*, const unsigned short*, float*, int, int, int, int);
template __global__ void gemv_xs_kernel<16, 2, true>(const float*, const unsigned short*, const unsigned short*, float*, int, int, int, int);
#endif
