// Row-wise argmax with torch.argmax semantics (index of the FIRST maximum).
// A row that holds any NaN or +-Inf gives -1 (the engine turns that into a
// non-finite-logits error).  One block per row; any V (up to 2^31 - 1).
#include "common.cu"

__device__ __forceinline__ float argmax_load(const float* p, u64 i) { return p[i]; }
__device__ __forceinline__ float argmax_load(const unsigned short* p, u64 i) {
    return bf16_to_f32_bits(p[i]);
}

// The block's first maximum of (best, bidx): "larger value, or the same value at a lower index", over
// the warp by shuffles, then over the warps through s_val / s_idx; warp 0's lanes end with the result.
// Macros, not functions: as a shared helper (by reference, pointer, lambda or returned struct) nvcc
// 13.0 generated different sm_90 code for these reductions; a macro is the written-out code.
#define ARGMAX_WARP_REDUCE(best, bidx)                                     \
    _Pragma("unroll") for (int o = 16; o > 0; o >>= 1) {                  \
        const float ov_ = __shfl_xor_sync(0xffffffffu, best, o);          \
        const int oi_ = __shfl_xor_sync(0xffffffffu, bidx, o);            \
        if (ov_ > best || (ov_ == best && oi_ < bidx)) {                  \
            best = ov_;                                                    \
            bidx = oi_;                                                    \
        }                                                                  \
    }
#define ARGMAX_BLOCK_REDUCE(best, bidx, lane, warp, nwarps, s_val, s_idx) \
    ARGMAX_WARP_REDUCE(best, bidx)                                         \
    if (lane == 0) {                                                       \
        s_val[warp] = best;                                                \
        s_idx[warp] = bidx;                                                \
    }                                                                      \
    __syncthreads();                                                       \
    if (warp == 0) {                                                       \
        best = (lane < nwarps) ? s_val[lane] : -METRALE_INF;               \
        bidx = (lane < nwarps) ? s_idx[lane] : 0x7fffffff;                 \
        ARGMAX_WARP_REDUCE(best, bidx)                                     \
    }

template <typename T>
__device__ __forceinline__ void argmax_row(const T* __restrict__ rows, int* __restrict__ out, int V) {
    __shared__ float s_val[32];
    __shared__ int s_idx[32];
    const T* r = rows + (u64)blockIdx.x * V;
    float best = -METRALE_INF;
    int bidx = 0x7fffffff;
    int bad = 0;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float v = argmax_load(r, i);
        if (!is_finite_f32(v)) {
            bad = 1;
        } else if (v > best) {  // i grows, so ties keep the earlier index
            best = v;
            bidx = i;
        }
    }
    bad = __syncthreads_or(bad);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    ARGMAX_BLOCK_REDUCE(best, bidx, lane, warp, nwarps, s_val, s_idx);
    if (warp == 0 && lane == 0) out[blockIdx.x] = bad ? -1 : bidx;
}

extern "C" __global__ void argmax_f32_kernel(const float* __restrict__ rows, int* __restrict__ out, int V) {
    pdl_wait();
    pdl_trigger();
    argmax_row(rows, out, V);
}

extern "C" __global__ void argmax_bf16_kernel(const unsigned short* __restrict__ rows,
                                              int* __restrict__ out, int V) {
    pdl_wait();
    pdl_trigger();
    argmax_row(rows, out, V);
}

