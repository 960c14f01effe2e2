"""Bandwidth of the GEMV kernels (and decode attention) against the read-only kernel of `metrale bench`
(metrale_cli.bench.read_bandwidth_gpu) measured in the same run.  Needs CuPy and a CUDA GPU:

    PYTHONPATH=. python3 -m benchmarks.bench_kernels
    PYTHONPATH=. python3 -m benchmarks.bench_kernels --tc   # tensor-core GEMV only (+ sweep)
    PYTHONPATH=. python3 -m benchmarks.bench_kernels --pdl  # launch chains with / without PDL
    PYTHONPATH=. python3 -m benchmarks.bench_kernels --stream  # streaming GEMV vs gemv (normed qkv, M = 1)
    PYTHONPATH=. python3 -m benchmarks.bench_kernels --ring  # ring GEMV: per shape, and decode chains with PDL

Each measurement captures 32 launches into a CUDA graph (the engine replays graphs too, so
the per-node launch gap is included), rotating several weight copies so that the 60 MB L2
does not serve repeated reads; time with CUDA events; the median of the repeats.
"""

from __future__ import annotations

import math
import statistics
import sys

from metrale_cli.bench import read_bandwidth_gpu

L2_BYTES = 60 * 2**20


def _graph_time_ms(cp, launches, repeats=15):
    """Median time of one launch, from graph replays of the list of launch(stream) callables."""
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        for f in launches:
            f(s)
        s.synchronize()
        s.begin_capture()
        for f in launches:
            f(s)
        g = s.end_capture()
    g.launch(stream=s)
    s.synchronize()
    times = []
    for _ in range(repeats):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(s)
        g.launch(stream=s)
        e1.record(s)
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) / len(launches))
    return statistics.median(times)


def _bf16_weights(cp, K, shape, copies):
    out = []
    for _ in range(copies):
        w32 = cp.random.standard_normal(shape, dtype=cp.float32) * 0.05
        wb = cp.empty(shape, dtype=cp.uint16)
        K.f32_to_bf16(w32, wb)
        del w32
        out.append(wb)
    return out


# Tensor-core GEMV (gemv_tc): the Llama-3.1-8B shapes of the rows path.
TC_SHAPES = (
    ("qkv", 6144, 4096, False),
    ("o", 4096, 4096, False),
    ("gate_up", 14336, 4096, True),  # N = I: the weight is 2I x K
    ("down", 4096, 14336, False),
    ("lm_head", 128256, 4096, False),
)
TC_MS = (1, 4, 8, 16)


