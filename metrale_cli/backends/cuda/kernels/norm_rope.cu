// RMSNorm (with optional fused residual add) and rotary embedding (with optional
// per-head RMSNorm first, for Qwen3's q_norm / k_norm).
#include "common.cu"

// One block per row.  If has_residual: residual += x (in place) and the sum is
// normalised.  out = (offset + w) * (h * rsqrt(mean(h^2) + eps)), Hugging Face's
// LlamaRMSNorm (offset 0) or Gemma's (1 + w) RMSNorm (offset 1) in float32.  `out` may alias `x`
// (each element is read before it is written, by the same thread); `residual` must not alias x or out.
extern "C" __global__ void rmsnorm_kernel(const float* x, const unsigned short* __restrict__ w,
                                          float* out, float* residual, int H, float eps,
                                          int has_residual, float offset) {
    pdl_wait();
    pdl_trigger();
    __shared__ float scratch[32];
    const u64 row = blockIdx.x;
    const float* xr = x + row * H;
    float* rr = residual + (has_residual ? row * H : 0);
    float* orow = out + row * H;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        float h = xr[i];
        if (has_residual) {
            h = rr[i] + h;
            rr[i] = h;
        }
        ss = fmaf(h, h, ss);
    }
    ss = block_sum(ss, scratch);
    const float inv = rsqrtf(ss / (float)H + eps);
    const float* src = has_residual ? rr : xr;
    for (int i = threadIdx.x; i < H; i += blockDim.x)
        orow[i] = (bf16_to_f32_bits(w[i]) + offset) * (src[i] * inv);
}

// The sandwich blocks' post-norm (Gemma's post_attention_layernorm / post_feedforward_layernorm):
// residual += (offset + w) * (x * rsqrt(mean(x^2) + eps)), one block per row.  x must not alias residual.
extern "C" __global__ void rmsnorm_add_kernel(const float* __restrict__ x, const unsigned short* __restrict__ w,
                                              float* __restrict__ residual, int H, float eps, float offset) {
    pdl_wait();
    pdl_trigger();
    __shared__ float scratch[32];
    const u64 row = blockIdx.x;
    const float* xr = x + row * H;
    float* rr = residual + row * H;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    ss = block_sum(ss, scratch);
    const float inv = rsqrtf(ss / (float)H + eps);
    for (int i = threadIdx.x; i < H; i += blockDim.x) rr[i] += (bf16_to_f32_bits(w[i]) + offset) * (xr[i] * inv);
}

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

// x: float32 [M, n_heads, head_dim], in place.  One warp per (row, head).
// head_dim even and <= 256.  Optional per-head RMSNorm, then rotation (rope_head).
extern "C" __global__ void rope_kernel(float* __restrict__ x, const int* __restrict__ positions,
                                       const float* __restrict__ inv_freq,
                                       const unsigned short* __restrict__ norm_w, int M,
                                       int n_heads, int head_dim, float eps, int has_norm,
                                       float attn_scaling, float norm_offset, int rot_dim) {
    pdl_wait();
    pdl_trigger();
    const int lane = threadIdx.x & 31;
    const int vec = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (vec >= M * n_heads) return;  // whole warp leaves together
    const int m = vec / n_heads;
    float* v = x + (u64)vec * head_dim;
    const int half = head_dim >> 1;
    if (rot_dim < head_dim) {
        float o[8];
        rope_head_partial(v, inv_freq, norm_w, head_dim, rot_dim, eps, has_norm, (float)positions[m], attn_scaling,
                          norm_offset, lane, o);
        __syncwarp();
#pragma unroll
        for (int j = 0; j < 8; ++j)
            if (lane + 32 * j < head_dim) v[lane + 32 * j] = o[j];
        return;
    }
    float a[4], b[4];
    rope_head(v, inv_freq, norm_w, head_dim, eps, has_norm, (float)positions[m], attn_scaling,
              lane, a, b, norm_offset);
    rope_store(v, a, b, half, lane);
}

// Rope and KV-cache append in one launch, straight from the fused QKV GEMV output.
// qkv: float32 [M, (n_heads + 2 n_kv) * head_dim], each row q heads, k heads, v heads.
// One warp per (row m, head slot s), s < n_heads + 2 n_kv:
//   q slot: optional q_norm, rotate, store fp32 to q_out [M, n_heads, head_dim]
//           (q_out may be qkv itself when M == 1: each value is read before it is written,
//           by the same thread);
//   k slot: optional k_norm, rotate, round to bf16, store to k_cache[h, positions[m], :];
//   v slot: round to bf16, store to v_cache[h, positions[m], :].
// Caches bf16 [n_kv, max_ctx, head_dim].  A position outside [0, max_ctx) skips the cache
// writes (as kv_append_kernel).  head_dim even and <= 256.
extern "C" __global__ void rope_kv_append_kernel(const float* qkv, const int* __restrict__ positions,
                                                 const float* __restrict__ inv_freq,
                                                 const unsigned short* __restrict__ q_norm,
                                                 const unsigned short* __restrict__ k_norm,
                                                 float* q_out, unsigned short* __restrict__ k_cache,
                                                 unsigned short* __restrict__ v_cache, int M,
                                                 int n_heads, int n_kv, int head_dim, int max_ctx,
                                                 float eps, int has_q_norm, int has_k_norm,
                                                 float attn_scaling, float norm_offset, int rot_dim) {
    pdl_wait();
    pdl_trigger();
    const int lane = threadIdx.x & 31;
    const int slots = n_heads + 2 * n_kv;
    const int vec = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (vec >= M * slots) return;  // whole warp leaves together
    const int m = vec / slots, s = vec - m * slots;
    const float* src = qkv + (u64)vec * head_dim;
    const int half = head_dim >> 1;
    const int p = positions[m];
    const bool in_cache = p >= 0 && p < max_ctx;
    if (s >= n_heads + n_kv) {  // v head: round and store
        if (!in_cache) return;
        unsigned short* dst = v_cache + ((u64)(s - n_heads - n_kv) * max_ctx + p) * head_dim;
        for (int i = lane; i < head_dim; i += 32) dst[i] = f32_to_bf16_bits(src[i]);
        return;
    }
    const bool is_q = s < n_heads;
    if (!is_q && !in_cache) return;
    if (rot_dim < head_dim) {
        float o[8];
        rope_head_partial(src, inv_freq, is_q ? q_norm : k_norm, head_dim, rot_dim, eps,
                          is_q ? has_q_norm : has_k_norm, (float)p, attn_scaling, norm_offset, lane, o);
        __syncwarp();  // q_out may be qkv itself: every lane has read its partners
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int i = lane + 32 * j;
            if (i >= head_dim) continue;
            if (is_q) q_out[((u64)m * n_heads + s) * head_dim + i] = o[j];
            else k_cache[((u64)(s - n_heads) * max_ctx + p) * head_dim + i] = f32_to_bf16_bits(o[j]);
        }
        return;
    }
    float a[4], b[4];
    rope_head(src, inv_freq, is_q ? q_norm : k_norm, head_dim, eps, is_q ? has_q_norm : has_k_norm,
              (float)p, attn_scaling, lane, a, b, norm_offset);
    if (is_q) {
        rope_store(q_out + ((u64)m * n_heads + s) * head_dim, a, b, half, lane);
    } else {
        rope_store(k_cache + ((u64)(s - n_heads) * max_ctx + p) * head_dim, a, b, half, lane);
    }
}
