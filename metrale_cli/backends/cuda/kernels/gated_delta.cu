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

// ---- the chunked rule (the prefill path's long passes): the rule of gdn_recurrent_pre by chunks of L = 64 rows,
// backends/numpy/gated_delta.chunked's form and order (a chunk's rows padded with zero q, k, v, beta and g).
// Within a chunk, with G_i the cumulative sum of g from the chunk's start to row i:
//   A     [L, L]  strictly lower: beta_i (k_i . k_j) exp(G_i - G_j)
//   W     [L, DK] (I + A)^-1 (beta_i exp(G_i) k_i)   (forward substitution)
//   U     [L, dv] (I + A)^-1 (beta_i v_i)
//   intra [L, L]  lower with the diagonal: (q_i . k_j) exp(G_i - G_j)
// (gdn_chunk_prep_kernel: independent across the chunks and heads), then per chunk in sequence, S the state at
// the chunk's start (gdn_chunk_state_kernel):
//   v' = U - W S;  o = (exp(G) q) S + intra v';  S = exp(G_{L-1}) S + (exp(G_{L-1} - G) k)^T v'.
// Both read the conv output [T, C] after gdn_qk_norm_kernel (q of key head hk at hk DK, k at Hk DK + hk DK, v of
// value head h at 2 Hk DK + h dv; hk = h / (Hv / Hk)) and beta, g [T, Hv]. The intermediates go through a work
// area of [Hv, N L, ...] fp32 arrays (N = ceil(T / L) chunks; row n L + i of head h is chunk n's row i): w [.., DK],
// u [.., dv], intra [.., L], cum [Hv, N L] (G); w and intra 16-byte aligned (read as float4). Launches: prep on a
// grid (N, Hv), then state on (Hv, ceil(dv / GDN_CHUNK_BV)), both of GDN_CHUNK_THREADS threads, on one stream.
// The state's slot rules are the prefill's (the header): read at pos[0], written at pos[0] + T only.
#define GDN_CHUNK 64
#define GDN_CHUNK_THREADS 256
#define GDN_CHUNK_BV 32  // the state's columns per gdn_chunk_state block

