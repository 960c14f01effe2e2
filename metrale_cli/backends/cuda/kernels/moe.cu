// Mixture-of-experts kernels of the rows path (decode / verify, M <= 16 rows) and the prefill router.
//
// A sparse layer on the rows path is four launches, all graph-capturable (no host reads; every count
// the work depends on is read on the device):
//   1. the router GEMV (gemv.cu / gemv_tc.cu, RMSNorm fused): logits [M, LD] (LD = E, or E + 1 when
//      the last column is the shared expert's gate logit);
//   2. moe_route_kernel (one block): per row the router kind's choice over the E logits in fp32
//      (moe_choose_row: softmax top-k here, the other kinds in routers.cu; ties to the lowest expert
//      index; a router bias is already in the logits, added by the GEMV), renormalised when norm_topk, times routed_scaling_factor; the shared expert's gate
//      (sigmoid of its logit, or 1 for an ungated shared expert); h = rmsnorm(x);
//      and the union of the experts the M rows chose, in increasing expert order, each with the mask
//      of rows that chose it and the slot j (idx[m, j] == e) each such row gave it (at most M k experts:
//      the union's arrays are sized by MOE_MAX_UNION, not by E);
//   3. moe_gate_up_kernel: grid (I tiles, union slot u): block (t, u) reads rows t of expert
//      union_e[u]'s gate and up weights once and computes act[m * k + j] = silu(g) * u (or gpt-oss's
//      glu_oai, common.cu; with the expert's gate/up bias added to g and u first) for every row m of the
//      mask: each chosen expert's weights are read once, whatever the number of rows;
//   4. moe_down_kernel: grid (H / R tiles) of 8-warp blocks: the block's warps share its R output rows'
//      work as items (one chosen expert, or one K part of it when the model has few experts per token;
//      K parts of the shared expert), each item's dots land in shared memory, and one thread per
//      (row, output) sums  w[m, j] * down_e[n] . act[m * k + j]  over the row's experts in increasing
//      order (with a down bias: w[m, j] * (down_e[n] . act[m * k + j] + b_e[n]), as the reference adds it
//      per expert before the routing weight), adds the shared expert  sigmoid(g[m]) * shared_down[n] .
//      act_shared[m]  when given, and
//      writes or adds (the residual stream) the sum once.  No atomics: the result does not depend on
//      the launch.
// A row's numbers depend on its own inputs only (not on M or on which other rows share an expert):
// the k loop and the order of experts are the same, so a verify row equals the decode row bit for bit
// for the same h and routing.
//
// Inner loops follow gemv.cu's register variant: a lane takes 16-byte chunks c, c + 32, ... of each
// weight row (8 bf16), U chunks in flight, fp32 FMA with the fp32 activations read through L1, warp
// shuffles to reduce.  Requirements (checked by kernels/moe.py): H, I, S multiples of 8, pointers
// 16-byte aligned, E <= MOE_MAX_EXPERTS (the routing's bound only), k <= MOE_MAX_K, M <= MOE_MAX_ROWS.
// Steps 3 and 4 are templates over the experts' weight format (their section below: bf16; FP8 blocks and MXFP4 kept
// as stored, dequantized in registers, K a multiple of their chunk's 16 / 32 weights).
#include "common.cu"
#include "e4m3.cu"
#include "e2m1.cu"
#include "routers.cu"

#define MOE_MAX_EXPERTS 1024  // a router lane holds E / 32 of a row's logits; the union's bitmap is one word a lane
#define MOE_MAX_ROWS 16
#define MOE_MAX_K 16
#define MOE_MAX_UNION 256  // MOE_MAX_ROWS * MOE_MAX_K: the experts a call's rows choose at most
static_assert(MOE_MAX_UNION == MOE_MAX_ROWS * MOE_MAX_K, "the union holds every row's k choices");
static_assert(MOE_MAX_EXPERTS <= 32 * 32, "the union's bitmap is one word a lane");
#define MOE_WARPS 4         // warps of a gate_up block
#define MOE_DOWN_WARPS 8    // warps of a down block
#define MOE_DOWN_ITEMS 264  // items of a down block: union experts x K parts (<= 256) + shared parts (<= 8)

// Softmax over logits[0..E) and the top-k of one row, by one warp, each lane holding NS (>= E / 32) of the logits.
// Lane j < k ends with the j-th chosen expert in e_out (decreasing probability, equal probabilities by increasing
// index) and its weight in w_out (renormalised when norm_topk); the other lanes' are unspecified.  A NaN logit makes
// its row's weights NaN, never an invalid index.
// One warp's latency chain, so every slot and round counts: each slot a lane holds costs an expf and an IEEE
// division, and a round of dependent shuffles costs more than two redux.sync.  Hence NS by the model's E, not the
// largest E, and the rounds as: each lane's best (probability, expert) as one integer key, the warp's max key and
// the lowest expert holding it.
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

