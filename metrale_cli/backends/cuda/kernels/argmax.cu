// Row-wise argmax with torch.argmax semantics (index of the FIRST maximum).
// A row that holds any NaN or +-Inf gives -1 (the engine turns that into a
// non-finite-logits error).  One block per row; any V (up to 2^31 - 1).
#include "common.cu"

__device__ __forceinline__ float argmax_load(const float* p, u64 i) { return p[i]; }
__device__ __forceinline__ float argmax_load(const unsigned short* p, u64 i) {
    return bf16_to_f32_bits(p[i]);
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
    // The two warp reductions of (value, index) below stay written out: as a shared helper (by
    // reference, pointer, lambda or returned struct) nvcc 13.0 generated different sm_90 code.
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bidx, o);
        if (ov > best || (ov == best && oi < bidx)) {
            best = ov;
            bidx = oi;
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    if (lane == 0) {
        s_val[warp] = best;
        s_idx[warp] = bidx;
    }
    __syncthreads();
    if (warp == 0) {
        best = (lane < nwarps) ? s_val[lane] : -METRALE_INF;
        bidx = (lane < nwarps) ? s_idx[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bidx, o);
            if (ov > best || (ov == best && oi < bidx)) {
                best = ov;
                bidx = oi;
            }
        }
        if (lane == 0) out[blockIdx.x] = bad ? -1 : bidx;
    }
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
