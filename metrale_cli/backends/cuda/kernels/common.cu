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

// Max over the whole block (as block_sum).
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();  // scratch may still be read by an earlier call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = (lane < nwarps) ? scratch[lane] : -METRALE_INF;
    return warp_max(v);
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

// gpt-oss's clamped SwiGLU (the MoE kernels' ACT_SWIGLU_OAI; backends/numpy/ops.glu "swiglu_oai"), in the
// reference's order: g' = min(g, limit), u' = clip(u, -limit, limit), (g' * sigmoid(alpha g')) * (u' + 1).
#define ACT_SWIGLU_OAI 2
__device__ __forceinline__ float glu_oai(float g, float u, float limit, float alpha) {
    g = g > limit ? limit : g;  // comparisons, not fminf / fmaxf: a NaN stays NaN, as np.minimum / np.clip keep it
    u = u > limit ? limit : u < -limit ? -limit : u;
    return (g * (1.0f / (1.0f + expf(-(alpha * g))))) * (u + 1.0f);
}

// act(gate) * up for ACT_SILU / ACT_GELU_TANH, glu_oai for ACT_SWIGLU_OAI (limit, alpha: its clamp and slope).
__device__ __forceinline__ float glu_act(float g, float u, int act, float limit, float alpha) {
    return act == ACT_SWIGLU_OAI ? glu_oai(g, u, limit, alpha) : gate_act(g, act) * u;
}

// Prefetch the 128-byte line holding p into L2 (no register result, never faults on a valid address).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// ---------------------------------------------------------------------------
// Rotary embedding helpers (rope_kernel, rope_kv_append_kernel, the fused qkv GEMV epilogues).

// One head vector v[0 .. head_dim) held by one warp: lane l keeps a[j] = v[i],
// b[j] = v[i + d/2] for i = l + 32 j < d/2.  If has_norm: per-head RMSNorm over
// head_dim with bf16 weight first.  Then HF's rotate_half rotary embedding:
//   angle = float(pos) * inv_freq[i] (fp32),
//   a' = a*cos - b*sin, b' = b*cos + a*sin,
// with cos/sin multiplied by attn_scaling (1.0 for default and llama3 rope).  The norm weight is
// (norm_offset + w) (Gemma 3: offset 1).  Partial rotary: rope_head_partial.
// Every value is read before the caller stores any (in-place use is safe).
__device__ __forceinline__ void rope_head(const float* v, const float* __restrict__ inv_freq,
                                          const unsigned short* __restrict__ norm_w,
                                          int head_dim, float eps, int has_norm, float pos,
                                          float attn_scaling, int lane, float (&a)[4],
                                          float (&b)[4], float norm_offset = 0.0f) {
    const int half = head_dim >> 1;
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int i = lane + 32 * j;
        a[j] = 0.0f;
        b[j] = 0.0f;
        if (i < half) {
            a[j] = v[i];
            b[j] = v[i + half];
            ss = fmaf(a[j], a[j], ss);
            ss = fmaf(b[j], b[j], ss);
        }
    }
    if (has_norm) {
        ss = warp_sum(ss);
        const float inv = rsqrtf(ss / (float)head_dim + eps);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int i = lane + 32 * j;
            if (i < half) {
                a[j] = (bf16_to_f32_bits(norm_w[i]) + norm_offset) * (a[j] * inv);
                b[j] = (bf16_to_f32_bits(norm_w[i + half]) + norm_offset) * (b[j] * inv);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int i = lane + 32 * j;
        if (i < half) {
            const float angle = __fmul_rn(pos, inv_freq[i]);
            float s, c;
            sincosf(angle, &s, &c);
            c *= attn_scaling;
            s *= attn_scaling;
            const float ra = a[j] * c - b[j] * s;
            const float rb = b[j] * c + a[j] * s;
            a[j] = ra;
            b[j] = rb;
        }
    }
}

// dst[i] = v, as fp32 or rounded to bf16 bits.
__device__ __forceinline__ void rope_put(float* dst, int i, float v) { dst[i] = v; }
__device__ __forceinline__ void rope_put(unsigned short* dst, int i, float v) { dst[i] = f32_to_bf16_bits(v); }

// Store the head that rope_head left in lane's a/b (dst[0 .. head_dim), half = head_dim / 2).
template <typename T>
__device__ __forceinline__ void rope_store(T* dst, const float (&a)[4], const float (&b)[4], int half, int lane) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int i = lane + 32 * j;
        if (i < half) {
            rope_put(dst, i, a[j]);
            rope_put(dst, i + half, b[j]);
        }
    }
}

