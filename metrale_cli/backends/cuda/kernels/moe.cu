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
//   4. moe_down_kernel: grid (H tiles): each warp owns R output rows, walks the union in expert order
//      accumulating  w[m, j] * down_e[n] . act[m * k + j]  for the rows of each expert's mask, adds the
//      shared expert  sigmoid(g[m]) * shared_down[n] . act_shared[m]  when given, and writes or adds
//      (the residual stream) the sum once.  No atomics: the result does not depend on the launch.
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
#define MOE_WARPS 4
#define MOE_PICKED -1.0f  // a picked expert's probability in the top-k search (probabilities are >= 0)
#define MOE_NAN_P -0.5f   // a NaN probability: chosen after every real one, its weight stays NaN

// Softmax over logits[0..E) and the top-k of one row, by one warp.  Every lane ends with the chosen
// experts pe[0..k) (decreasing probability, equal probabilities by increasing index) and their weights
// pw[0..k) (renormalised when norm_topk).  A NaN logit makes its row's weights NaN, never an invalid
// index.
__device__ __forceinline__ void moe_topk_row(const float* __restrict__ logits, int E, int k, int norm_topk,
                                             int (&pe)[MOE_MAX_K], float (&pw)[MOE_MAX_K]) {
    const int lane = threadIdx.x & 31;
    float v[MOE_MAX_EXPERTS / 32];
    float mx = -METRALE_INF;
#pragma unroll
    for (int i = 0; i < MOE_MAX_EXPERTS / 32; ++i) {
        const int e = lane + 32 * i;
        v[i] = e < E ? logits[e] : -METRALE_INF;
        mx = fmaxf(mx, v[i]);
    }
    mx = warp_max(mx);
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < MOE_MAX_EXPERTS / 32; ++i) {
        const int e = lane + 32 * i;
        v[i] = e < E ? expf(v[i] - mx) : 0.0f;
        s += v[i];
    }
    s = warp_sum(s);
    bool any_nan = false;
#pragma unroll
    for (int i = 0; i < MOE_MAX_EXPERTS / 32; ++i) {
        const int e = lane + 32 * i;
        float p = v[i] / s;
        if (p != p) {
            any_nan = true;
            p = MOE_NAN_P;
        }
        v[i] = e < E ? p : MOE_PICKED;
    }
    any_nan = __any_sync(0xffffffffu, any_nan);
#pragma unroll
    for (int j = 0; j < MOE_MAX_K; ++j) {
        if (j >= k) break;
        float bv = MOE_PICKED;
        int be = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < MOE_MAX_EXPERTS / 32; ++i) {  // a lane's experts in increasing order
            if (v[i] > bv) {
                bv = v[i];
                be = lane + 32 * i;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oe = __shfl_xor_sync(0xffffffffu, be, o);
            if (ov > bv || (ov == bv && oe < be)) {
                bv = ov;
                be = oe;
            }
        }
#pragma unroll
        for (int i = 0; i < MOE_MAX_EXPERTS / 32; ++i)
            if (lane + 32 * i == be) v[i] = MOE_PICKED;
        pe[j] = be;
        pw[j] = any_nan ? __int_as_float(0x7fc00000) : bv;
    }
    if (norm_topk) {
        float t = 0.0f;
#pragma unroll
        for (int j = 0; j < MOE_MAX_K; ++j)
            if (j < k) t += pw[j];
#pragma unroll
        for (int j = 0; j < MOE_MAX_K; ++j)
            if (j < k) pw[j] = pw[j] / t;
    }
}