def tc_section(cp, K, read_gbs) -> None:
    """gemv_tc against gemv / gemv_swiglu (default configs) for M in TC_MS on TC_SHAPES, plus a
    sweep over the compiled gemv_tc configs.  'x M=1' = time / the fp32 gemv's time at M = 1 (the
    verify pass at M = k should cost <= 1.15x / 1.3x a decode step)."""
    from metrale_cli.backends.cuda.kernels import (GEMV_TC_DEFAULT, GEMV_TC_EXTRA, GEMV_TC_SWIGLU_DEFAULT,
                                                   GEMV_TC_SWIGLU_EXTRA)

    print(f"{'op':<16}{'N x K':>14}{'M':>4}{'config':>10}{'us':>9}{'GB/s':>8}{'% read':>8}{'x M=1':>7}")
    best = []
    for op, N, Kd, swiglu in TC_SHAPES:
        rows_w = 2 * N if swiglu else N
        nbytes_w = rows_w * Kd * 2
        copies = max(2, min(16, math.ceil(4 * L2_BYTES / nbytes_w)))
        ws = _bf16_weights(cp, K, (rows_w, Kd), copies)
        defaults = GEMV_TC_SWIGLU_DEFAULT if swiglu else GEMV_TC_DEFAULT
        extra = GEMV_TC_SWIGLU_EXTRA if swiglu else GEMV_TC_EXTRA
        t1 = None
        for M in TC_MS:
            x = cp.random.standard_normal((M, Kd), dtype=cp.float32)
            out = cp.empty((M, N), dtype=cp.float32)
            nbytes = nbytes_w + M * Kd * 4 + M * N * 4
            cands = [("gemv", None)] + [("tc", c) for c in dict.fromkeys([defaults[M]] + list(extra))]
            res = []
            for kind, cfg in cands:
                if kind == "gemv":
                    if swiglu:
                        f = lambda s, w, c=cfg: K.gemv_swiglu(x, w, out, stream=s)  # noqa: E731
                    else:
                        f = lambda s, w, c=cfg: K.gemv(x, w, out, stream=s)  # noqa: E731
                else:
                    f = lambda s, w, c=cfg: K.gemv_tc(x, w, out, swiglu=swiglu, config=c, stream=s)  # noqa: E731
                launches = [(lambda s, w=ws[i % copies], f=f: f(s, w)) for i in range(32)]
                ms = _graph_time_ms(cp, launches)
                if kind == "gemv" and M == 1:
                    t1 = ms
                gbs = nbytes / (ms * 1e-3) / 1e9
                tag = "fp32*" if kind == "gemv" else ",".join(map(str, cfg)) + ("*" if cfg == defaults[M] else "")
                label = ("gemv_swiglu" if swiglu else "gemv") if kind == "gemv" else f"tc {op}"
                print(f"{label:<16}{N:>7}x{Kd:<6}{M:>4}{tag:>10}{ms * 1e3:>9.1f}{gbs:>8.0f}"
                      f"{100 * gbs / read_gbs:>7.0f}%{ms / t1:>7.2f}")
                sys.stdout.flush()
                res.append((ms, tag))
            b = min(r for r in res[1:])
            best.append((op, M, res[0][0] * 1e3, b[0] * 1e3, b[1], 100 * nbytes / (b[0] * 1e-3) / 1e9 / read_gbs,
                         b[0] / t1))
        del ws
    print()
    print("best gemv_tc config per shape and M (us: fp32 gemv default -> best tc; % read; x gemv M=1):")
    for op, M, tg, tb, tag, pct, ratio in best:
        print(f"  {op:<8} M={M:<3} {tg:8.1f} -> {tb:8.1f} us  ({tag:>7}) {pct:5.0f}%  {ratio:5.2f}x")


def pdl_section(cp, K) -> None:
    """Time per launch of dependent chains captured in one graph, with and without programmatic
    dependent launch (PDL): tiny kernels (rmsnorm of one row: the gap between kernels dominates) and
    a chain of Llama-3-8B decode projections at M = 1 (o 4096x4096 and down 4096x14336 alternating
    with qkv 6144x4096 and gate/up, each reading the previous one's output), weights rotated."""
    if not K.pdl_supported:
        print("PDL: not supported on this GPU")
        return
    H = 4096
    x = cp.random.standard_normal((1, H), dtype=cp.float32)
    y = cp.empty_like(x)
    nw = cp.zeros(H, dtype=cp.uint16) + 0x3F80  # bf16 1.0
    tiny = [(lambda s, a=(x, y) if i % 2 == 0 else (y, x): K.rmsnorm(a[0], nw, 1e-6, a[1], stream=s))
            for i in range(256)]
    copies = 4
    wq = _bf16_weights(cp, K, (6144, H), copies)
    wo = _bf16_weights(cp, K, (H, H), copies)
    wgu = _bf16_weights(cp, K, (2 * 14336, H), copies)
    wd = _bf16_weights(cp, K, (H, 14336), copies)
    res = cp.random.standard_normal((1, H), dtype=cp.float32)
    qkv = cp.empty((1, 6144), dtype=cp.float32)
    act = cp.empty((1, 14336), dtype=cp.float32)
    layer = []
    for i in range(16):
        c = i % copies
        layer += [
            lambda s, c=c: K.gemv(res, wq[c], qkv, norm_weight=nw, stream=s),
            lambda s, c=c: K.gemv(x, wo[c], res, accumulate=True, stream=s),
            lambda s, c=c: K.gemv_swiglu(res, wgu[c], act, norm_weight=nw, stream=s),
            lambda s, c=c: K.gemv(act, wd[c], res, accumulate=True, stream=s),
        ]
    for label, chain in (("rmsnorm x256", tiny), ("decode GEMVs x64", layer)):
        for pdl in (False, True):
            K.pdl = pdl
            try:
                ms = _graph_time_ms(cp, chain)
            finally:
                K.pdl = False
            print(f"{label:<18} PDL {'on ' if pdl else 'off'}  {ms * 1e3:8.2f} us per launch")
            sys.stdout.flush()


