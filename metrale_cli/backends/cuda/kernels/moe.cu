// Mixture-of-experts kernels of the rows path (decode / verify, M <= 16 rows) and the prefill router.
//
// A sparse layer on the rows path is four launches, all graph-capturable (no host reads; every count
// the work depends on is read on the device):
//   1. the router GEMV (gemv.cu / gemv_tc.cu, RMSNorm fused): logits [M, LD] (LD = E, or E + 1 when
//      the last column is the shared expert's gate logit);
//   2. moe_route_kernel (one block): per row softmax over the E logits in fp32, top-k (ties to the
//      lowest expert index), renormalised when norm_topk; sigmoid of the shared gate; h = rmsnorm(x);
//      and the union of the experts the M rows chose, in increasing expert order, each with the mask
//      of rows that chose it and the slot j (idx[m, j] == e) each such row gave it;
//   3. moe_gate_up_kernel: grid (I tiles, union slot u): block (t, u) reads rows t of expert
//      union_e[u]'s gate and up weights once and computes act[m * k + j] = silu(g) * u for every row m
//      of the mask: each chosen expert's weights are read once, whatever the number of rows;
//   4. moe_down_kernel: grid (H / R tiles) of 8-warp blocks: the block's warps share its R output rows'
//      work as items (one chosen expert, or one K part of it when the model has few experts per token;
//      K parts of the shared expert), each item's dots land in shared memory, and one thread per
//      (row, output) sums  w[m, j] * down_e[n] . act[m * k + j]  over the row's experts in increasing
//      order, adds the shared expert  sigmoid(g[m]) * shared_down[n] . act_shared[m]  when given, and
//      writes or adds (the residual stream) the sum once.  No atomics: the result does not depend on
//      the launch.  (The first version walked the experts one after another in each warp: on the H200
//      it read qwen3-30b-a3b's 768-wide expert rows with 2 loads in flight per lane.)
// A row's numbers depend on its own inputs only (not on M or on which other rows share an expert):
// the k loop and the order of experts are the same, so a verify row equals the decode row bit for bit
// for the same h and routing.
//
// Inner loops follow gemv.cu's register variant: a lane takes 16-byte chunks c, c + 32, ... of each
// weight row (8 bf16), U chunks in flight, fp32 FMA with the fp32 activations read through L1, warp
// shuffles to reduce.  Requirements (checked by kernels/moe.py): H, I, S multiples of 8, pointers
// 16-byte aligned, E <= MOE_MAX_EXPERTS, k <= MOE_MAX_K, M <= MOE_MAX_ROWS.
#include "common.cu"

#define MOE_MAX_EXPERTS 256
#define MOE_MAX_ROWS 16
#define MOE_MAX_K 16
#define MOE_WARPS 4         // warps of a gate_up block
#define MOE_DOWN_WARPS 8    // warps of a down block
#define MOE_DOWN_ITEMS 264  // items of a down block: union experts x K parts (<= 256) + shared parts (<= 8)

// Softmax over logits[0..E) and the top-k of one row, by one warp, each lane holding NS (>= E / 32) of the logits.
// Lane j < k ends with the j-th chosen expert in e_out (decreasing probability, equal probabilities by increasing
// index) and its weight in w_out (renormalised when norm_topk); the other lanes' are unspecified.  A NaN logit makes
// its row's weights NaN, never an invalid index.
// One warp's latency chain, so every slot and round counts (scripts/topk_cycles.py, H200, E = 128, k = 8): the
// softmax took 3457 cycles over the largest E's 8 slots a lane and takes 1456 over 4 (100-150 cycles a slot: expf
// and an IEEE division each); a round of shuffles (10 dependent) took ~410 cycles, one of two redux.sync ~230.
// Hence NS by the model's E, not the largest E, and the rounds as: each lane's best (probability, expert) as one
// integer key, the warp's max key and the lowest expert holding it.
template <int NS>
__device__ __forceinline__ void moe_topk_lane(const float* __restrict__ logits, int E, int k, int norm_topk,
                                              int& e_out, float& w_out) {
    const int lane = threadIdx.x & 31;
    float v[NS];
    float mx = -METRALE_INF;
#pragma unroll
    for (int i = 0; i < NS; ++i) {
        const int e = lane + 32 * i;
        v[i] = e < E ? logits[e] : -METRALE_INF;
        mx = fmaxf(mx, v[i]);
    }
    mx = warp_max(mx);
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < NS; ++i) {
        const int e = lane + 32 * i;
        v[i] = e < E ? expf(v[i] - mx) : 0.0f;
        s += v[i];
    }
    s = warp_sum(s);
    // key: the probability's bits + 2 (bits of a float >= 0 order as integers), 1 for a NaN probability (chosen
    // after every real one), 0 for an absent or picked expert
    unsigned int key[NS];
    bool any_nan = false;
#pragma unroll
    for (int i = 0; i < NS; ++i) {
        const float p = v[i] / s;
        any_nan |= p != p;
        key[i] = lane + 32 * i >= E ? 0u : p != p ? 1u : __float_as_uint(p) + 2u;
    }
    any_nan = __any_sync(0xffffffffu, any_nan);
    int my_e = 0x7fffffff;
    float my_w = 0.0f;
#pragma unroll 1
    for (int j = 0; j < k; ++j) {
        unsigned int bk = 0u;
        int be = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < NS; ++i) {  // a lane's experts in increasing order
            if (key[i] > bk) {
                bk = key[i];
                be = lane + 32 * i;
            }
        }
        const unsigned int mk = __reduce_max_sync(0xffffffffu, bk);
        be = (int)__reduce_min_sync(0xffffffffu, bk == mk ? (unsigned int)be : 0x7fffffffu);
#pragma unroll
        for (int i = 0; i < NS; ++i)
            if (lane + 32 * i == be) key[i] = 0u;
        if (lane == j) {
            my_e = be;
            my_w = any_nan ? __int_as_float(0x7fc00000) : __uint_as_float(mk - 2u);
        }
    }
    if (norm_topk) {  // the k weights summed in order, as the reference sums them
        float t = 0.0f;
#pragma unroll 1
        for (int j = 0; j < k; ++j) t += __shfl_sync(0xffffffffu, my_w, j);
        my_w = my_w / t;
    }
    e_out = my_e;
    w_out = my_w;
}