// Row routing by the router's kind (routers.cu): one warp, each lane holding NS of the row's logits (32 NS >= E);
// lane j < k ends with choice j and its final weight.  NS is the launch's: the route kernels are compiled for each
// of MOE_SLOTS and the host takes the fewest that hold E (each slot costs the warp's chain 100-150 cycles, and each
// instance has the registers of its own NS).
template <int NS>
__device__ __forceinline__ void moe_choose_row(const float* __restrict__ logits, const MoeRouter& r, int E, int k,
                                               int& e_out, float& w_out) {
    if (r.kind == MOE_ROUTER_SIGMOID_GROUPED) {
        moe_sigmoid_grouped_lane<NS>(logits, r, E, k, e_out, w_out);
    } else if (r.kind == MOE_ROUTER_SOFTMAX_GROUPED) {
        moe_softmax_grouped_lane<NS>(logits, r, E, k, e_out, w_out);
    } else if (r.kind == MOE_ROUTER_TOPK_SOFTMAX) {
        moe_topk_softmax_lane<NS>(logits, r, E, k, e_out, w_out);
    } else {
        moe_topk_lane<NS>(logits, E, k, r.norm_topk, e_out, w_out);
        w_out *= r.scaling;  // exact for a factor of 1
    }
}

// The kernels' router arguments as one MoeRouter.
__device__ __forceinline__ MoeRouter moe_router(int kind, int norm_topk, int n_group, int topk_group, float scaling,
                                                const float* correction, int use_correction) {
    MoeRouter r;
    r.kind = kind;
    r.norm_topk = norm_topk;
    r.n_group = n_group;
    r.topk_group = topk_group;
    r.scaling = scaling;
    r.correction = use_correction ? correction : nullptr;
    return r;
}

// ---------------------------------------------------------------------------------------------------
// The rows path's routing (moe_route_kernel): the router GEMV's logits -> top-k, shared gate, h = rmsnorm(x), the
// union.

// Sums of squares of x's rows [M, H] (M <= MT) in parts, by the whole block (blockDim.x == MOE_MAX_ROWS * 32):
// thread t sums its float4s t, t + 512, ... of each row (every row's loads in flight together), then a warp sum
// into ss[r][warp].
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

// h[r] = (norm_w + off) * (x[r] * inv_r) for every row r < M (off: the (1 + w) norms' 1, else 0), float4 i of a row by the threads t = i (mod nt): elementwise
// once the sums are known, so which threads write it does not change it.
__device__ __forceinline__ void moe_write_h(const float* x, const unsigned short* __restrict__ norm_w, float off,
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
            hr[i] = make_float4((bf16_to_f32_bits(g.x) + off) * (v.x * inv), (bf16_to_f32_bits(g.y) + off) * (v.y * inv),
                                (bf16_to_f32_bits(g.z) + off) * (v.z * inv), (bf16_to_f32_bits(g.w) + off) * (v.w * inv));
        }
    }
}

// Row m's routing by one warp from its logits lrow [E (+1)]: idx / wts [m, :k], sgate[m] = sigmoid(lrow[E]) when
// has_shared == 1 (a gated shared expert), 1 when 2 (ungated).  Returns lane j's choice j (-1 on the lanes j >= k).
template <int NS>
__device__ __forceinline__ int moe_route_row(const float* lrow, int m, int E, int k, const MoeRouter& router,
                                             int has_shared, int* __restrict__ idx, float* __restrict__ wts,
                                             float* __restrict__ sgate) {
    const int j = threadIdx.x & 31;  // lane j holds choice j
    int e;
    float w;
    moe_choose_row<NS>(lrow, router, E, k, e, w);
    if (j < k) {
        idx[m * k + j] = e;
        wts[m * k + j] = w;
    }
    if (has_shared && j == 0) sgate[m] = has_shared == 2 ? 1.0f : 1.0f / (1.0f + expf(-lrow[E]));
    return j < k ? e : -1;
}

// The union's positions from chosen [MOE_MAX_EXPERTS / 32], the bitmap of the experts some row chose (one word a
// lane): expert e's position is the count of chosen experts below it.  Each warp scans the words' counts for itself
// (no barrier): returns lane w's exclusive prefix (word w's first position) and the total in n.
__device__ __forceinline__ int moe_union_base(const unsigned int* chosen, int& n) {
    const int lane = threadIdx.x & 31;
    const int c = __popc(chosen[lane]);
    int incl = c;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += v;
    }
    n = __shfl_sync(0xffffffffu, incl, 31);
    return incl - c;
}

// The union position of chosen expert e, by the whole warp (lane w's base from moe_union_base); any value for e < 0.
__device__ __forceinline__ int moe_union_pos(const unsigned int* chosen, int base, int e) {
    const int w = (e >> 5) & 31;
    return __shfl_sync(0xffffffffu, base, w) + __popc(chosen[w] & ((1u << (e & 31)) - 1u));
}

