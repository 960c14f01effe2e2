// Prefill attention on tensor cores (flash-attention-2 style).
//
// Causal attention of a prompt chunk of T query rows at positions start_pos ..
// start_pos+T-1 whose K/V are already in the bf16 cache [n_kv, max_ctx, HD]
// (query head h reads KV head h / (n_heads / n_kv)).  q, out float32
// [>= T, n_heads, HD]; rows >= T are neither read nor written.
//
// Grid (n_heads, ceil(T / BQ)); a block = NW warps = BQ = 16 * NW query rows of
// one head, 16 rows per warp.  blockIdx.y counts from the last (longest) query
// block down, and heads vary fastest, so the longest blocks of every head start
// first (balance) and heads that share a KV head run side by side (L2 reuse).
// The block walks key tiles of FP_BK = 64 keys, 0 .. kend-1 (kend = position of
// its last row + 1), staged with cp.async in a double-buffered, padded shared
// layout (row stride HD + 8 bf16: ldmatrix rows fall in distinct banks); keys
// >= kend are zero-filled (the cache past start_pos+T may hold anything, NaN
// included, and 0 * NaN would poison P.V).
//   S = Q K^T: mma.sync m16n8k16 bf16 -> fp32.  Q is converted once to bf16
//      A fragments in registers, with qscale = scale * log2(e) folded in before
//      the rounding; K B fragments come from ldmatrix (keys are the rows).
//   causal mask only where a tile reaches past the warp's first position;
//      a warp skips tiles (and 8-key / 16-key pieces of them) that lie wholly
//      past its last position.
//   online softmax in base 2 in registers: each thread holds rows g and g+8 of
//      its warp's 16 (g = lane / 4); row max over the quad with two shuffles,
//      row sums kept per thread and reduced once at the end.
//   O += P V: P is rounded to bf16 and reused straight from the S accumulator
//      registers as the A operand (the C layout of two n8 tiles is the A layout
//      of one k16 step); V B fragments from ldmatrix.trans.  O stays in fp32
//      registers, rescaled per tile, normalised and written once at the end.
// Sliding window (window > 0): row p sees keys (p - window, p]: the block starts at the tile of its
// first row's first visible key, a warp skips tiles wholly before its rows' windows, and keys before
// a row's window are masked.  Score softcapping (softcap_l2 > 0): s2 = c2 tanh(s2 / c2) on the base-2
// scores before the mask (attention.cu).  Both only in the EXT instances: the window / softcap state
// would take registers from the plain ones (168 -> 204 at head_dim 128: 3 -> 2 blocks per SM), which
// every full-attention family runs.  BK: keys per tile (FP_BK; 32 at head_dim 256, whose Q and O
// fragments already take 192 registers a thread).
// Attention sinks (EXT instances, use_sinks; gpt-oss): sinks f32 [n_heads], one logit s_h per head in natural-log
// units, joins each row's softmax denominator at the end: out = O' / (l' + exp2(s2 - m')) with s2 = s_h log2(e),
// m' = max(m, s2), O' and l' rescaled by exp2(m - m') (attention.cu's combine kernel does the same for decode).
#include "common.cu"

#define FP_BK 64

__device__ __forceinline__ unsigned fp_smem_u32(const void* p) {
    unsigned r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}