// ---------------------------------------------------------------------------
// The same argmax over several blocks per row (one launch, last block reduces): for the few rows of a
// decode / verify step, where one block per row reads a 128k-vocabulary row at a fraction of the
// bandwidth.  Grid (nb, n): block b of row r
// takes the ARGMAX_CHUNK-element chunks b, b + nb, b + 2 nb, ... of the row, ARGMAX_PER loads in flight
// per thread; its first maximum (value, index), or index -1 when its range holds a NaN or +-Inf, goes
// to the workspace; the last block of the row to arrive (last_block_arrives, common.cu: the counter is
// back at 0 afterwards) reduces the nb partials.  Every comparison is "larger value, or the same value
// at a lower index", a total order on (value, index) of finite values, so the result does not depend
// on how the row is cut: the index of the first maximum, -1 if any element is non-finite, exactly as
// argmax_row above (and np.argmax on finite rows; +0 and -0 compare equal, the earlier one wins).
// ws: int32[n + 2 n nb]: n counters (all zero before the launch, zero after it), then nb partial
// indices per row, then nb partial values per row (float bits).
#define ARGMAX_THREADS 256
#define ARGMAX_PER 8
#define ARGMAX_CHUNK (ARGMAX_THREADS * ARGMAX_PER)

template <typename T>
__device__ __forceinline__ void argmax_split_row(const T* __restrict__ rows, int* __restrict__ out, int V,
                                                 int* __restrict__ ws) {
    __shared__ float s_val[32];
    __shared__ int s_idx[32];
    const int nb = gridDim.x, b = blockIdx.x, row = blockIdx.y, n = gridDim.y;
    int* counters = ws;
    int* part_idx = ws + n;
    float* part_val = reinterpret_cast<float*>(ws + n + (u64)n * nb);
    const T* r = rows + (u64)row * V;
    float best = -METRALE_INF;
    int bidx = 0x7fffffff;
    int bad = 0;
    for (long long c0 = (long long)b * ARGMAX_CHUNK; c0 < V; c0 += (long long)nb * ARGMAX_CHUNK) {
        float v[ARGMAX_PER];
#pragma unroll
        for (int j = 0; j < ARGMAX_PER; ++j) {  // independent loads first
            const long long i = c0 + j * ARGMAX_THREADS + threadIdx.x;
            v[j] = i < V ? argmax_load(r, (u64)i) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < ARGMAX_PER; ++j) {
            const long long i = c0 + j * ARGMAX_THREADS + threadIdx.x;
            if (i < V) {
                if (!is_finite_f32(v[j])) {
                    bad = 1;
                } else if (v[j] > best) {  // i grows, so ties keep the earlier index
                    best = v[j];
                    bidx = (int)i;
                }
            }
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    // Stage 1: this block's first maximum.
    bad = __syncthreads_or(bad);
    ARGMAX_BLOCK_REDUCE(best, bidx, lane, warp, nwarps, s_val, s_idx);
    if (warp == 0 && lane == 0) {
        part_val[(u64)row * nb + b] = best;
        part_idx[(u64)row * nb + b] = bad ? -1 : bidx;
    }
    if (!last_block_arrives(counters + row, nb)) return;
    // Stage 2 (the row's last block): the nb partials, read through L2 (other blocks wrote them).
    best = -METRALE_INF;
    bidx = 0x7fffffff;
    bad = 0;
    for (int i = threadIdx.x; i < nb; i += blockDim.x) {
        const float pv = __ldcg(part_val + (u64)row * nb + i);
        const int pi = __ldcg(part_idx + (u64)row * nb + i);
        if (pi < 0) {
            bad = 1;
        } else if (pv > best || (pv == best && pi < bidx)) {
            best = pv;
            bidx = pi;
        }
    }
    bad = __syncthreads_or(bad);  // also: warp 0 has read stage 1's s_val / s_idx
    ARGMAX_BLOCK_REDUCE(best, bidx, lane, warp, nwarps, s_val, s_idx);
    if (warp == 0 && lane == 0) out[row] = bad ? -1 : bidx;
}

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_split_f32_kernel(const float* __restrict__ rows, int* __restrict__ out, int V, int* __restrict__ ws) {
    pdl_wait();
    pdl_trigger();
    argmax_split_row(rows, out, V, ws);
}

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_split_bf16_kernel(const unsigned short* __restrict__ rows, int* __restrict__ out, int V,
                         int* __restrict__ ws) {
    pdl_wait();
    pdl_trigger();
    argmax_split_row(rows, out, V, ws);
}
