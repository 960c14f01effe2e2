// Ring GEMV of one row for the decode step, built to overlap kernel boundaries:
//     out[1, N] (=|+=) x' @ w[N, K]^T (+ bias)                                     (GATED false)
//     out[1, N] = act(x' @ w[0:N]^T) * (x' @ w[N:2N]^T)                            (GATED true)
// with x' = rmsnorm(x) * (norm_offset + norm_w) when NORM, else x' = x: the functions of gemv_kernel /
// gemv_swiglu_kernel (gemv.cu) for M = 1.  x float32 [1, K], w bf16 bits [N or 2N, K], bias bf16 [N] (optional),
// out float32 [1, N]; fp32 accumulation.  Requirements (checked by Kernels.gemv_ring): K % 256 == 0, x and w
// 16-byte aligned, x does not overlap out.
//
// Why (the design notes, "Ring GEMV"): the decode step's projections lose time to ramp-up and tail (stretches of
// a GEMV with no SM busy).  Here one block per SM streams its
// weights into a shared-memory ring by cp.async (loads in flight hold no registers, so 1024 threads keep 48-144
// KB per SM in flight) and requests its first GT_STAGES - 1 ring slots BEFORE pdl_wait.  Launched with
// programmatic dependent launch (Kernels.pdl), a block starts on an SM as soon as the previous kernel's block
// there exits, and its weights stream while the previous kernel's last blocks still run elsewhere.
//
// Geometry: one wave (gridDim.x <= SMs); block b owns the output rows [b N / G, (b + 1) N / G) and streams their
// weights as one run of 16-byte chunks (GATED: the gate rows' run, then the up rows' run), in tiles of P chunks
// per thread through GT_STAGES ring slots.  Thread t takes the chunks t, t + THREADS, ... of the run and reads
// only what it copied itself (no barrier between tiles); a warp's 32 consecutive chunks lie in one weight row
// (K % 256 == 0), so the partial sums are kept per (row, warp) and summed by the epilogue.  Each chunk's dot
// product is its own chain (from zero), added to the row's partial in chunk order: the result depends on (N, K,
// gridDim.x, THREADS) only, never on P.
#include "common.cu"

#define GT_STAGES 4  // ring slots: GT_STAGES - 1 tiles in flight while one is used

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// 16 bytes global -> shared, asynchronous (cp.async, L1 bypassed); completion by commit / wait groups.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// This thread's chunks of tile t into ring slot t % GT_STAGES (GATED: chunks [0, T0) from src0, [T0, T) from
// src1), then one commit group (empty past the end, so that the group count stays uniform).
template <int P, int THREADS>
__device__ __forceinline__ void gt_issue(uint4* ring, int t, int T, int T0, const uint4* src0, const uint4* src1) {
    const int tile_chunks = P * THREADS;
    uint4* slot = ring + (size_t)(t % GT_STAGES) * tile_chunks + threadIdx.x;
    const int i0 = t * tile_chunks + threadIdx.x;
#pragma unroll
    for (int j = 0; j < P; ++j) {
        const int i = i0 + j * THREADS;
        if (i < T) cp_async16(slot + j * THREADS, i < T0 ? src0 + i : src1 + (i - T0));
    }
    cp_async_commit();
}