# The normed, ungated projection (qkv) of the presets the issues name, M = 1: llama-3.1-8b, gemma-2-9b,
# phi-3-mini, qwen3-30b-a3b.
STREAM_SHAPES = (("8b qkv", 6144, 4096), ("g2 qkv", 8192, 3584), ("phi qkv", 9216, 3072), ("moe qkv", 5120, 2048))
STREAM_CONFIGS = ((4, 2), (4, 3), (4, 4), (8, 2))


def stream_section(cp, K, read_gbs) -> None:
    """The streaming GEMV (gemv_stream, configs (U, B)) against the fp32-FMA gemv's default, both with the fused
    norm, at M = 1 on STREAM_SHAPES."""
    print(f"{'shape':<10}{'N x K':>14}{'kernel':>10}{'us':>8}{'% read':>8}")
    for label, N, Kd in STREAM_SHAPES:
        nbytes_w = N * Kd * 2
        copies = max(2, min(16, math.ceil(4 * L2_BYTES / nbytes_w)))
        ws = _bf16_weights(cp, K, (N, Kd), copies)
        nw = cp.zeros(Kd, dtype=cp.uint16) + 0x3F80
        x = cp.random.standard_normal((1, Kd), dtype=cp.float32)
        out = cp.empty((1, N), dtype=cp.float32)
        for cfg in (None,) + STREAM_CONFIGS:
            if cfg is None:
                f = lambda s, w: K.gemv(x, w, out, norm_weight=nw, stream=s)  # noqa: E731
            else:
                f = lambda s, w, c=cfg: K.gemv_stream(x, w, out, norm_weight=nw, config=c, stream=s)  # noqa: E731
            ms = _graph_time_ms(cp, [(lambda s, w=ws[i % copies], f=f: f(s, w)) for i in range(32)])
            pct = 100 * nbytes_w / (ms * 1e-3) / 1e9 / read_gbs
            tag = "gemv" if cfg is None else f"s{cfg[0]},{cfg[1]}"
            print(f"{label:<10}{N:>7}x{Kd:<6}{tag:>10}{ms * 1e3:>8.2f}{pct:>7.0f}%")
            sys.stdout.flush()
        del ws


# The decode projections of the presets the issues name (H, qkv rows, intermediate), for the --ring section.
RING_PRESETS = (("llama-3.1-8b", 4096, 6144, 14336), ("phi-3-mini", 3072, 9216, 8192),
               ("gemma-2-9b", 3584, 8192, 14336), ("llama-3.2-1b", 2048, 3072, 8192))
RING_VARIANTS = ((512, 1), (512, None), (1024, 1), (1024, 2), (1024, None))  # (threads, chunks per thread and slot)


