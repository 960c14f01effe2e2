// Attention over the bf16 KV cache.
//
// KV-cache layout (per layer): bf16 [n_kv_heads, max_ctx, head_dim]; key/value j
// of KV head h is at ((h * max_ctx) + j) * head_dim.  The engine may keep one
// buffer per layer or one [layers, n_kv, max_ctx, head_dim] buffer and pass the
// contiguous per-layer view cache[layer].
// Queries/outputs: float32 [rows, n_heads, head_dim]; grouped-query attention
// with group G = n_heads / n_kv: query head h reads KV head h / G.
// Softmax runs in base 2: the caller's `qscale` is scale * log2(e), so
// exp2(q.k * qscale - max) == exp(q.k * scale - max').
#include "common.cu"

#define ATTN_WARPS 4

// ---------------------------------------------------------------------------
// Decode / verify: flash-decoding.  Launch 1 (split kernel): grid (n_kv,
// n_splits, ceil(M*G / QB)); block ATTN_WARPS warps.  Each block takes one KV
// head, one contiguous slice of the context and QB of that head's M*G query
// vectors; its warps take interleaved groups of KB keys, keep an online-softmax
// state per query in registers (lanes split head_dim), merge the warps through
// shared memory and write the unnormalised partial (max, sum, acc) to scratch.
// Launch 2 (combine kernel) merges the splits.  The context length
// L = max(positions) + 1 is read on the device, and so is the slice size
// (decode_chunk), so one captured graph serves every step; splits that start
// at or after L return at once.
// ---------------------------------------------------------------------------

__device__ __forceinline__ int decode_len(const int* __restrict__ positions, int M, int max_ctx) {
    int L = 0;
    for (int m = 0; m < M; ++m) L = max(L, min(positions[m], max_ctx - 1) + 1);
    return L;  // 0 when every position is negative
}

// Keys per split for context length L: ceil(L / n_splits) rounded up to 32.
__device__ __forceinline__ int decode_chunk(int L, int n_splits) {
    const int c = (L + n_splits - 1) / n_splits;
    return max(32, (c + 31) & ~31);
}

// E consecutive bf16 values held as raw bits (E = 1, 2, 4, 8).
template <int E>
struct Bf16Vec {
    unsigned int w[(E + 1) / 2];
    __device__ __forceinline__ void load(const unsigned short* p) {
        if constexpr (E == 1) {
            w[0] = *p;
        } else if constexpr (E == 2) {
            w[0] = *reinterpret_cast<const unsigned int*>(p);
        } else if constexpr (E == 4) {
            const uint2 t = *reinterpret_cast<const uint2*>(p);
            w[0] = t.x;
            w[1] = t.y;
        } else {
            const uint4 t = *reinterpret_cast<const uint4*>(p);
            w[0] = t.x;
            w[1] = t.y;
            w[2] = t.z;
            w[3] = t.w;
        }
    }
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < (E + 1) / 2; ++i) w[i] = 0u;
    }
    __device__ __forceinline__ float get(int e) const {
        return (e & 1) ? bf16_hi(w[e >> 1]) : bf16_lo(w[e >> 1]);
    }
};

