// Gated DeltaNet (the linear_attention mixer kind) for the rows path: T rows (a decode step, or the rows of a
// verify pass, in order) through one layer's conv, gates, recurrent rule and gated norm. fp32 throughout,
// the order of operations of backends/numpy/gated_delta.py (the reference the GPU tests compare with).
// Compiled as a module of its own, for a model with linear-attention layers (backends/cuda/linear_attention.py).
//
// The states live in a ring of R slots ([R, ...] each): slot p % R holds the state at position p (after the
// first p tokens). A pass of T rows at positions pos[0..T-1] (consecutive, on the device: a captured graph reads
// them at replay) reads the slot of pos[0] and writes the state after row t to the slot of pos[t] + 1, every row
// (`every`: decode and verify, so a rollback to any of the last R - 1 positions is only a change of length) or
// the last row only (a prefill). Each thread reads its part of the state once, before it writes any slot.
//
// The fused input projection `proj` [T, in_size] is read through column maps (gated_delta.py builds them
// from the spec), so the head-grouped (qwen3_next) and flat (qwen3_5) layouts need no copy:
//   src[c]    conv channel c (q | k | v, conv_dim of them)      z_col[h * dv + j]  the gate z of value (h, j)
//   b_col[h]  beta's logit of value head h                      a_col[h]           the decay's input of head h
#include "common.cu"

#define GDN_MAX_KERNEL 8

__device__ __forceinline__ float gdn_silu(float x) { return x / (1.0f + expf(-x)); }

// One thread per conv channel: out[t, c] = silu(sum_j w[c, j] * x[t + j - (K - 1)]) over the channel's last
// K - 1 inputs (a ring slot [C, K - 1], oldest first) and this row's; the state after each row (every) or the
// last goes to the next position's slot of `ring` [R, C, K - 1].
extern "C" __global__ void gdn_conv_kernel(const float* __restrict__ proj, int in_size, const int* __restrict__ src,
                                           const unsigned short* __restrict__ w, float* __restrict__ ring, int R,
                                           const int* __restrict__ pos, int every, float* __restrict__ out, int T,
                                           int C, int K) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const size_t slot = (size_t)C * (K - 1);
    float win[GDN_MAX_KERNEL];
    const int p0 = pos[0];
    const float* state = ring + (size_t)(p0 % R) * slot;
    for (int j = 0; j < K - 1; ++j) win[j] = state[(size_t)c * (K - 1) + j];
    for (int t = 0; t < T; ++t) {
        float x = proj[(size_t)t * in_size + src[c]];
        float acc = 0.0f;
        for (int j = 0; j < K - 1; ++j) acc += win[j] * bf16_to_f32_bits(w[(size_t)c * K + j]);
        acc += x * bf16_to_f32_bits(w[(size_t)c * K + K - 1]);
        out[(size_t)t * C + c] = gdn_silu(acc);
        for (int j = 0; j + 1 < K - 1; ++j) win[j] = win[j + 1];
        if (K > 1) win[K - 2] = x;
        if (every || t == T - 1) {
            float* next = ring + (size_t)((p0 + t + 1) % R) * slot;
            for (int j = 0; j < K - 1; ++j) next[(size_t)c * (K - 1) + j] = win[j];
        }
    }
}

// One thread per (row, value head): beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias) (torch's
// softplus: x itself above 20).
extern "C" __global__ void gdn_gates_kernel(const float* __restrict__ proj, int in_size, const int* __restrict__ b_col,
                                            const int* __restrict__ a_col, const float* __restrict__ a_log,
                                            const float* __restrict__ dt_bias, float* __restrict__ beta,
                                            float* __restrict__ g, int T, int H) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * H) return;
    int t = i / H, h = i % H;
    float b = proj[(size_t)t * in_size + b_col[h]];
    float a = proj[(size_t)t * in_size + a_col[h]] + dt_bias[h];
    beta[i] = 1.0f / (1.0f + expf(-b));
    float sp = a > 20.0f ? a : log1pf(expf(a));
    g[i] = -expf(a_log[h]) * sp;
}

