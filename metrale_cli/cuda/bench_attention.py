"""Decode attention (attention_decode: split + combine kernels) against the bandwidth of a
large read-only kernel measured in the same run, and against the previous kernels (their source
is kept below, compiled as a separate module).  Needs CuPy and a CUDA GPU:

    PYTHONPATH=. python3 -m metrale_cli.cuda.bench_attention

Llama-3-8B layer shape: 8 KV heads x head_dim 128, G = 4 query heads per KV head; contexts 1024,
4096, 8192, 32768; M = 1, 4, 8 query rows (decode, verify), row m at position ctx - M + m, so
every call reads L = ctx keys and values once: 2 * 8 * ctx * 128 * 2 bytes.  Each figure is one
attention_decode call (both launches) inside a CUDA graph of 32 calls rotating several caches so
that the 60 MB L2 does not serve them; CUDA events; median of 15 replays.  Columns: us per call,
GB/s of K+V, % of the read-only kernel.  Rows: new (default n_splits = decode_splits(ctx, 8, M,
32)), new with PDL (when Kernels has it: launches with programmatic dependent launch, as the engine
will), new with other split counts at M=1, and the old kernels with their own default split
count and with the engine's old count (decode_splits(..., n_rows=16) -> 5 splits).
"""

from __future__ import annotations

import math
import sys

from metrale_cli.cuda.bench_kernels import L2_BYTES, _graph_time_ms, read_bandwidth

N_KV, G, HD = 8, 4, 128
CONTEXTS = (1024, 4096, 8192, 32768)
ROWS = (1, 4, 8)
LOG2E = 1.4426950408889634

# The decode kernels of attention.cu before the tensor-core rewrite (git 59ceb35), renamed old_*.
OLD_SRC = r"""
#define OLD_ATTN_WARPS 4

__device__ __forceinline__ int old_decode_len(const int* __restrict__ positions, int M, int max_ctx) {
    int L = 0;
    for (int m = 0; m < M; ++m) L = max(L, min(positions[m], max_ctx - 1) + 1);
    return L;  // 0 when every position is negative
}

// Keys per split for context length L: ceil(L / n_splits) rounded up to 32.
__device__ __forceinline__ int old_decode_chunk(int L, int n_splits) {
    const int c = (L + n_splits - 1) / n_splits;
    return max(32, (c + 31) & ~31);
}

// E consecutive bf16 values held as raw bits (E = 1, 2, 4, 8).
template <int E>
struct OldBf16Vec {
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
__global__ void __launch_bounds__(OLD_ATTN_WARPS * 32)
old_attn_decode_split_kernel(const float* __restrict__ q, const unsigned short* __restrict__ k_cache,
                         const unsigned short* __restrict__ v_cache,
                         const int* __restrict__ positions, float* __restrict__ part_acc,
                         float* __restrict__ part_ml, int M, int n_heads, int n_kv, int max_ctx,
                         int n_splits, float qscale) {
    constexpr int E = HD / 32;  // head_dim elements per lane
    __shared__ float s_acc[OLD_ATTN_WARPS][QB][HD];
    __shared__ float s_ml[OLD_ATTN_WARPS][QB][2];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int hk = blockIdx.x, split = blockIdx.y;
    const int G = n_heads / n_kv;
    const int QT = M * n_heads;
    const int L = old_decode_len(positions, M, max_ctx);
    const int chunk = old_decode_chunk(L, n_splits);
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

    for (int j0 = start + warp * KB; j0 < end; j0 += OLD_ATTN_WARPS * KB) {
        OldBf16Vec<E> kv[KB], vv[KB];
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
        for (int w = 0; w < OLD_ATTN_WARPS; ++w) gm = fmaxf(gm, s_ml[w][qb][0]);
        float a = 0.0f, lsum = 0.0f;
        if (gm != -METRALE_INF) {
#pragma unroll
            for (int w = 0; w < OLD_ATTN_WARPS; ++w) {
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
extern "C" __global__ void old_attn_decode_combine_kernel(const float* __restrict__ part_acc,
                                                      const float* __restrict__ part_ml,
                                                      const int* __restrict__ positions,
                                                      float* __restrict__ out, int M, int n_heads,
                                                      int HD, int max_ctx, int n_splits) {
    __shared__ float s_max[32];
    const int qt = blockIdx.x;
    const int QT = M * n_heads;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int L = old_decode_len(positions, M, max_ctx);
    const int chunk = old_decode_chunk(L, n_splits);
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

"""


def _old_module(cp):
    from metrale_cli.cuda.kernels import COMPILE_OPTIONS, _CUDA_DIR

    names = tuple(f"old_attn_decode_split_kernel<{HD}, {qb}, 8>" for qb in (1, 2, 4, 8))
    src = (_CUDA_DIR / "common.cu").read_text() + OLD_SRC
    mod = cp.RawModule(code=src, options=COMPILE_OPTIONS, name_expressions=names)
    fns = {qb: mod.get_function(n) for qb, n in zip((1, 2, 4, 8), names)}
    return fns, mod.get_function("old_attn_decode_combine_kernel")