// moe_topk_lane with the fewest slots a lane that E needs (each slot costs the warp's chain 100-150 cycles).
__device__ __forceinline__ void moe_topk_row(const float* __restrict__ logits, int E, int k, int norm_topk,
                                             int& e_out, float& w_out) {
    if (E <= 32)
        moe_topk_lane<1>(logits, E, k, norm_topk, e_out, w_out);
    else if (E <= 128)
        moe_topk_lane<4>(logits, E, k, norm_topk, e_out, w_out);
    else
        moe_topk_lane<MOE_MAX_EXPERTS / 32>(logits, E, k, norm_topk, e_out, w_out);
}

// ---------------------------------------------------------------------------------------------------
// The rows path's routing (moe_route_kernel): the router GEMV's logits -> top-k, shared gate, h = rmsnorm(x), the
// union.  Its parts are helpers the one-launch layer shares (the same numbers).

#define MOE_ROUTER_U 8        // router weight chunks a lane requests at once (before pdl_wait)

// Rows r0, r0 + stride, ... (< rows) of a bf16 matrix w [rows, 8 C], one warp per row: acc[m] += the row's
// chunk c . the activations, by dot(c, weights of chunk c, acc) (rows m < M), lanes taking chunks lane,
// lane + 32, ..., MOE_ROUTER_U at a time, the first ones of row r0 from wpre (requested before the wait);
// then store(r, m, the warp's sum) for m < M by lane 0.  The o projection and the router of the one-launch
// layer are both this loop.
template <int MT, class Dot, class Store>
__device__ __forceinline__ void moe_warp_rows(const unsigned short* __restrict__ w, int rows, int C, int r0,
                                              int stride, const uint4 (&wpre)[MOE_ROUTER_U], int M, Dot dot,
                                              Store store) {
    const int lane = threadIdx.x & 31;
    for (int r = r0; r < rows; r += stride) {
        float acc[MT];
#pragma unroll
        for (int m = 0; m < MT; ++m) acc[m] = 0.0f;
        for (int c0 = 0; c0 < C; c0 += 32 * MOE_ROUTER_U) {
            uint4 wv[MOE_ROUTER_U];
#pragma unroll
            for (int i = 0; i < MOE_ROUTER_U; ++i) {
                const int c = c0 + lane + 32 * i;
                wv[i] = (r == r0 && c0 == 0) ? wpre[i]
                        : (c < C ? ld_stream_u4(w + ((u64)r * C + c) * 8) : make_uint4(0u, 0u, 0u, 0u));
            }
#pragma unroll
            for (int i = 0; i < MOE_ROUTER_U; ++i) {
                const int c = c0 + lane + 32 * i;
                if (c >= C) break;
                dot(c, wv[i], acc);
            }
        }
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            const float v = warp_sum(acc[m]);
            if (lane == 0 && m < M) store(r, m, v);
        }
    }
}

// The router's dot for chunk c (8 weights q of one router row) and rows m < M: acc[m] += q . (norm_w * x[m] *
// inv[m]) over the chunk (x read with plain loads: the one-launch layer may have written it in the same launch).
template <int MT>
__device__ __forceinline__ void moe_router_dot(int c, const uint4& q, const float* x, const unsigned short* norm_w,
                                               const float* inv, int M, int H, float (&acc)[MT]) {
    const uint4 g = __ldg(reinterpret_cast<const uint4*>(norm_w) + c);
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        if (m >= M) break;
        const float iv = inv[m];
        const float4* xp = reinterpret_cast<const float4*>(x + (u64)m * H) + 2 * c;
        const float4 xa = xp[0], xb = xp[1];
        const float4 ha = make_float4(bf16_lo(g.x) * (xa.x * iv), bf16_hi(g.x) * (xa.y * iv),
                                      bf16_lo(g.y) * (xa.z * iv), bf16_hi(g.y) * (xa.w * iv));
        const float4 hb = make_float4(bf16_lo(g.z) * (xb.x * iv), bf16_hi(g.z) * (xb.y * iv),
                                      bf16_lo(g.w) * (xb.z * iv), bf16_hi(g.w) * (xb.w * iv));
        acc[m] = dot8_bf16(q, ha, hb, acc[m]);
    }
}

// Sums of squares of x's rows [M, H] (M <= MT) in parts, by the whole block (blockDim.x == MOE_MAX_ROWS * 32):
// thread t sums its float4s t, t + 512, ... of each row (every row's loads in flight together), then a warp sum
// into ss[r][warp].  The route kernels and the one-launch layer share it: the same h.  Plain loads (never the
// non-coherent path): the one-launch layer reads x after other blocks of its launch wrote it.
template <int MT>
__device__ __forceinline__ void moe_sumsq_parts(const float* x, int M, int H, float (*ss)[MOE_MAX_ROWS]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, H4 = H >> 2;
    float v[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        v[m] = 0.0f;
        if (m >= M) continue;
        const float4* xr = reinterpret_cast<const float4*>(x + (u64)m * H);
        for (int i = threadIdx.x; i < H4; i += blockDim.x) {
            const float4 q = xr[i];
            v[m] = fmaf(q.x, q.x, fmaf(q.y, q.y, fmaf(q.z, q.z, fmaf(q.w, q.w, v[m]))));
        }
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        if (m >= M) break;
        const float t = warp_sum(v[m]);
        if (lane == 0) ss[m][warp] = t;
    }
}

// 1 / rms of row r from its parts (the 16 parts in order).
__device__ __forceinline__ float moe_inv_rms(const float (*ss)[MOE_MAX_ROWS], int r, int H, float eps) {
    float tot = 0.0f;
#pragma unroll
    for (int w = 0; w < MOE_MAX_ROWS; ++w) tot += ss[r][w];
    return rsqrtf(tot / (float)H + eps);
}