// After the router GEMV: one block of MOE_MAX_ROWS warps.  logits [M, ld] (ld = E, or E + 1 with the shared
// expert's gate logit last); x [M, H] the residual stream (H % 4 == 0, 16-byte rows); norm_w bf16 [H] (8-byte
// aligned).  Writes idx [M, k], wts [M, k], sgate [M] (has_shared), h [M, H] = (norm_w + norm_offset) *
// (x * rsqrt(mean(x^2) + eps)), and the union of the experts [e_lo, e_hi) this engine holds (a tensor-parallel
// rank's; 0, E otherwise): n_union, union_e, union_mask and union_slot [., MOE_MAX_ROWS] (the expert's slot in row
// m, -1 if none).  Every row is routed over all E experts, and the others' share of the sum comes from the other
// ranks (the all-reduce).  The rows' logits are staged in dynamic shared memory (M ld floats, the launch's) beside
// the sums of squares' loads; then warp m routes row m while the warps without a row write h; then each choice of a
// held expert finds its union position in the bitmap of the chosen experts.
template <int NS>
__global__ void __launch_bounds__(MOE_MAX_ROWS * 32)
moe_route_kernel(const float* __restrict__ logits, int ld, const float* __restrict__ x,
                 const unsigned short* __restrict__ norm_w, float norm_offset, float eps, int M, int H, int E, int k,
                 int norm_topk,
                 int has_shared, int* __restrict__ idx, float* __restrict__ wts, float* __restrict__ sgate,
                 float* __restrict__ h, int* __restrict__ n_union, int* __restrict__ union_e,
                 unsigned int* __restrict__ union_mask, int* __restrict__ union_slot, int e_lo, int e_hi,
                 int kind, int n_group, int topk_group, float scaling, const float* __restrict__ correction,
                 int use_correction) {
    extern __shared__ float s_logit[];                           // [M, ld]
    __shared__ unsigned int s_chosen[MOE_MAX_EXPERTS / 32];      // bit e: some row chose held expert e
    __shared__ signed char s_slot[MOE_MAX_UNION][MOE_MAX_ROWS];  // union position u's slot in row m, -1 if none
    __shared__ float s_ss[MOE_MAX_ROWS][MOE_MAX_ROWS];
    for (int t = threadIdx.x; t < MOE_MAX_UNION * MOE_MAX_ROWS; t += blockDim.x) (&s_slot[0][0])[t] = -1;
    if (threadIdx.x < MOE_MAX_EXPERTS / 32) s_chosen[threadIdx.x] = 0u;
    pdl_wait();
    pdl_trigger();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int t = threadIdx.x; t < M * ld; t += blockDim.x) s_logit[t] = logits[t];
    moe_sumsq_parts<MOE_MAX_ROWS>(x, M, H, s_ss);
    __syncthreads();
    int e = -1;  // lane j < k of warp m < M: row m's choice j
    if (warp < M) {
        const MoeRouter router = moe_router(kind, norm_topk, n_group, topk_group, scaling, correction, use_correction);
        e = moe_route_row<NS>(s_logit + warp * ld, warp, E, k, router, has_shared, idx, wts, sgate);
        if (e >= e_lo && e < e_hi) atomicOr(&s_chosen[e >> 5], 1u << (e & 31));
    }
    const int hw0 = M < MOE_MAX_ROWS ? M : 0;  // warps [hw0, 16) write h (with 16 rows: every warp, after its row)
    if (warp >= hw0) moe_write_h(x, norm_w, norm_offset, s_ss, eps, M, H, threadIdx.x - 32 * hw0, 32 * (MOE_MAX_ROWS - hw0), h);
    __syncthreads();
    int n;
    const int base = moe_union_base(s_chosen, n);
    const int pos = moe_union_pos(s_chosen, base, e);
    if (e >= e_lo && e < e_hi) s_slot[pos][warp] = (signed char)lane;
    for (int w = (e_lo >> 5) + warp; w <= (e_hi - 1) >> 5; w += MOE_MAX_ROWS) {  // expert 32 w + lane, if chosen
        const int p = moe_union_pos(s_chosen, base, 32 * w + lane);
        if ((s_chosen[w] >> lane) & 1u) union_e[p] = 32 * w + lane;
    }
    __syncthreads();
    for (int t = threadIdx.x; t < n * MOE_MAX_ROWS; t += blockDim.x)
        union_slot[t] = s_slot[t / MOE_MAX_ROWS][t % MOE_MAX_ROWS];
    for (int u = threadIdx.x; u < n; u += blockDim.x) {
        unsigned int mask = 0u;
        for (int r = 0; r < M; ++r)
            if (s_slot[u][r] >= 0) mask |= 1u << r;
        union_mask[u] = mask;
    }
    if (threadIdx.x == 0) *n_union = n;
}

