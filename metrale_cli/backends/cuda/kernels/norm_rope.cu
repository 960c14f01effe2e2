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

// rope_head, rope_head_partial, rope_store and rope_kv_slot live in common.cu (the fused qkv
// GEMV epilogues of gemv.cu / gemv_tc.cu call them too).

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
    rope_kv_slot(qkv + (u64)vec * head_dim, m, s, positions, inv_freq, q_norm, k_norm, q_out, k_cache, v_cache,
                 n_heads, n_kv, head_dim, max_ctx, eps, has_q_norm, has_k_norm, attn_scaling, norm_offset, rot_dim,
                 lane);
}