// h[r] = norm_w * (x[r] * inv_r) for every row r < M, float4 i of a row by the threads t = i (mod nt): elementwise
// once the sums are known, so which threads write it does not change it.  Plain loads of x (see moe_sumsq_parts).
__device__ __forceinline__ void moe_write_h(const float* x, const unsigned short* __restrict__ norm_w,
                                            const float (*ss)[MOE_MAX_ROWS], float eps, int M, int H, int t, int nt,
                                            float* __restrict__ h) {
    const int H4 = H >> 2;
    for (int r = 0; r < M; ++r) {
        const float inv = moe_inv_rms(ss, r, H, eps);
        const float4* xr = reinterpret_cast<const float4*>(x + (u64)r * H);
        float4* hr = reinterpret_cast<float4*>(h + (u64)r * H);
        for (int i = t; i < H4; i += nt) {
            const float4 v = xr[i];
            const ushort4 g = reinterpret_cast<const ushort4*>(norm_w)[i];
            hr[i] = make_float4(bf16_to_f32_bits(g.x) * (v.x * inv), bf16_to_f32_bits(g.y) * (v.y * inv),
                                bf16_to_f32_bits(g.z) * (v.z * inv), bf16_to_f32_bits(g.w) * (v.w * inv));
        }
    }
}

// Row m's routing by one warp from its logits lrow [E (+1)]: idx / wts [m, :k], slot_of[e][m] = j for its
// experts, sgate[m] = sigmoid(lrow[E]) when has_shared.
__device__ __forceinline__ void moe_route_row(const float* lrow, int m, int E, int k, int norm_topk, int has_shared,
                                              signed char (*slot_of)[MOE_MAX_ROWS], int* __restrict__ idx,
                                              float* __restrict__ wts, float* __restrict__ sgate) {
    const int j = threadIdx.x & 31;  // lane j holds choice j
    int e;
    float w;
    moe_topk_row(lrow, E, k, norm_topk, e, w);
    if (j < k) {
        idx[m * k + j] = e;
        wts[m * k + j] = w;
        slot_of[e][m] = (signed char)j;
    }
    if (has_shared && j == 0) sgate[m] = 1.0f / (1.0f + expf(-lrow[E]));
}

// One warp: the experts [e_lo, e_hi) some row chose (slot_of[e][m] >= 0), in increasing order: emit(pos, e, mask)
// for each (bit m of mask: row m chose it) by the lane holding it; returns their count (to every lane).
template <class Emit>
__device__ __forceinline__ int moe_union_warp(const signed char (*slot_of)[MOE_MAX_ROWS], int M, int e_lo, int e_hi,
                                              Emit emit) {
    const int lane = threadIdx.x & 31;
    int base = 0;
    for (int e0 = e_lo & ~31; e0 < e_hi; e0 += 32) {
        const int e = e0 + lane;
        unsigned int mask = 0u;
        if (e >= e_lo && e < e_hi)
            for (int r = 0; r < M; ++r)
                if (slot_of[e][r] >= 0) mask |= 1u << r;
        const unsigned int used = __ballot_sync(0xffffffffu, mask != 0u);
        if (mask != 0u) emit(base + __popc(used & ((1u << lane) - 1u)), e, mask);
        base += __popc(used);
    }
    return base;
}

// The route kernels' union: n_union, union_e, union_mask, union_slot [., MOE_MAX_ROWS] (the expert's slot in row
// m, -1 if none), by one warp.
__device__ __forceinline__ void moe_union_out(const signed char (*slot_of)[MOE_MAX_ROWS], int M, int e_lo, int e_hi,
                                              int* __restrict__ n_union, int* __restrict__ union_e,
                                              unsigned int* __restrict__ union_mask, int* __restrict__ union_slot) {
    const int n = moe_union_warp(slot_of, M, e_lo, e_hi, [&](int pos, int e, unsigned int mask) {
        union_e[pos] = e;
        union_mask[pos] = mask;
        for (int r = 0; r < MOE_MAX_ROWS; ++r) union_slot[pos * MOE_MAX_ROWS + r] = slot_of[e][r];
    });
    if ((threadIdx.x & 31) == 0) *n_union = n;
}

// After the router GEMV: one block of MOE_MAX_ROWS warps.  logits [M, ld] (ld = E, or E + 1 with the shared
// expert's gate logit last); x [M, H] the residual stream (H % 4 == 0, 16-byte rows); norm_w bf16 [H] (8-byte
// aligned).  Writes idx [M, k], wts [M, k], sgate [M] (has_shared), h [M, H] = norm_w * (x * rsqrt(mean(x^2) +
// eps)), and the union (moe_union_out) of the experts [e_lo, e_hi) this engine holds (a tensor-parallel rank's;
// 0, E otherwise): every row is routed over all E experts, and the others' share of the sum comes from the other
// ranks (the all-reduce).  The rows' logits are staged in shared memory beside the sums of squares' loads; then
// warp m routes row m while the warps without a row write h.
extern "C" __global__ void __launch_bounds__(MOE_MAX_ROWS * 32)
moe_route_kernel(const float* __restrict__ logits, int ld, const float* __restrict__ x,
                 const unsigned short* __restrict__ norm_w, float eps, int M, int H, int E, int k, int norm_topk,
                 int has_shared, int* __restrict__ idx, float* __restrict__ wts, float* __restrict__ sgate,
                 float* __restrict__ h, int* __restrict__ n_union, int* __restrict__ union_e,
                 unsigned int* __restrict__ union_mask, int* __restrict__ union_slot, int e_lo, int e_hi) {
    __shared__ signed char slot_of[MOE_MAX_EXPERTS][MOE_MAX_ROWS];
    __shared__ float s_logit[MOE_MAX_ROWS][MOE_MAX_EXPERTS + 1];
    __shared__ float s_ss[MOE_MAX_ROWS][MOE_MAX_ROWS];
    for (int t = threadIdx.x; t < MOE_MAX_EXPERTS * MOE_MAX_ROWS; t += blockDim.x) (&slot_of[0][0])[t] = -1;
    pdl_wait();
    pdl_trigger();
    const int warp = threadIdx.x >> 5;
    for (int t = threadIdx.x; t < M * ld; t += blockDim.x) s_logit[t / ld][t % ld] = logits[t];
    moe_sumsq_parts<MOE_MAX_ROWS>(x, M, H, s_ss);
    __syncthreads();
    if (warp < M) moe_route_row(s_logit[warp], warp, E, k, norm_topk, has_shared, slot_of, idx, wts, sgate);
    const int hw0 = M < MOE_MAX_ROWS ? M : 0;  // warps [hw0, 16) write h (with 16 rows: every warp, after its row)
    if (warp >= hw0) moe_write_h(x, norm_w, s_ss, eps, M, H, threadIdx.x - 32 * hw0, 32 * (MOE_MAX_ROWS - hw0), h);
    __syncthreads();
    if (warp == 0) moe_union_out(slot_of, M, e_lo, e_hi, n_union, union_e, union_mask, union_slot);
}

