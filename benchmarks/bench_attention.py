"""Decode attention (attention_decode: split + combine kernels) against the bandwidth of the
read-only kernel of `metrale bench` measured in the same run.  Needs CuPy and a CUDA GPU:

    PYTHONPATH=. python3 -m benchmarks.bench_attention
    PYTHONPATH=. python3 -m benchmarks.bench_attention --simt   # head_dim 96 / 256: split counts old vs new
    PYTHONPATH=. python3 -m benchmarks.bench_attention --sweep  # one row at 1024 / 8192 + 1 keys, split counts

Llama-3-8B layer shape: 8 KV heads x head_dim 128, G = 4 query heads per KV head; contexts 1024,
4096, 8192, 32768; M = 1, 4, 8 query rows (decode, verify), row m at position ctx - M + m, so
every call reads L = ctx keys and values once: 2 * 8 * ctx * 128 * 2 bytes.  Each figure is one
attention_decode call (both launches) inside a CUDA graph of 32 calls rotating several caches so
that the 60 MB L2 does not serve them; CUDA events; median of 15 replays.  Columns: us per call,
GB/s of K+V, % of the read-only kernel.  Rows: new (default n_splits = decode_splits(ctx, 8, M,
32)), with PDL (programmatic dependent launch, where the GPU has it), and other split counts at
M=1.  The SIMT kernels this replaced (git 59ceb35) were compared in the same way: see docs/CUDA_ENGINE.md.
"""

from __future__ import annotations

import math
import sys

from benchmarks.bench_kernels import L2_BYTES, _graph_time_ms
from metrale_cli.bench import read_bandwidth_gpu

N_KV, G, HD = 8, 4, 128
CONTEXTS = (1024, 4096, 8192, 32768)
ROWS = (1, 4, 8)
# The SIMT head dims (--simt): gemma-2-9b (8 KV heads x 256, G 2, softcap 50) and phi-3-mini (32 x 96, G 1).
SIMT_SHAPES = (("gemma-2-9b", 256, 8, 2, 50.0), ("phi-3-mini", 96, 32, 1, None))


def simt_section(cp, K, read_gbs) -> None:
    """The SIMT split kernel at M = 1 with its split count (decode_splits with head_dim: DECODE_SIMT_SPLITS)
    against the tensor-core kernels' count (decode_splits without it: ~2 blocks per SM, as before 2026-12-04) on
    a cache of 2 x ctx positions, ctx = 1024 and 8192: us per call (split + combine)."""
    print(f"{'shape':<12}{'ctx':>7}{'splits':>8}{'us':>9}{'GB/s':>8}{'% read':>8}")
    for label, hd, n_kv, g, cap in SIMT_SHAPES:
        nh = n_kv * g
        for ctx in (1024, 8192):
            max_ctx = 2 * ctx
            kv_bytes = 2 * n_kv * (ctx + 1) * hd * 2
            copies = max(2, min(32, math.ceil(4 * L2_BYTES / kv_bytes)))
            caches = []
            for _ in range(copies):
                kc = cp.empty((n_kv, max_ctx, hd), dtype=cp.uint16)
                vc = cp.empty((n_kv, max_ctx, hd), dtype=cp.uint16)
                K.f32_to_bf16(cp.random.standard_normal((n_kv * max_ctx, hd), dtype=cp.float32), kc.reshape(-1, hd))
                K.f32_to_bf16(cp.random.standard_normal((n_kv * max_ctx, hd), dtype=cp.float32), vc.reshape(-1, hd))
                caches.append((kc, vc))
            cp.cuda.Device().synchronize()
            q = cp.random.standard_normal((1, nh, hd), dtype=cp.float32)
            out = cp.empty_like(q)
            pos = cp.asarray([ctx], dtype=cp.int32)
            for tag, ns in (("old", K.decode_splits(max_ctx, n_kv, 1, nh)), ("new", K.decode_splits(max_ctx, n_kv, 1, nh, hd))):
                ws = cp.zeros(K.decode_workspace_size(1, nh, hd, ns), dtype=cp.float32)
                launches = [(lambda s, c=caches[i % copies], ns=ns, ws=ws: K.attention_decode(
                    q, c[0], c[1], pos, out, hd ** -0.5, n_splits=ns, workspace=ws, softcap=cap, stream=s))
                    for i in range(32)]
                ms = _graph_time_ms(cp, launches)
                gbs = kv_bytes / (ms * 1e-3) / 1e9
                print(f"{label:<12}{ctx:>7}{ns:>5} {tag}{ms * 1e3:>9.2f}{gbs:>8.0f}{100 * gbs / read_gbs:>7.0f}%")
                sys.stdout.flush()
            del caches