// Block (value head h, a slice of its dv columns); each column j is held by DK / 32 threads
// (consecutive lanes), 32 values of S[h, :, j] each, in registers: the state is read once and written once,
// whatever T. Per row: q and k of h's key head from the conv output ([T, C]: q at hk * DK, k at
// Hk * DK + hk * DK, v at 2 Hk DK + h dv), l2-normalised in shared memory (q also times DK^-0.5), then
// S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q (the sums over DK: each thread's 32, then across the
// column's threads). The state is read from the slot of pos[0] of `ring` [R, v_heads, DK, dv]; the state after
// each row (every) or the last goes to the next position's slot.
#define GDN_PER_THREAD 32
template <int DK>
__device__ void gdn_recurrent(const float* __restrict__ conv, int C, const float* __restrict__ beta,
                              const float* __restrict__ g, float* __restrict__ ring, int R,
                              const int* __restrict__ pos, int every, float* __restrict__ out, int T, int Hk, int Hv,
                              int dv) {
    constexpr int P = DK / GDN_PER_THREAD;  // threads per column, a power of two <= 32
    __shared__ float qs[DK], ks[DK], red[2][32];
    const int h = blockIdx.x, p = threadIdx.x % P, hk = h / (Hv / Hk);
    const int j = blockIdx.y * (blockDim.x / P) + threadIdx.x / P;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    const bool mine = j < dv;
    const int i0 = p * GDN_PER_THREAD;
    const size_t slot = (size_t)Hv * DK * dv;
    const int p0 = pos[0];
    const float* state = ring + (size_t)(p0 % R) * slot;
    float s[GDN_PER_THREAD];
#pragma unroll
    for (int i = 0; i < GDN_PER_THREAD; ++i) s[i] = mine ? state[((size_t)h * DK + i0 + i) * dv + j] : 0.0f;
    for (int t = 0; t < T; ++t) {
        const float* row = conv + (size_t)t * C;
        float sq = 0.0f, sk = 0.0f;
        for (int i = threadIdx.x; i < DK; i += blockDim.x) {
            float q = row[hk * DK + i], k = row[Hk * DK + hk * DK + i];
            qs[i] = q;
            ks[i] = k;
            sq += q * q;
            sk += k * k;
        }
        sq = warp_sum(sq);
        sk = warp_sum(sk);
        if (lane == 0) {
            red[0][warp] = sq;
            red[1][warp] = sk;
        }
        __syncthreads();
        sq = 0.0f;
        sk = 0.0f;
        for (int w = 0; w < warps; ++w) {
            sq += red[0][w];
            sk += red[1][w];
        }
        const float qn = 1.0f / sqrtf(sq + 1e-6f), kn = 1.0f / sqrtf(sk + 1e-6f), scale = rsqrtf((float)DK);
        __syncthreads();  // every thread has read red before the next row's warps overwrite it
        for (int i = threadIdx.x; i < DK; i += blockDim.x) {
            qs[i] = qs[i] * qn * scale;
            ks[i] = ks[i] * kn;
        }
        __syncthreads();
        const float decay = expf(g[t * Hv + h]), b = beta[t * Hv + h];
        float mem = 0.0f;
#pragma unroll
        for (int i = 0; i < GDN_PER_THREAD; ++i) {
            s[i] *= decay;
            mem += s[i] * ks[i0 + i];
        }
#pragma unroll
        for (int o = P / 2; o > 0; o >>= 1) mem += __shfl_xor_sync(0xffffffffu, mem, o);
        const float v = mine ? row[2 * Hk * DK + h * dv + j] : 0.0f;
        const float delta = (v - mem) * b;
        float o = 0.0f;
#pragma unroll
        for (int i = 0; i < GDN_PER_THREAD; ++i) {
            s[i] += ks[i0 + i] * delta;
            o += s[i] * qs[i0 + i];
        }
#pragma unroll
        for (int m = P / 2; m > 0; m >>= 1) o += __shfl_xor_sync(0xffffffffu, o, m);
        if (mine) {
            if (p == 0) out[((size_t)t * Hv + h) * dv + j] = o;
            if (every || t == T - 1) {
                float* next = ring + (size_t)((p0 + t + 1) % R) * slot;
#pragma unroll
                for (int i = 0; i < GDN_PER_THREAD; ++i) next[((size_t)h * DK + i0 + i) * dv + j] = s[i];
            }
        }
        __syncthreads();  // qs / ks are rewritten by the next row
    }
}

#define GDN_RECURRENT(DK)                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) gdn_recurrent_##DK##_kernel(                                 \
        const float* conv, int C, const float* beta, const float* g, float* ring, int R, const int* pos, int every, \
        float* out, int T, int Hk, int Hv, int dv) {                                                               \
        gdn_recurrent<DK>(conv, C, beta, g, ring, R, pos, every, out, T, Hk, Hv, dv);                              \
    }
GDN_RECURRENT(64)
GDN_RECURRENT(128)
GDN_RECURRENT(256)