// The prefill router: top-k only, one warp per row, rows 0..T-1 (no union, no h); blocks of MOE_TOPK_WARPS warps.
#define MOE_TOPK_WARPS 8
extern "C" __global__ void moe_topk_rows_kernel(const float* __restrict__ logits, int ld, int T, int E, int k,
                                                int norm_topk, int has_shared, int* __restrict__ idx,
                                                float* __restrict__ wts, float* __restrict__ sgate) {
    pdl_wait();
    pdl_trigger();
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * MOE_TOPK_WARPS + (threadIdx.x >> 5);
    if (row >= T) return;
    int e;
    float w;
    moe_topk_row(logits + (u64)row * ld, E, k, norm_topk, e, w);
    if (lane < k) {
        idx[(u64)row * k + lane] = e;
        wts[(u64)row * k + lane] = w;
    }
    if (has_shared && lane == 0) sgate[row] = 1.0f / (1.0f + expf(-logits[(u64)row * ld + E]));
}

// A 16-byte load of activations: through the read-only path (__ldg) when they were written by an
// earlier kernel, or (COHERENT) as a plain weak load, which may be served by L1 but sees what other
// blocks of the same launch wrote before a grid barrier (moe_grid_barrier: fence, then acquire).  The
// non-coherent path must not read data the launch itself writes.  Volatile: never moved across a barrier.
template <bool COHERENT>
__device__ __forceinline__ float4 ld_act4(const float4* p) {
    if constexpr (COHERENT) {
        float4 v;
        asm volatile("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];"
                     : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                     : "l"(p));
        return v;
    } else {
        return __ldg(p);
    }
}

// One step of a lane over UU chunks (c, c + 32, ...) of RW weight rows, for the rows m of `mask`,
// whose activations are row ri[m] of x (K floats each).  All chunks must be < K / 8.
// With TAIL, only the chunks below `end` are read and added (the last, partial step of a range).
// COHERENT: x was written by this launch (ld_act4).
template <int MT, int RW, int UU, bool TAIL, bool COHERENT = false>
__device__ __forceinline__ void moe_step(const uint4* const (&wrow)[RW], const float* __restrict__ x,
                                         const int (&ri)[MT], int K, unsigned int mask, int c, int end,
                                         float (&acc)[RW][MT]) {
    uint4 wv[UU][RW];
#pragma unroll
    for (int u = 0; u < UU; ++u)
#pragma unroll
        for (int r = 0; r < RW; ++r)
            wv[u][r] = (!TAIL || c + 32 * u < end) ? ld_stream_u4(wrow[r] + c + 32 * u) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int u = 0; u < UU; ++u) {
        if (TAIL && c + 32 * u >= end) break;
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            if (!((mask >> m) & 1u)) continue;  // uniform over the warp
            const float4* xp = reinterpret_cast<const float4*>(x + (u64)ri[m] * K) + 2 * (c + 32 * u);
            const float4 xa = ld_act4<COHERENT>(xp);
            const float4 xb = ld_act4<COHERENT>(xp + 1);
#pragma unroll
            for (int r = 0; r < RW; ++r) {
                const uint4 q = wv[u][r];
                float s = acc[r][m];
                s = fmaf(bf16_lo(q.x), xa.x, s);
                s = fmaf(bf16_hi(q.x), xa.y, s);
                s = fmaf(bf16_lo(q.y), xa.z, s);
                s = fmaf(bf16_hi(q.y), xa.w, s);
                s = fmaf(bf16_lo(q.z), xb.x, s);
                s = fmaf(bf16_hi(q.z), xb.y, s);
                s = fmaf(bf16_lo(q.w), xb.z, s);
                s = fmaf(bf16_hi(q.w), xb.w, s);
                acc[r][m] = s;
            }
        }
    }
}

// acc[r][m] += the dot products of weight rows wrow[r] with row ri[m] of x (rows K floats apart) over
// the 8-element chunks [c0, c1) of K, per lane (not yet reduced over the warp).  A lane adds its chunks
// in increasing order; the last partial step keeps all of its loads in flight (predicated, not a
// one-chunk loop: a 768-wide expert row is 3 chunks a lane, which one-chunk steps read one at a time).
template <int MT, int RW, int U, bool COHERENT = false>
__device__ __forceinline__ void moe_dots(const uint4* const (&wrow)[RW], const float* __restrict__ x,
                                         const int (&ri)[MT], unsigned int mask, int K, int c0, int c1,
                                         float (&acc)[RW][MT]) {
    int c = c0 + (threadIdx.x & 31);
    for (; c + 32 * (U - 1) < c1; c += 32 * U) moe_step<MT, RW, U, false, COHERENT>(wrow, x, ri, K, mask, c, c1, acc);
    if (c < c1) moe_step<MT, RW, U, true, COHERENT>(wrow, x, ri, K, mask, c, c1, acc);
}

// act[(m * k + j), n] = silu(gate_e[n] . h[m]) * (up_e[n] . h[m]) for the rows m that chose expert
// e = union_e[blockIdx.y] (slot j), n in this warp's R rows.  w_gate_up [E, 2I, H]: experts e_lo .. (a
// tensor-parallel rank's, e_lo its first), expert e at index e - e_lo.  MT >= M.
template <int MT, int R, int U>
__global__ void __launch_bounds__(MOE_WARPS * 32)
moe_gate_up_kernel(const float* __restrict__ h, const unsigned short* __restrict__ w,
                   const int* __restrict__ n_union, const int* __restrict__ union_e,
                   const unsigned int* __restrict__ union_mask, const int* __restrict__ union_slot,
                   float* __restrict__ act, int I, int H, int k, int e_lo) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int u = blockIdx.y;
    const int n0 = (blockIdx.x * MOE_WARPS + warp) * R;
    pdl_wait();
    pdl_trigger();
    // read beside n_union, not after it (one load latency, not two): grid.y <= the union's capacity
    const int nu = *n_union, e = union_e[u];
    const unsigned int mask = union_mask[u];
    if (u >= nu || n0 >= I) return;  // whole warps; no block barrier
    const uint4* wrow[2 * R];