// The prefill router: top-k only, one warp per row, rows 0..T-1 (no union, no h); blocks of MOE_TOPK_WARPS warps.
#define MOE_TOPK_WARPS 8
template <int NS>
__global__ void moe_topk_rows_kernel(const float* __restrict__ logits, int ld, int T, int E, int k, int norm_topk,
                                     int has_shared, int* __restrict__ idx, float* __restrict__ wts,
                                     float* __restrict__ sgate, int kind, int n_group, int topk_group, float scaling,
                                     const float* __restrict__ correction, int use_correction) {
    pdl_wait();
    pdl_trigger();
    const int row = blockIdx.x * MOE_TOPK_WARPS + (threadIdx.x >> 5);
    if (row >= T) return;
    const MoeRouter router = moe_router(kind, norm_topk, n_group, topk_group, scaling, correction, use_correction);
    moe_route_row<NS>(logits + (u64)row * ld, row, E, k, router, has_shared, idx, wts, sgate);
}

// ---------------------------------------------------------------------------------------------------
// The experts' weights in a weight format (steps 3 and 4, and the prefill's dequantization below): one policy struct
// per format, the kernels templates over it, so that every format runs the same grids, union, items, parts and
// summation order and differs only in how a lane reads a 16-byte chunk of a weight row.  A policy W has
//   V      the weights a chunk holds (K % V == 0: a row is K / V chunks, 16-byte aligned);
//   P      the weights widened at a time (V / P pieces a chunk), so that a piece of each of a warp's rows and the
//          activations it meets stay in registers;
//   U      the chunks of a row in flight per lane;
//   WIDEN_ONCE  whether a piece is widened once for all the rows of x (its conversion costs more than the registers
//          its P floats hold: FP8, MXFP4) or at each use (bf16: a shift, as the registers are scarcer);
//   Scale  the element of its scale grid [E, SB, KB]: expert e's weight (n, k) is scaled by [e - e_lo, n / srow,
//          k / bk], SB = ceil(N / srow), KB = ceil(K / bk), bk % V == 0 (a chunk has one scale);
//   Chunk  a chunk as loaded (its 16 bytes and its scale): load(row, srp, cpb, c) reads chunk c of a weight row whose
//          scale row is srp (cpb = bk / V chunks a scale), and widen(chunk, piece, w) gives its weights piece P ..
//          piece P + P - 1 (k order) as fp32, each exactly the value the NumPy engine's dequantization gives.
// A new format is one more struct, its instances at the end of this file and its entry in kernels/moe.py's
// EXPERT_FORMATS.

// bf16 experts: 8 weights a chunk, no scales (the scale arguments are not read).
struct MoeBf16 {
    static constexpr int V = 8, P = 8, U = 4;
    static constexpr bool WIDEN_ONCE = false;
    typedef unsigned char Scale;
    struct Chunk {
        uint4 q;
    };
    static __device__ __forceinline__ Chunk load(const uint4* row, const Scale* srp, int cpb, int c) {
        return Chunk{ld_stream_u4(row + c)};
    }
    static __device__ __forceinline__ void widen(const Chunk& ch, int piece, float (&w)[P]) {
        const unsigned int q[4] = {ch.q.x, ch.q.y, ch.q.z, ch.q.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            w[2 * j] = bf16_lo(q[j]);
            w[2 * j + 1] = bf16_hi(q[j]);
        }
    }
};

// FP8 block experts (models/quantized/fp8.py): 16 e4m3 weights a chunk, widened exactly (e4m3.cu) and multiplied by
// their block's fp32 scale; srow the block height, or 1 where the engine expanded a fused gate/up's scales to one row
// each (backends/cuda/fp8.py).  2 chunks in flight: the weights of the bf16 policy's 4.
struct MoeFp8 {
    static constexpr int V = 16, P = 16, U = 2;
    static constexpr bool WIDEN_ONCE = true;
    typedef float Scale;
    struct Chunk {
        uint4 q;
        float s;
    };
    static __device__ __forceinline__ Chunk load(const uint4* row, const Scale* srp, int cpb, int c) {
        return Chunk{ld_stream_u4(row + c), __ldg(srp + c / cpb)};
    }
    static __device__ __forceinline__ void widen(const Chunk& ch, int piece, float (&w)[P]) {
        e4m3x16_scaled(ch.q, ch.s, w);
    }
};

