// RMSNorm (with optional fused residual add) and rotary embedding (with optional
// per-head RMSNorm first, for Qwen3's q_norm / k_norm).
#include "common.cu"

// One block per row.  If has_residual: residual += x (in place) and the sum is
// normalised.  out = w * (h * rsqrt(mean(h^2) + eps)), Hugging Face's
// LlamaRMSNorm in float32.  `out` may alias `x` (each element is read before
// it is written, by the same thread); `residual` must not alias x or out.
extern "C" __global__ void rmsnorm_kernel(const float* x, const unsigned short* __restrict__ w,
                                          float* out, float* residual, int H, float eps,
                                          int has_residual) {
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
        orow[i] = bf16_to_f32_bits(w[i]) * (src[i] * inv);
}

// x: float32 [M, n_heads, head_dim], in place.  One warp per (row, head).
// head_dim even and <= 256.  Rotation is HF's rotate_half convention:
//   i < d/2: a = x[i], b = x[i + d/2], angle = float(pos) * inv_freq[i] (fp32),
//   x[i] = a*cos - b*sin, x[i + d/2] = b*cos + a*sin,
// with cos/sin multiplied by attn_scaling (1.0 for default and llama3 rope).
// If has_norm: per-head RMSNorm over head_dim with bf16 weight first.
extern "C" __global__ void rope_kernel(float* __restrict__ x, const int* __restrict__ positions,
                                       const float* __restrict__ inv_freq,
                                       const unsigned short* __restrict__ norm_w, int M,
                                       int n_heads, int head_dim, float eps, int has_norm,
                                       float attn_scaling) {
    const int lane = threadIdx.x & 31;
    const int vec = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (vec >= M * n_heads) return;  // whole warp leaves together
    const int m = vec / n_heads;
    float* v = x + (u64)vec * head_dim;
    const int half = head_dim >> 1;
    float a[4], b[4];
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
                a[j] = bf16_to_f32_bits(norm_w[i]) * (a[j] * inv);
                b[j] = bf16_to_f32_bits(norm_w[i + half]) * (b[j] * inv);
            }
        }
    }
    const float pos = (float)positions[m];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int i = lane + 32 * j;
        if (i < half) {
            const float angle = __fmul_rn(pos, inv_freq[i]);
            float s, c;
            sincosf(angle, &s, &c);
            c *= attn_scaling;
            s *= attn_scaling;
            v[i] = a[j] * c - b[j] * s;
            v[i + half] = b[j] * c + a[j] * s;
        }
    }
}