#pragma unroll
    for (int r = 0; r < 2 * R; ++r) {
        const int n = min(n0 + (r % R), I - 1);  // rows past I - 1 are read, never stored
        wrow[r] = reinterpret_cast<const uint4*>(w + ((u64)(e - e_lo) * 2 * I + (r < R ? n : I + n)) * H);
    }
    int ri[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) ri[m] = m;
    float acc[2 * R][MT];
#pragma unroll
    for (int r = 0; r < 2 * R; ++r)
#pragma unroll
        for (int m = 0; m < MT; ++m) acc[r][m] = 0.0f;
    moe_dots<MT, 2 * R, U>(wrow, h, ri, mask, H, 0, H >> 3, acc);
#pragma unroll
    for (int r = 0; r < 2 * R; ++r)
#pragma unroll
        for (int m = 0; m < MT; ++m) acc[r][m] = warp_sum(acc[r][m]);
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            const int n = n0 + r;
            if (((mask >> m) & 1u) && n < I && lane == ((r * MT + m) & 31)) {
                const int j = union_slot[u * MOE_MAX_ROWS + m];
                const float g = acc[r][m], up = acc[R + r][m];
                act[((u64)m * k + j) * I + n] = g / (1.0f + expf(-g)) * up;
            }
        }
    }
}

// out[m, n] (=|+=) sum over the union's experts e chosen by row m (slot j) of wts[m, j] *
// (down_e[n] . act[m * k + j])  [+ sgate[m] * (shared_down[n] . act_shared[m]) when S > 0], for the
// block's R output rows n.  w_down [E, H, I] (experts e_lo .., as w_gate_up); w_shared [H, S]; act_shared
// [M, S]; out [M, H].
// The block's MOE_DOWN_WARPS warps share the work as items: item u * P + p is part p of P of union
// expert u's K (chunks [p C / P, (p + 1) C / P)), then PS items split the shared expert's K the same way;
// warp w takes items w, w + MOE_DOWN_WARPS, ...  Each item's warp-reduced dots go to shared memory, and
// one thread per (r, m) sums them: parts in order, then experts in increasing order weighted by wts (as
// the reference sums), then the shared expert.  P depends on the model only (kernels/moe.py), never on
// M, so a row's numbers do not depend on the other rows: a verify row equals its decode row.
template <int MT, int R, int U>
__global__ void __launch_bounds__(MOE_DOWN_WARPS * 32)
moe_down_kernel(const float* __restrict__ act, const unsigned short* __restrict__ w, const float* __restrict__ wts,
                const int* __restrict__ n_union, const int* __restrict__ union_e,
                const unsigned int* __restrict__ union_mask, const int* __restrict__ union_slot,
                const float* __restrict__ act_s, const unsigned short* __restrict__ w_s,
                const float* __restrict__ sgate, int S, float* __restrict__ out, int M, int H, int I, int k,
                int P, int PS, int accumulate, int e_lo) {
    __shared__ float part[MOE_DOWN_ITEMS][R][MT];
    __shared__ float wsm[MOE_MAX_EXPERTS][MT];  // row m's weight for union expert u (read by the item warps)
    __shared__ unsigned int msk[MOE_MAX_EXPERTS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n0 = blockIdx.x * R;
    // The routing was written two launches back (route -> gate_up -> down; every launch of the chain waits
    // for its predecessor before it lets its dependents start), so it is complete and visible before this
    // launch's pdl_wait: the first item's routing is read while gate_up still runs.  act needs the wait.
    const int u_first = min(warp / P, k - 1);
    const int e_first = union_e[u_first];
    const unsigned int mask_first = union_mask[u_first];
    const int nu = *n_union;
    pdl_wait();
    pdl_trigger();
    const int routed = nu * P, items = routed + (S > 0 ? PS : 0);
    for (int it = warp; it < items; it += MOE_DOWN_WARPS) {
        const bool sh = it >= routed;
        const int u = sh ? 0 : it / P, p = sh ? it - routed : it % P, np = sh ? PS : P;
        const int K = sh ? S : I, C = K >> 3;
        const bool first = u == u_first;
        const unsigned int mask = sh ? (M >= 32 ? 0xffffffffu : ((1u << M) - 1u)) : first ? mask_first : union_mask[u];
        const uint4* wrow[R];
        int ri[MT];
        if (sh) {  // the shared expert: row m's activations are row m of act_s
#pragma unroll
            for (int r = 0; r < R; ++r) wrow[r] = reinterpret_cast<const uint4*>(w_s + (u64)min(n0 + r, H - 1) * S);
#pragma unroll
            for (int m = 0; m < MT; ++m) ri[m] = min(m, M - 1);
        } else {  // row m's activations for expert u: row m * k + j of act
            const int e = first ? e_first : union_e[u];
#pragma unroll
            for (int r = 0; r < R; ++r)
                wrow[r] = reinterpret_cast<const uint4*>(w + ((u64)(e - e_lo) * H + min(n0 + r, H - 1)) * I);
#pragma unroll
            for (int m = 0; m < MT; ++m) ri[m] = m * k + (((mask >> m) & 1u) ? union_slot[u * MOE_MAX_ROWS + m] : 0);
        }
        if (!sh && p == 0) {  // the weights the final sum needs, read here in parallel (not in its loop)
            if (lane < MT && lane < M && ((mask >> lane) & 1u))
                wsm[u][lane] = wts[lane * k + union_slot[u * MOE_MAX_ROWS + lane]];
            if (lane == 0) msk[u] = mask;
        }
        float acc[R][MT];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int m = 0; m < MT; ++m) acc[r][m] = 0.0f;
        moe_dots<MT, R, U>(wrow, sh ? act_s : act, ri, mask, K, p * C / np, (p + 1) * C / np, acc);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                const float v = warp_sum(acc[r][m]);  // uniform: every lane holds the sum
                if (lane == 0) part[it][r][m] = v;
            }
    }
    __syncthreads();
    const int t = threadIdx.x;
    if (t >= R * MT) return;
    const int r = t / MT, m = t % MT, n = n0 + r;
    if (m >= M || n >= H) return;
    float y = 0.0f;
    for (int u = 0; u < nu; ++u) {  // experts in increasing order, as the reference sums them
        if (!((msk[u] >> m) & 1u)) continue;
        float d = 0.0f;
        for (int p = 0; p < P; ++p) d += part[u * P + p][r][m];
        y = fmaf(wsm[u][m], d, y);
    }
    if (S > 0) {  // the shared expert, scaled by its sigmoid gate, added after the routed experts
        float d = 0.0f;
        for (int p = 0; p < PS; ++p) d += part[routed + p][r][m];
        y = fmaf(sgate[m], d, y);
    }
    float* o = out + (u64)m * H + n;
    *o = accumulate ? *o + y : y;
}