template <int HD, int QB, int KB>
__global__ void __launch_bounds__(ATTN_WARPS * 32)
attn_decode_split_kernel(const float* __restrict__ q, const unsigned short* __restrict__ k_cache,
                         const unsigned short* __restrict__ v_cache,
                         const int* __restrict__ positions, float* __restrict__ part_acc,
                         float* __restrict__ part_ml, int M, int n_heads, int n_kv, int max_ctx,
                         int n_splits, float qscale) {
    constexpr int E = HD / 32;  // head_dim elements per lane
    __shared__ float s_acc[ATTN_WARPS][QB][HD];
    __shared__ float s_ml[ATTN_WARPS][QB][2];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int hk = blockIdx.x, split = blockIdx.y;
    const int G = n_heads / n_kv;
    const int QT = M * n_heads;
    const int L = decode_len(positions, M, max_ctx);
    const int chunk = decode_chunk(L, n_splits);
    const int start = split * chunk;
    if (start >= L) return;  // the same for the whole block
    const int end = min(L, start + chunk);

    float qr[QB][E];
    int lim[QB];
#pragma unroll
    for (int qb = 0; qb < QB; ++qb) {
        const int qi = blockIdx.z * QB + qb;
        if (qi < M * G) {
            const int m = qi / G, g = qi - m * G;
            lim[qb] = min(positions[m], max_ctx - 1);
            const float* qp = q + ((u64)m * n_heads + hk * G + g) * HD + lane * E;
#pragma unroll
            for (int e = 0; e < E; ++e) qr[qb][e] = qp[e] * qscale;
        } else {
            lim[qb] = -1;
#pragma unroll
            for (int e = 0; e < E; ++e) qr[qb][e] = 0.0f;
        }
    }

    float mx[QB], l[QB], acc[QB][E];
#pragma unroll
    for (int qb = 0; qb < QB; ++qb) {
        mx[qb] = -METRALE_INF;
        l[qb] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[qb][e] = 0.0f;
    }

    const unsigned short* kbase = k_cache + (u64)hk * max_ctx * HD + lane * E;
    const unsigned short* vbase = v_cache + (u64)hk * max_ctx * HD + lane * E;

    for (int j0 = start + warp * KB; j0 < end; j0 += ATTN_WARPS * KB) {
        Bf16Vec<E> kv[KB], vv[KB];
#pragma unroll
        for (int kk = 0; kk < KB; ++kk) {
            const int j = j0 + kk;
            if (j < end) {
                kv[kk].load(kbase + (u64)j * HD);
                vv[kk].load(vbase + (u64)j * HD);
            } else {
                kv[kk].zero();
                vv[kk].zero();
            }
        }
#pragma unroll
        for (int qb = 0; qb < QB; ++qb) {
            float s[KB];
#pragma unroll
            for (int kk = 0; kk < KB; ++kk) {
                float d = 0.0f;
#pragma unroll
                for (int e = 0; e < E; ++e) d = fmaf(qr[qb][e], kv[kk].get(e), d);
                s[kk] = d;
            }
#pragma unroll
            for (int kk = 0; kk < KB; ++kk) s[kk] = warp_sum(s[kk]);
            float bm = mx[qb];
#pragma unroll
            for (int kk = 0; kk < KB; ++kk) {
                const int j = j0 + kk;
                if (j >= end || j > lim[qb]) s[kk] = -METRALE_INF;
                bm = fmaxf(bm, s[kk]);
            }
            if (bm == -METRALE_INF) continue;  // no valid key yet (same in every lane)
            const float corr = exp2f(mx[qb] - bm);
            float psum = 0.0f;
#pragma unroll
            for (int kk = 0; kk < KB; ++kk) {
                s[kk] = exp2f(s[kk] - bm);
                psum += s[kk];
            }
            l[qb] = fmaf(l[qb], corr, psum);
#pragma unroll
            for (int e = 0; e < E; ++e) {
                float a = acc[qb][e] * corr;
#pragma unroll
                for (int kk = 0; kk < KB; ++kk) a = fmaf(s[kk], vv[kk].get(e), a);
                acc[qb][e] = a;
            }
            mx[qb] = bm;
        }
    }

    // Merge the warps of the block.
#pragma unroll
    for (int qb = 0; qb < QB; ++qb) {
#pragma unroll
        for (int e = 0; e < E; ++e) s_acc[warp][qb][lane * E + e] = acc[qb][e];
        if (lane == 0) {
            s_ml[warp][qb][0] = mx[qb];
            s_ml[warp][qb][1] = l[qb];
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < QB * HD; idx += blockDim.x) {
        const int qb = idx / HD, d = idx - qb * HD;
        const int qi = blockIdx.z * QB + qb;
        if (qi >= M * G) continue;
        float gm = -METRALE_INF;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; ++w) gm = fmaxf(gm, s_ml[w][qb][0]);
        float a = 0.0f, lsum = 0.0f;
        if (gm != -METRALE_INF) {
#pragma unroll
            for (int w = 0; w < ATTN_WARPS; ++w) {
                const float f = exp2f(s_ml[w][qb][0] - gm);  // 0 for warps without keys
                a = fmaf(s_acc[w][qb][d], f, a);
                lsum = fmaf(s_ml[w][qb][1], f, lsum);
            }
        }
        const int m = qi / G, g = qi - m * G;
        const u64 slot = (u64)split * QT + (u64)m * n_heads + hk * G + g;
        part_acc[slot * HD + d] = a;
        if (d == 0) {
            part_ml[slot * 2] = gm;
            part_ml[slot * 2 + 1] = lsum;
        }
    }
}