// MXFP4 experts (models/quantized/mxfp4.py), the checkpoint's bytes as they are: 32 e2m1 weights a chunk (two a
// byte, the low nibble first: a `_blocks` row of K / 2 bytes) and its E8M0 `_scales` byte s (srow 1, bk 32).
// weight = value * 2^(s - 127), computed as (2 value) * 2^(s - 128) (e2m1.cu's doubled values): the factor is an
// fp32 for every byte (2^-128 subnormal, 2^127 normal), so the product is the correctly rounded one, NumPy's ldexp
// bit for bit (infinities included).  A piece is one 32-bit word: 8 weights; 2 chunks in flight, as FP8 (4 held
// 255 registers in the down kernel, ptxas sm_90).
struct MoeMxfp4 {
    static constexpr int V = 32, P = 8, U = 2;
    static constexpr bool WIDEN_ONCE = true;
    typedef unsigned char Scale;
    struct Chunk {
        uint4 q;
        unsigned int s;
    };
    static __device__ __forceinline__ Chunk load(const uint4* row, const Scale* srp, int cpb, int c) {
        return Chunk{ld_stream_u4(row + c), (unsigned int)__ldg(srp + c)};  // cpb == 1
    }
    static __device__ __forceinline__ void widen(const Chunk& ch, int piece, float (&w)[P]) {
        const unsigned int word = piece == 0 ? ch.q.x : piece == 1 ? ch.q.y : piece == 2 ? ch.q.z : ch.q.w;
        const float f = __uint_as_float(ch.s >= 2u ? (ch.s - 1u) << 23 : 0x00200000u << ch.s);  // 2^(s - 128)
        e2m1x8<1>(word, w);
#pragma unroll
        for (int i = 0; i < P; ++i) w[i] *= f;
    }
};

template <class A, class B>
struct moe_same {
    static constexpr bool value = false;
};
template <class A>
struct moe_same<A, A> {
    static constexpr bool value = true;
};

// Weight row `row` of expert slot es (expert e_lo + es) of a stacked weight [E, N, K] in format W (bytes w, scale
// grid ws [E, SB, KB]): its chunks, and its scale row.
template <class W>
__device__ __forceinline__ const uint4* moe_row(const unsigned char* w, int N, int K, int es, int row) {
    return reinterpret_cast<const uint4*>(w + ((u64)es * N + row) * K * 16 / W::V);
}
template <class W>
__device__ __forceinline__ const typename W::Scale* moe_scale_row(const unsigned char* ws, int SB, int srow, int KB,
                                                                   int es, int row) {
    return reinterpret_cast<const typename W::Scale*>(ws) + ((u64)es * SB + row / srow) * KB;
}

// One step of a lane over UU chunks (c, c + 32, ...) of RW weight rows in format W, for the rows m of `mask`, whose
// activations are row ri[m] of x (K floats each).  All chunks must be < K / V.  With TAIL, only the chunks below
// `end` are read and added (the last, partial step of a range).  Each piece of a chunk is widened once and used for
// every row of x; per (m, r) its weights meet x in k order, one fmaf chain.
template <class W, int MT, int RW, int UU, bool TAIL>
__device__ __forceinline__ void moe_step(const uint4* const (&wrow)[RW], const typename W::Scale* const (&srp)[RW],
                                         int cpb, const float* __restrict__ x, const int (&ri)[MT], int K,
                                         unsigned int mask, int c, int end, float (&acc)[RW][MT]) {
    typename W::Chunk wv[UU][RW];
#pragma unroll
    for (int u = 0; u < UU; ++u)
#pragma unroll
        for (int r = 0; r < RW; ++r)
            wv[u][r] = (!TAIL || c + 32 * u < end) ? W::load(wrow[r], srp[r], cpb, c + 32 * u) : typename W::Chunk{};
#pragma unroll
    for (int u = 0; u < UU; ++u) {
        if (TAIL && c + 32 * u >= end) break;
#pragma unroll
        for (int piece = 0; piece < W::V / W::P; ++piece) {
            float wf[RW][W::P];
            if constexpr (W::WIDEN_ONCE) {
#pragma unroll
                for (int r = 0; r < RW; ++r) W::widen(wv[u][r], piece, wf[r]);
            }
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                if (!((mask >> m) & 1u)) continue;  // uniform over the warp
                const float4* xp = reinterpret_cast<const float4*>(x + (u64)ri[m] * K) + (W::V / 4) * (c + 32 * u) +
                                   (W::P / 4) * piece;
                float xv[W::P];
#pragma unroll
                for (int j = 0; j < W::P / 4; ++j) {
                    const float4 v = __ldg(xp + j);
                    xv[4 * j] = v.x;
                    xv[4 * j + 1] = v.y;
                    xv[4 * j + 2] = v.z;
                    xv[4 * j + 3] = v.w;
                }
#pragma unroll
                for (int r = 0; r < RW; ++r) {
                    if constexpr (!W::WIDEN_ONCE) W::widen(wv[u][r], piece, wf[r]);
                    float s = acc[r][m];
#pragma unroll
                    for (int j = 0; j < W::P; ++j) s = fmaf(wf[r][j], xv[j], s);
                    acc[r][m] = s;
                }
            }
        }
    }
}

