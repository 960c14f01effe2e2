// Tensor parallelism (parallel/): the vocabulary-parallel embedding and the distributed argmax's
// candidates.  A module of its own (kernels/tp.py), built only when an engine is one rank of a group.
#include "common.cu"

// out[m, :] = float32(table[ids[m] - start, :]) * scale when start <= ids[m] < start + rows (this rank's
// vocabulary range; table holds those rows), else 0: summed over the ranks (all-reduce), every row is
// the one embedding_kernel gives, bit for bit (one rank contributes it, the others add zeros).
// One block per row.
extern "C" __global__ void vocab_embedding_kernel(const int* __restrict__ ids,
                                                  const unsigned short* __restrict__ table,
                                                  float* __restrict__ out, int start, int rows, int H,
                                                  float scale) {
    pdl_wait();
    pdl_trigger();
    const int m = blockIdx.x;
    const int id = ids[m] - start;
    float* o = out + (u64)m * H;
    if (id < 0 || id >= rows) {
        for (int i = threadIdx.x; i < H; i += blockDim.x) o[i] = 0.0f;
        return;
    }
    const unsigned short* t = table + (u64)id * H;
    for (int i = threadIdx.x; i < H; i += blockDim.x) o[i] = bf16_to_f32_bits(t[i]) * scale;
}

__device__ __forceinline__ float pairs_load(const float* p, u64 i) { return p[i]; }
__device__ __forceinline__ float pairs_load(const unsigned short* p, u64 i) { return bf16_to_f32_bits(p[i]); }

// pairs[i] = (rows[i, idx[i]], start + idx[i]) as floats: a rank's candidate for row i's argmax, from
// argmax_kernel's local index; (NaN, -1) when idx[i] < 0 (a non-finite value in this rank's range).
// Indices stay exact as floats below 2^24 (the launcher checks the vocabulary).
template <typename T>
__device__ __forceinline__ void argmax_pairs(const T* __restrict__ rows, const int* __restrict__ idx,
                                             float* __restrict__ pairs, int n, int V, int start) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int j = idx[i];
    if (j < 0) {
        pairs[2 * i] = __int_as_float(0x7fc00000);
        pairs[2 * i + 1] = -1.0f;
    } else {
        pairs[2 * i] = pairs_load(rows, (u64)i * V + j);
        pairs[2 * i + 1] = (float)(start + j);
    }
}

extern "C" __global__ void argmax_pairs_f32_kernel(const float* __restrict__ rows, const int* __restrict__ idx,
                                                   float* __restrict__ pairs, int n, int V, int start) {
    pdl_wait();
    pdl_trigger();
    argmax_pairs(rows, idx, pairs, n, V, start);
}

extern "C" __global__ void argmax_pairs_bf16_kernel(const unsigned short* __restrict__ rows,
                                                    const int* __restrict__ idx, float* __restrict__ pairs,
                                                    int n, int V, int start) {
    pdl_wait();
    pdl_trigger();
    argmax_pairs(rows, idx, pairs, n, V, start);
}
