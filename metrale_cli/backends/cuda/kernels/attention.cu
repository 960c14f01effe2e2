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
//
// Sliding window (window > 0): row m sees keys (positions[m] - window, positions[m]]; the split work
// covers only [lo, L) with lo = the first key any row sees (decode_lo), so a long context costs what
// its window costs.  Score softcapping (softcap_l2 > 0, Gemma 2): s = c tanh(s / c) on the natural-log
// scores before the mask, i.e. on the base-2 scores s2 = s log2(e): s2 = c2 tanh(s2 / c2), c2 = c log2(e).
#include "common.cu"

#define ATTN_WARPS 4         // warps per block of the SIMT split kernel (head_dim 256)
#define ATTN_TC_WARPS 4      // warps per block of the tensor-core split kernel
#define ATTN_CHUNK_ALIGN 64  // split sizes are multiples of this (16 keys per warp step x 4 warps)
#define ATTN_SIMT_ALIGN 32   // ... or of this in the SIMT split kernel (8 keys per warp step x 4 warps)
#define ATTN_COMBINE_BATCH 32

// ---------------------------------------------------------------------------
// Decode / verify: flash-decoding in two launches.
//
// Launch 1, split kernel: each block takes one KV head, one contiguous slice
// ("split") of the context and some of that head's M*G query vectors, and
// writes the unnormalised partial (max, sum, acc[head_dim]) of each of its
// query vectors to the workspace:
//     part_acc[split][m * n_heads + h][d], part_ml[split][m * n_heads + h][2].
// The context length L = max(positions) + 1 is read on the device, and so is the
// split size decode_chunk(L, n_splits), so one captured graph serves every step.
// A block whose split starts at or after L writes (max, sum) = (-inf, 0) for its
// query vectors and returns at once (acc left unwritten); a query vector without a
// visible key in a split gets (-inf, 0) and acc 0.
// Launch 2, combine kernel: merges the splits whose sum is not 0.
//
// head_dim 32/64/128: attn_decode_tc_kernel, tensor cores (mma.sync m16n8k16 bf16,
// fp32 accumulation), K and V loaded straight from global memory into the mma
// fragments with 16-byte loads (no shared-memory staging).  head_dim 256: the SIMT
// kernel attn_decode_split_kernel.
// ---------------------------------------------------------------------------

// L = max over rows of min(positions[m], max_ctx - 1) + 1, or 0 when every position is
// negative.  The lanes read the positions in parallel; every lane gets L.  The whole
// warp must call it.
__device__ __forceinline__ int decode_len(const int* __restrict__ positions, int M, int max_ctx) {
    const int lane = threadIdx.x & 31;
    int L = 0;
    for (int m = lane; m < M; m += 32) L = max(L, min(positions[m], max_ctx - 1) + 1);
    return __reduce_max_sync(0xffffffffu, L);
}

// The first key any row sees: 0 without a window, else min over rows of (position - window + 1),
// clamped to >= 0 and rounded down to ATTN_CHUNK_ALIGN (so splits stay aligned).  Rows with a negative
// position are ignored.  The whole warp must call it.
__device__ __forceinline__ int decode_lo(const int* __restrict__ positions, int M, int max_ctx, int window) {
    if (window <= 0) return 0;
    const int lane = threadIdx.x & 31;
    int lo = 0x7fffffff;
    for (int m = lane; m < M; m += 32) {
        const int p = positions[m];
        if (p >= 0) lo = min(lo, min(p, max_ctx - 1) - window + 1);
    }
    lo = __reduce_min_sync(0xffffffffu, lo);
    if (lo == 0x7fffffff) return 0;
    return max(0, lo) & ~(ATTN_CHUNK_ALIGN - 1);
}

// The first key query vector qi's row sees (0 without a window).
__device__ __forceinline__ int decode_first(int p, int max_ctx, int window) {
    return window > 0 ? max(0, min(p, max_ctx - 1) - window + 1) : 0;
}

// The first cache position this launch's rows write (rope_kv_append / the fused qkv GEMV, the kernel before):
// min over rows of min(positions[m], max_ctx - 1), rows with a negative position ignored; INT_MAX when none.
// Every key before it was written by an earlier step, so the split kernels may load it before pdl_wait.  The
// whole warp must call it.
__device__ __forceinline__ int decode_fresh(const int* __restrict__ positions, int M, int max_ctx) {
    const int lane = threadIdx.x & 31;
    int f = 0x7fffffff;
    for (int m = lane; m < M; m += 32) {
        const int p = positions[m];
        if (p >= 0) f = min(f, min(p, max_ctx - 1));
    }
    return __reduce_min_sync(0xffffffffu, f);
}

__device__ __forceinline__ float softcap_l2f(float s, float c2) { return c2 > 0.0f ? c2 * tanhf(s / c2) : s; }