// acc[r][m] += the dot products of weight rows wrow[r] (format W) with row ri[m] of x (rows K floats apart) over
// the chunks [c0, c1) of K, per lane (not yet reduced over the warp).  A lane adds its chunks in increasing order;
// the last partial step keeps all of its loads in flight (predicated, not a one-chunk loop: a 768-wide bf16 expert
// row is 3 chunks a lane, which one-chunk steps read one at a time).
template <class W, int MT, int RW>
__device__ __forceinline__ void moe_dots(const uint4* const (&wrow)[RW], const typename W::Scale* const (&srp)[RW],
                                         int cpb, const float* __restrict__ x, const int (&ri)[MT], unsigned int mask,
                                         int K, int c0, int c1, float (&acc)[RW][MT]) {
    int c = c0 + (threadIdx.x & 31);
    for (; c + 32 * (W::U - 1) < c1; c += 32 * W::U)
        moe_step<W, MT, RW, W::U, false>(wrow, srp, cpb, x, ri, K, mask, c, c1, acc);
    if (c < c1) moe_step<W, MT, RW, W::U, true>(wrow, srp, cpb, x, ri, K, mask, c, c1, acc);
}

// moe_dots of rows n0 .. n0 + R - 1 of expert slot es's weight [N, K] (format W; rows past N - 1 read as row N - 1,
// never stored) over part p of np of its K / V chunks.
template <class W, int MT, int R>
__device__ __forceinline__ void moe_part(const unsigned char* w, const unsigned char* ws, int SB, int srow, int bk,
                                         int KB, int N, int K, int es, int n0, const float* __restrict__ x,
                                         const int (&ri)[MT], unsigned int mask, int p, int np, float (&acc)[R][MT]) {
    const uint4* wrow[R];
    const typename W::Scale* srp[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int n = min(n0 + r, N - 1);
        wrow[r] = moe_row<W>(w, N, K, es, n);
        srp[r] = moe_scale_row<W>(ws, SB, srow, KB, es, n);
    }
    const int C = K / W::V;
    moe_dots<W, MT, R>(wrow, srp, bk / W::V, x, ri, mask, K, p * C / np, (p + 1) * C / np, acc);
}

// act[(m * k + j), n] = silu(g) * u, g = gate_e[n] . h[m] (+ bias[e, n]), u = up_e[n] . h[m] (+ bias[e, I + n])
// for the rows m that chose expert e = union_e[blockIdx.y] (slot j), n in this warp's R rows; act == ACT_SWIGLU_OAI:
// glu_oai(g, u, limit, alpha) instead.  w_gate_up [E, 2I, H] in format W (bytes w, scales ws [E, SB, KB] with srow,
// bk: see the policies), bias bf16 [E, 2I] (gate rows, then up rows, as the weights; read when use_bias): experts
// e_lo .. (a tensor-parallel rank's, e_lo its first), expert e at index e - e_lo.  MT >= M; H % W::V == 0.
template <int MT, int R, class W>
__global__ void __launch_bounds__(MOE_WARPS * 32)
moe_gate_up_kernel(const float* __restrict__ h, const unsigned char* __restrict__ w,
                   const unsigned char* __restrict__ ws, int SB, int srow, int bk, int KB,
                   const int* __restrict__ n_union, const int* __restrict__ union_e,
                   const unsigned int* __restrict__ union_mask, const int* __restrict__ union_slot,
                   float* __restrict__ act, int I, int H, int k, int e_lo,
                   const unsigned short* __restrict__ bias, int use_bias, int act_kind, float limit, float alpha) {
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
    const typename W::Scale* srp[2 * R];
#pragma unroll
    for (int r = 0; r < 2 * R; ++r) {
        const int n = min(n0 + (r % R), I - 1);  // rows past I - 1 are read, never stored
        wrow[r] = moe_row<W>(w, 2 * I, H, e - e_lo, r < R ? n : I + n);
        srp[r] = moe_scale_row<W>(ws, SB, srow, KB, e - e_lo, r < R ? n : I + n);
    }
    int ri[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) ri[m] = m;
    float acc[2 * R][MT];
#pragma unroll
    for (int r = 0; r < 2 * R; ++r)
#pragma unroll
        for (int m = 0; m < MT; ++m) acc[r][m] = 0.0f;
    moe_dots<W, MT, 2 * R>(wrow, srp, bk / W::V, h, ri, mask, H, 0, H / W::V, acc);
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
                float g = acc[r][m], up = acc[R + r][m];
                if (use_bias) {
                    const unsigned short* b = bias + (u64)(e - e_lo) * 2 * I;
                    g += bf16_to_f32_bits(b[n]);
                    up += bf16_to_f32_bits(b[I + n]);
                }
                act[((u64)m * k + j) * I + n] =
                    act_kind == ACT_SWIGLU_OAI ? glu_oai(g, up, limit, alpha) : g / (1.0f + expf(-g)) * up;
            }
        }
    }
}