// 16-byte async copy global -> shared; src_bytes = 0 zero-fills the destination.
__device__ __forceinline__ void fp_cp_async16(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void fp_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void fp_cp_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

__device__ __forceinline__ void fp_ldsm_x4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2,
                                           unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void fp_ldsm_x4_t(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2,
                                             unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}

// Stage keys/values k0 .. k0+BK-1 of one KV head (rows >= kend zero-filled).
template <int HD, int NTH, int BK>
__device__ __forceinline__ void fp_load_kv(unsigned sk, unsigned sv, const unsigned short* __restrict__ kb,
                                           const unsigned short* __restrict__ vb, int k0, int kend) {
    constexpr int CH = HD / 8;  // 16-byte chunks per row
    constexpr int LD = HD + 8;
    static_assert((BK * CH) % NTH == 0, "tile chunks must divide among the threads");
#pragma unroll
    for (int j = 0; j < BK * CH / NTH; ++j) {
        const int i = threadIdx.x + j * NTH;
        const int row = i / CH, ch = i - row * CH;
        const int key = k0 + row;
        const bool ok = key < kend;
        const u64 off = (u64)(ok ? key : 0) * HD + ch * 8;
        const unsigned so = (unsigned)(row * LD + ch * 8) * 2u;
        fp_cp_async16(sk + so, kb + off, ok ? 16 : 0);
        fp_cp_async16(sv + so, vb + off, ok ? 16 : 0);
    }
}

// Dynamic shared memory: 2 stages x (K, V) x BK x (HD + 8) bf16.
template <int HD, int NW, int BK, bool EXT>
__global__ void __launch_bounds__(NW * 32)
flash_prefill_kernel(const float* __restrict__ q, const unsigned short* __restrict__ k_cache,
                     const unsigned short* __restrict__ v_cache, float* __restrict__ out, int T,
                     int start_pos, int n_heads, int n_kv, int max_ctx, float qscale, int window,
                     float softcap_l2, const float* __restrict__ sinks, int use_sinks) {
    constexpr int NTH = NW * 32;
    constexpr int LD = HD + 8;         // shared row stride in bf16 elements
    constexpr int KS = HD / 16;        // k16 steps of S = Q K^T
    constexpr int DT = HD / 8;         // n8 tiles of O
    constexpr int NT = BK / 8;         // n8 tiles of S
    constexpr unsigned STAGE = BK * LD * 2;  // bytes of one K (or V) tile
    static_assert(HD % 32 == 0, "head_dim must be a multiple of 32");
    extern __shared__ __align__(16) unsigned short fp_smem[];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, c = lane & 3;
    const int h = blockIdx.x;
    const int qblock = gridDim.y - 1 - blockIdx.y;
    const int hk = h / (n_heads / n_kv);
    const int t0 = qblock * (NW * 16);
    const int kend = start_pos + min(T, t0 + NW * 16);  // keys 0 .. kend-1
    const int ntiles = (kend + BK - 1) / BK;
    // Window: the block's first row sees keys from start_pos + t0 - window + 1 on: its tile first.
    const int it0 = (EXT && window > 0) ? max(0, start_pos + t0 - window + 1) / BK : 0;
    const int tw = t0 + warp * 16;                      // first row of this warp
    const bool active = tw < T;
    const int pw_min = start_pos + tw;                  // positions of the warp's valid rows
    const int pw_max = start_pos + min(tw + 15, T - 1);
    const int r0 = tw + g, r1 = tw + g + 8;             // this thread's two rows
    const int p0 = start_pos + r0, p1 = start_pos + r1;
    // First visible key of the warp's first row (its lowest), of its last row, of this thread's rows.
    const bool win = EXT && window > 0;
    const int fw_min = win ? pw_min - window + 1 : 0, fw_max = win ? pw_max - window + 1 : 0;
    const int f0 = win ? p0 - window + 1 : 0, f1 = win ? p1 - window + 1 : 0;

    const unsigned short* kb = k_cache + (u64)hk * max_ctx * HD;
    const unsigned short* vb = v_cache + (u64)hk * max_ctx * HD;
    const unsigned sK = fp_smem_u32(fp_smem);
    const unsigned sV = sK + 2 * STAGE;

    pdl_wait();  // q and the cache were written by earlier kernels
    pdl_trigger();

    fp_load_kv<HD, NTH, BK>(sK + (it0 & 1) * STAGE, sV + (it0 & 1) * STAGE, kb, vb, it0 * BK, kend);
    fp_cp_commit();

    // Q as bf16 A fragments: qa[ks] = rows (g, g+8) x dims ks*16 + {2c, 2c+1, 2c+8, 2c+9}.
    unsigned qa[KS][4];
    {
        const float* q0 = q + ((u64)r0 * n_heads + h) * HD + 2 * c;
        const float* q1 = q + ((u64)r1 * n_heads + h) * HD + 2 * c;
        const bool v0 = r0 < T, v1 = r1 < T;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            float2 a = make_float2(0.0f, 0.0f), b = a, a8 = a, b8 = a;
            if (v0) {
                a = *reinterpret_cast<const float2*>(q0 + ks * 16);
                a8 = *reinterpret_cast<const float2*>(q0 + ks * 16 + 8);
            }
            if (v1) {
                b = *reinterpret_cast<const float2*>(q1 + ks * 16);
                b8 = *reinterpret_cast<const float2*>(q1 + ks * 16 + 8);
            }
            qa[ks][0] = pack_bf16x2(a.x * qscale, a.y * qscale);
            qa[ks][1] = pack_bf16x2(b.x * qscale, b.y * qscale);
            qa[ks][2] = pack_bf16x2(a8.x * qscale, a8.y * qscale);
            qa[ks][3] = pack_bf16x2(b8.x * qscale, b8.y * qscale);
        }
    }

    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    float m0 = -METRALE_INF, m1 = -METRALE_INF, l0 = 0.0f, l1 = 0.0f;

    // ldmatrix lane addressing: matrix mi = lane / 8, row lane % 8 of it.
    const int mi = lane >> 3, mr = lane & 7;
    // K (non-trans): matrix mi = keys nt*8 + mr, dims ksp*32 + mi*8 -> b0,b1 of k-step 2ksp, b0,b1 of 2ksp+1.
    const unsigned k_lane_off = (unsigned)(mr * LD + mi * 8) * 2u;
    // V (trans): matrix mi = keys kk*16 + (mi&1)*8 + mr, dims (2dp + (mi>>1))*8 -> b0,b1 of dim tile 2dp, of 2dp+1.
    const unsigned v_lane_off = (unsigned)((((mi & 1) * 8) + mr) * LD + (mi >> 1) * 8) * 2u;

    for (int it = it0; it < ntiles; ++it) {
        fp_cp_wait_all();
        __syncthreads();  // tile it is in place; every warp is done with the other buffer
        if (it + 1 < ntiles)
            fp_load_kv<HD, NTH, BK>(sK + ((it + 1) & 1) * STAGE, sV + ((it + 1) & 1) * STAGE, kb, vb,
                                    (it + 1) * BK, kend);
        fp_cp_commit();

        const int k0 = it * BK;
        // nothing of this tile is visible to the warp: past its last position, or before its windows
        if (!active || k0 > pw_max || (EXT && k0 + BK - 1 < fw_min)) continue;
        const unsigned kt = sK + (it & 1) * STAGE + k_lane_off;
        const unsigned vt = sV + (it & 1) * STAGE + v_lane_off;

        float s[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
            if (k0 + nt * 8 <= pw_max) {
#pragma unroll
                for (int ksp = 0; ksp < KS / 2; ++ksp) {
                    unsigned b0, b1, b2, b3;
                    fp_ldsm_x4(kt + (unsigned)(nt * 8 * LD + ksp * 32) * 2u, b0, b1, b2, b3);
                    mma_bf16_16816(s[nt], qa[2 * ksp][0], qa[2 * ksp][1], qa[2 * ksp][2], qa[2 * ksp][3], b0,
                                   b1);
                    mma_bf16_16816(s[nt], qa[2 * ksp + 1][0], qa[2 * ksp + 1][1], qa[2 * ksp + 1][2],
                                   qa[2 * ksp + 1][3], b2, b3);
                }
            }
        }

        if (EXT && softcap_l2 > 0.0f) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[nt][e] = softcap_l2 * tanhf(s[nt][e] / softcap_l2);
        }
        if (k0 + BK - 1 > pw_min) {  // the tile reaches past some row's position: mask
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int key = k0 + nt * 8 + 2 * c;
                if (key > p0) s[nt][0] = -METRALE_INF;
                if (key + 1 > p0) s[nt][1] = -METRALE_INF;
                if (key > p1) s[nt][2] = -METRALE_INF;
                if (key + 1 > p1) s[nt][3] = -METRALE_INF;
            }
        }
        if (EXT && k0 < fw_max) {  // the tile starts before some row's window: mask those keys
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int key = k0 + nt * 8 + 2 * c;
                if (key < f0) s[nt][0] = -METRALE_INF;
                if (key + 1 < f0) s[nt][1] = -METRALE_INF;
                if (key < f1) s[nt][2] = -METRALE_INF;
                if (key + 1 < f1) s[nt][3] = -METRALE_INF;
            }
        }

        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
            mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        // A row with no visible key yet keeps max -inf: subtract 0 instead (exp2(-inf) = 0, no NaN).
        const float base0 = (mx0 == -METRALE_INF) ? 0.0f : mx0;
        const float base1 = (mx1 == -METRALE_INF) ? 0.0f : mx1;
        const float cr0 = exp2f(m0 - base0), cr1 = exp2f(m1 - base1);
        m0 = mx0;
        m1 = mx1;
        float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            s[nt][0] = exp2f(s[nt][0] - base0);
            s[nt][1] = exp2f(s[nt][1] - base0);
            s[nt][2] = exp2f(s[nt][2] - base1);
            s[nt][3] = exp2f(s[nt][3] - base1);
            ps0 += s[nt][0] + s[nt][1];
            ps1 += s[nt][2] + s[nt][3];
        }
        l0 = fmaf(l0, cr0, ps0);
        l1 = fmaf(l1, cr1, ps1);
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            o[dt][0] *= cr0;
            o[dt][1] *= cr0;
            o[dt][2] *= cr1;
            o[dt][3] *= cr1;
        }