// ---- the prefill path (T > 16 rows, eager): the conv and the l2 norms parallel over the rows, then the rule with
// the next row's operands loaded while the current one is computed (no shared memory, no barrier). Each gives the
// numbers of the kernels above: the same operations in the same order.

// One thread per (row t, channel c): the conv of row t from the K - 1 inputs before it (the earlier rows', or for
// the first K - 1 rows the slot of pos[0]); gdn_conv_tail_kernel then writes the state after the last row.
extern "C" __global__ void gdn_conv_rows_kernel(const float* __restrict__ proj, int in_size,
                                                const int* __restrict__ src, const unsigned short* __restrict__ w,
                                                const float* __restrict__ ring, int R, const int* __restrict__ pos,
                                                float* __restrict__ out, int T, int C, int K) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T * C) return;
    const int t = (int)(i / C), c = (int)(i % C);
    const float* state = ring + (size_t)(pos[0] % R) * C * (K - 1) + (size_t)c * (K - 1);
    float acc = 0.0f;
    for (int j = 0; j < K - 1; ++j) {
        const int r = t + j - (K - 1);  // the input row; before the first: the state, oldest first
        const float x = r >= 0 ? proj[(size_t)r * in_size + src[c]] : state[K - 1 + r];
        acc += x * bf16_to_f32_bits(w[(size_t)c * K + j]);
    }
    acc += proj[(size_t)t * in_size + src[c]] * bf16_to_f32_bits(w[(size_t)c * K + K - 1]);
    out[i] = gdn_silu(acc);
}

// One thread per channel, after gdn_conv_rows_kernel (T >= K - 1): the slot of pos[0] + T gets the last K - 1
// inputs (a launch of its own: that slot may be the one the conv read, when T is a multiple of R).
extern "C" __global__ void gdn_conv_tail_kernel(const float* __restrict__ proj, int in_size,
                                                const int* __restrict__ src, float* __restrict__ ring, int R,
                                                const int* __restrict__ pos, int T, int C, int K) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float* next = ring + (size_t)((pos[0] + T) % R) * C * (K - 1) + (size_t)c * (K - 1);
    for (int j = 0; j < K - 1; ++j) next[j] = proj[(size_t)(T - (K - 1) + j) * in_size + src[c]];
}

// Block (row t, head hh of the 2 Hk q and k heads, contiguous in the conv output [T, C]) of 128 threads: the head
// l2-normalised in place, q also times DK^-0.5, with gdn_recurrent's sums (the same threads, loop and reduction).
extern "C" __global__ void __launch_bounds__(128) gdn_qk_norm_kernel(float* __restrict__ conv, int C, int Hk, int DK) {
    __shared__ float red[32];
    const int t = blockIdx.x, hh = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    float* x = conv + (size_t)t * C + (size_t)hh * DK;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < DK; i += blockDim.x) ss += x[i] * x[i];
    ss = warp_sum(ss);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    ss = 0.0f;
    for (int w = 0; w < warps; ++w) ss += red[w];
    const float n = 1.0f / sqrtf(ss + 1e-6f), scale = rsqrtf((float)DK);
    for (int i = threadIdx.x; i < DK; i += blockDim.x) x[i] = hh < Hk ? x[i] * n * scale : x[i] * n;
}