// Partial rotary (Phi-4-mini, rot_dim < head_dim): only dims 0 .. rot_dim-1 rotate, dim i < rot_dim/2
// paired with i + rot_dim/2 (HF's rotate_half on the rotary slice; inv_freq holds rot_dim/2 values),
// dims >= rot_dim pass through (after the optional per-head norm, which spans the whole head).  Lane l
// computes out[j] = the result at dim l + 32 j (j < 8, head_dim <= 256); a dim's partner value is read
// again from v (an L1 hit) and normalised with the same warp-wide factor, so no shuffle pattern depends
// on rot_dim.  Same operations as rope_head for the rotated pairs.  Every value is read before the
// caller stores any.
__device__ __forceinline__ void rope_head_partial(const float* v, const float* __restrict__ inv_freq,
                                                  const unsigned short* __restrict__ norm_w, int head_dim,
                                                  int rot_dim, float eps, int has_norm, float pos,
                                                  float attn_scaling, float norm_offset, int lane,
                                                  float (&out)[8]) {
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int i = lane + 32 * j;
        out[j] = (i < head_dim) ? v[i] : 0.0f;
        ss = fmaf(out[j], out[j], ss);
    }
    float inv = 1.0f;
    if (has_norm) inv = rsqrtf(warp_sum(ss) / (float)head_dim + eps);
    const int rh = rot_dim >> 1;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int i = lane + 32 * j;
        if (i >= head_dim) continue;
        float xi = out[j];
        if (has_norm) xi = (bf16_to_f32_bits(norm_w[i]) + norm_offset) * (xi * inv);
        if (i < rot_dim) {
            const int p = i < rh ? i + rh : i - rh;  // the partner dim
            float xp = v[p];
            if (has_norm) xp = (bf16_to_f32_bits(norm_w[p]) + norm_offset) * (xp * inv);
            const float angle = __fmul_rn(pos, inv_freq[i < rh ? i : i - rh]);
            float s, c;
            sincosf(angle, &s, &c);
            c *= attn_scaling;
            s *= attn_scaling;
            xi = i < rh ? xi * c - xp * s : xi * c + xp * s;
        }
        out[j] = xi;
    }
}

// Rotate one q or k head vector read from src[0 .. head_dim) (optional per-head norm norm_w, partial rotary when
// rot_dim < head_dim) at position p and store it to dst[0 .. head_dim) as fp32 (q) or bf16 bits (k).  One warp
// (lane = its lane); dst may be src itself (each value is read before any is stored).
template <typename T>
__device__ __forceinline__ void rope_head_to(const float* src, T* dst, const float* __restrict__ inv_freq,
                                             const unsigned short* __restrict__ norm_w, int has_norm, int p,
                                             int head_dim, float eps, float attn_scaling, float norm_offset,
                                             int rot_dim, int lane) {
    if (rot_dim < head_dim) {
        float o[8];
        rope_head_partial(src, inv_freq, norm_w, head_dim, rot_dim, eps, has_norm, (float)p, attn_scaling,
                          norm_offset, lane, o);
        __syncwarp();  // dst may be src: every lane has read its partners
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int i = lane + 32 * j;
            if (i < head_dim) rope_put(dst, i, o[j]);
        }
        return;
    }
    float a[4], b[4];
    rope_head(src, inv_freq, norm_w, head_dim, eps, has_norm, (float)p, attn_scaling, lane, a, b, norm_offset);
    rope_store(dst, a, b, head_dim >> 1, lane);
}

// Rope + KV append of one head vector: row m, head slot s (q heads, then k heads, then v heads) read
// from src[0 .. head_dim) (global or shared memory):
//   q slot: optional q_norm, rotate, store fp32 to q_out [M, n_heads, head_dim];
//   k slot: optional k_norm, rotate, round to bf16, store to k_cache[h, positions[m], :];
//   v slot: round to bf16, store to v_cache[h, positions[m], :].
// A position outside [0, max_ctx) skips the cache writes.  One warp (lane = its lane); q_out may be src
// itself (each value is read before any is stored).  rope_kv_append_kernel, the fused qkv GEMV epilogue
// (qkv_rope_tail) and the attention split kernel's ROPE prologue all call it (or rope_head_to), so the paths
// compute the same values.
__device__ __forceinline__ void rope_kv_slot(const float* src, int m, int s, const int* __restrict__ positions,
                                             const float* __restrict__ inv_freq,
                                             const unsigned short* __restrict__ q_norm,
                                             const unsigned short* __restrict__ k_norm, float* q_out,
                                             unsigned short* __restrict__ k_cache,
                                             unsigned short* __restrict__ v_cache, int n_heads, int n_kv,
                                             int head_dim, int max_ctx, float eps, int has_q_norm, int has_k_norm,
                                             float attn_scaling, float norm_offset, int rot_dim, int lane) {
    const int p = positions[m];
    const bool in_cache = p >= 0 && p < max_ctx;
    if (s >= n_heads + n_kv) {  // v head: round and store
        if (!in_cache) return;
        unsigned short* dst = v_cache + ((u64)(s - n_heads - n_kv) * max_ctx + p) * head_dim;
        for (int i = lane; i < head_dim; i += 32) dst[i] = f32_to_bf16_bits(src[i]);
        return;
    }
    if (s < n_heads) {
        rope_head_to(src, q_out + ((u64)m * n_heads + s) * head_dim, inv_freq, q_norm, has_q_norm, p, head_dim, eps,
                     attn_scaling, norm_offset, rot_dim, lane);
    } else if (in_cache) {
        rope_head_to(src, k_cache + ((u64)(s - n_heads) * max_ctx + p) * head_dim, inv_freq, k_norm, has_k_norm, p,
                     head_dim, eps, attn_scaling, norm_offset, rot_dim, lane);
    }
}

