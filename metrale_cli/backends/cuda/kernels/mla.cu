// Latent attention (the "mla" mixer kind, engine/mla.py) in the absorbed form, for every pass of the CUDA engine
// (decode, verify, short and long prefills): four launches per layer, all graph-capturable (every length is read
// on the device from the rows' positions).  Shapes: H heads, NOPE + P query/key dims per head (P rotated), V
// value dims, R = kv_lora_rank, D = R + P floats per cached position (a multiple of 8, at most 768).
//   1. mla_append_kernel: per row, c = RMSNorm(kv[:R]) (bf16 weight) and k_pe = rope(kv[R:]), written to the bf16
//      latent cache at the row's position (and c in fp32 for the kv_a_layernorm tap);
//   2. mla_q_kernel: per row and head, q_cat = [q_nope W_k; rope(q_pe)] (D floats): the nope part folded through
//      kv_b's key rows W_k [NOPE, R] of the head, each weight read once for up to 16 rows;
//   3. mla_attend_kernel: grid (splits, head groups of MLA_HG, rows): the block's warps are its heads (their q_cat
//      in registers); each tile of MLA_TK cached rows is loaded once into shared memory for all of them; scores q_cat . [c; k_pe] * scale over
//      the positions 0..pos of the row (split into `splits` equal parts of the row's own length), an online softmax
//      and o_lat = sum p c per head: partials (max, sum, o_lat [R]) per split; the next tile's 16-byte loads are in
//      flight while the block computes on the current one;
//   4. mla_out_kernel: per (row, head), the splits combined, o_lat normalised and mapped through kv_b's value rows
//      W_v [V, R]: y [H * V], o_proj's input.
// The rope pairs: rotate_half (i, i + P/2), or interleaved (2i, 2i + 1) written as the rotated evens then the odd
// ones (q and k alike, as transformers' DeepSeek-V3 does), with cos and sin times attn_scaling (YaRN's factor).
// A row's numbers never depend on the other rows of the launch (verify rows equal decode rows).
#include "common.cu"

#define MLA_HG 16       // heads per attention block: one warp each
#define MLA_TK 16       // cached rows per shared-memory tile
#define MLA_MAX_D 768   // kv_lora_rank + qk_rope_head_dim at most (a tile of MLA_TK rows in 48 KiB)
#define MLA_LOADS 3     // 16-byte chunks of a tile per thread: MLA_TK rows of <= MLA_MAX_D values over MLA_HG * 32
#define MLA_MAX_R 512   // kv_lora_rank at most (16 accumulators per lane)
#define MLA_MAX_NOPE 256
#define MLA_Q_ROWS 16   // rows per pass of mla_q_kernel
#define MLA_Q_COLS 64   // columns of q_cat per mla_q_kernel block (2 per lane)
#define MLA_Q_WARPS 4   // warps of an mla_q_kernel block, each a part of the NOPE dims
#define MLA_OUT_THREADS 128
#define MLA_OUT_V 32    // value dims per mla_out_kernel block (8 per warp)
#define MLA_MAX_SPLITS 64  // key splits of mla_attend_kernel at most (<= MLA_OUT_THREADS: one thread each in mla_out)

// Rope pair i of the P-dim vector src, at position pos: (a, b) for output dims i and i + P/2.
__device__ __forceinline__ void mla_rope_pair(const float* src, int i, int P, int interleave, float pos,
                                              const float* __restrict__ inv_freq, float attn_scaling, float& a,
                                              float& b) {
    const int half = P >> 1;
    const float x0 = interleave ? src[2 * i] : src[i];
    const float x1 = interleave ? src[2 * i + 1] : src[i + half];
    float s, c;
    sincosf(__fmul_rn(pos, inv_freq[i]), &s, &c);
    c *= attn_scaling;
    s *= attn_scaling;
    a = x0 * c - x1 * s;
    b = x1 * c + x0 * s;
}