// Merge the splits: one block per (row, head), threads over head_dim (blockDim.x a
// multiple of 32).  The global max over the splits is reduced in parallel (thread t
// reads splits t, t + blockDim.x, ...); then each thread accumulates its dims over the
// splits with no branch around the loads, so that the unrolled loop keeps several
// independent loads in flight (the loop used to walk the splits with a load inside a
// branch, one L2 round trip after another).  A split that saw no key of this row has
// (max, sum, acc) = (-inf, 0, 0) and gets weight 0.
extern "C" __global__ void attn_decode_combine_kernel(const float* __restrict__ part_acc,
                                                      const float* __restrict__ part_ml,
                                                      const int* __restrict__ positions,
                                                      float* __restrict__ out, int M, int n_heads,
                                                      int HD, int max_ctx, int n_splits) {
    __shared__ float s_max[32];
    const int qt = blockIdx.x;
    const int QT = M * n_heads;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int L = decode_len(positions, M, max_ctx);
    const int chunk = decode_chunk(L, n_splits);
    const int nact = (L + chunk - 1) / chunk;  // splits that wrote a partial (<= n_splits)
    float gm = -METRALE_INF;
    for (int s = threadIdx.x; s < nact; s += blockDim.x) {
        const u64 slot = (u64)s * QT + qt;
        const float mx = part_ml[slot * 2], ls = part_ml[slot * 2 + 1];
        if (ls > 0.0f) gm = fmaxf(gm, mx);
    }
    gm = warp_max(gm);
    if (lane == 0) s_max[warp] = gm;
    __syncthreads();
    gm = (lane < (int)(blockDim.x >> 5)) ? s_max[lane] : -METRALE_INF;
    gm = warp_max(gm);
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float a = 0.0f, lsum = 0.0f;
#pragma unroll 8
        for (int s = 0; s < nact; ++s) {
            const u64 slot = (u64)s * QT + qt;
            const float mx = part_ml[slot * 2], ls = part_ml[slot * 2 + 1];
            const float pa = part_acc[slot * HD + d];
            const float f = (ls > 0.0f) ? exp2f(mx - gm) : 0.0f;
            a = fmaf(pa, f, a);
            lsum = fmaf(ls, f, lsum);
        }
        out[(u64)qt * HD + d] = a / lsum;  // a row with no key (position < 0) gives NaN
    }
}

// ---------------------------------------------------------------------------
// Prefill: causal attention of a prompt chunk of T rows at positions
// start_pos .. start_pos+T-1 whose K/V are already in the cache.  Flash-attention
// style, fp32 SIMT: a block takes PF_BQ query rows of one head (4 threads per
// row, each holding head_dim/4 interleaved dims of q and of the accumulator),
// walks the keys 0 .. last position of its rows in tiles of PF_BK staged in
// shared memory as float32, with an online softmax.  Grid (ceil(T/PF_BQ),
// n_heads); the longest (last) row blocks are started first.
// ---------------------------------------------------------------------------
#define PF_BQ 64
#define PF_BK 32

template <int HD>
__global__ void __launch_bounds__(PF_BQ * 4)
attn_prefill_kernel(const float* __restrict__ q, const unsigned short* __restrict__ k_cache,
                    const unsigned short* __restrict__ v_cache, float* __restrict__ out, int T,
                    int start_pos, int n_heads, int n_kv, int max_ctx, float qscale) {
    constexpr int NC = HD / 16;  // float4 groups per thread
    constexpr int DPT = NC * 4;  // dims per thread
    constexpr int VPR = HD / 8;  // uint4 (8 bf16) vectors per cache row
    __shared__ __align__(16) float Ks[PF_BK][HD];
    __shared__ __align__(16) float Vs[PF_BK][HD];

    const int tid = threadIdx.x;
    const int ql = tid >> 2, sub = tid & 3;
    const int qblock = gridDim.x - 1 - blockIdx.x;
    const int h = blockIdx.y;
    const int G = n_heads / n_kv;
    const int hk = h / G;
    const int t0 = qblock * PF_BQ;
    const int t = t0 + ql;
    const bool valid = t < T;
    const int tt = valid ? t : T - 1;
    const int qpos = start_pos + tt;
    const int kend = start_pos + min(T, t0 + PF_BQ);  // keys 0 .. kend-1

    float qr[DPT], acc[DPT];
    const float* qp = q + ((u64)tt * n_heads + h) * HD + sub * 4;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        const float4 v = *reinterpret_cast<const float4*>(qp + c * 16);
        qr[c * 4 + 0] = v.x * qscale;
        qr[c * 4 + 1] = v.y * qscale;
        qr[c * 4 + 2] = v.z * qscale;
        qr[c * 4 + 3] = v.w * qscale;
    }