// Keys per split for context length L: ceil(L / n_splits) rounded up to `align` (a power of two dividing
// ATTN_CHUNK_ALIGN): ATTN_CHUNK_ALIGN for the tensor-core kernel (16 keys per warp step x 4 warps); the SIMT
// kernel's ALIGN, down to ATTN_SIMT_ALIGN (KB = 8 keys per warp step x 4 warps), whose shorter splits give more
// blocks per SM at short contexts (it is latency-bound: one warp per scheduler left most issue slots idle).
// The splits that hold keys are 0 .. ceil(L / chunk) - 1.  The combine kernel counts them with the smaller
// alignment: its count is never below the split kernel's, and the extra splits carry (-inf, 0) markers.
__device__ __forceinline__ int decode_chunk(int L, int n_splits, int align = ATTN_CHUNK_ALIGN) {
    const int c = (L + n_splits - 1) / n_splits;
    return max(align, (c + align - 1) & ~(align - 1));
}

// The (max, sum) = (-inf, 0) marker ("no key here") of query vector qi (< M*G) of KV head hk.
__device__ __forceinline__ void decode_mark_empty(float* __restrict__ part_ml, int split, int qi, int G,
                                                  int n_heads, int hk, int QT) {
    const int m = qi / G, gg = qi - m * G;
    const u64 slot = (u64)split * QT + (u64)m * n_heads + hk * G + gg;
    part_ml[slot * 2] = -METRALE_INF;
    part_ml[slot * 2 + 1] = 0.0f;
}

// Dim d of the split partial of query vector qi (< M*G) of KV head hk, from the block's W warps'
// online-softmax states in shared memory: ml[w][r] = (max, sum), acc[w][r][d] (r: the vector's
// index in the block); the (max, sum) are written by the thread of d == 0.
// The block's partial of its query vector r, dim d: returns acc, sets (gm, lsum).
template <int W, typename ML, typename ACC>
__device__ __forceinline__ float decode_block_partial(const ML& ml, const ACC& acc, int r, int d, float& gm,
                                                      float& lsum) {
    gm = -METRALE_INF;
#pragma unroll
    for (int w = 0; w < W; ++w) gm = fmaxf(gm, ml[w][r][0]);
    float a = 0.0f;
    lsum = 0.0f;
    if (gm != -METRALE_INF) {
#pragma unroll
        for (int w = 0; w < W; ++w) {
            const float f = exp2f(ml[w][r][0] - gm);  // 0 for warps without keys
            a = fmaf(acc[w][r][d], f, a);
            lsum = fmaf(ml[w][r][1], f, lsum);
        }
    }
    return a;
}

template <int W, int HD, typename ML, typename ACC>
__device__ __forceinline__ void decode_write_partial(const ML& ml, const ACC& acc, int r, int d, float* part_acc,
                                                     float* part_ml, int split, int qi, int G, int n_heads, int hk,
                                                     int QT) {
    float gm, lsum;
    const float a = decode_block_partial<W>(ml, acc, r, d, gm, lsum);
    const int m = qi / G, gg = qi - m * G;
    const u64 slot = (u64)split * QT + (u64)m * n_heads + hk * G + gg;
    part_acc[slot * HD + d] = a;
    if (d == 0) {
        part_ml[slot * 2] = gm;
        part_ml[slot * 2 + 1] = lsum;
    }
}

// ---------------------------------------------------------------------------
// Tensor-core split kernel (head_dim 32, 64, 128).
//
// Grid (ceil(M*G / (8 NQ)), n_splits, n_kv), ATTN_TC_WARPS warps; a block takes 8 NQ
// query vectors (NQ = 1 or 2 n-tiles of 8): vector r of the block is
// qi = blockIdx.x * 8 NQ + r, i.e. row m = qi / G of head hk * G + qi % G.  Blocks that
// share a KV slice are adjacent in x, so the second one finds it in L2.  The warps take
// interleaved steps of 16 keys of the split.  The mma (m16n8k16, bf16 in, fp32
// accumulate) run transposed, keys (and head dims) as the M dimension and query
// vectors as N, so that no half of an mma is wasted for 8 query vectors.  Per step
// and warp, with lane = 4 g + t:
//   S^T = K Q^T: A = K, B = (q * qscale) split into bf16 hi + lo (two mma; the pair
//     keeps ~16 mantissa bits of q).  Lane (g, t) loads keys g and g + 8 of the step,
//     dims 32 i + 8 t .. +7 (i < HD/32; 16-byte loads, 4 lanes per key), and uses the
//     words as its A fragments: the mma's k index is a permutation of head_dim, and
//     the q fragments are built once with the same permutation (k-step ks, lane t:
//     dims 32 (ks/2) + 8 t + 4 (ks%2) .. +3).  Lane (g, t) then holds the scores of
//     keys g, g + 8 for query vectors 2t, 2t + 1.
//   Online softmax per query vector: max over the 16 keys with 3 shuffles (lanes of
//     the same t); the sums stay per lane until the end.
//   O^T += V^T P^T: A = V^T: lane (g, t) loads keys 2t, 2t+1, 2t+8, 2t+9 of the step
//     at dims (8 i + g) * 8 .. +7 (i < HD/64; head_dim 32: g * 4 .. +3) and pairs the
//     two keys of a dim with a byte permute; row r of m-tile mt is dim
//     ad_vdim(mt, r).  B = P^T (hi + lo as well) needs lane (g, t) to hold keys
//     2t, 2t+1, 2t+8, 2t+9 of query vector g: 8 shuffles of packed bf16 pairs.
// The next step's K is loaded right after q.k and its V right after p.V, so each
// warp keeps one step (8 KiB at head_dim 128) in flight while it computes.  At the
// end the warps merge through shared memory and the block writes its partials.
// ---------------------------------------------------------------------------