// ---------------------------------------------------------------------------------------------------
// The sparse layer in ONE launch (the fused rows path, kernels/moe.py `layer`): the router GEMV with its
// RMSNorm, the routing, gate_up and down of the four launches above, in a persistent grid of one
// MOE_LAYER_WARPS-warp block per SM with two grid barriers (three with the attention's output projection):
//   0. (Q > 0) x += attn w_o^T, the o projection before the layer (its first weights requested before
//      pdl_wait), rows n = blockIdx.x + G w of x a warp each;                               -> barrier 0
//   A. every block: the sums of squares of x's rows (route's order), its slice of h = rmsnorm(x); the
//      router rows r = blockIdx.x + G w (one warp each, the first weights requested before pdl_wait):
//      logits[m, r] over the normalised x.                                                 -> barrier 1
//   B. every block (no barrier after it): the top-k of every row from the logits, and the union of the
//      rows' experts, in shared memory (block 0 also writes idx / wts / sgate for the Route);
//   C. gate_up: the union's (expert, row n) pairs split evenly over the blocks, a pair per warp: act as
//      moe_gate_up_kernel computes it;                                                       -> barrier 2
//   D. down: block b owns output rows [b R, b R + R) (R = rows_per_block), its warps take (row group,
//      expert, K part) items as moe_down_kernel's do; the sums in the same order; out (=|+=) y.
// Per sparse layer that is one launch instead of four (router GEMV, route, gate_up, down), each of which
// paid its ramp and tail inside the step (every one is latency-bound at decode).  The numbers of h, act
// and the down sums are the route / gate_up / down kernels' (the same code and order); the router logits
// differ from the GEMV's by fp32 summation order only.  A row's numbers do not depend on the other rows.
// The grid barrier needs every block resident: G <= the SMs, one block per SM fits (kernels/moe.py
// checks the shared memory; __launch_bounds__ caps the registers), and the launch triggers its dependents
// (PDL) only after the last barrier, so no later kernel can take an SM a waiting block needs.  A barrier
// that waits longer than MOE_BARRIER_TIMEOUT_NS traps (a launch error, never a hang).
#define MOE_LAYER_WARPS 16
static_assert(MOE_LAYER_WARPS == MOE_MAX_ROWS, "the sums of squares' parts (moe_sumsq_parts) are one per warp");
#define MOE_BARRIER_TIMEOUT_NS 2000000000ull  // 2 s


__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Phase time stamps of every block (scripts/moe_layer_phases.py compiles with MOE_LAYER_STAMPS; never the engine):
// launch l (counted since the script zeroed moe_layer_launch, modulo MOE_STAMP_LAUNCHES) writes, per block, its
// entry time at [l][block][15] and phase i's end at [l][block][i].  A launch reads its number after pdl_wait (the
// previous launch has counted itself by then) and block 0 counts it after the last barrier.
#ifdef MOE_LAYER_STAMPS
#define MOE_STAMP_LAUNCHES 64
__device__ unsigned long long moe_layer_stamps[MOE_STAMP_LAUNCHES * 1024 * 16];
__device__ unsigned int moe_layer_launch;
#define MOE_STAMP_ENTRY const unsigned long long stamp_entry = global_ns()
#define MOE_STAMP_BEGIN                                                                              \
    const unsigned int stamp_l = *(volatile unsigned int*)&moe_layer_launch % MOE_STAMP_LAUNCHES;    \
    if (threadIdx.x == 0) moe_layer_stamps[(stamp_l * 1024 + blockIdx.x) * 16 + 15] = stamp_entry
#define MOE_STAMP(i) \
    if (threadIdx.x == 0) moe_layer_stamps[(stamp_l * 1024 + blockIdx.x) * 16 + (i)] = global_ns()
#define MOE_STAMP_COUNT \
    if (threadIdx.x == 0 && blockIdx.x == 0) atomicAdd(&moe_layer_launch, 1u)
#else
#define MOE_STAMP_ENTRY
#define MOE_STAMP_BEGIN
#define MOE_STAMP(i)
#define MOE_STAMP_COUNT
#endif

// Every thread of every block calls it; the blocks' writes before it are seen by every block after it.
// The counter needs no reset: block 0 adds 2^31 - (G - 1), the others 1, so its top bit flips exactly
// when the last block arrives, and the low bits come back to where they were (any start value works,
// graph replays included).
__device__ __forceinline__ void moe_grid_barrier(unsigned int* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned int add = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1u) : 1u;
        __threadfence();
        const unsigned int old = atomicAdd(bar, add);
        const volatile unsigned int* vb = bar;
        const unsigned long long t0 = global_ns();
        while (((old ^ *vb) & 0x80000000u) == 0u)
            if (global_ns() - t0 > MOE_BARRIER_TIMEOUT_NS) __trap();
        __threadfence();
    }
    __syncthreads();
}