def ring_section(cp, K, read_gbs) -> None:
    """The ring GEMV (gemv_ring) at M = 1: first each projection alone (32 launches a graph, weights rotated)
    with RING_VARIANTS (threads, ring chunks per thread and slot; None: the most that fit) against what the rows path takes (gemv_stream for the normed qkv, gemv / gemv_swiglu
    otherwise), checked against that kernel on the same data; then a chain of 16 layers of the four projections
    (qkv normed, o accumulating, gate_up normed and gated, down accumulating: each reads the one before), rows
    path kernels vs gemv_ring, PDL off and on, per layer and against the chain's byte floor."""
    for preset, H, NQ, I in RING_PRESETS:
        ops = (("qkv", NQ, H, "norm"), ("o", H, H, "acc"), ("gate_up", I, H, "gated"), ("down", H, I, "acc"))
        nw = cp.asarray((cp.random.standard_normal(max(H, I), dtype=cp.float32) * 0.1 + 1.0).astype(cp.float32))
        nwb = cp.empty(nw.shape, dtype=cp.uint16)
        K.f32_to_bf16(nw, nwb)
        weights, chain_bytes = {}, 0
        print(f"{preset}: H {H}, qkv {NQ}, intermediate {I}")
        for op, N, Kd, mode in ops:
            rows = 2 * N if mode == "gated" else N
            nbytes_w = rows * Kd * 2
            chain_bytes += nbytes_w
            copies = max(2, min(16, math.ceil(4 * L2_BYTES / nbytes_w)))
            ws = _bf16_weights(cp, K, (rows, Kd), copies)
            weights[op] = ws
            x = cp.random.standard_normal((1, Kd), dtype=cp.float32)
            out = cp.random.standard_normal((1, N), dtype=cp.float32)
            kw = dict(norm_weight=nwb[:Kd]) if mode in ("norm", "gated") else {}

            def old(s, w, kw=kw, mode=mode, x=x, out=out):
                if mode == "gated":
                    K.gemv_swiglu(x, w, out, stream=s, **kw)
                elif mode == "norm" and K.stream_fits(1, x.shape[1], out.shape[1]):
                    K.gemv_stream(x, w, out, stream=s, **kw)
                else:
                    K.gemv(x, w, out, accumulate=mode == "acc", stream=s, **kw)

            def new(s, w, v, kw=kw, mode=mode, x=x, out=out):
                K.gemv_ring(x, w, out, swiglu=mode == "gated", accumulate=mode == "acc", threads=v[0], chunks=v[1],
                           stream=s,
                           **kw)

            o0 = out.copy()
            old(None, ws[0])
            a = out.copy()
            out[...] = o0
            new(None, ws[0], (512, None))
            b = out.copy()
            diff = float(cp.abs(a - b).max() / (cp.abs(a).max() + 1e-30))
            t_old = _graph_time_ms(cp, [(lambda s, w=ws[i % copies]: old(s, w)) for i in range(32)])
            line = f"  {op:<8}{rows:>6}x{Kd:<6} rows path {t_old * 1e3:7.2f} us {_pct(nbytes_w, t_old, read_gbs):4.0f}%"
            for v in RING_VARIANTS:
                try:
                    t = _graph_time_ms(cp, [(lambda s, w=ws[i % copies], v=v: new(s, w, v)) for i in range(32)])
                except ValueError:  # this ring does not fit beside x
                    continue
                line += f" | {v[0]}/{v[1] or 'max'} {t * 1e3:6.2f} us {_pct(nbytes_w, t, read_gbs):3.0f}%"
            print(line + f"  (max diff {diff:.1e})")
            sys.stdout.flush()
        # the chain: x (the residual, H) -> qkv; attn stand-in (H) -> o += ; gate_up(norm x) -> act; act -> down +=
        res = cp.random.standard_normal((1, H), dtype=cp.float32)
        attn = cp.random.standard_normal((1, H), dtype=cp.float32)
        qkv = cp.empty((1, NQ), dtype=cp.float32)
        act = cp.empty((1, I), dtype=cp.float32)
        nh = nwb[:H]

        def layer(i, ring, w=weights):
            c = {op: w[op][i % len(w[op])] for op in w}
            if ring:
                t = ring
                return [lambda s, c=c: K.gemv_ring(res, c["qkv"], qkv, norm_weight=nh, threads=t, stream=s),
                        lambda s, c=c: K.gemv_ring(attn, c["o"], res, accumulate=True, threads=t, stream=s),
                        lambda s, c=c: K.gemv_ring(res, c["gate_up"], act, swiglu=True, norm_weight=nh, threads=t,
                                                  stream=s),
                        lambda s, c=c: K.gemv_ring(act, c["down"], res, accumulate=True, threads=t, stream=s)]
            q = (lambda s, c=c: K.gemv_stream(res, c["qkv"], qkv, norm_weight=nh, stream=s)) if K.stream_fits(
                1, H, NQ) else (lambda s, c=c: K.gemv(res, c["qkv"], qkv, norm_weight=nh, stream=s))
            return [q, lambda s, c=c: K.gemv(attn, c["o"], res, accumulate=True, stream=s),
                    lambda s, c=c: K.gemv_swiglu(res, c["gate_up"], act, norm_weight=nh, stream=s),
                    lambda s, c=c: K.gemv(act, c["down"], res, accumulate=True, stream=s)]

        floor_us = chain_bytes / (read_gbs * 1e9) * 1e6
        for ring in (0, 512, 1024):
            for pdl in (False, True):
                chain = [f for i in range(16) for f in layer(i, ring)]
                K.pdl = pdl
                try:
                    ms = _graph_time_ms(cp, chain)
                finally:
                    K.pdl = False
                per_layer = ms * 1e3 * 4
                print(f"  chain x16 {f'ring {ring:<4}' if ring else 'rows path'} PDL {'on ' if pdl else 'off'} "
                      f"{per_layer:8.2f} us per layer = {per_layer / floor_us:5.3f} x its floor ({floor_us:.2f} us)")
                sys.stdout.flush()
        del weights


