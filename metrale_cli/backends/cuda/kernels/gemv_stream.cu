// One-wave streaming GEMV with the fused RMSNorm, for the decode step's normed projection (one row):
//     out[1, N] (=|+=) (rmsnorm(x) * (norm_offset + norm_w)) @ w[N, K]^T (+ bias)
// the function of gemv_kernel<1, R, U, false, true> (gemv.cu): x float32 [1, K] is the raw residual stream,
// w bf16 bits [N, K], bias bf16 [N] (optional), out float32 [1, N]; fp32 accumulation.  Requirements (checked
// by Kernels.gemv_stream): K % 256 == 0 (a warp's 32 consecutive chunks lie in one weight row), x and w
// 16-byte aligned, x does not overlap out.
//
// Why (backends/cuda/NOTES.md, "Streaming GEMV"): gemv.cu's NORM variant multiplies x by the norm weight and
// sums its squares for every 16-byte weight chunk in every warp (each warp reads all of x for its row): on the
// H200 the llama-3.1-8b qkv GEMV took 19.5 us with the norm against 16.1 us without.  Here the norm is paid
// once per block: the grid is one wave (Kernels picks gridDim.x <= SMs x resident blocks per SM) and block b
// owns the contiguous output rows [b N / G, (b + 1) N / G), whose weights are one run of 16-byte chunks
// that its GS_THREADS threads stream, thread t taking chunks t, t + GS_THREADS, ...; U chunks per thread are
// in flight while the previous U are used (a register double buffer), the first U requested before pdl_wait
// (weights do not depend on the previous kernel).  The block stages x times the norm weight in shared memory
// (each row's sum of squares from the same loads, one block reduction: inv_rms multiplies the finished dot
// products, as in gemv.cu) as two float4 planes, plane 0 = x[8c .. 8c + 3] and plane 1 = x[8c + 4 .. 8c + 7]
// at index c, so that a warp's 32 consecutive chunks read conflict-free.
// The same one-wave design without the norm (and gated, and for 2 rows) measured slower than gemv.cu on
// every H200 shape tried (NOTES.md): it is not compiled.
//
// A thread keeps one fp32 partial for the weight row it is in; when its next chunk is in another row (the same
// for the whole warp), the warp sums its lanes and stores the sum to part[v][warp]: each warp passes through a
// row once, so each slot is written at most once (the others stay zero).  The epilogue sums a row's GS_WARPS
// slots in warp order: the result depends on (N, K, gridDim.x) only, and every graph replay gives the same bits.
#include "common.cu"

#define GS_THREADS 256
#define GS_WARPS (GS_THREADS / 32)
#define GS_PART_STRIDE (GS_WARPS + 1)  // part[v][.] padded: the epilogue's threads read conflict-free

// Shared memory (dynamic): float4 xs[2][K / 8], then float part[rows][GS_PART_STRIDE] for the most rows any
// block owns.  Kernels.gemv_stream sizes it (tuning.stream_smem_bytes).
template <int U>
__global__ void __launch_bounds__(GS_THREADS)
gemv_stream_kernel(const float* __restrict__ x, const unsigned short* __restrict__ w,
                   const unsigned short* __restrict__ bias, float* __restrict__ out, int N, int K, int accumulate,
                   int has_bias, const unsigned short* __restrict__ norm_w, float eps, float norm_offset) {
    extern __shared__ float4 gs_smem[];
    __shared__ float scratch[32];
    const int C = K >> 3;  // 16-byte chunks per weight row, a multiple of 32
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int G = gridDim.x;
    const int rb = (int)(((long long)blockIdx.x * N) / G);
    const int nr = (int)(((long long)(blockIdx.x + 1) * N) / G) - rb;  // rows of this block
    const int T = nr * C;                                               // its chunks, a multiple of 32
    const uint4* wp = reinterpret_cast<const uint4*>(w + (u64)rb * K);
    float4* xs = gs_smem;
    float* part = reinterpret_cast<float*>(gs_smem + 2 * C);

    // The first U chunks of weights, before the previous kernel's output is needed.
    uint4 buf[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int i = tid + u * GS_THREADS;
        buf[u] = i < T ? ld_stream_u4(wp + i) : make_uint4(0u, 0u, 0u, 0u);
    }
    pdl_wait();

    // x times the norm weight into shared memory, 4 float4 per thread in flight; zero the partial slots.
    float ss = 0.0f;
    for (int q0 = tid; q0 < 2 * C; q0 += 4 * GS_THREADS) {  // float4 q of x: chunk q >> 1, plane q & 1
        float4 v[4];
        uint2 nw[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int q = q0 + j * GS_THREADS;
            if (q < 2 * C) {
                nw[j] = __ldg(reinterpret_cast<const uint2*>(norm_w) + q);
                v[j] = __ldg(reinterpret_cast<const float4*>(x) + q);
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int q = q0 + j * GS_THREADS;
            if (q < 2 * C) {
                const float4 a = v[j];
                ss = fmaf(a.x, a.x, ss);
                ss = fmaf(a.y, a.y, ss);
                ss = fmaf(a.z, a.z, ss);
                ss = fmaf(a.w, a.w, ss);
                xs[(q & 1) * C + (q >> 1)] =
                    make_float4(a.x * (bf16_lo(nw[j].x) + norm_offset), a.y * (bf16_hi(nw[j].x) + norm_offset),
                                a.z * (bf16_lo(nw[j].y) + norm_offset), a.w * (bf16_hi(nw[j].y) + norm_offset));
            }
        }
    }
    for (int i = tid; i < nr * GS_PART_STRIDE; i += GS_THREADS) part[i] = 0.0f;
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)K + eps);
    __syncthreads();  // xs and part are ready
    pdl_trigger();

    // Stream the block's chunks: use the U loaded ones while the next U are in flight.  (v, c): the weight
    // row and chunk of this thread's next chunk i.
    int i = tid, v = tid / C, c = tid - (tid / C) * C;
    int cur = v;  // the row the partial belongs to
    float acc = 0.0f;
    for (int base = 0; base < T; base += U * GS_THREADS) {
        uint4 now[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            now[u] = buf[u];
            const int nx = base + (U + u) * GS_THREADS + tid;
            buf[u] = nx < T ? ld_stream_u4(wp + nx) : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (i < T) {  // uniform over the warp, as is v != cur
                if (v != cur) {
                    const float s = warp_sum(acc);
                    if (lane == 0) part[cur * GS_PART_STRIDE + warp] = s;
                    acc = 0.0f;
                    cur = v;
                }
                acc = dot8_bf16(now[u], xs[c], xs[C + c], acc);
            }
            i += GS_THREADS;
            c += GS_THREADS;
            while (c >= C) {
                c -= C;
                ++v;
            }
        }
    }
    if (cur < nr) {  // uniform: whether this warp had any chunk
        const float s = warp_sum(acc);
        if (lane == 0) part[cur * GS_PART_STRIDE + warp] = s;
    }
    __syncthreads();

    // One thread per output row: its slots in warp order, then the norm factor, bias, add.
    for (int n = tid; n < nr; n += GS_THREADS) {
        const float* p = part + n * GS_PART_STRIDE;
        float g = 0.0f;
#pragma unroll
        for (int k = 0; k < GS_WARPS; ++k) g += p[k];
        float val = g * inv;
        if (has_bias) val += bf16_to_f32_bits(bias[rb + n]);
        float* o = out + rb + n;
        if (accumulate) val += *o;
        *o = val;
    }
}