// out[m, n] (=|+=) sum over the union's experts e chosen by row m (slot j) of wts[m, j] *
// (down_e[n] . act[m * k + j])  [+ sgate[m] * (shared_down[n] . act_shared[m]) when S > 0], for the
// block's R output rows n.  w_down [E, H, I] in format W (w, ws [E, SB, KB], srow, bk; experts e_lo .., as
// w_gate_up; I % W::V == 0); the shared expert's w_shared [H, S] in format W when s_fmt (w_s, ws_s [ceil(H / s_srow),
// s_KB], s_srow, s_bk: an FP8 projection's weight beside FP8 experts; S % W::V == 0), else bf16 (w_s; S % 8 == 0);
// act_shared [M, S]; out [M, H]; bias bf16 [E, H] (experts e_lo .., as w_down; read when use_bias): expert e's
// bias[e, n] is added to its dot before the routing weight scales it.
// The block's MOE_DOWN_WARPS warps share the work as items: item u * P + p is part p of P of union
// expert u's K (chunks [p C / P, (p + 1) C / P)), then PS items split the shared expert's K the same way (over each
// weight's own chunks); warp w takes items w, w + MOE_DOWN_WARPS, ...  Each item's warp-reduced dots go to shared
// memory, and one thread per (r, m) sums them: parts in order, then experts in increasing order weighted by wts (as
// the reference sums), then the shared expert.  P depends on the model only (kernels/moe.py), never on
// M, so a row's numbers do not depend on the other rows: a verify row equals its decode row.
template <int MT, int R, class W>
__global__ void __launch_bounds__(MOE_DOWN_WARPS * 32)
moe_down_kernel(const float* __restrict__ act, const unsigned char* __restrict__ w, const unsigned char* __restrict__ ws,
                int SB, int srow, int bk, int KB, const float* __restrict__ wts,
                const int* __restrict__ n_union, const int* __restrict__ union_e,
                const unsigned int* __restrict__ union_mask, const int* __restrict__ union_slot,
                const float* __restrict__ act_s, const unsigned char* __restrict__ w_s,
                const unsigned char* __restrict__ ws_s, int s_srow, int s_bk, int s_KB, int s_fmt,
                const float* __restrict__ sgate, int S, float* __restrict__ out, int M, int H, int I, int k,
                int P, int PS, int accumulate, int e_lo, const unsigned short* __restrict__ bias,
                int use_bias) {
    __shared__ float part[MOE_DOWN_ITEMS][R][MT];
    __shared__ float wsm[MOE_MAX_UNION][MT];  // row m's weight for union expert u (read by the item warps)
    __shared__ unsigned int msk[MOE_MAX_UNION];
    __shared__ float bsm[MOE_MAX_UNION][R];  // union expert u's down bias at the block's rows (0 without one)
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
        const bool first = u == u_first;
        const unsigned int mask = sh ? (M >= 32 ? 0xffffffffu : ((1u << M) - 1u)) : first ? mask_first : union_mask[u];
        const int e = sh ? e_lo : first ? e_first : union_e[u];
        int ri[MT];
        if (sh) {  // the shared expert: row m's activations are row m of act_s
#pragma unroll
            for (int m = 0; m < MT; ++m) ri[m] = min(m, M - 1);
        } else {  // row m's activations for expert u: row m * k + j of act
#pragma unroll
            for (int m = 0; m < MT; ++m) ri[m] = m * k + (((mask >> m) & 1u) ? union_slot[u * MOE_MAX_ROWS + m] : 0);
        }
        if (!sh && p == 0) {  // the weights the final sum needs, read here in parallel (not in its loop)
            if (lane < MT && lane < M && ((mask >> lane) & 1u))
                wsm[u][lane] = wts[lane * k + union_slot[u * MOE_MAX_ROWS + lane]];
            if (lane == 0) msk[u] = mask;
            if (lane < R)
                bsm[u][lane] = use_bias && n0 + lane < H
                                   ? bf16_to_f32_bits(bias[(u64)(e - e_lo) * H + n0 + lane]) : 0.0f;
        }
        float acc[R][MT];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int m = 0; m < MT; ++m) acc[r][m] = 0.0f;
        if (sh && !moe_same<W, MoeBf16>::value && !s_fmt)  // a bf16 shared expert beside experts in another format
            moe_part<MoeBf16, MT, R>(w_s, w_s, 1, 1, 8, 0, H, S, 0, n0, act_s, ri, mask, p, np, acc);
        else
            moe_part<W, MT, R>(sh ? w_s : w, sh ? ws_s : ws, sh ? 1 : SB, sh ? s_srow : srow, sh ? s_bk : bk,
                               sh ? s_KB : KB, H, sh ? S : I, e - e_lo, n0, sh ? act_s : act, ri, mask, p, np, acc);
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
        if (use_bias) d += bsm[u][r];
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