// (x0, x1) ~= hi + lo with hi = bf16(x) and lo = bf16(x - hi).
__device__ __forceinline__ void ad_split_bf16x2(float x0, float x1, unsigned& hi, unsigned& lo) {
    hi = pack_bf16x2(x0, x1);
    lo = pack_bf16x2(x0 - bf16_lo(hi), x1 - bf16_hi(hi));
}

// d += A B: A 16x16 bf16 (a0: row g, k 2t..; a1: row g+8; a2: row g, k 2t+8..; a3: row
// g+8, k 2t+8..), B 16x8 bf16 (b0: k 2t, 2t+1, col g; b1: k 2t+8, 2t+9), d 16x8 fp32
// (d0, d1: row g, cols 2t, 2t+1; d2, d3: row g+8).  common.cu's mma_bf16_16816 but asm volatile;
// nvcc 13.0 gives the same sm_90 code with either, but the difference is kept, not merged away.
__device__ __forceinline__ void ad_mma(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                       unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Head dim of row r (0..15) of p.V m-tile mt (see the V loads).
template <int HD>
__device__ __forceinline__ int ad_vdim(int mt, int r) {
    if constexpr (HD >= 64) {
        return ((mt >> 2) * 8 + (r & 7)) * 8 + (mt & 3) * 2 + (r >> 3);
    } else {
        return (r & 7) * 4 + mt * 2 + (r >> 3);
    }
}

// q fragments (hi, lo) of query vector qi for lane t; returns the last key the vector
// may see, min(positions[m], max_ctx - 1); a vector past M*G gets zeros and -1.  ROT (one row): q holds the
// block's G rotated query heads [G][HD] (shared memory, the ROPE prologue) instead of all of them.
template <int HD, bool ROT = false>
__device__ __forceinline__ int ad_load_q(const float* __restrict__ q, const int* __restrict__ positions, int qi,
                                         int MG, int G, int n_heads, int hk, int max_ctx, int t, float qscale,
                                         unsigned (&hi)[HD / 16][2], unsigned (&lo)[HD / 16][2]) {
    if (qi >= MG) {
#pragma unroll
        for (int ks = 0; ks < HD / 16; ++ks) hi[ks][0] = hi[ks][1] = lo[ks][0] = lo[ks][1] = 0u;
        return -1;
    }
    const int m = qi / G, gg = qi - m * G;
    const float* qp = (ROT ? q + gg * HD : q + ((u64)m * n_heads + hk * G + gg) * HD) + 8 * t;
#pragma unroll
    for (int ks = 0; ks < HD / 16; ++ks) {
        const int b = 32 * (ks >> 1) + 4 * (ks & 1);
        ad_split_bf16x2(qp[b] * qscale, qp[b + 1] * qscale, hi[ks][0], lo[ks][0]);
        ad_split_bf16x2(qp[b + 2] * qscale, qp[b + 3] * qscale, hi[ks][1], lo[ks][1]);
    }
    return min(positions[m], max_ctx - 1);
}

// EXT: the window / softcap code is compiled in (instances without it keep the registers of the
// plain kernel: at head_dim 128, NQ 2 the extra state would spill).
// ROPE (engine path "fused", one row, NQ 1, G <= 8): rope_kv_append_kernel's work moves in here.  q is then the
// qkv projection [1, (n_heads + 2 n_kv) head_dim], unrotated: each block rotates (and q-norms) its G query heads
// into shared memory, and the block whose split holds the row's position rotates its KV head's k and appends
// k and v to the cache (rope_kv_slot, through k_app / v_app: the caches again) before it reads that key.  The
// rope arguments are rope_kv_append's; the other instances ignore them.
template <int HD, int NQ, bool EXT, bool ROPE>
__global__ void __launch_bounds__(ATTN_TC_WARPS * 32, NQ == 1 ? 3 : 2)
attn_decode_tc_kernel(const float* __restrict__ q, const unsigned short* __restrict__ k_cache,
                      const unsigned short* __restrict__ v_cache, const int* __restrict__ positions,
                      float* __restrict__ part_acc, float* __restrict__ part_ml, int M, int n_heads, int n_kv,
                      int max_ctx, int n_splits, float qscale, int window, float softcap_l2,
                      const float* __restrict__ inv_freq,
                      const unsigned short* __restrict__ q_norm, const unsigned short* __restrict__ k_norm,
                      unsigned short* k_app, unsigned short* v_app, float rope_eps, int has_q_norm, int has_k_norm,
                      float attn_scaling, float norm_offset, int rot_dim) {
    static_assert(!ROPE || NQ == 1, "rope in the split kernel: one row, 8 query vectors");
    static_assert(HD == 32 || HD == 64 || HD == 128, "tensor-core decode: head_dim 32, 64 or 128");
    static_assert(NQ == 1 || NQ == 2, "8 or 16 query vectors per block");
    constexpr int W = ATTN_TC_WARPS;
    constexpr int ROWS = 8 * NQ;
    constexpr int NKS = HD / 16;  // q.k k-steps (16 dims each)
    constexpr int KI = HD / 32;   // 16-byte K loads per lane per key
    constexpr int NMT = HD / 16;  // p.V m-tiles (16 dims each)
    constexpr int VW = HD / 16;   // 32-bit V words per lane per key (= NMT)
    __shared__ float s_o[W][ROWS][HD + 1];  // +1: the fragment-order stores hit distinct banks
    __shared__ float s_ml[W][ROWS][2];
    __shared__ float s_q[ROPE ? ROWS : 1][ROPE ? HD : 1];  // ROPE: the block's rotated query heads

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int r0 = blockIdx.x * ROWS, split = blockIdx.y, hk = blockIdx.z;
    const int G = n_heads / n_kv, MG = M * G, QT = M * n_heads;

    // Before pdl_wait, only what no kernel of this step writes: the positions (copied from the host before the
    // step) and the cached keys before decode_fresh (earlier steps'), so that each warp's first keys are in flight
    // while the kernel before (rope + KV append, or the fused qkv GEMV) drains.
    const int L = decode_len(positions, M, max_ctx);
    const int lo = EXT ? decode_lo(positions, M, max_ctx, window) : 0;
    const int chunk = decode_chunk(L - lo, n_splits);
    const int start = lo + split * chunk;
    if (start >= L) {  // the same for the whole block
        pdl_wait();
        pdl_trigger();
        if (threadIdx.x < ROWS && r0 + (int)threadIdx.x < MG) {
            decode_mark_empty(part_ml, split, r0 + threadIdx.x, G, n_heads, hk, QT);
        }
        return;
    }
    const int end = min(L, start + chunk);
    const int fresh = decode_fresh(positions, M, max_ctx);
    const unsigned short* kh = k_cache + (u64)hk * max_ctx * HD;
    const unsigned short* vh = v_cache + (u64)hk * max_ctx * HD;
    unsigned kr[2][4 * KI];  // [key g, g + 8][word 4 i + w = dims 32 i + 8 t + 2 w, +1]
    unsigned vr[4][VW];      // [key 2t, 2t+1, 2t+8, 2t+9][word]
    auto load_k = [&](int j0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j = j0 + g + 8 * h;
            const unsigned short* p = kh + (u64)j * HD + 8 * t;
#pragma unroll
            for (int i = 0; i < KI; ++i) {
                uint4 x = make_uint4(0u, 0u, 0u, 0u);
                if (j < end) x = __ldcg(reinterpret_cast<const uint4*>(p + 32 * i));  // L2: see pdl_wait below
                kr[h][4 * i + 0] = x.x;
                kr[h][4 * i + 1] = x.y;
                kr[h][4 * i + 2] = x.z;
                kr[h][4 * i + 3] = x.w;
            }
        }
    };
    auto load_v = [&](int j0) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int j = j0 + 2 * t + (c & 1) + 8 * (c >> 1);
            if constexpr (HD >= 64) {
                const unsigned short* p = vh + (u64)j * HD + 8 * g;
#pragma unroll
                for (int i = 0; i < HD / 64; ++i) {
                    uint4 x = make_uint4(0u, 0u, 0u, 0u);
                    if (j < end) x = __ldcg(reinterpret_cast<const uint4*>(p + 64 * i));
                    vr[c][4 * i + 0] = x.x;
                    vr[c][4 * i + 1] = x.y;
                    vr[c][4 * i + 2] = x.z;
                    vr[c][4 * i + 3] = x.w;
                }
            } else {
                uint2 x = make_uint2(0u, 0u);
                if (j < end) x = __ldcg(reinterpret_cast<const uint2*>(vh + (u64)j * HD + 4 * g));
                vr[c][0] = x.x;
                vr[c][1] = x.y;
            }
        }
    };

    const int nsteps = (end - start + 15) >> 4;
    int step = warp;
    // This warp's first keys before the wait unless they hold one the kernel before writes (K and V are read
    // through L2 (ld.cg) everywhere: nothing stale can sit in this SM's L1).  Its values after the q fragments
    // (held across them, they would spill at head_dim 128).
    const bool early = step < nsteps && start + 16 * step + 16 <= fresh;
    if (early) load_k(start + 16 * step);
    pdl_wait();  // q and this step's own keys come from the kernel before
    pdl_trigger();
    if constexpr (ROPE) {  // warps take the G query heads, then (the split holding the position) k and v
        const int p = positions[0];
        const int items = G + (start <= fresh && fresh < end ? 2 : 0);
        for (int i = warp; i < items; i += W) {
            if (i < G) {
                rope_head_to(q + (u64)(hk * G + i) * HD, &s_q[i][0], inv_freq, q_norm, has_q_norm, p, HD, rope_eps,
                             attn_scaling, norm_offset, rot_dim, lane);
            } else {
                const int sl = i == G ? n_heads + hk : n_heads + n_kv + hk;
                rope_kv_slot(q + (u64)sl * HD, 0, sl, positions, inv_freq, q_norm, k_norm, nullptr, k_app, v_app,
                             n_heads, n_kv, HD, max_ctx, rope_eps, has_q_norm, has_k_norm, attn_scaling, norm_offset,
                             rot_dim, lane);
            }
        }
        __syncthreads();  // s_q, and the appended key and value, for the whole block
    }
    if (step < nsteps && !early) load_k(start + 16 * step);

    // q of query vector 8 nq + g (B fragments); last key of query vectors 8 nq + 2t + e
    unsigned qh[NQ][NKS][2], ql[NQ][NKS][2];
    int last[NQ][2], first[EXT ? NQ : 1][2];