// x [M, H] (the residual stream, read; with Q > 0 first x += attn w_o^T, attn [M, Q] f32, w_o bf16 [H, Q]),
// out [M, H]: out = x + y (accumulate; out may be x) or y.
// norm_w bf16 [H]; w_router bf16 [ld, H] (ld = E, or E + 1 with the shared expert's gate row);
// logits [M, ld]; w_gu [E, 2I, H]; w_dn [E, H, I]; w_s bf16 [H, S] and act_s [M, S] (S > 0: the shared
// expert's down weights and its activations, computed by an earlier launch); idx, wts [M, k], sgate [M];
// h [M, H]; act [M k, I]; bar: the grid barrier's counter.  P, PS: down_parts.  Dynamic shared memory:
// (rows_per_block / DR) x (min(E, M k) P + PS) x DR x MT floats (kernels/moe.py layer_smem_bytes).
template <int MT, int DR>
__global__ void __launch_bounds__(MOE_LAYER_WARPS * 32, 1)
moe_layer_kernel(float* x, float* out, int accumulate, const float* __restrict__ attn,
                 const unsigned short* __restrict__ w_o, int Q, const unsigned short* __restrict__ norm_w, float eps,
                 const unsigned short* __restrict__ w_router, int ld, float* logits,
                 const unsigned short* __restrict__ w_gu, const unsigned short* __restrict__ w_dn,
                 const unsigned short* __restrict__ w_s, const float* act_s, int S, int P, int PS,
                 int* idx, float* wts, float* sgate, float* h, float* act, unsigned int* bar, int M, int H,
                 int E, int I, int k, int norm_topk, int rows_per_block) {
    __shared__ signed char slot_of[MOE_MAX_EXPERTS][MOE_MAX_ROWS];  // row m's slot of expert e, -1: not chosen
    __shared__ int s_ue[MOE_MAX_EXPERTS];                           // the union, increasing
    __shared__ unsigned int s_um[MOE_MAX_EXPERTS];                  // its rows
    __shared__ float s_w[MOE_MAX_EXPERTS][MT];                      // row m's weight of union expert u
    __shared__ float s_logit[MT][MOE_MAX_EXPERTS + 1];
    __shared__ float s_wk[MT][MOE_MAX_K];
    __shared__ float s_ss[MT][MOE_MAX_ROWS];  // sums of squares in parts (MOE_LAYER_WARPS == MOE_MAX_ROWS)
    __shared__ float s_inv[MT], s_sg[MT];
    __shared__ int s_nu;
    extern __shared__ float s_part[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int G = gridDim.x, C = H >> 3;
    const int has_shared = ld > E;
    MOE_STAMP_ENTRY;

    // The first weights in flight before waiting for the previous kernel: o's (Q > 0), else the router's.
    // Warp w of block b takes rows b + G w, b + G (w + 16), ... of o, then of the router.
    const int r0 = blockIdx.x + G * warp;
    uint4 wpre[MOE_ROUTER_U];
    const int QC = Q >> 3;
#pragma unroll
    for (int i = 0; i < MOE_ROUTER_U; ++i) {
        const int c = lane + 32 * i;
        const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
        wpre[i] = Q > 0 ? ((r0 < H && c < QC) ? ld_stream_u4(w_o + (u64)r0 * Q + 8 * c) : zero)
                        : ((r0 < ld && c < C) ? ld_stream_u4(w_router + (u64)r0 * H + 8 * c) : zero);
    }
    for (int t = tid; t < MOE_MAX_EXPERTS * MOE_MAX_ROWS; t += blockDim.x) (&slot_of[0][0])[t] = -1;
    pdl_wait();
    MOE_STAMP_BEGIN;
    MOE_STAMP(0);
    if (Q > 0) {  // 0. x[m, n] += attn[m] . w_o[n]: the attention's output projection
        moe_warp_rows<MT>(w_o, H, QC, r0, G * MOE_LAYER_WARPS, wpre, M,
                          [&](int c, const uint4& q, float (&acc)[MT]) {
#pragma unroll
                              for (int m = 0; m < MT; ++m) {
                                  if (m >= M) break;
                                  const float4* ap = reinterpret_cast<const float4*>(attn + (u64)m * Q) + 2 * c;
                                  acc[m] = dot8_bf16(q, __ldg(ap), __ldg(ap + 1), acc[m]);
                              }
                          },
                          [&](int n, int m, float v) { x[(u64)m * H + n] += v; });
#pragma unroll
        for (int i = 0; i < MOE_ROUTER_U; ++i) {  // the router's first weights, while the barrier waits
            const int c = lane + 32 * i;
            wpre[i] = (r0 < ld && c < C) ? ld_stream_u4(w_router + (u64)r0 * H + 8 * c) : make_uint4(0u, 0u, 0u, 0u);
        }
        MOE_STAMP(1);
        moe_grid_barrier(bar);
        MOE_STAMP(2);
    }
    // sums of squares in the route kernels' order (moe_sumsq_parts): the same h
    moe_sumsq_parts<MT>(x, M, H, s_ss);
    __syncthreads();
    if (tid < M) s_inv[tid] = moe_inv_rms(s_ss, tid, H, eps);
    __syncthreads();
    moe_write_h(x, norm_w, s_ss, eps, M, H, blockIdx.x * blockDim.x + tid, G * blockDim.x, h);  // this block's h
    // the router rows: logits[m, r] = w_router[r] . (norm_w * x[m] * inv[m])
    moe_warp_rows<MT>(w_router, ld, C, r0, G * MOE_LAYER_WARPS, wpre, M,
                      [&](int c, const uint4& q, float (&acc)[MT]) {
                          moe_router_dot<MT>(c, q, x, norm_w, s_inv, M, H, acc);
                      },
                      [&](int r, int m, float v) { logits[(u64)m * ld + r] = v; });
    MOE_STAMP(3);
    moe_grid_barrier(bar);
    MOE_STAMP(4);

    // B. routing, in every block
    for (int t = tid; t < M * ld; t += blockDim.x) s_logit[t / ld][t % ld] = __ldcg(logits + t);
    __syncthreads();
    MOE_STAMP(9);
    if (warp < M) {
        const int m = warp;
        int e;
        float w;
        moe_topk_row(s_logit[m], E, k, norm_topk, e, w);
        if (lane < k) {
            slot_of[e][m] = (signed char)lane;
            s_wk[m][lane] = w;
            if (blockIdx.x == 0) {
                idx[m * k + lane] = e;
                wts[m * k + lane] = w;
            }
        }
        if (has_shared && lane == 0) {
            const float g = 1.0f / (1.0f + expf(-s_logit[m][E]));
            s_sg[m] = g;
            if (blockIdx.x == 0) sgate[m] = g;
        }
    }
    __syncthreads();
    MOE_STAMP(10);
    if (warp == 0) {  // the union in increasing expert order, with each row's weight for it
        const int n = moe_union_warp(slot_of, M, 0, E, [&](int pos, int e, unsigned int mask) {
            s_ue[pos] = e;
            s_um[pos] = mask;
            for (int r = 0; r < M; ++r)
                if ((mask >> r) & 1u) s_w[pos][r] = s_wk[r][slot_of[e][r]];
        });
        if (lane == 0) s_nu = n;
    }
    __syncthreads();
    const int nu = s_nu;
    MOE_STAMP(5);

    // C. gate_up: pairs p = u I + n, this block's share of them, a pair per warp
    {
        const long long T = (long long)nu * I;
        const long long lo = T * blockIdx.x / G, hi = T * (blockIdx.x + 1) / G;
        int ri[MT];
#pragma unroll
        for (int m = 0; m < MT; ++m) ri[m] = m;
        for (long long p = lo + warp; p < hi; p += MOE_LAYER_WARPS) {
            const int u = (int)(p / I), n = (int)(p - (long long)u * I);
            const int e = s_ue[u];
            const unsigned int mask = s_um[u];
            const uint4* wrow[2] = {reinterpret_cast<const uint4*>(w_gu + ((u64)e * 2 * I + n) * H),
                                    reinterpret_cast<const uint4*>(w_gu + ((u64)e * 2 * I + I + n) * H)};
            float acc[2][MT];
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int m = 0; m < MT; ++m) acc[r][m] = 0.0f;
            moe_dots<MT, 2, 4, true>(wrow, h, ri, mask, H, 0, C, acc);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                const float g = warp_sum(acc[0][m]), up = warp_sum(acc[1][m]);
                if (((mask >> m) & 1u) && lane == (m & 31))
                    act[((u64)m * k + slot_of[e][m]) * I + n] = g / (1.0f + expf(-g)) * up;
            }
        }
    MOE_STAMP(6);
    }
    moe_grid_barrier(bar);
    MOE_STAMP(7);
    MOE_STAMP_COUNT;
    pdl_trigger();  // no barrier after this point: a dependent kernel's blocks may take the free SM slots

    // D. down: output rows [n_lo, n_hi) of this block, items (row group, union expert u / shared, part)
    const int n_lo = blockIdx.x * rows_per_block, n_hi = min(n_lo + rows_per_block, H);
    if (n_lo >= n_hi) return;
    const int groups = (n_hi - n_lo + DR - 1) / DR;
    const int routed = nu * P, per = routed + (S > 0 ? PS : 0), items = groups * per;
    for (int it = warp; it < items; it += MOE_LAYER_WARPS) {
        const int g = it / per, j = it - g * per, n0 = n_lo + g * DR;
        const bool sh = j >= routed;
        const int u = sh ? 0 : j / P, p = sh ? j - routed : j % P, np = sh ? PS : P;
        const int K = sh ? S : I, CC = K >> 3;
        const unsigned int mask = sh ? (M >= 32 ? 0xffffffffu : ((1u << M) - 1u)) : s_um[u];
        const uint4* wrow[DR];
        int ri[MT];
        if (sh) {
#pragma unroll
            for (int r = 0; r < DR; ++r) wrow[r] = reinterpret_cast<const uint4*>(w_s + (u64)min(n0 + r, n_hi - 1) * S);
#pragma unroll
            for (int m = 0; m < MT; ++m) ri[m] = min(m, M - 1);
        } else {
            const int e = s_ue[u];
#pragma unroll
            for (int r = 0; r < DR; ++r)
                wrow[r] = reinterpret_cast<const uint4*>(w_dn + ((u64)e * H + min(n0 + r, n_hi - 1)) * I);
#pragma unroll
            for (int m = 0; m < MT; ++m) ri[m] = m * k + (((mask >> m) & 1u) ? slot_of[e][m] : 0);
        }
        float acc[DR][MT];
#pragma unroll
        for (int r = 0; r < DR; ++r)
#pragma unroll
            for (int m = 0; m < MT; ++m) acc[r][m] = 0.0f;
        moe_dots<MT, DR, 4, true>(wrow, sh ? act_s : act, ri, mask, K, p * CC / np, (p + 1) * CC / np, acc);
#pragma unroll
        for (int r = 0; r < DR; ++r)
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                const float v = warp_sum(acc[r][m]);
                if (lane == 0) s_part[((u64)it * DR + r) * MT + m] = v;
            }
    }
    __syncthreads();
    for (int t = tid; t < groups * DR * MT; t += blockDim.x) {
        const int rr = t / MT, m = t - rr * MT, n = n_lo + rr;
        if (m >= M || n >= n_hi) continue;
        const int base = (rr / DR) * per, r = rr % DR;
        float y = 0.0f;
        for (int u = 0; u < nu; ++u) {  // experts in increasing order, as moe_down_kernel sums them
            if (!((s_um[u] >> m) & 1u)) continue;
            float d = 0.0f;
            for (int p = 0; p < P; ++p) d += s_part[((u64)(base + u * P + p) * DR + r) * MT + m];
            y = fmaf(s_w[u][m], d, y);
        }
        if (S > 0) {
            float d = 0.0f;
            for (int p = 0; p < PS; ++p) d += s_part[((u64)(base + routed + p) * DR + r) * MT + m];
            y = fmaf(s_sg[m], d, y);
        }
        out[(u64)m * H + n] = accumulate ? x[(u64)m * H + n] + y : y;
    }
    MOE_STAMP(8);
}