// grid (M), any multiple of 32 threads.  kv f32 [M, ld] (the first D = R + P of a row used); cache bf16
// [max_context, D]; latent f32 [M, R].
extern "C" __global__ void mla_append_kernel(const float* __restrict__ kv, int ld, const int* __restrict__ positions,
                                             const unsigned short* __restrict__ norm_w, float eps,
                                             const float* __restrict__ inv_freq, float attn_scaling, int interleave,
                                             int R, int P, unsigned short* __restrict__ cache,
                                             float* __restrict__ latent) {
    __shared__ float scratch[32];
    pdl_wait();
    pdl_trigger();
    const int m = blockIdx.x, D = R + P;
    const float* x = kv + (u64)m * ld;
    const int pos = positions[m];
    float ss = 0.0f;
    for (int c = threadIdx.x; c < R; c += blockDim.x) ss = fmaf(x[c], x[c], ss);
    ss = block_sum(ss, scratch);
    const float inv = rsqrtf(ss / (float)R + eps);
    unsigned short* row = cache + (u64)pos * D;
    for (int c = threadIdx.x; c < R; c += blockDim.x) {
        const float v = bf16_to_f32_bits(norm_w[c]) * (x[c] * inv);
        latent[(u64)m * R + c] = v;
        row[c] = f32_to_bf16_bits(v);
    }
    for (int i = threadIdx.x; i < (P >> 1); i += blockDim.x) {
        float a, b;
        mla_rope_pair(x + R, i, P, interleave, (float)pos, inv_freq, attn_scaling, a, b);
        row[R + i] = f32_to_bf16_bits(a);
        row[R + i + (P >> 1)] = f32_to_bf16_bits(b);
    }
}