// The rows path's router after the logits GEMV: one block of MOE_MAX_ROWS warps, warp m for row m.
// logits [M, ld]; x [M, H] the residual stream; norm_w bf16 [H].  Writes idx [M, k], wts [M, k],
// sgate [M] (has_shared), h [M, H] = norm_w * (x * rsqrt(mean(x^2) + eps)), and the union: n_union,
// union_e [n_union] (increasing), union_mask [n_union] (bit m: row m chose it), union_slot
// [n_union, MOE_MAX_ROWS] (its slot j in row m, -1 for rows that did not choose it).
extern "C" __global__ void __launch_bounds__(MOE_MAX_ROWS * 32)
moe_route_kernel(const float* __restrict__ logits, int ld, const float* __restrict__ x,
                 const unsigned short* __restrict__ norm_w, float eps, int M, int H, int E, int k, int norm_topk,
                 int has_shared, int* __restrict__ idx, float* __restrict__ wts, float* __restrict__ sgate,
                 float* __restrict__ h, int* __restrict__ n_union, int* __restrict__ union_e,
                 unsigned int* __restrict__ union_mask, int* __restrict__ union_slot) {
    __shared__ signed char slot_of[MOE_MAX_EXPERTS][MOE_MAX_ROWS];
    for (int t = threadIdx.x; t < MOE_MAX_EXPERTS * MOE_MAX_ROWS; t += blockDim.x)
        (&slot_of[0][0])[t] = -1;
    pdl_wait();
    pdl_trigger();
    __syncthreads();
    const int lane = threadIdx.x & 31, m = threadIdx.x >> 5;
    if (m < M) {
        int pe[MOE_MAX_K];
        float pw[MOE_MAX_K];
        moe_topk_row(logits + (u64)m * ld, E, k, norm_topk, pe, pw);
#pragma unroll
        for (int j = 0; j < MOE_MAX_K; ++j) {
            if (j < k && lane == j) {
                idx[m * k + j] = pe[j];
                wts[m * k + j] = pw[j];
                slot_of[pe[j]][m] = (signed char)j;
            }
        }
        if (has_shared && lane == 0) sgate[m] = 1.0f / (1.0f + expf(-logits[(u64)m * ld + E]));
        // h = rmsnorm(x) for this row (the experts' input)
        const float* xr = x + (u64)m * H;
        float ss = 0.0f;
        for (int i = lane; i < H; i += 32) ss = fmaf(xr[i], xr[i], ss);
        const float inv = rsqrtf(warp_sum(ss) / (float)H + eps);
        for (int i = lane; i < H; i += 32) h[(u64)m * H + i] = bf16_to_f32_bits(norm_w[i]) * (xr[i] * inv);
    }
    __syncthreads();
    if (m == 0) {  // warp 0 lists the chosen experts in increasing order
        int base = 0;
        for (int e0 = 0; e0 < E; e0 += 32) {
            const int e = e0 + lane;
            unsigned int mask = 0u;
            if (e < E)
                for (int r = 0; r < M; ++r)
                    if (slot_of[e][r] >= 0) mask |= 1u << r;
            const unsigned int used = __ballot_sync(0xffffffffu, mask != 0u);
            if (mask != 0u) {
                const int pos = base + __popc(used & ((1u << lane) - 1u));
                union_e[pos] = e;
                union_mask[pos] = mask;
                for (int r = 0; r < MOE_MAX_ROWS; ++r) union_slot[pos * MOE_MAX_ROWS + r] = slot_of[e][r];
            }
            base += __popc(used);
        }
        if (lane == 0) *n_union = base;
    }
}

// The prefill router: top-k only, one warp per row, rows 0..T-1 (no union, no h).
extern "C" __global__ void moe_topk_rows_kernel(const float* __restrict__ logits, int ld, int T, int E, int k,
                                                int norm_topk, int has_shared, int* __restrict__ idx,
                                                float* __restrict__ wts, float* __restrict__ sgate) {
    pdl_wait();
    pdl_trigger();
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= T) return;
    int pe[MOE_MAX_K];
    float pw[MOE_MAX_K];
    moe_topk_row(logits + (u64)row * ld, E, k, norm_topk, pe, pw);
#pragma unroll
    for (int j = 0; j < MOE_MAX_K; ++j) {
        if (j < k && lane == j) {
            idx[(u64)row * k + j] = pe[j];
            wts[(u64)row * k + j] = pw[j];
        }
    }
    if (has_shared && lane == 0) sgate[row] = 1.0f / (1.0f + expf(-logits[(u64)row * ld + E]));
}