#pragma unroll
    for (int nq = 0; nq < NQ; ++nq) {
        ad_load_q<HD, ROPE>(ROPE ? &s_q[0][0] : q, positions, r0 + 8 * nq + g, MG, G, n_heads, hk, max_ctx, t, qscale,
                            qh[nq], ql[nq]);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int qi = r0 + 8 * nq + 2 * t + e;
            last[nq][e] = (qi < MG) ? min(min(positions[qi / G], max_ctx - 1), end - 1) : -1;
            if constexpr (EXT) first[nq][e] = (qi < MG) ? decode_first(positions[qi / G], max_ctx, window) : 0;
        }
    }

    float o[NQ][NMT][4];  // O^T: [m-tile][rows g, g (q 2t+1), g+8, g+8 (q 2t+1)]
    float mrow[NQ][2], lrow[NQ][2];
#pragma unroll
    for (int nq = 0; nq < NQ; ++nq) {
#pragma unroll
        for (int mt = 0; mt < NMT; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[nq][mt][e] = 0.0f;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            mrow[nq][e] = -METRALE_INF;
            lrow[nq][e] = 0.0f;
        }
    }

    if (step < nsteps) load_v(start + 16 * step);
    const unsigned sel = (g & 1) ? 0x7632u : 0x5410u;  // query vector g: odd -> high halves
    const int src0 = 8 * t + (g >> 1), src1 = src0 + 4;  // lanes holding keys 2t (2t+8), 2t+1 (2t+9)