def _old_splits(num_sms, max_ctx, n_kv, n_rows, n_heads):
    """decode_splits as it was."""
    qgroups = -(-(n_rows * (n_heads // n_kv)) // 8)
    want = -(-2 * num_sms // (n_kv * qgroups))
    return max(1, min(want, -(-max_ctx // 32)))


def _old_call(cp, fns, comb, q, kc, vc, pos, out, ws, n_splits, s):
    import numpy as np

    M, nh, hd = q.shape
    n_kv, max_ctx, _ = kc.shape
    G_ = nh // n_kv
    qb = min(8, 1 << max(0, (M * G_ - 1).bit_length()))
    n_acc = n_splits * M * nh * hd
    part_acc, part_ml = ws[:n_acc], ws[n_acc : n_acc + 2 * n_splits * M * nh]
    args = (q, kc, vc, pos, part_acc, part_ml, np.int32(M), np.int32(nh), np.int32(n_kv), np.int32(max_ctx),
            np.int32(n_splits), np.float32(hd**-0.5 * LOG2E))
    fns[qb]((n_kv, n_splits, -(-(M * G_) // qb)), (128,), args, stream=s)
    args2 = (part_acc, part_ml, pos, out, np.int32(M), np.int32(nh), np.int32(hd), np.int32(max_ctx), np.int32(n_splits))
    comb((M * nh,), (max(32, min(hd, 256)),), args2, stream=s)


def main() -> int:
    import cupy as cp

    from metrale_cli.cuda.kernels import Kernels

    K = Kernels()
    fns, comb = _old_module(cp)
    dev = cp.cuda.Device()
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    read_gbs = read_bandwidth(cp)
    pdl_ok = bool(getattr(K, "pdl_supported", False))
    print(f"device: {name}, {K.num_sms} SMs; PDL rows: {'yes' if pdl_ok else 'no (Kernels has no pdl)'}")
    print(f"read-only kernel (4 GiB, uint4 streaming loads): {read_gbs:8.0f} GB/s")
    print(f"decode attention, n_kv {N_KV}, G {G}, head_dim {HD}; us per call (split + combine) in a graph")
    print()
    print(f"{'kernel':<12}{'ctx':>7}{'M':>4}{'splits':>8}{'us':>9}{'GB/s':>8}{'% read':>8}")
    nh = N_KV * G
    for ctx in CONTEXTS:
        kv_bytes = 2 * N_KV * ctx * HD * 2
        copies = max(2, min(32, math.ceil(4 * L2_BYTES / kv_bytes)))
        caches = []
        for _ in range(copies):
            kc = cp.empty((N_KV, ctx, HD), dtype=cp.uint16)
            vc = cp.empty((N_KV, ctx, HD), dtype=cp.uint16)
            K.f32_to_bf16(cp.random.standard_normal((N_KV, ctx, HD), dtype=cp.float32), kc)
            K.f32_to_bf16(cp.random.standard_normal((N_KV, ctx, HD), dtype=cp.float32), vc)
            caches.append((kc, vc))
        cp.cuda.Device().synchronize()
        for M in ROWS:
            q = cp.random.standard_normal((M, nh, HD), dtype=cp.float32)
            out = cp.empty_like(q)
            pos = cp.asarray((ctx - M + cp.arange(M)).astype(cp.int32))
            default = K.decode_splits(ctx, N_KV, M, nh)
            runs = [("new", default, False)]
            if pdl_ok:
                runs.append(("new+pdl", default, True))
            if M == 1:
                runs += [("new", s, False) for s in (default // 2, 2 * default) if s >= 1]
            old_default = _old_splits(K.num_sms, ctx, N_KV, M, nh)
            runs += [("old", old_default, False), ("old engine", _old_splits(K.num_sms, ctx, N_KV, 16, nh), False)]
            for label, ns, pdl in runs:
                ws = cp.zeros(K.decode_workspace_size(M, nh, HD, ns), dtype=cp.float32)
                if label.startswith("old"):
                    launches = [
                        (lambda s, c=caches[i % copies], ns=ns, ws=ws: _old_call(cp, fns, comb, q, c[0], c[1], pos, out, ws, ns, s))
                        for i in range(32)
                    ]
                else:
                    launches = [
                        (lambda s, c=caches[i % copies], ns=ns, ws=ws: K.attention_decode(
                            q, c[0], c[1], pos, out, HD**-0.5, n_splits=ns, workspace=ws, stream=s))
                        for i in range(32)
                    ]
                try:
                    K.pdl = pdl
                    ms = _graph_time_ms(cp, launches)
                except Exception as exc:  # a PDL failure must not hide the other rows
                    print(f"{label:<12}{ctx:>7}{M:>4}{ns:>8}   failed: {type(exc).__name__}: {exc}")
                    continue
                finally:
                    if pdl_ok:
                        K.pdl = False
                gbs = kv_bytes / (ms * 1e-3) / 1e9
                tag = f"{ns}" + ("*" if label.startswith("new") and ns == default else "")
                print(f"{label:<12}{ctx:>7}{M:>4}{tag:>8}{ms * 1e3:>9.1f}{gbs:>8.0f}{100 * gbs / read_gbs:>7.0f}%")
                sys.stdout.flush()
        del caches
    print("(* = decode_splits default; 'old engine' = the old kernels with the engine's old split count)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