// One step of a lane over UU chunks (c, c + 32, ...) of RW weight rows, for the rows m of `mask`,
// whose activations are row ri[m] of x (K floats each).  All chunks must be < K / 8.
template <int MT, int RW, int UU>
__device__ __forceinline__ void moe_step(const uint4* const (&wrow)[RW], const float* __restrict__ x,
                                         const int (&ri)[MT], int K, unsigned int mask, int c,
                                         float (&acc)[RW][MT]) {
    uint4 wv[UU][RW];
#pragma unroll
    for (int u = 0; u < UU; ++u)
#pragma unroll
        for (int r = 0; r < RW; ++r) wv[u][r] = ld_stream_u4(wrow[r] + c + 32 * u);
#pragma unroll
    for (int u = 0; u < UU; ++u) {
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            if (!((mask >> m) & 1u)) continue;  // uniform over the warp
            const float4* xp = reinterpret_cast<const float4*>(x + (u64)ri[m] * K) + 2 * (c + 32 * u);
            const float4 xa = __ldg(xp);
            const float4 xb = __ldg(xp + 1);
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

// acc[r][m] += the dot products of weight rows wrow[r] (K bf16) with row ri[m] of x over the whole K,
// per lane (not yet reduced over the warp).
template <int MT, int RW, int U>
__device__ __forceinline__ void moe_dots(const uint4* const (&wrow)[RW], const float* __restrict__ x,
                                         const int (&ri)[MT], unsigned int mask, int K, float (&acc)[RW][MT]) {
    const int lane = threadIdx.x & 31;
    const int C = K >> 3;
    int c = lane;
    for (; c + 32 * (U - 1) < C; c += 32 * U) moe_step<MT, RW, U>(wrow, x, ri, K, mask, c, acc);
    for (; c < C; c += 32) moe_step<MT, RW, 1>(wrow, x, ri, K, mask, c, acc);
}

// act[(m * k + j), n] = silu(gate_e[n] . h[m]) * (up_e[n] . h[m]) for the rows m that chose expert
// e = union_e[blockIdx.y] (slot j), n in this warp's R rows.  w_gate_up [E, 2I, H].  MT >= M.
template <int MT, int R, int U>
__global__ void __launch_bounds__(MOE_WARPS * 32)
moe_gate_up_kernel(const float* __restrict__ h, const unsigned short* __restrict__ w,
                   const int* __restrict__ n_union, const int* __restrict__ union_e,
                   const unsigned int* __restrict__ union_mask, const int* __restrict__ union_slot,
                   float* __restrict__ act, int I, int H, int k) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int u = blockIdx.y;
    const int n0 = (blockIdx.x * MOE_WARPS + warp) * R;
    pdl_wait();
    pdl_trigger();
    if (u >= *n_union || n0 >= I) return;  // whole warps; no block barrier
    const int e = union_e[u];
    const unsigned int mask = union_mask[u];
    const uint4* wrow[2 * R];
#pragma unroll
    for (int r = 0; r < 2 * R; ++r) {
        const int n = min(n0 + (r % R), I - 1);  // rows past I - 1 are read, never stored
        wrow[r] = reinterpret_cast<const uint4*>(w + ((u64)e * 2 * I + (r < R ? n : I + n)) * H);
    }
    int ri[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) ri[m] = m;
    float acc[2 * R][MT];
#pragma unroll
    for (int r = 0; r < 2 * R; ++r)
#pragma unroll
        for (int m = 0; m < MT; ++m) acc[r][m] = 0.0f;
    moe_dots<MT, 2 * R, U>(wrow, h, ri, mask, H, acc);
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
// warp's R output rows n.  w_down [E, H, I]; w_shared [H, S]; act_shared [M, S]; out [M, H].
template <int MT, int R, int U>
__global__ void __launch_bounds__(MOE_WARPS * 32)
moe_down_kernel(const float* __restrict__ act, const unsigned short* __restrict__ w, const float* __restrict__ wts,
                const int* __restrict__ n_union, const int* __restrict__ union_e,
                const unsigned int* __restrict__ union_mask, const int* __restrict__ union_slot,
                const float* __restrict__ act_s, const unsigned short* __restrict__ w_s,
                const float* __restrict__ sgate, int S, float* __restrict__ out, int M, int H, int I, int k,
                int accumulate) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n0 = (blockIdx.x * MOE_WARPS + warp) * R;
    pdl_wait();
    pdl_trigger();
    if (n0 >= H) return;
    const int nu = *n_union;
    float y[R][MT];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < MT; ++m) y[r][m] = 0.0f;
    for (int u = 0; u < nu; ++u) {  // experts in increasing order, as the reference sums them
        const int e = union_e[u];
        const unsigned int mask = union_mask[u];
        const uint4* wrow[R];
#pragma unroll
        for (int r = 0; r < R; ++r)
            wrow[r] = reinterpret_cast<const uint4*>(w + ((u64)e * H + min(n0 + r, H - 1)) * I);
        int ri[MT];  // row m's activation row m * k + j in act
#pragma unroll
        for (int m = 0; m < MT; ++m) ri[m] = m * k + (((mask >> m) & 1u) ? union_slot[u * MOE_MAX_ROWS + m] : 0);
        float acc[R][MT];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int m = 0; m < MT; ++m) acc[r][m] = 0.0f;
        moe_dots<MT, R, U>(wrow, act, ri, mask, I, acc);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            if (!((mask >> m) & 1u)) continue;
            const float wt = wts[ri[m]];  // wts [M, k]: the same index as the activation row
#pragma unroll
            for (int r = 0; r < R; ++r) y[r][m] = fmaf(wt, warp_sum(acc[r][m]), y[r][m]);
        }
    }
    if (S > 0) {  // the shared expert, scaled by its sigmoid gate, added after the routed experts
        const unsigned int mask = M >= 32 ? 0xffffffffu : ((1u << M) - 1u);
        const uint4* wrow[R];
#pragma unroll
        for (int r = 0; r < R; ++r) wrow[r] = reinterpret_cast<const uint4*>(w_s + (u64)min(n0 + r, H - 1) * S);
        int ri[MT];
#pragma unroll
        for (int m = 0; m < MT; ++m) ri[m] = min(m, M - 1);
        float acc[R][MT];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int m = 0; m < MT; ++m) acc[r][m] = 0.0f;
        moe_dots<MT, R, U>(wrow, act_s, ri, mask, S, acc);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int m = 0; m < MT; ++m)
                if (m < M) y[r][m] = fmaf(sgate[m], warp_sum(acc[r][m]), y[r][m]);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            const int n = n0 + r;
            if (m < M && n < H && lane == ((r * MT + m) & 31)) {
                float* o = out + (u64)m * H + n;
                *o = accumulate ? *o + y[r][m] : y[r][m];
            }
        }
    }
}

// Instances (kernels/moe.py names them): MT in {1, 2, 4, 8, 16}; gate_up R = 1, down R = 2; U = 4.
#ifndef METRALE_NVRTC  // a standalone `nvcc -ptx moe.cu` compiles every instance the engine uses
#define MOE_INSTANCES(MT)                                                                                  \
    template __global__ void moe_gate_up_kernel<MT, 1, 4>(const float*, const unsigned short*, const int*, \
                                                          const int*, const unsigned int*, const int*,     \
                                                          float*, int, int, int);                          \
    template __global__ void moe_down_kernel<MT, 2, 4>(const float*, const unsigned short*, const float*,  \
                                                       const int*, const int*, const unsigned int*,        \
                                                       const int*, const float*, const unsigned short*,    \
                                                       const float*, int, float*, int, int, int, int, int);
MOE_INSTANCES(1)
MOE_INSTANCES(2)
MOE_INSTANCES(4)
MOE_INSTANCES(8)
MOE_INSTANCES(16)
#endif