// The prefill's bf16 weights of one expert (its batched cuBLAS GEMMs): out[n, k] = bf16(weight (n, k) of expert slot
// es of a stacked weight [E, N, K] in format W), round to nearest even: the rows path's values rounded once.  out
// bf16 [N, K]; one thread a chunk (V weights, V / 8 16-byte stores).
template <class W>
__global__ void moe_dequant_bf16_kernel(const unsigned char* __restrict__ w, const unsigned char* __restrict__ ws,
                                        int SB, int srow, int bk, int KB, int es, uint4* __restrict__ out, int N,
                                        int K) {
    pdl_wait();  // its output may be read by a kernel launched before this one finished (common.cu)
    pdl_trigger();
    const int C = K / W::V;
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)N * C) return;
    const int n = (int)(i / C), c = (int)(i % C);
    const typename W::Chunk q = W::load(moe_row<W>(w, N, K, es, n), moe_scale_row<W>(ws, SB, srow, KB, es, n),
                                        bk / W::V, c);
#pragma unroll
    for (int piece = 0; piece < W::V / W::P; ++piece) {
        float v[W::P];
        W::widen(q, piece, v);
#pragma unroll
        for (int j = 0; j < W::P / 8; ++j)
            out[i * (W::V / 8) + piece * (W::P / 8) + j] =
                make_uint4(pack_bf16x2(v[8 * j], v[8 * j + 1]), pack_bf16x2(v[8 * j + 2], v[8 * j + 3]),
                           pack_bf16x2(v[8 * j + 4], v[8 * j + 5]), pack_bf16x2(v[8 * j + 6], v[8 * j + 7]));
    }
}

// Instances (kernels/moe.py names them): per format W, MT in {1, 2, 4, 8, 16}; gate_up R = 1; down R = 4, 4, 4, 2,
// 1 (its shared memory holds items x R x MT floats: 16.5 KB for each); the prefill's dequantization for the formats
// the prefill cannot read as stored (MXFP4; FP8's is qgemv.cu's qdequant_bf16_kernel); the route and top-k kernels
// per slot count (MOE_SLOTS).
#ifndef METRALE_NVRTC  // a standalone `nvcc -ptx moe.cu` compiles every instance the engine uses
#define MOE_INSTANCES(MT, DR, W)                                                                                     \
    template __global__ void moe_gate_up_kernel<MT, 1, W>(                                                           \
        const float*, const unsigned char*, const unsigned char*, int, int, int, int, const int*, const int*,        \
        const unsigned int*, const int*, float*, int, int, int, int, const unsigned short*, int, int, float, float); \
    template __global__ void moe_down_kernel<MT, DR, W>(                                                             \
        const float*, const unsigned char*, const unsigned char*, int, int, int, int, const float*, const int*,      \
        const int*, const unsigned int*, const int*, const float*, const unsigned char*, const unsigned char*, int,  \
        int, int, int, const float*, int, float*, int, int, int, int, int, int, int, int, const unsigned short*,     \
        int);
#define MOE_ROUTE_INSTANCES(NS)                                                                            \
    template __global__ void moe_route_kernel<NS>(const float*, int, const float*, const unsigned short*, \
                                                  float, float, int, int, int, int, int, int, int*,        \
                                                  float*, float*, float*, int*, int*, unsigned int*, int*, \
                                                  int, int, int, int, int, float, const float*, int);      \
    template __global__ void moe_topk_rows_kernel<NS>(const float*, int, int, int, int, int, int, int*,   \
                                                      float*, float*, int, int, int, float, const float*,  \
                                                      int);
MOE_ROUTE_INSTANCES(1)
MOE_ROUTE_INSTANCES(4)
MOE_ROUTE_INSTANCES(8)
MOE_ROUTE_INSTANCES(16)
MOE_ROUTE_INSTANCES(32)
#define MOE_FORMAT_INSTANCES(W) \
    MOE_INSTANCES(1, 4, W)      \
    MOE_INSTANCES(2, 4, W)      \
    MOE_INSTANCES(4, 4, W)      \
    MOE_INSTANCES(8, 2, W)      \
    MOE_INSTANCES(16, 1, W)
MOE_FORMAT_INSTANCES(MoeBf16)
MOE_FORMAT_INSTANCES(MoeFp8)
MOE_FORMAT_INSTANCES(MoeMxfp4)
template __global__ void moe_dequant_bf16_kernel<MoeMxfp4>(const unsigned char*, const unsigned char*, int, int, int,
                                                           int, int, uint4*, int, int);
#endif
