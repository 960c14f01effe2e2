// Shared helpers of the metrale CUDA kernels.
//
// nvrtc.py builds ONE NVRTC module: it puts this file first and removes the
// `#include "common.cu"` lines of the other .cu files (so CuPy's kernel cache,
// which hashes the source text only, always sees the helpers that are used).
// The include lines stay so that every .cu file also compiles on its own with
//     nvcc -arch=sm_90 -std=c++17 -ptx -o /dev/null file.cu
// (tests/test_cuda_sources.py does so, with every template instance that
// names.py lists; the name ends in .cu, not .cuh, so that pyproject's
// package-data glob ships it).
#ifndef METRALE_COMMON_CU
#define METRALE_COMMON_CU

#include <cuda_bf16.h>

// No C/C++ standard headers under NVRTC: spell out what would come from them.
typedef unsigned long long u64;
#define METRALE_INF __int_as_float(0x7f800000)

__device__ __forceinline__ bool is_finite_f32(float v) {
    return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u;
}

// bf16 values travel as their raw 16 bits (unsigned short); conversions below
// are exact bit operations, independent of compiler flags.
__device__ __forceinline__ float bf16_to_f32_bits(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}
// The low / high bf16 of a 32-bit word that holds two consecutive bf16 values.
__device__ __forceinline__ float bf16_lo(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }

// s + the dot product of 8 bf16 weights (16 bytes, in k order) with 8 floats xa, xb, as one
// chain of fmaf in k order (the order fixes the fp32 rounding of the GEMVs).
__device__ __forceinline__ float dot8_bf16(const uint4& q, const float4& xa, const float4& xb, float s) {
    s = fmaf(bf16_lo(q.x), xa.x, s);
    s = fmaf(bf16_hi(q.x), xa.y, s);
    s = fmaf(bf16_lo(q.y), xa.z, s);
    s = fmaf(bf16_hi(q.y), xa.w, s);
    s = fmaf(bf16_lo(q.z), xb.x, s);
    s = fmaf(bf16_hi(q.z), xb.y, s);
    s = fmaf(bf16_lo(q.w), xb.z, s);
    s = fmaf(bf16_hi(q.w), xb.w, s);
    return s;
}

// bf16x2 of (lo, hi), round to nearest even: lo in bits 0..15, hi in bits 16..31.
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// d += A (16x16 bf16, row) * B (16x8 bf16, col), fp32 accumulate (mma.sync m16n8k16).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                               unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// float32 -> bfloat16 bits, round to nearest even, bit-identical to torch's CPU
// `tensor.to(torch.bfloat16)` (c10::detail::round_to_nearest_even): every NaN
// (any sign, any payload) becomes the quiet NaN 0x7FC0; +-Inf stay +-Inf;
// finite values that round past the largest bf16 become +-Inf; subnormals are
// rounded, not flushed.
__device__ __forceinline__ unsigned short f32_to_bf16_bits(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every
// thread gets the result. `scratch` is __shared__ float[32]. Contains barriers:
// all threads of the block must call it.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by an earlier call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = (lane < nwarps) ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

// 16-byte streaming load of read-only data (weights): skip L1, keep L2 default.
__device__ __forceinline__ uint4 ld_stream_u4(const void* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

// Programmatic dependent launch (PDL, sm_90+).  When Kernels launches a kernel with the
// programmatic-stream-serialization attribute (the rows path does, inside its CUDA graph), the
// kernel may start while the previous kernel of the stream is still running.  Every kernel
// therefore calls pdl_wait() before its first read of data written by earlier kernels and before
// its first global write; work that touches only read-only inputs (weights) may come before it.
// pdl_trigger() lets the next kernel start launching (its blocks then wait in their own
// pdl_wait()).  Without the attribute (or below sm_90) both are no-ops.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Gate activation of a gated MLP, act(gate) * up: ACT_SILU (SwiGLU, Llama) or ACT_GELU_TANH (GeGLU,
// Gemma: torch's gelu(approximate="tanh") = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))).
#define ACT_SILU 0
#define ACT_GELU_TANH 1
__device__ __forceinline__ float gate_act(float g, int act) {
    if (act == ACT_GELU_TANH) {
        const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
        return 0.5f * g * (1.0f + tanhf(inner));
    }
    return g / (1.0f + expf(-g));
}

// Prefetch the 128-byte line holding p into L2 (no register result, never faults on a valid address).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

#endif  // METRALE_COMMON_CU