#pragma unroll
    for (int i = 0; i < DPT; ++i) acc[i] = 0.0f;
    float mx = -METRALE_INF, l = 0.0f;

    const unsigned short* kb = k_cache + (u64)hk * max_ctx * HD;
    const unsigned short* vb = v_cache + (u64)hk * max_ctx * HD;

    for (int k0 = 0; k0 < kend; k0 += PF_BK) {
        __syncthreads();  // the previous tile is consumed
        for (int i = tid; i < PF_BK * VPR; i += blockDim.x) {
            const int row = i / VPR, col = (i - row * VPR) * 8;
            uint4 kw = make_uint4(0u, 0u, 0u, 0u), vw = make_uint4(0u, 0u, 0u, 0u);
            if (k0 + row < kend) {
                kw = *reinterpret_cast<const uint4*>(kb + (u64)(k0 + row) * HD + col);
                vw = *reinterpret_cast<const uint4*>(vb + (u64)(k0 + row) * HD + col);
            }
            float4* kd = reinterpret_cast<float4*>(&Ks[row][col]);
            float4* vd = reinterpret_cast<float4*>(&Vs[row][col]);
            kd[0] = make_float4(bf16_lo(kw.x), bf16_hi(kw.x), bf16_lo(kw.y), bf16_hi(kw.y));
            kd[1] = make_float4(bf16_lo(kw.z), bf16_hi(kw.z), bf16_lo(kw.w), bf16_hi(kw.w));
            vd[0] = make_float4(bf16_lo(vw.x), bf16_hi(vw.x), bf16_lo(vw.y), bf16_hi(vw.y));
            vd[1] = make_float4(bf16_lo(vw.z), bf16_hi(vw.z), bf16_lo(vw.w), bf16_hi(vw.w));
        }
        __syncthreads();

        float s[PF_BK];
#pragma unroll
        for (int j = 0; j < PF_BK; ++j) {
            float d = 0.0f;
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                const float4 kk = *reinterpret_cast<const float4*>(&Ks[j][c * 16 + sub * 4]);
                d = fmaf(qr[c * 4 + 0], kk.x, d);
                d = fmaf(qr[c * 4 + 1], kk.y, d);
                d = fmaf(qr[c * 4 + 2], kk.z, d);
                d = fmaf(qr[c * 4 + 3], kk.w, d);
            }
            s[j] = d;
        }
        float bm = mx;
#pragma unroll
        for (int j = 0; j < PF_BK; ++j) {
            s[j] += __shfl_xor_sync(0xffffffffu, s[j], 1);
            s[j] += __shfl_xor_sync(0xffffffffu, s[j], 2);
            if (k0 + j > qpos) s[j] = -METRALE_INF;
            bm = fmaxf(bm, s[j]);
        }
        // bm is finite: key 0 is visible to every row, and the first tile holds it.
        const float corr = exp2f(mx - bm);
        float psum = 0.0f;
#pragma unroll
        for (int j = 0; j < PF_BK; ++j) {
            s[j] = exp2f(s[j] - bm);
            psum += s[j];
        }
        l = fmaf(l, corr, psum);
#pragma unroll
        for (int i = 0; i < DPT; ++i) acc[i] *= corr;
#pragma unroll
        for (int j = 0; j < PF_BK; ++j) {
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                const float4 vv = *reinterpret_cast<const float4*>(&Vs[j][c * 16 + sub * 4]);
                acc[c * 4 + 0] = fmaf(s[j], vv.x, acc[c * 4 + 0]);
                acc[c * 4 + 1] = fmaf(s[j], vv.y, acc[c * 4 + 1]);
                acc[c * 4 + 2] = fmaf(s[j], vv.z, acc[c * 4 + 2]);
                acc[c * 4 + 3] = fmaf(s[j], vv.w, acc[c * 4 + 3]);
            }
        }
        mx = bm;
    }

    if (valid) {
        const float inv = 1.0f / l;
        float* op = out + ((u64)t * n_heads + h) * HD + sub * 4;
#pragma unroll
        for (int c = 0; c < NC; ++c)
            *reinterpret_cast<float4*>(op + c * 16) =
                make_float4(acc[c * 4 + 0] * inv, acc[c * 4 + 1] * inv, acc[c * 4 + 2] * inv,
                            acc[c * 4 + 3] * inv);
    }
}

#ifndef METRALE_NVRTC
#define INST_SPLIT(HD, QB, KB)                                                                 \
    template __global__ void attn_decode_split_kernel<HD, QB, KB>(                              \
        const float*, const unsigned short*, const unsigned short*, const int*, float*, float*, \
        int, int, int, int, int, float);
INST_SPLIT(32, 1, 8)
INST_SPLIT(64, 4, 8)
INST_SPLIT(128, 1, 8)
INST_SPLIT(128, 4, 8)
INST_SPLIT(128, 8, 8)
INST_SPLIT(256, 4, 4)
template __global__ void attn_prefill_kernel<32>(const float*, const unsigned short*, const unsigned short*, float*, int, int, int, int, int, float);
template __global__ void attn_prefill_kernel<64>(const float*, const unsigned short*, const unsigned short*, float*, int, int, int, int, int, float);
template __global__ void attn_prefill_kernel<128>(const float*, const unsigned short*, const unsigned short*, float*, int, int, int, int, int, float);
#endif