// Shared memory (dynamic): uint4 ring[GT_STAGES][P * THREADS], float4 xs[2][K / 8] (plane 0 = x'[8c .. 8c + 3],
// plane 1 = x'[8c + 4 .. 8c + 7] at index c), float part[rows][STRIDE] for the most stream rows any
// block owns.  Kernels.gemv_ring sizes it (tuning.ring_fixed_smem_bytes + the ring).
template <bool NORM, bool GATED, int P, int THREADS>
__global__ void __launch_bounds__(THREADS, 1)
gemv_ring_kernel(const float* __restrict__ x, const unsigned short* __restrict__ w,
                const unsigned short* __restrict__ bias, float* __restrict__ out, int N, int K, int accumulate,
                int has_bias, const unsigned short* __restrict__ norm_w, float eps, float norm_offset, int act) {
    constexpr int WARPS = THREADS / 32, STRIDE = WARPS + 1;  // part[v][.] padded: the epilogue reads conflict-free
    extern __shared__ __align__(128) uint4 gt_smem[];
    __shared__ float scratch[32];
    const int C = K >> 3;  // 16-byte chunks per weight row, a multiple of 32
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int G = gridDim.x;
    const int rb = (int)(((long long)blockIdx.x * N) / G);
    const int nr = (int)(((long long)(blockIdx.x + 1) * N) / G) - rb;  // output rows of this block
    const int T0 = nr * C;                                              // chunks of the first run
    const int T = GATED ? 2 * T0 : T0;                                  // all its chunks, a multiple of 32
    const int tile_chunks = P * THREADS;
    const int ntiles = (T + tile_chunks - 1) / tile_chunks;
    const uint4* src0 = reinterpret_cast<const uint4*>(w + (u64)rb * K);
    const uint4* src1 = GATED ? reinterpret_cast<const uint4*>(w + (u64)(N + rb) * K) : src0;
    uint4* ring = gt_smem;
    float4* xs = reinterpret_cast<float4*>(gt_smem + (size_t)GT_STAGES * tile_chunks);
    float* part = reinterpret_cast<float*>(xs + 2 * C);

    // The first GT_STAGES - 1 tiles of weights, before the previous kernel's output is needed.
#pragma unroll
    for (int t = 0; t < GT_STAGES - 1; ++t) gt_issue<P, THREADS>(ring, t, T, T0, src0, src1);
    pdl_wait();

    // x' into shared memory (NORM: x times the norm weight, each thread's sum of squares from the same loads).
    float ss = 0.0f;
    for (int q0 = tid; q0 < 2 * C; q0 += 4 * THREADS) {  // float4 q of x: chunk q >> 1, plane q & 1
        float4 v[4];
        uint2 nw[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int q = q0 + j * THREADS;
            if (q < 2 * C) {
                v[j] = __ldg(reinterpret_cast<const float4*>(x) + q);
                if (NORM) nw[j] = __ldg(reinterpret_cast<const uint2*>(norm_w) + q);
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int q = q0 + j * THREADS;
            if (q < 2 * C) {
                float4 a = v[j];
                if (NORM) {
                    ss = fmaf(a.x, a.x, ss);
                    ss = fmaf(a.y, a.y, ss);
                    ss = fmaf(a.z, a.z, ss);
                    ss = fmaf(a.w, a.w, ss);
                    a = make_float4(a.x * (bf16_lo(nw[j].x) + norm_offset), a.y * (bf16_hi(nw[j].x) + norm_offset),
                                    a.z * (bf16_lo(nw[j].y) + norm_offset), a.w * (bf16_hi(nw[j].y) + norm_offset));
                }
                xs[(q & 1) * C + (q >> 1)] = a;
            }
        }
    }
    const int R = GATED ? 2 * nr : nr;  // stream rows
    for (int i = tid; i < R * STRIDE; i += THREADS) part[i] = 0.0f;
    float inv = 1.0f;
    if (NORM) inv = rsqrtf(block_sum(ss, scratch) / (float)K + eps);
    __syncthreads();  // xs and part are ready
    pdl_trigger();

    // Stream the tiles: each thread uses only the chunks it copied itself, so no barrier between tiles; the slot
    // refilled at step t is the one this thread used at step t - 1.  The P dot products of a step are independent
    // chains (each from zero), then added to the row's partial in chunk order.  (v, c): the stream row and chunk
    // of this thread's next chunk i.
    int i = tid, v = tid / C, c = tid - (tid / C) * C;
    int cur = v;  // the stream row the partial belongs to
    float acc = 0.0f;
    for (int t = 0; t < ntiles; ++t) {
        gt_issue<P, THREADS>(ring, t + GT_STAGES - 1, T, T0, src0, src1);
        cp_async_wait<GT_STAGES - 1>();  // tile t has landed (this thread's part of it)
        const uint4* tile = ring + (size_t)(t % GT_STAGES) * tile_chunks + tid;
        float d[P];
        int vj[P];
#pragma unroll
        for (int j = 0; j < P; ++j) {
            vj[j] = v;
            d[j] = i + j * THREADS < T ? dot8_bf16(tile[j * THREADS], xs[c], xs[C + c], 0.0f) : 0.0f;
            c += THREADS;
            while (c >= C) {
                c -= C;
                ++v;
            }
        }
#pragma unroll
        for (int j = 0; j < P; ++j) {
            if (i < T) {  // uniform over the warp, as is vj[j] != cur
                if (vj[j] != cur) {
                    const float sum = warp_sum(acc);
                    if (lane == 0) part[cur * STRIDE + warp] = sum;
                    acc = 0.0f;
                    cur = vj[j];
                }
                acc += d[j];
            }
            i += THREADS;
        }
    }
    cp_async_wait<0>();
    if (cur < R) {  // uniform: whether this warp had any chunk
        const float sum = warp_sum(acc);
        if (lane == 0) part[cur * STRIDE + warp] = sum;
    }
    __syncthreads();

    // One thread per output row: its slots in warp order, then the norm factor, (gate,) bias, add.
    for (int n = tid; n < nr; n += THREADS) {
        const float* p = part + n * STRIDE;
        float g = 0.0f;
#pragma unroll
        for (int k = 0; k < WARPS; ++k) g += p[k];
        float val = g * inv;
        if (GATED) {
            const float* pu = part + (nr + n) * STRIDE;
            float u = 0.0f;
#pragma unroll
            for (int k = 0; k < WARPS; ++k) u += pu[k];
            out[rb + n] = gate_act(val, act) * (u * inv);
        } else {
            if (has_bias) val += bf16_to_f32_bits(bias[rb + n]);
            float* o = out + rb + n;
            if (accumulate) val += *o;
            *o = val;
        }
    }
}