// Block (chunk n, value head h) of GDN_CHUNK_THREADS threads, 33 KiB of static shared memory: G by one thread in
// row order (np.cumsum's), then A and intra from 32-wide slices of k and q in shared memory (each thread 4 x 4 of
// both), then the substitution with one thread per column of W (DK of them) and of U (dv), the column in registers.
template <int DK>
__device__ void gdn_chunk_prep(const float* __restrict__ conv, int C, const float* __restrict__ beta,
                               const float* __restrict__ g, float* __restrict__ w_out, float* __restrict__ u_out,
                               float* __restrict__ intra_out, float* __restrict__ cum_out, int T, int Hk, int Hv,
                               int dv) {
    constexpr int L = GDN_CHUNK, TD = 32;
    __shared__ float ks[L][TD + 1], qs[L][TD + 1], cum[L], bet[L];
    __shared__ __align__(16) float A[L][L];
    const int n = blockIdx.x, h = blockIdx.y, N = gridDim.x, hk = h / (Hv / Hk), tid = threadIdx.x;
    const int t0 = n * L;
    const size_t base = ((size_t)h * N + n) * L;  // the chunk's row 0 in the work arrays
    const size_t qo = (size_t)hk * DK, ko = (size_t)Hk * DK + hk * DK, vo = (size_t)2 * Hk * DK + h * dv;
    if (tid == 0) {
        float c = 0.0f;
        for (int i = 0; i < L; ++i) {
            c += t0 + i < T ? g[(size_t)(t0 + i) * Hv + h] : 0.0f;
            cum[i] = c;
        }
    }
    if (tid < L) bet[tid] = t0 + tid < T ? beta[(size_t)(t0 + tid) * Hv + h] : 0.0f;
    const int ty = tid / 16, tx = tid % 16;  // rows ty + 16 r, columns tx + 16 s
    float sa[4][4] = {}, sq[4][4] = {};
    for (int d0 = 0; d0 < DK; d0 += TD) {
        for (int e = tid; e < L * TD; e += blockDim.x) {
            const int i = e / TD, d = e % TD, t = t0 + i;
            ks[i][d] = t < T ? conv[(size_t)t * C + ko + d0 + d] : 0.0f;
            qs[i][d] = t < T ? conv[(size_t)t * C + qo + d0 + d] : 0.0f;
        }
        __syncthreads();
#pragma unroll 4
        for (int d = 0; d < TD; ++d) {
            float kj[4];
#pragma unroll
            for (int s = 0; s < 4; ++s) kj[s] = ks[tx + 16 * s][d];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const float ki = ks[ty + 16 * r][d], qi = qs[ty + 16 * r][d];
#pragma unroll
                for (int s = 0; s < 4; ++s) {
                    sa[r][s] += ki * kj[s];
                    sq[r][s] += qi * kj[s];
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int i = ty + 16 * r;
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const int j = tx + 16 * s;
            const float decay = j <= i ? expf(cum[i] - cum[j]) : 0.0f;
            A[i][j] = j < i ? bet[i] * sa[r][s] * decay : 0.0f;
            intra_out[(base + i) * L + j] = j <= i ? sq[r][s] * decay : 0.0f;
        }
    }
    __syncthreads();
    for (int col = tid; col < DK + dv; col += blockDim.x) {
        const bool key = col < DK;
        float x[L];
#pragma unroll
        for (int i = 0; i < L; ++i) {
            const size_t at = (size_t)(t0 + i) * C + (key ? ko + col : vo + col - DK);
            x[i] = t0 + i >= T ? 0.0f : key ? conv[at] * bet[i] * expf(cum[i]) : conv[at] * bet[i];
        }
#pragma unroll
        for (int i = 1; i < L; ++i) {
            float acc = 0.0f;
#pragma unroll
            for (int j = 0; j < i; ++j) acc += A[i][j] * x[j];
            x[i] -= acc;
            asm volatile("" ::: "memory");  // A's rows loaded row by row (not all ahead, which spills)
        }
        float* dst = key ? w_out + base * DK + col : u_out + base * dv + (col - DK);
        const int stride = key ? DK : dv;
#pragma unroll
        for (int i = 0; i < L; ++i) dst[(size_t)i * stride] = x[i];
    }
    if (tid < L) cum_out[base + tid] = cum[tid];
}

// Block (value head h, GDN_CHUNK_BV columns of its state) of GDN_CHUNK_THREADS threads (8 warps, lane = column),
// gdn_chunk_state_smem(DK) bytes of dynamic shared memory: the state slice S [DK, BV], W then the decayed k
// [L, DK], the decayed q [L, DK], intra [L, L], v' [L, BV]. The slice is read from the slot of pos[0] of `ring`
// [R, Hv, DK, dv] once and written to the slot of pos[0] + T once (the same block's elements: safe when the
// slots are one). Per chunk: warp w computes rows 8 w .. 8 w + 7 of W S and (exp(G) q) S (the sums over DK in
// order), v' and o; then the DK / 8 rows of S from 8 w on (the sum over the chunk's rows in order).
template <int DK>
__device__ void gdn_chunk_state(const float* __restrict__ conv, int C, const float* __restrict__ w_in,
                                const float* __restrict__ u_in, const float* __restrict__ intra_in,
                                const float* __restrict__ cum_in, float* __restrict__ ring, int R,
                                const int* __restrict__ pos, float* __restrict__ out, int T, int Hk, int Hv, int dv) {
    constexpr int L = GDN_CHUNK, BV = GDN_CHUNK_BV, WARPS = GDN_CHUNK_THREADS / 32, RW = L / WARPS, DW = DK / WARPS;
    extern __shared__ __align__(16) float gdn_smem[];
    float* S = gdn_smem;      // [DK][BV]
    float* Kb = S + DK * BV;  // [L][DK]: W, then k exp(G_{L-1} - G)
    float* Qb = Kb + L * DK;  // [L][DK]: q exp(G)
    float* Ib = Qb + L * DK;  // [L][L]
    float* Vn = Ib + L * L;   // [L][BV]
    const int h = blockIdx.x, hk = h / (Hv / Hk), tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int j = blockIdx.y * BV + lane, N = (T + L - 1) / L;
    const bool mine = j < dv;
    const size_t slot = (size_t)Hv * DK * dv, qo = (size_t)hk * DK, ko = (size_t)Hk * DK + hk * DK;
    const int p0 = pos[0];
    const float* state = ring + (size_t)(p0 % R) * slot + (size_t)h * DK * dv;
    for (int d = warp; d < DK; d += WARPS) S[d * BV + lane] = mine ? state[(size_t)d * dv + j] : 0.0f;
    for (int n = 0; n < N; ++n) {
        const size_t base = ((size_t)h * N + n) * L;
        const float* cum = cum_in + base;
        const float4* w4 = reinterpret_cast<const float4*>(w_in + base * DK);
        const float4* i4 = reinterpret_cast<const float4*>(intra_in + base * L);
        for (int e = tid; e < L * DK / 4; e += blockDim.x) reinterpret_cast<float4*>(Kb)[e] = w4[e];
        for (int e = tid; e < L * L / 4; e += blockDim.x) reinterpret_cast<float4*>(Ib)[e] = i4[e];
        for (int e = tid; e < L * DK; e += blockDim.x) {
            const int i = e / DK, t = n * L + i;
            Qb[e] = t < T ? conv[(size_t)t * C + qo + e % DK] * expf(cum[i]) : 0.0f;
        }
        __syncthreads();  // the chunk's operands, and the state after the last chunk
        const int r0 = warp * RW;
        float aw[RW], aq[RW];
#pragma unroll
        for (int r = 0; r < RW; ++r) aw[r] = aq[r] = 0.0f;
        for (int d = 0; d < DK; d += 4) {
            const float s0 = S[d * BV + lane], s1 = S[(d + 1) * BV + lane], s2 = S[(d + 2) * BV + lane],
                        s3 = S[(d + 3) * BV + lane];
#pragma unroll
            for (int r = 0; r < RW; ++r) {
                const float4 w = *reinterpret_cast<const float4*>(Kb + (r0 + r) * DK + d);
                const float4 q = *reinterpret_cast<const float4*>(Qb + (r0 + r) * DK + d);
                aw[r] += w.x * s0;
                aw[r] += w.y * s1;
                aw[r] += w.z * s2;
                aw[r] += w.w * s3;
                aq[r] += q.x * s0;
                aq[r] += q.y * s1;
                aq[r] += q.z * s2;
                aq[r] += q.w * s3;
            }
        }
#pragma unroll
        for (int r = 0; r < RW; ++r) Vn[(r0 + r) * BV + lane] = (mine ? u_in[(base + r0 + r) * dv + j] : 0.0f) - aw[r];
        __syncthreads();  // v' complete, W no longer read
        const float last = cum[L - 1];
        for (int e = tid; e < L * DK; e += blockDim.x) {
            const int i = e / DK, t = n * L + i;
            Kb[e] = t < T ? conv[(size_t)t * C + ko + e % DK] * expf(last - cum[i]) : 0.0f;
        }
#pragma unroll
        for (int r = 0; r < RW; ++r) {
            const int i = r0 + r, t = n * L + i;
            float acc = 0.0f;
            for (int c = 0; c < L; c += 4) {
                const float4 a = *reinterpret_cast<const float4*>(Ib + i * L + c);
                acc += a.x * Vn[c * BV + lane];
                acc += a.y * Vn[(c + 1) * BV + lane];
                acc += a.z * Vn[(c + 2) * BV + lane];
                acc += a.w * Vn[(c + 3) * BV + lane];
            }
            if (mine && t < T) out[((size_t)t * Hv + h) * dv + j] = aq[r] + acc;
        }
        __syncthreads();  // the decayed k
        const float decay = expf(last);
        const int d0 = warp * DW;
        float acc[DW];
#pragma unroll
        for (int dd = 0; dd < DW; ++dd) acc[dd] = 0.0f;
        for (int c = 0; c < L; ++c) {
            const float v = Vn[c * BV + lane];
#pragma unroll
            for (int dd = 0; dd < DW; dd += 4) {
                const float4 k = *reinterpret_cast<const float4*>(Kb + c * DK + d0 + dd);
                acc[dd] += k.x * v;
                acc[dd + 1] += k.y * v;
                acc[dd + 2] += k.z * v;
                acc[dd + 3] += k.w * v;
            }
        }
#pragma unroll
        for (int dd = 0; dd < DW; ++dd) S[(d0 + dd) * BV + lane] = S[(d0 + dd) * BV + lane] * decay + acc[dd];
        __syncthreads();  // the next chunk's operands overwrite Kb, Qb, Ib
    }
    float* next = ring + (size_t)((p0 + T) % R) * slot + (size_t)h * DK * dv;
    if (mine)
        for (int d = warp; d < DK; d += WARPS) next[(size_t)d * dv + j] = S[d * BV + lane];
}

#define GDN_CHUNKED(DK)                                                                                              \
    extern "C" __global__ void __launch_bounds__(GDN_CHUNK_THREADS) gdn_chunk_prep_##DK##_kernel(                    \
        const float* conv, int C, const float* beta, const float* g, float* w, float* u, float* intra, float* cum,    \
        int T, int Hk, int Hv, int dv) {                                                                             \
        gdn_chunk_prep<DK>(conv, C, beta, g, w, u, intra, cum, T, Hk, Hv, dv);                                       \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(GDN_CHUNK_THREADS, 2) gdn_chunk_state_##DK##_kernel(                \
        const float* conv, int C, const float* w, const float* u, const float* intra, const float* cum, float* ring, \
        int R, const int* pos, float* out, int T, int Hk, int Hv, int dv) {                                          \
        gdn_chunk_state<DK>(conv, C, w, u, intra, cum, ring, R, pos, out, T, Hk, Hv, dv);                            \
    }
GDN_CHUNKED(64)
GDN_CHUNKED(128)
GDN_CHUNKED(256)

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