#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            if (k0 + kk * 16 > pw_max) continue;  // P is 0 there for every valid row
            const unsigned a0 = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
            const unsigned a1 = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
            const unsigned a2 = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            const unsigned a3 = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int dp = 0; dp < DT / 2; ++dp) {
                unsigned b0, b1, b2, b3;
                fp_ldsm_x4_t(vt + (unsigned)(kk * 16 * LD + dp * 16) * 2u, b0, b1, b2, b3);
                mma_bf16_16816(o[2 * dp], a0, a1, a2, a3, b0, b1);
                mma_bf16_16816(o[2 * dp + 1], a0, a1, a2, a3, b2, b3);
            }
        }
    }

    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    if (!active) return;
    // l > 0 for every valid row: its own key is visible to it.
    float inv0 = 1.0f / l0, inv1 = 1.0f / l1;
    if (EXT && use_sinks) {  // m0 / m1: the rows' running maxima (uniform over the quad)
        const float s2 = sinks[h] * 1.4426950408889634f;
        const float c0 = exp2f(m0 - fmaxf(m0, s2)), c1 = exp2f(m1 - fmaxf(m1, s2));
        inv0 = c0 / fmaf(l0, c0, exp2f(s2 - fmaxf(m0, s2)));
        inv1 = c1 / fmaf(l1, c1, exp2f(s2 - fmaxf(m1, s2)));
    }
    if (r0 < T) {
        float* op = out + ((u64)r0 * n_heads + h) * HD + 2 * c;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
            *reinterpret_cast<float2*>(op + dt * 8) = make_float2(o[dt][0] * inv0, o[dt][1] * inv0);
    }
    if (r1 < T) {
        float* op = out + ((u64)r1 * n_heads + h) * HD + 2 * c;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
            *reinterpret_cast<float2*>(op + dt * 8) = make_float2(o[dt][2] * inv1, o[dt][3] * inv1);
    }
}