// Instances (kernels/moe.py names them): MT in {1, 2, 4, 8, 16}; gate_up R = 1; down R = 4, 4, 4, 2, 1
// (its shared memory holds items x R x MT floats: 16.5 KB for each); U = 4.
#ifndef METRALE_NVRTC  // a standalone `nvcc -ptx moe.cu` compiles every instance the engine uses
#define MOE_INSTANCES(MT, DR)                                                                              \
    template __global__ void moe_gate_up_kernel<MT, 1, 4>(const float*, const unsigned short*, const int*, \
                                                          const int*, const unsigned int*, const int*,     \
                                                          float*, int, int, int, int);                     \
    template __global__ void moe_down_kernel<MT, DR, 4>(const float*, const unsigned short*, const float*, \
                                                        const int*, const int*, const unsigned int*,       \
                                                        const int*, const float*, const unsigned short*,   \
                                                        const float*, int, float*, int, int, int, int,     \
                                                        int, int, int, int);                               \
    template __global__ void moe_layer_kernel<MT, DR>(float*, float*, int, const float*, const unsigned short*, \
                                                      int, const unsigned short*, float,                     \
                                                      const unsigned short*, int, float*,                    \
                                                      const unsigned short*, const unsigned short*,          \
                                                      const unsigned short*, const float*, int, int, int,    \
                                                      int*, float*, float*, float*, float*, unsigned int*,   \
                                                      int, int, int, int, int, int, int);
MOE_INSTANCES(1, 4)
MOE_INSTANCES(2, 4)
MOE_INSTANCES(4, 4)
MOE_INSTANCES(8, 2)
MOE_INSTANCES(16, 1)
#endif