#pragma unroll 1
    for (; step < nsteps; step += W) {
        const int j0 = start + 16 * step;
        const int jn = j0 + 16 * W;
        const bool more = step + W < nsteps;

        // ---- S^T = K (q * qscale)^T: hi and lo chains, even and odd k-steps kept apart
        float s[NQ][4];
        {
            float d[NQ][4][4];
#pragma unroll
            for (int nq = 0; nq < NQ; ++nq)
#pragma unroll
                for (int c = 0; c < 4; ++c)
#pragma unroll
                    for (int e = 0; e < 4; ++e) d[nq][c][e] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < NKS; ++ks) {
                const unsigned a0 = kr[0][2 * ks], a1 = kr[1][2 * ks];
                const unsigned a2 = kr[0][2 * ks + 1], a3 = kr[1][2 * ks + 1];
#pragma unroll
                for (int nq = 0; nq < NQ; ++nq) {
                    ad_mma(d[nq][(ks & 1) * 2 + 0], a0, a1, a2, a3, qh[nq][ks][0], qh[nq][ks][1]);
                    ad_mma(d[nq][(ks & 1) * 2 + 1], a0, a1, a2, a3, ql[nq][ks][0], ql[nq][ks][1]);
                }
            }
#pragma unroll
            for (int nq = 0; nq < NQ; ++nq)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    s[nq][e] = (d[nq][0][e] + d[nq][2][e]) + (d[nq][1][e] + d[nq][3][e]);
            if constexpr (EXT)
#pragma unroll
                for (int nq = 0; nq < NQ; ++nq)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[nq][e] = softcap_l2f(s[nq][e], softcap_l2);
        }
        if (more) load_k(jn);  // the K registers are free: fetch the next step's keys now

        // ---- online softmax per query vector; keys past its last key (or the split) get -inf.
        // s[nq][2h + e]: key j0 + g + 8h, query vector 8 nq + 2t + e.
        unsigned bh[NQ][2], bl[NQ][2];  // P^T B fragments (hi, lo)