// ---------------------------------------------------------------------------
// The split-K "last block" pattern of the fused rows path (engine path "fused").
//
// A block that wrote values another block will read calls this with every thread (it has barriers).
// Each thread fences its own writes, the block synchronises, one thread counts the block in at
// `counter`; the block that brings the count to `expected` learns that it is the last (every thread of
// it gets true), resets the counter to 0 (so the next launch, and every graph replay, starts from 0:
// no other block of the launch touches it after that) and fences before reading what the others wrote.
// Data written by other blocks must then be read through L2 (__ldcg), not the non-coherent L1.
// A counter left non-zero after a launch means a wrong `expected`: Kernels / the engine check for it.
__device__ __forceinline__ bool last_block_arrives(int* counter, int expected) {
    __shared__ int s_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int prev = atomicAdd(counter, 1);
        const int last = prev == expected - 1;
        if (last) atomicExch(counter, 0);
        s_last = last;
    }
    __syncthreads();
    const bool last = s_last != 0;
    if (last) __threadfence();
    return last;
}

// Epilogue of the fused qkv GEMV (gemv_qkv_rope_kernel, gemv_tc_qkv_rope_kernel): the block that
// finishes the last output rows of a head slot applies rope (+ q/k norm) and appends k/v to the cache
// for that slot and every row m < M, exactly as rope_kv_append_kernel would (rope_kv_slot).
// The block owns output rows [blockIdx.x * BR, +BR) of qkv [M, N], N = (n_heads + 2 n_kv) head_dim;
// it touches head slots s0 .. s1 (at most 32) and counts itself in at counters[s] for each; slot s
// is covered by the blocks (s hd) / BR .. ((s + 1) hd - 1) / BR.  NW warps; warp w takes rows w, w + NW, ...
// of a slot: the head vector is copied through L2 into shared memory (other blocks wrote it), then
// rotated.  Every thread of the block must call it.
template <int NW>
__device__ __forceinline__ void qkv_rope_tail(int BR, const float* qkv, int N, int M,
                                              const int* __restrict__ positions, const float* __restrict__ inv_freq,
                                              const unsigned short* __restrict__ q_norm,
                                              const unsigned short* __restrict__ k_norm, float* q_out,
                                              unsigned short* __restrict__ k_cache,
                                              unsigned short* __restrict__ v_cache, int n_heads, int n_kv,
                                              int head_dim, int max_ctx, float eps, int has_q_norm,
                                              int has_k_norm, float attn_scaling, float norm_offset, int rot_dim,
                                              int* __restrict__ counters) {
    __shared__ int s_slots[32];
    __shared__ int s_n;
    __shared__ float s_head[NW][256];
    const int n_first = blockIdx.x * BR;
    const int n_last = min(n_first + BR, N) - 1;
    const int s0 = n_first / head_dim, s1 = n_last / head_dim;
    __threadfence();  // this thread's qkv stores, before the block is counted in
    if (threadIdx.x == 0) s_n = 0;
    __syncthreads();
    if ((int)threadIdx.x <= s1 - s0 && threadIdx.x < 32) {
        const int s = s0 + threadIdx.x;
        const int b0 = (s * head_dim) / BR, b1 = (min((s + 1) * head_dim, N) - 1) / BR;
        const int prev = atomicAdd(counters + s, 1);
        if (prev == b1 - b0) {  // the last of its b1 - b0 + 1 blocks
            atomicExch(counters + s, 0);
            s_slots[atomicAdd(&s_n, 1)] = s;
        }
    }
    __syncthreads();
    const int n = s_n;
    if (n == 0) return;  // the same for the whole block
    __threadfence();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int slots = n_heads + 2 * n_kv;
    for (int i = 0; i < n; ++i) {
        const int s = s_slots[i];
        for (int m = warp; m < M; m += NW) {
            const float* src = qkv + ((u64)m * slots + s) * head_dim;
            for (int j = lane; j < head_dim; j += 32) s_head[warp][j] = __ldcg(src + j);
            __syncwarp();
            rope_kv_slot(s_head[warp], m, s, positions, inv_freq, q_norm, k_norm, q_out, k_cache, v_cache, n_heads,
                         n_kv, head_dim, max_ctx, eps, has_q_norm, has_k_norm, attn_scaling, norm_offset, rot_dim,
                         lane);
            __syncwarp();  // s_head[warp] is refilled next
        }
    }
}

#endif  // METRALE_COMMON_CU