// gdn_recurrent over q and k normalised by gdn_qk_norm_kernel: each thread reads its 32 values of q and k from the
// conv output itself, one row ahead of the one it computes.
template <int DK>
__device__ void gdn_recurrent_pre(const float* __restrict__ conv, int C, const float* __restrict__ beta,
                                  const float* __restrict__ g, float* __restrict__ ring, int R,
                                  const int* __restrict__ pos, int every, float* __restrict__ out, int T, int Hk,
                                  int Hv, int dv) {
    constexpr int P = DK / GDN_PER_THREAD;
    const int h = blockIdx.x, p = threadIdx.x % P, hk = h / (Hv / Hk);
    const int j = blockIdx.y * (blockDim.x / P) + threadIdx.x / P;
    const bool mine = j < dv;
    const int i0 = p * GDN_PER_THREAD;
    const size_t slot = (size_t)Hv * DK * dv;
    const int p0 = pos[0];
    const float* state = ring + (size_t)(p0 % R) * slot;
    float s[GDN_PER_THREAD];
#pragma unroll
    for (int i = 0; i < GDN_PER_THREAD; ++i) s[i] = mine ? state[((size_t)h * DK + i0 + i) * dv + j] : 0.0f;
    const size_t qo = (size_t)hk * DK + i0, ko = (size_t)Hk * DK + hk * DK + i0, vo = (size_t)2 * Hk * DK + h * dv + j;
    float qc[GDN_PER_THREAD], kc[GDN_PER_THREAD], vc, gc, bc;
#pragma unroll
    for (int i = 0; i < GDN_PER_THREAD; ++i) {
        qc[i] = conv[qo + i];
        kc[i] = conv[ko + i];
    }
    vc = mine ? conv[vo] : 0.0f;
    gc = g[h];
    bc = beta[h];
    for (int t = 0; t < T; ++t) {
        float qn[GDN_PER_THREAD], kn[GDN_PER_THREAD], vn = 0.0f, gn = 0.0f, bn = 0.0f;
        if (t + 1 < T) {  // the next row's operands, in flight while this row is computed
            const float* row = conv + (size_t)(t + 1) * C;
#pragma unroll
            for (int i = 0; i < GDN_PER_THREAD; ++i) {
                qn[i] = row[qo + i];
                kn[i] = row[ko + i];
            }
            vn = mine ? row[vo] : 0.0f;
            gn = g[(t + 1) * Hv + h];
            bn = beta[(t + 1) * Hv + h];
        }
        const float decay = expf(gc);
        float mem = 0.0f;
#pragma unroll
        for (int i = 0; i < GDN_PER_THREAD; ++i) {
            s[i] *= decay;
            mem += s[i] * kc[i];
        }
#pragma unroll
        for (int o = P / 2; o > 0; o >>= 1) mem += __shfl_xor_sync(0xffffffffu, mem, o);
        const float delta = (vc - mem) * bc;
        float o = 0.0f;
#pragma unroll
        for (int i = 0; i < GDN_PER_THREAD; ++i) {
            s[i] += kc[i] * delta;
            o += s[i] * qc[i];
        }
#pragma unroll
        for (int m = P / 2; m > 0; m >>= 1) o += __shfl_xor_sync(0xffffffffu, o, m);
        if (mine) {
            if (p == 0) out[((size_t)t * Hv + h) * dv + j] = o;
            if (every || t == T - 1) {
                float* next = ring + (size_t)((p0 + t + 1) % R) * slot;
#pragma unroll
                for (int i = 0; i < GDN_PER_THREAD; ++i) next[((size_t)h * DK + i0 + i) * dv + j] = s[i];
            }
        }
#pragma unroll
        for (int i = 0; i < GDN_PER_THREAD; ++i) {
            qc[i] = qn[i];
            kc[i] = kn[i];
        }
        vc = vn;
        gc = gn;
        bc = bn;
    }
}

#define GDN_RECURRENT_PRE(DK)                                                                                      \
    extern "C" __global__ void __launch_bounds__(128) gdn_recurrent_pre_##DK##_kernel(                             \
        const float* conv, int C, const float* beta, const float* g, float* ring, int R, const int* pos, int every, \
        float* out, int T, int Hk, int Hv, int dv) {                                                               \
        gdn_recurrent_pre<DK>(conv, C, beta, g, ring, R, pos, every, out, T, Hk, Hv, dv);                          \
    }
GDN_RECURRENT_PRE(64)
GDN_RECURRENT_PRE(128)
GDN_RECURRENT_PRE(256)

// Block per (row, value head), RMSNormGated: y = w * o / sqrt(mean(o^2) + eps) * silu(z), over dv.
extern "C" __global__ void gdn_gated_norm_kernel(const float* __restrict__ o, const float* __restrict__ proj,
                                                 int in_size, const int* __restrict__ z_col,
                                                 const unsigned short* __restrict__ w, float eps,
                                                 float* __restrict__ y, int Hv, int dv) {
    __shared__ float red[32];
    const int t = blockIdx.x, h = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    const float* x = o + ((size_t)t * Hv + h) * dv;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < dv; j += blockDim.x) ss += x[j] * x[j];
    ss = warp_sum(ss);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    ss = 0.0f;
    for (int i = 0; i < warps; ++i) ss += red[i];
    const float inv = 1.0f / sqrtf(ss / (float)dv + eps);
    for (int j = threadIdx.x; j < dv; j += blockDim.x) {
        float z = proj[(size_t)t * in_size + z_col[h * dv + j]];
        y[(size_t)t * Hv * dv + h * dv + j] = bf16_to_f32_bits(w[j]) * (x[j] * inv) * gdn_silu(z);
    }
}