#pragma unroll
        for (int nq = 0; nq < NQ; ++nq) {
            float p[4];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float s0 = (j0 + g <= last[nq][e]) ? s[nq][e] : -METRALE_INF;
                float s1 = (j0 + g + 8 <= last[nq][e]) ? s[nq][2 + e] : -METRALE_INF;
                if constexpr (EXT) {
                    if (j0 + g < first[nq][e]) s0 = -METRALE_INF;
                    if (j0 + g + 8 < first[nq][e]) s1 = -METRALE_INF;
                }
                float mx = fmaxf(s0, s1);
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
                const float mn = fmaxf(mrow[nq][e], mx);
                const float mu = (mn == -METRALE_INF) ? 0.0f : mn;  // no key yet: p, corr = 0
                const float corr = exp2f(mrow[nq][e] - mu);
                p[e] = exp2f(s0 - mu);
                p[2 + e] = exp2f(s1 - mu);
                lrow[nq][e] = fmaf(lrow[nq][e], corr, p[e] + p[2 + e]);
                mrow[nq][e] = mn;
#pragma unroll
                for (int mt = 0; mt < NMT; ++mt) {
                    o[nq][mt][e] *= corr;
                    o[nq][mt][2 + e] *= corr;
                }
            }
            // pack (query 2t, 2t+1) pairs of keys g and g+8, then gather keys 2t, 2t+1, 2t+8,
            // 2t+9 of query vector g from lanes src0 (keys 2t, 2t+8) and src1 (2t+1, 2t+9)
            unsigned wh0, wl0, wh1, wl1;
            ad_split_bf16x2(p[0], p[1], wh0, wl0);  // key g
            ad_split_bf16x2(p[2], p[3], wh1, wl1);  // key g + 8
            const unsigned xh0 = __shfl_sync(0xffffffffu, wh0, src0), xh1 = __shfl_sync(0xffffffffu, wh0, src1);
            const unsigned yh0 = __shfl_sync(0xffffffffu, wh1, src0), yh1 = __shfl_sync(0xffffffffu, wh1, src1);
            const unsigned xl0 = __shfl_sync(0xffffffffu, wl0, src0), xl1 = __shfl_sync(0xffffffffu, wl0, src1);
            const unsigned yl0 = __shfl_sync(0xffffffffu, wl1, src0), yl1 = __shfl_sync(0xffffffffu, wl1, src1);
            bh[nq][0] = __byte_perm(xh0, xh1, sel);
            bh[nq][1] = __byte_perm(yh0, yh1, sel);
            bl[nq][0] = __byte_perm(xl0, xl1, sel);
            bl[nq][1] = __byte_perm(yl0, yl1, sel);
        }

        // ---- O^T += V^T P^T
#pragma unroll
        for (int mt = 0; mt < NMT; ++mt) {
            const unsigned a0 = __byte_perm(vr[0][mt], vr[1][mt], 0x5410u);  // dim row g, keys 2t, 2t+1
            const unsigned a1 = __byte_perm(vr[0][mt], vr[1][mt], 0x7632u);  // dim row g+8
            const unsigned a2 = __byte_perm(vr[2][mt], vr[3][mt], 0x5410u);  // keys 2t+8, 2t+9
            const unsigned a3 = __byte_perm(vr[2][mt], vr[3][mt], 0x7632u);
#pragma unroll
            for (int nq = 0; nq < NQ; ++nq) {
                ad_mma(o[nq][mt], a0, a1, a2, a3, bh[nq][0], bh[nq][1]);
                ad_mma(o[nq][mt], a0, a1, a2, a3, bl[nq][0], bl[nq][1]);
            }
        }
        if (more) load_v(jn);
    }

    // ---- merge the warps of the block through shared memory
#pragma unroll
    for (int nq = 0; nq < NQ; ++nq) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            float l = lrow[nq][e];
            l += __shfl_xor_sync(0xffffffffu, l, 4);
            l += __shfl_xor_sync(0xffffffffu, l, 8);
            l += __shfl_xor_sync(0xffffffffu, l, 16);
            const int r = 8 * nq + 2 * t + e;
            if (g == 0) {
                s_ml[warp][r][0] = mrow[nq][e];
                s_ml[warp][r][1] = l;
            }
#pragma unroll
            for (int mt = 0; mt < NMT; ++mt) {
                s_o[warp][r][ad_vdim<HD>(mt, g)] = o[nq][mt][e];
                s_o[warp][r][ad_vdim<HD>(mt, g + 8)] = o[nq][mt][2 + e];
            }
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < ROWS * HD; idx += W * 32) {
        const int r = idx / HD, d = idx - r * HD;
        const int qi = r0 + r;
        if (qi >= MG) break;  // idx only grows: every later qi is past M*G too
        decode_write_partial<W, HD>(s_ml, s_o, r, d, part_acc, part_ml, split, qi, G, n_heads, hk, QT);
    }
}