def _pct(nbytes, ms, read_gbs) -> float:
    return 100 * nbytes / (ms * 1e-3) / 1e9 / read_gbs


def main() -> int:
    import cupy as cp

    from metrale_cli.backends.cuda.kernels import GEMV_DEFAULT, GEMV_SWIGLU_DEFAULT, Kernels

    K = Kernels()
    K.load_extra()  # the configs this bench sweeps
    dev = cp.cuda.Device()
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    read_gbs = read_bandwidth_gpu(cp) / 1e9
    print(f"device: {name}, {K.num_sms} SMs")
    print(f"read-only kernel of metrale bench (4 GiB, uint4 loads): {read_gbs:8.0f} GB/s")
    print()
    if "--tc" in sys.argv[1:]:  # only the tensor-core GEMV section
        tc_section(cp, K, read_gbs)
        return 0
    if "--stream" in sys.argv[1:]:  # only the streaming GEMV section
        stream_section(cp, K, read_gbs)
        return 0
    if "--ring" in sys.argv[1:]:  # only the bulk-copy GEMV section
        ring_section(cp, K, read_gbs)
        return 0
    if "--pdl" in sys.argv[1:]:  # only the programmatic-dependent-launch section
        pdl_section(cp, K)
        return 0
    print(f"{'op':<10}{'N x K':>14}{'M':>4}{'R,U':>6}{'us':>9}{'GB/s':>8}{'% read':>8}")

    shapes = [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096), (128256, 4096)]
    variants = {1: [None, (2, 4), (4, 2)], 4: [None, (2, 4)], 8: [None, (4, 0), (8, 0)], 16: [None, (4, 1)]}
    rows = []
    for N, Kd in shapes:
        nbytes_w = N * Kd * 2
        copies = max(2, min(16, math.ceil(4 * L2_BYTES / nbytes_w)))
        ws = _bf16_weights(cp, K, (N, Kd), copies)
        for M in (1, 4, 8, 16) if (N, Kd) in ((14336, 4096), (4096, 14336)) else (1, 4):
            cfgs = variants.get(M, [None])
            x = cp.random.standard_normal((M, Kd), dtype=cp.float32)
            out = cp.empty((M, N), dtype=cp.float32)
            for cfg in cfgs:
                launches = [
                    (lambda s, w=ws[i % copies], c=cfg: K.gemv(x, w, out, config=c, stream=s))
                    for i in range(32)
                ]
                ms = _graph_time_ms(cp, launches)
                gbs = (nbytes_w + M * Kd * 4 + M * N * 4) / (ms * 1e-3) / 1e9
                r, u = cfg if cfg is not None else GEMV_DEFAULT[M]
                tag = f"{r},{u}" + ("" if cfg is not None else "*")
                rows.append(("gemv", f"{N}x{Kd}", M, tag, ms * 1e3, gbs))
                print(f"{'gemv':<10}{N:>7}x{Kd:<6}{M:>4}{tag:>6}{ms * 1e3:>9.1f}{gbs:>8.0f}{100 * gbs / read_gbs:>7.0f}%")
                sys.stdout.flush()
        del ws

    # fused gate/up + SiLU (Llama-3-8B MLP: 2 x 14336 rows of 4096)
    I, Kd = 14336, 4096
    nbytes_w = 2 * I * Kd * 2
    ws = _bf16_weights(cp, K, (2 * I, Kd), 3)
    for M, cfg in ((1, None), (4, None), (8, None), (8, (2, 0)), (16, None), (16, (2, 0))):
        x = cp.random.standard_normal((M, Kd), dtype=cp.float32)
        out = cp.empty((M, I), dtype=cp.float32)
        launches = [(lambda s, w=ws[i % 3], c=cfg: K.gemv_swiglu(x, w, out, config=c, stream=s)) for i in range(32)]
        ms = _graph_time_ms(cp, launches)
        gbs = (nbytes_w + M * Kd * 4 + M * I * 4) / (ms * 1e-3) / 1e9
        r, u = cfg if cfg is not None else GEMV_SWIGLU_DEFAULT[M]
        tag = f"{r},{u}" + ("" if cfg is not None else "*")
        print(f"{'swiglu':<10}{2 * I:>7}x{Kd:<6}{M:>4}{tag:>6}{ms * 1e3:>9.1f}{gbs:>8.0f}{100 * gbs / read_gbs:>7.0f}%")
    del ws

    # decode attention, Llama-3-8B layer shape: 8 KV heads x 128, 32 query heads, context 8192
    n_kv, G, hd, ctx = 8, 4, 128, 8192
    caches = []
    for _ in range(4):
        kc = cp.empty((n_kv, ctx, hd), dtype=cp.uint16)
        vc = cp.empty((n_kv, ctx, hd), dtype=cp.uint16)
        K.f32_to_bf16(cp.random.standard_normal((n_kv, ctx, hd), dtype=cp.float32), kc)
        K.f32_to_bf16(cp.random.standard_normal((n_kv, ctx, hd), dtype=cp.float32), vc)
        caches.append((kc, vc))
    for M, splits in ((1, None), (1, 66), (1, 132), (1, 264), (4, None), (4, 66), (4, 132)):
        q = cp.random.standard_normal((M, n_kv * G, hd), dtype=cp.float32)
        out = cp.empty_like(q)
        pos = cp.asarray((ctx - M + cp.arange(M)).astype(cp.int32))
        launches = [
            (lambda s, c=caches[i % 4], ns=splits: K.attention_decode(q, c[0], c[1], pos, out, hd**-0.5, n_splits=ns, stream=s))
            for i in range(16)
        ]
        ms = _graph_time_ms(cp, launches)
        kvbytes = 2 * n_kv * ctx * hd * 2
        gbs = kvbytes / (ms * 1e-3) / 1e9
        ns = splits if splits is not None else K.decode_splits(ctx, n_kv, M, n_kv * G)
        tag = f"{ns}" + ("" if splits is not None else "*")
        print(f"{'attn-dec':<10}{'ctx ' + str(ctx):>14}{M:>4}{tag:>6}{ms * 1e3:>9.1f}{gbs:>8.0f}{100 * gbs / read_gbs:>7.0f}%")
    print("(* = default config; attn-dec R,U column = number of splits; us per launch incl. graph node)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