// grid (ceil(R / MLA_Q_COLS), H), MLA_Q_WARPS warps: the block's columns [c0, c0 + MLA_Q_COLS) of head h, lane l
// holding columns c0 + 2l, c0 + 2l + 1 (one 4-byte load of W_k per d), warp w the w-th part of the NOPE dims.
// q f32 [M, H * (NOPE + P)]; kv_b bf16 [H * (NOPE + V), R] (R even); q_cat f32 [M, H, D].  A row's sum runs over
// d in order within each part, then the parts in order: it never depends on the other rows.
extern "C" __global__ void __launch_bounds__(MLA_Q_WARPS * 32)
mla_q_kernel(const float* __restrict__ q, int M, int H, int NOPE, int P, int V, int R,
             const unsigned short* __restrict__ kv_b, const int* __restrict__ positions,
             const float* __restrict__ inv_freq, float attn_scaling, int interleave, float* __restrict__ q_cat) {
    __shared__ float qs[MLA_Q_ROWS][MLA_MAX_NOPE];
    __shared__ float part[MLA_Q_WARPS][MLA_Q_ROWS][MLA_Q_COLS];
    const int h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int c0 = blockIdx.x * MLA_Q_COLS, c = c0 + 2 * lane;
    const int QD = NOPE + P, D = R + P;
    const int per = (NOPE + MLA_Q_WARPS - 1) / MLA_Q_WARPS, d0 = warp * per, d1 = min(NOPE, d0 + per);
    const unsigned short* wk = kv_b + (u64)h * (NOPE + V) * R;  // W_k of head h: rows 0..NOPE-1
    pdl_wait();
    pdl_trigger();
    for (int m0 = 0; m0 < M; m0 += MLA_Q_ROWS) {
        const int rows = min(MLA_Q_ROWS, M - m0);
        __syncthreads();  // the previous rows' qs and part are no longer read
        for (int t = threadIdx.x; t < rows * NOPE; t += blockDim.x)
            qs[t / NOPE][t % NOPE] = q[(u64)(m0 + t / NOPE) * H * QD + (u64)h * QD + t % NOPE];
        __syncthreads();
        float acc[MLA_Q_ROWS][2];
#pragma unroll
        for (int r = 0; r < MLA_Q_ROWS; ++r) acc[r][0] = acc[r][1] = 0.0f;
        if (c < R) {
#pragma unroll 8
            for (int d = d0; d < d1; ++d) {
                const unsigned int w = *reinterpret_cast<const unsigned int*>(wk + (u64)d * R + c);
                const float w0 = bf16_lo(w), w1 = bf16_hi(w);
#pragma unroll
                for (int r = 0; r < MLA_Q_ROWS; ++r) {
                    acc[r][0] = fmaf(qs[r][d], w0, acc[r][0]);
                    acc[r][1] = fmaf(qs[r][d], w1, acc[r][1]);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < MLA_Q_ROWS; ++r) {
            part[warp][r][2 * lane] = acc[r][0];
            part[warp][r][2 * lane + 1] = acc[r][1];
        }
        __syncthreads();
        for (int t = threadIdx.x; t < rows * MLA_Q_COLS; t += blockDim.x) {
            const int r = t / MLA_Q_COLS, cc = t % MLA_Q_COLS;
            if (c0 + cc >= R) continue;
            float sum = 0.0f;
#pragma unroll
            for (int w = 0; w < MLA_Q_WARPS; ++w) sum += part[w][r][cc];
            q_cat[((u64)(m0 + r) * H + h) * D + c0 + cc] = sum;
        }
        if (blockIdx.x == 0)
            for (int t = threadIdx.x; t < rows * (P >> 1); t += blockDim.x) {
                const int r = t / (P >> 1), i = t % (P >> 1), m = m0 + r;
                float a, b;
                mla_rope_pair(q + (u64)m * H * QD + (u64)h * QD + NOPE, i, P, interleave, (float)positions[m],
                              inv_freq, attn_scaling, a, b);
                float* dst = q_cat + ((u64)m * H + h) * D + R;
                dst[i] = a;
                dst[i + (P >> 1)] = b;
            }
    }
}

// grid (splits, ceil(H / MLA_HG), M), MLA_HG warps, dynamic shared memory MLA_TK * D floats (the tile).
// q_cat f32 [M, H, D]; cache bf16 [max_context, D]; ws_o f32 [M, splits, H, R]; ws_ml f32 [M, splits, H, 2].
// Split s of a row at position pos takes the keys [s * chunk, min(pos + 1, (s + 1) * chunk)), chunk = the row's
// length over the splits rounded up to MLA_TK; a split without keys writes (-inf, 0, 0).
extern "C" __global__ void __launch_bounds__(MLA_HG * 32)
mla_attend_kernel(const float* __restrict__ q_cat, const unsigned short* __restrict__ cache,
                  const int* __restrict__ positions, int H, int R, int P, int splits, float scale,
                  float* __restrict__ ws_o, float* __restrict__ ws_ml) {
    extern __shared__ __align__(16) float lat[];  // [MLA_TK][D]
    const int D = R + P, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int s = blockIdx.x, m = blockIdx.z, h = blockIdx.y * MLA_HG + warp;
    pdl_wait();
    pdl_trigger();
    const int len = positions[m] + 1;
    int chunk = (len + splits - 1) / splits;
    chunk = (chunk + MLA_TK - 1) / MLA_TK * MLA_TK;
    const int k0 = s * chunk, k1 = min(len, k0 + chunk);
    float qr[MLA_MAX_D / 32];  // the warp's head: lane l holds q_cat dims l, l + 32, ...
#pragma unroll
    for (int i = 0; i < MLA_MAX_D / 32; ++i) {
        const int c = lane + 32 * i;
        qr[i] = h < H && c < D ? q_cat[((u64)m * H + h) * D + c] : 0.0f;
    }
    float mx = -METRALE_INF, l = 0.0f;
    float acc[MLA_MAX_R / 32];
#pragma unroll
    for (int i = 0; i < MLA_MAX_R / 32; ++i) acc[i] = 0.0f;
    // A tile is MLA_TK rows of D / 8 16-byte chunks; thread t holds chunks t, t + blockDim.x, ... in registers: the
    // next tile's loads are in flight while the block computes on this one.
    const int D8 = D >> 3, n8 = MLA_TK * D8;
    uint4 pre[MLA_LOADS];
    auto fetch = [&](int t0) {
#pragma unroll
        for (int i = 0; i < MLA_LOADS; ++i) {
            const int t = threadIdx.x + i * MLA_HG * 32, key = t0 + t / D8;
            pre[i] = t < n8 && key < k1 ? *reinterpret_cast<const uint4*>(cache + (u64)key * D + (t % D8) * 8)
                                        : make_uint4(0u, 0u, 0u, 0u);
        }
    };
    if (k0 < k1) fetch(k0);
    for (int t0 = k0; t0 < k1; t0 += MLA_TK) {
        __syncthreads();  // the previous tile is no longer read
#pragma unroll
        for (int i = 0; i < MLA_LOADS; ++i) {
            const int t = threadIdx.x + i * MLA_HG * 32;
            if (t < n8) {
                float4* dst = reinterpret_cast<float4*>(lat + (t / D8) * D + (t % D8) * 8);  // 32-byte aligned
                const uint4 w = pre[i];
                dst[0] = make_float4(bf16_lo(w.x), bf16_hi(w.x), bf16_lo(w.y), bf16_hi(w.y));
                dst[1] = make_float4(bf16_lo(w.z), bf16_hi(w.z), bf16_lo(w.w), bf16_hi(w.w));
            }
        }
        __syncthreads();
        if (t0 + MLA_TK < k1) fetch(t0 + MLA_TK);
        float sc[MLA_TK];
        float tmax = -METRALE_INF;
#pragma unroll
        for (int j = 0; j < MLA_TK; ++j) {
            float d = 0.0f;
#pragma unroll
            for (int i = 0; i < MLA_MAX_D / 32; ++i) {
                const int c = lane + 32 * i;
                if (c >= D) break;
                d = fmaf(qr[i], lat[j * D + c], d);
            }
            d = warp_sum(d) * scale;
            sc[j] = t0 + j < k1 ? d : -METRALE_INF;
            tmax = fmaxf(tmax, sc[j]);
        }
        const float mnew = fmaxf(mx, tmax);
        const float alpha = expf(mx - mnew);  // 0 on the first tile (mx = -inf)
        float psum = 0.0f;
#pragma unroll
        for (int j = 0; j < MLA_TK; ++j) {
            sc[j] = expf(sc[j] - mnew);  // 0 past the split's end
            psum += sc[j];
        }
        l = l * alpha + psum;
#pragma unroll
        for (int i = 0; i < MLA_MAX_R / 32; ++i) {
            const int c = lane + 32 * i;
            if (c >= R) break;
            float a = acc[i] * alpha;
#pragma unroll
            for (int j = 0; j < MLA_TK; ++j) a = fmaf(sc[j], lat[j * D + c], a);
            acc[i] = a;
        }
        mx = mnew;
    }
    if (h >= H) return;
    const u64 base = ((u64)m * splits + s) * H + h;
#pragma unroll
    for (int i = 0; i < MLA_MAX_R / 32; ++i) {
        const int c = lane + 32 * i;
        if (c < R) ws_o[base * R + c] = acc[i];
    }
    if (lane == 0) {
        ws_ml[base * 2] = mx;
        ws_ml[base * 2 + 1] = l;
    }
}

// grid (H, ceil(V / MLA_OUT_V), M), MLA_OUT_THREADS threads.  out f32 [M, H * V]: row m, head h, value dims
// [v0, v0 + MLA_OUT_V) = W_v o_lat / sum, the splits combined in order (each block of the head combines them: the
// splits' weights once, then per latent dim one pass over the splits' partials);
// W_v of head h: kv_b rows h (NOPE + V) + NOPE .. + V - 1 (R a multiple of 8: 16-byte chunks); warp w computes
// MLA_OUT_V / 4 outputs together, every chunk of their rows in flight at once.
extern "C" __global__ void __launch_bounds__(MLA_OUT_THREADS)
mla_out_kernel(const float* __restrict__ ws_o, const float* __restrict__ ws_ml, int H, int R, int NOPE, int V,
               int splits, const unsigned short* __restrict__ kv_b, float* __restrict__ out) {
    __shared__ __align__(16) float o_lat[MLA_MAX_R];
    constexpr int PER = MLA_OUT_V / (MLA_OUT_THREADS / 32);
    const int h = blockIdx.x, m = blockIdx.z, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int vw = blockIdx.y * MLA_OUT_V + warp * PER;  // this warp's first output
    pdl_wait();
    pdl_trigger();
    const u64 base = (u64)m * splits * H + h;  // split s: base + s * H
    // split s's weight exp(max_s - max) / sum_s' exp(max_s' - max) sum_s', once per block (thread s: split s)
    __shared__ float weight[MLA_MAX_SPLITS], scratch[32];
    const int s0 = threadIdx.x;
    const float ms = s0 < splits ? ws_ml[(base + (u64)s0 * H) * 2] : -METRALE_INF;
    const float gmax = block_max(ms, scratch);
    const float e = ms == -METRALE_INF ? 0.0f : expf(ms - gmax);  // a split without keys weighs 0
    const float total = block_sum(s0 < splits ? e * ws_ml[(base + (u64)s0 * H) * 2 + 1] : 0.0f, scratch);
    if (s0 < splits) weight[s0] = e / total;
    __syncthreads();
    for (int c = threadIdx.x; c < R; c += blockDim.x) {
        float o = 0.0f;
#pragma unroll 8
        for (int s = 0; s < splits; ++s) o = fmaf(weight[s], ws_o[(base + (u64)s * H) * R + c], o);
        o_lat[c] = o;
    }
    __syncthreads();
    const unsigned short* wv = kv_b + ((u64)h * (NOPE + V) + NOPE) * R;
    const float4* o4 = reinterpret_cast<const float4*>(o_lat);
    float acc[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) acc[j] = 0.0f;
    for (int c8 = lane; c8 < (R >> 3); c8 += 32) {
        const float4 xa = o4[2 * c8], xb = o4[2 * c8 + 1];
        uint4 w[PER];
#pragma unroll
        for (int j = 0; j < PER; ++j)
            w[j] = vw + j < V ? *reinterpret_cast<const uint4*>(wv + (u64)(vw + j) * R + c8 * 8)
                              : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int j = 0; j < PER; ++j) acc[j] = dot8_bf16(w[j], xa, xb, acc[j]);
    }
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const float d = warp_sum(acc[j]);
        if (lane == 0 && vw + j < V) out[(u64)m * H * V + (u64)h * V + vw + j] = d;
    }
}