// ---------------------------------------------------------------------------
// SIMT split kernel (head_dim 96 and 256; any head_dim of 32 E, E in 1, 2, 3, 4, 8; 96 runs as 24 x 4).
// Grid (n_kv, n_splits, ceil(M*G / QB)); block ATTN_WARPS warps.  Each block takes
// one KV head, one split and QB of that head's M*G query vectors; its warps take
// interleaved groups of KB keys, keep an online-softmax state per query in
// registers (lanes split head_dim), merge the warps through shared memory and write
// the partials as described above.
// ---------------------------------------------------------------------------

// E consecutive bf16 values held as raw bits (E = 1, 2, 3, 4, 8; 3: head_dim 96, 2-byte aligned).
template <int E>
struct Bf16Vec {
    unsigned int w[(E + 1) / 2];
    __device__ __forceinline__ void load(const unsigned short* p) {
        if constexpr (E == 1) {
            w[0] = *p;
        } else if constexpr (E == 2) {
            w[0] = *reinterpret_cast<const unsigned int*>(p);
        } else if constexpr (E == 3) {
            w[0] = (unsigned int)p[0] | ((unsigned int)p[1] << 16);
            w[1] = p[2];
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

// ALIGN: the split sizes' multiple (decode_chunk), ATTN_SIMT_ALIGN or ATTN_CHUNK_ALIGN (tuning.DECODE_SIMT_SPLITS
// per head_dim: the shorter splits only paid at head_dim 96).
template <int HD, int QB, int KB, int ALIGN>
__global__ void __launch_bounds__(ATTN_WARPS * 32)
attn_decode_split_kernel(const float* __restrict__ q, const unsigned short* __restrict__ k_cache,
                         const unsigned short* __restrict__ v_cache,
                         const int* __restrict__ positions, float* __restrict__ part_acc,
                         float* __restrict__ part_ml, int M, int n_heads, int n_kv, int max_ctx,
                         int n_splits, float qscale, int window, float softcap_l2) {
    // head_dim elements per lane and the lanes that hold them: head_dim 96 on 24 lanes x 4 (8-byte loads;
    // 32 x 3 needed three 2-byte loads per key and lane), else 32 x HD / 32.
    constexpr int E = HD == 96 ? 4 : HD / 32;
    constexpr int LANES = HD / E;
    __shared__ float s_acc[ATTN_WARPS][QB][HD];
    __shared__ float s_ml[ATTN_WARPS][QB][2];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int hk = blockIdx.x, split = blockIdx.y;
    const int G = n_heads / n_kv;
    const int QT = M * n_heads;
    // Before pdl_wait, only what no kernel of this step writes (the positions, copied from the host before the
    // step): the split, and an L2 prefetch of this warp's first KB keys and values (a prefetch holds no register
    // and leaves nothing in L1; a key the kernel before rewrites is read after the wait, coherent in L2).
    const int L = decode_len(positions, M, max_ctx);
    const int lo = decode_lo(positions, M, max_ctx, window);
    static_assert(ALIGN % (ATTN_WARPS * KB) == 0 && ATTN_CHUNK_ALIGN % ALIGN == 0 && ALIGN >= ATTN_SIMT_ALIGN,
                  "SIMT splits: whole warp steps, an alignment the combine kernel's count covers");
    const int chunk = decode_chunk(L - lo, n_splits, ALIGN);
    const int start = lo + split * chunk;
    if (start < L && lane < 2 * KB) {
        const int j = start + warp * KB + lane % KB;
        if (j < min(L, start + chunk)) {
            const char* row = reinterpret_cast<const char*>((lane < KB ? k_cache : v_cache) +
                                                            ((u64)hk * max_ctx + j) * HD);
#pragma unroll
            for (int b = 0; b < HD * 2; b += 128) prefetch_l2(row + b);
        }
    }
    pdl_wait();  // q and this step's own keys come from the kernel before
    pdl_trigger();
    if (start >= L) {  // the same for the whole block
        const int qi = blockIdx.z * QB + threadIdx.x;
        if (threadIdx.x < QB && qi < M * G) {
            decode_mark_empty(part_ml, split, qi, G, n_heads, hk, QT);
        }
        return;
    }
    const int end = min(L, start + chunk);

    float qr[QB][E];
    int lim[QB], first[QB];
#pragma unroll
    for (int qb = 0; qb < QB; ++qb) {
        const int qi = blockIdx.z * QB + qb;
        first[qb] = 0;
        if (qi < M * G) {
            const int m = qi / G, g = qi - m * G;
            lim[qb] = min(positions[m], max_ctx - 1);
            first[qb] = decode_first(positions[m], max_ctx, window);
            const float* qp = q + ((u64)m * n_heads + hk * G + g) * HD + min(lane, LANES - 1) * E;
#pragma unroll
            for (int e = 0; e < E; ++e) qr[qb][e] = lane < LANES ? qp[e] * qscale : 0.0f;  // idle lanes add 0
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

    const unsigned short* kbase = k_cache + (u64)hk * max_ctx * HD + min(lane, LANES - 1) * E;
    const unsigned short* vbase = v_cache + (u64)hk * max_ctx * HD + min(lane, LANES - 1) * E;

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
            for (int kk = 0; kk < KB; ++kk) s[kk] = softcap_l2f(warp_sum(s[kk]), softcap_l2);
            float bm = mx[qb];
#pragma unroll
            for (int kk = 0; kk < KB; ++kk) {
                const int j = j0 + kk;
                if (j >= end || j > lim[qb] || j < first[qb]) s[kk] = -METRALE_INF;
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
        if (lane < LANES) {
#pragma unroll
            for (int e = 0; e < E; ++e) s_acc[warp][qb][lane * E + e] = acc[qb][e];
        }
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
        decode_write_partial<ATTN_WARPS, HD>(s_ml, s_acc, qb, d, part_acc, part_ml, split, qi, G, n_heads, hk, QT);
    }
}

// Merge the splits: one block per (row, head), thread d for dim d (blockDim.x = head_dim,
// a multiple of 32).  Batches of ATTN_COMBINE_BATCH splits: the (max, sum, acc) of a whole
// batch are loaded with independent loads (the first batch before the positions are
// known), then merged with an online rescale.  Splits with sum 0 (no key: the (-inf, 0)
// marker, or a query vector that sees no key of the split) get weight 0 and their acc is
// not used (it may be stale); a NaN sum still counts, so NaN propagates.  A row with no
// key at all (position < 0) gives 0 / 0 = NaN.
// Attention sinks (use_sinks, gpt-oss): sinks f32 [n_heads] holds one learned logit s_h per head (natural-log
// scale, as the scores before the base-2 factor), which joins every row's softmax denominator and no numerator:
// out = acc / (sum + exp(s_h - max)) with the max taken over the keys' scores and s_h.  Added here, once the
// splits are merged, so the split kernels do not change.
extern "C" __global__ void __launch_bounds__(256)
attn_decode_combine_kernel(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                           const int* __restrict__ positions, float* __restrict__ out, int M, int n_heads,
                           int HD, int max_ctx, int n_splits, int window, const float* __restrict__ sinks,
                           int use_sinks) {
    constexpr int B = ATTN_COMBINE_BATCH;
    const int qt = blockIdx.x;
    const int QT = M * n_heads;
    const int d = threadIdx.x;
    const bool active = d < HD;
    pdl_wait();  // the partials come from the split kernel
    pdl_trigger();
    float gm = -METRALE_INF, lsum = 0.0f, a = 0.0f;
    auto batch = [&](int s0) {
        float mv[B], lv[B], av[B];
#pragma unroll
        for (int i = 0; i < B; ++i) {
            const int s = s0 + i;
            mv[i] = -METRALE_INF;
            lv[i] = 0.0f;
            av[i] = 0.0f;
            if (s < n_splits && active) {
                const u64 slot = (u64)s * QT + qt;
                mv[i] = part_ml[slot * 2];
                lv[i] = part_ml[slot * 2 + 1];
                av[i] = part_acc[slot * HD + d];
            }
        }
        float cm = gm;
#pragma unroll
        for (int i = 0; i < B; ++i)
            if (lv[i] != 0.0f) cm = fmaxf(cm, mv[i]);
        if (cm == -METRALE_INF) return;  // nothing yet
        const float c = exp2f(gm - cm);  // 0 when gm is -inf
        a *= c;
        lsum *= c;
#pragma unroll
        for (int i = 0; i < B; ++i) {
            if (lv[i] != 0.0f) {
                const float f = exp2f(mv[i] - cm);
                a = fmaf(av[i], f, a);
                lsum = fmaf(lv[i], f, lsum);
            }
        }
        gm = cm;
    };
    batch(0);
    const int L = decode_len(positions, M, max_ctx);
    const int lo = decode_lo(positions, M, max_ctx, window);
    const int chunk = decode_chunk(L - lo, n_splits, ATTN_SIMT_ALIGN);  // >= either split kernel's count
    const int nact = (L - lo + chunk - 1) / chunk;  // splits that hold keys (<= n_splits)
    for (int s0 = B; s0 < nact; s0 += B) batch(s0);
    if (use_sinks && lsum != 0.0f) {  // a row with no key keeps its NaN
        const float s2 = sinks[qt % n_heads] * 1.4426950408889634f;  // base 2, as the scores
        const float cm = fmaxf(gm, s2);
        const float c = exp2f(gm - cm);
        a *= c;
        lsum = fmaf(lsum, c, exp2f(s2 - cm));
    }
    if (active) out[(u64)qt * HD + d] = a / lsum;
}