def sweep_section(cp, K, read_gbs) -> None:
    """One decode row at L = ctx + 1 keys (what `metrale bench --context ctx` times) in the engine's cache size, for a
    range of split counts: us per attention_decode call (split + combine, PDL on where the GPU has it, as the engine
    launches them).  Shapes: llama-3.1-8b (8 KV heads, G 4) and phi-4-mini (8 KV heads, G 3), head_dim 128.  (The
    split and combine kernels timed apart needed attention_decode's `only=`, removed in issue 35: those figures are
    in docs/CUDA_ENGINE.md.)"""
    print(f"{'shape':<14}{'ctx':>6}{'splits':>7}{'active':>7}{'us':>8}{'% read':>8}")
    pdl = bool(getattr(K, "pdl_supported", False))
    for label, n_kv, g in (("llama-3.1-8b", 8, 4), ("phi-4-mini", 8, 3)):
        nh = n_kv * g
        for ctx in (1024, 8192):
            max_ctx = max(ctx + 9, 2048)
            kv_bytes = 2 * n_kv * (ctx + 1) * HD * 2
            copies = max(2, min(32, math.ceil(4 * L2_BYTES / kv_bytes)))
            caches = []
            for _ in range(copies):
                kc = cp.empty((n_kv, max_ctx, HD), dtype=cp.uint16)
                vc = cp.empty((n_kv, max_ctx, HD), dtype=cp.uint16)
                K.f32_to_bf16(cp.random.standard_normal((n_kv * max_ctx, HD), dtype=cp.float32), kc.reshape(-1, HD))
                K.f32_to_bf16(cp.random.standard_normal((n_kv * max_ctx, HD), dtype=cp.float32), vc.reshape(-1, HD))
                caches.append((kc, vc))
            cp.cuda.Device().synchronize()
            q = cp.random.standard_normal((1, nh, HD), dtype=cp.float32)
            out = cp.empty_like(q)
            pos = cp.asarray([ctx], dtype=cp.int32)
            default = K.decode_splits(max_ctx, n_kv, 1, nh, HD)
            for ns in sorted({16, 24, 32, 33, 40, 48, 50, 64, default}):
                if ns > max_ctx // 64:
                    continue
                chunk = max(64, -(-(-(-(ctx + 1) // ns)) // 64) * 64)
                active = -(-(ctx + 1) // chunk)
                ws = cp.zeros(K.decode_workspace_size(1, nh, HD, ns), dtype=cp.float32)
                launches = [(lambda s, c=caches[i % copies], ns=ns, ws=ws: K.attention_decode(
                    q, c[0], c[1], pos, out, HD ** -0.5, n_splits=ns, workspace=ws, stream=s))
                    for i in range(32)]
                K.pdl = pdl
                try:
                    us = _graph_time_ms(cp, launches) * 1e3
                finally:
                    K.pdl = False
                gbs = kv_bytes / (us * 1e-6) / 1e9
                tag = f"{ns}" + ("*" if ns == default else "")
                print(f"{label:<14}{ctx:>6}{tag:>7}{active:>7}{us:>8.2f}{100 * gbs / read_gbs:>7.0f}%")
                sys.stdout.flush()
            del caches
    print("(* = decode_splits default; us per call (split + combine) in a graph of 32, PDL on where the GPU has it)")


def main() -> int:
    import cupy as cp

    from metrale_cli.backends.cuda.kernels import Kernels

    K = Kernels()
    dev = cp.cuda.Device()
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    read_gbs = read_bandwidth_gpu(cp) / 1e9
    pdl_ok = bool(getattr(K, "pdl_supported", False))
    print(f"device: {name}, {K.num_sms} SMs; PDL rows: {'yes' if pdl_ok else 'no (needs sm_90)'}")
    print(f"read-only kernel of metrale bench (4 GiB, uint4 loads): {read_gbs:8.0f} GB/s")
    if "--simt" in sys.argv[1:]:
        simt_section(cp, K, read_gbs)
        return 0
    if "--sweep" in sys.argv[1:]:
        sweep_section(cp, K, read_gbs)
        return 0
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
            runs = [("tc", default, False)]
            if pdl_ok:
                runs.append(("tc+pdl", default, True))
            if M == 1:
                runs += [("tc", s, False) for s in (default // 2, 2 * default) if s >= 1]
            for label, ns, pdl in runs:
                ws = cp.zeros(K.decode_workspace_size(M, nh, HD, ns), dtype=cp.float32)
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
                tag = f"{ns}" + ("*" if ns == default else "")
                print(f"{label:<12}{ctx:>7}{M:>4}{tag:>8}{ms * 1e3:>9.1f}{gbs:>8.0f}{100 * gbs / read_gbs:>7.0f}%")
                sys.stdout.flush()
        del caches
    print("(* = decode_splits default)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
