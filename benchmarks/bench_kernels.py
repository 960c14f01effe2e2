"""Bandwidth of the GEMV kernels (and decode attention) against the read-only kernel of `metrale bench`
(metrale_cli.bench.read_bandwidth_gpu) measured in the same run.  Needs CuPy and a CUDA GPU:

    PYTHONPATH=. python3 -m benchmarks.bench_kernels         # the GEMV each row count takes, per shape; attention
    PYTHONPATH=. python3 -m benchmarks.bench_kernels --tc    # tensor-core GEMV against the fp32-FMA GEMV, M = 1..16
    PYTHONPATH=. python3 -m benchmarks.bench_kernels --pdl   # launch chains with / without PDL
    PYTHONPATH=. python3 -m benchmarks.bench_kernels --ring  # ring GEMV: per shape, and decode chains with PDL

Each measurement captures 32 launches into a CUDA graph (the engine replays graphs too, so
the per-node launch gap is included), rotating several weight copies so that the 60 MB L2
does not serve repeated reads; time with CUDA events; the median of the repeats.

Only what the engine has is timed: each kernel in its one compiled configuration per row count (tuning.py's
GEMV_DEFAULT, GEMV_SWIGLU_DEFAULT, GEMV_TC_DEFAULT), the ring GEMV of 1024 threads at the ring depths compiled
(GEMV_RING_CHUNKS).  The configuration sweeps, the streaming GEMV (--stream) and the 512-thread ring were removed
with their kernels in issue 35; their figures are in docs/CUDA_ENGINE.md.
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
TC_MS = (1, 2, 4, 8, 16)


def _copies(nbytes_w: int) -> int:
    """Weight copies to rotate so that the L2 cannot serve a repeated read."""
    return max(2, min(16, math.ceil(4 * L2_BYTES / nbytes_w)))


def _per_launch_ms(cp, ws, f) -> float:
    """Time of one f(stream, w) in a graph of 32, the weights ws rotated."""
    return _graph_time_ms(cp, [(lambda s, w=ws[i % len(ws)]: f(s, w)) for i in range(32)])


def tc_section(cp, K, read_gbs) -> None:
    """gemv_tc against the fp32-FMA gemv / gemv_swiglu, each in its compiled configuration, for M in TC_MS on
    TC_SHAPES (the fp32 GEMV is compiled only for the rows below GEMV_TC_MIN_ROWS: '-' from there on).
    'x M=1' = gemv_tc's time / the fp32 GEMV's time at M = 1 (the verify pass at M = k should cost <= 1.15x /
    1.3x a decode step); '*' marks the kernel the rows path takes for M (one row: the ring GEMV where it fits,
    see --ring)."""
    from metrale_cli.backends.cuda.kernels import (GEMV_DEFAULT, GEMV_SWIGLU_DEFAULT, GEMV_TC_DEFAULT,
                                                   GEMV_TC_MIN_ROWS, GEMV_TC_SWIGLU_DEFAULT)

    print(f"{'op':<10}{'N x K':>14}{'M':>4}{'fp32 us':>10}{'tc config':>11}{'tc us':>9}{'GB/s':>8}{'% read':>8}"
          f"{'x M=1':>7}")
    for op, N, Kd, swiglu in TC_SHAPES:
        rows_w = 2 * N if swiglu else N
        nbytes_w = rows_w * Kd * 2
        ws = _bf16_weights(cp, K, (rows_w, Kd), _copies(nbytes_w))
        fp32_table = GEMV_SWIGLU_DEFAULT if swiglu else GEMV_DEFAULT
        tc_table = GEMV_TC_SWIGLU_DEFAULT if swiglu else GEMV_TC_DEFAULT
        t1 = None
        for M in TC_MS:
            x = cp.random.standard_normal((M, Kd), dtype=cp.float32)
            out = cp.empty((M, N), dtype=cp.float32)
            nbytes = nbytes_w + M * Kd * 4 + M * N * 4
            t_fp32 = None
            if M in fp32_table:
                if swiglu:
                    t_fp32 = _per_launch_ms(cp, ws, lambda s, w: K.gemv_swiglu(x, w, out, stream=s))
                else:
                    t_fp32 = _per_launch_ms(cp, ws, lambda s, w: K.gemv(x, w, out, stream=s))
                if M == 1:
                    t1 = t_fp32
            t_tc = _per_launch_ms(cp, ws, lambda s, w: K.gemv_tc(x, w, out, swiglu=swiglu, stream=s))
            gbs = nbytes / (t_tc * 1e-3) / 1e9
            tc_mark, fp32_mark = ("*", " ") if M >= GEMV_TC_MIN_ROWS else (" ", "*")
            fp32 = f"{t_fp32 * 1e3:8.1f}{fp32_mark}" if t_fp32 is not None else f"{'-':>8} "
            cfg = ",".join(map(str, tc_table[M])) + tc_mark
            ratio = f"{t_tc / t1:7.2f}" if t1 else f"{'-':>7}"
            print(f"{op:<10}{N:>7}x{Kd:<6}{M:>4}{fp32:>10}{cfg:>11}{t_tc * 1e3:>9.1f}{gbs:>8.0f}"
                  f"{100 * gbs / read_gbs:>7.0f}%{ratio}")
            sys.stdout.flush()
        del ws
    print("(* = the kernel the rows path takes for M; one row takes the ring GEMV where it fits: --ring)")


def pdl_section(cp, K) -> None:
    """Time per launch of dependent chains captured in one graph, with and without programmatic
    dependent launch (PDL): tiny kernels (rmsnorm of one row: the gap between kernels dominates) and
    a chain of Llama-3-8B decode projections at M = 1 (o 4096x4096 and down 4096x14336 alternating
    with qkv 6144x4096 and gate/up, each reading the previous one's output) on the fp32-FMA GEMV (gemv.cu),
    weights rotated (the ring GEMV's chains: --ring)."""
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


# The decode projections of the presets the issues name (H, qkv rows, intermediate), for the --ring section.
RING_PRESETS = (("llama-3.1-8b", 4096, 6144, 14336), ("phi-3-mini", 3072, 9216, 8192),
                ("gemma-2-9b", 3584, 8192, 14336), ("llama-3.2-1b", 2048, 3072, 8192))


def ring_section(cp, K, read_gbs) -> None:
    """The ring GEMV (gemv_ring, 1024 threads) at M = 1: first each projection alone (32 launches a graph, weights
    rotated) at each compiled ring depth (GEMV_RING_CHUNKS: chunks per thread and slot; '*' = the engine's,
    Kernels.ring_chunks) against the fp32-FMA GEMV the rows path falls back to where the ring does not fit (gemv
    / gemv_swiglu), checked against it on the same data; then a chain of 16 layers of the four projections (qkv
    normed, o accumulating, gate_up normed and gated, down accumulating: each reads the one before), fp32 GEMV vs
    the ring at the engine's depth, PDL off and on, per layer and against the chain's byte floor."""
    from metrale_cli.backends.cuda.kernels.tuning import GEMV_RING_CHUNKS

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
            copies = _copies(nbytes_w)
            ws = _bf16_weights(cp, K, (rows, Kd), copies)
            weights[op] = ws
            x = cp.random.standard_normal((1, Kd), dtype=cp.float32)
            out = cp.random.standard_normal((1, N), dtype=cp.float32)
            kw = dict(norm_weight=nwb[:Kd]) if mode in ("norm", "gated") else {}
            engine_chunks = K.ring_chunks(Kd, N, mode == "gated")

            def fp32(s, w, kw=kw, mode=mode, x=x, out=out):
                if mode == "gated":
                    K.gemv_swiglu(x, w, out, stream=s, **kw)
                else:
                    K.gemv(x, w, out, accumulate=mode == "acc", stream=s, **kw)

            def ring(s, w, chunks, kw=kw, mode=mode, x=x, out=out):
                K.gemv_ring(x, w, out, swiglu=mode == "gated", accumulate=mode == "acc", chunks=chunks, stream=s,
                            **kw)

            if not K.ring_fits(1, Kd, N, mode == "gated"):
                print(f"  {op:<8}{rows:>6}x{Kd:<6} the ring GEMV does not fit this shape on this device")
                continue
            o0 = out.copy()
            fp32(None, ws[0])
            a = out.copy()
            out[...] = o0
            ring(None, ws[0], engine_chunks)
            b = out.copy()
            diff = float(cp.abs(a - b).max() / (cp.abs(a).max() + 1e-30))
            t_fp32 = _graph_time_ms(cp, [(lambda s, w=ws[i % copies]: fp32(s, w)) for i in range(32)])
            line = (f"  {op:<8}{rows:>6}x{Kd:<6} fp32 gemv {t_fp32 * 1e3:7.2f} us "
                    f"{_pct(nbytes_w, t_fp32, read_gbs):4.0f}%")
            for p in GEMV_RING_CHUNKS:
                try:
                    t = _graph_time_ms(cp, [(lambda s, w=ws[i % copies], p=p: ring(s, w, p)) for i in range(32)])
                except ValueError:  # this ring does not fit beside x
                    continue
                tag = f"P={p}" + ("*" if p == engine_chunks else "")
                line += f" | ring {tag:<4} {t * 1e3:6.2f} us {_pct(nbytes_w, t, read_gbs):3.0f}%"
            print(line + f"  (max diff {diff:.1e})")
            sys.stdout.flush()
        if not all(K.ring_fits(1, Kd, N, mode == "gated") for _, N, Kd, mode in ops):
            print("  chain skipped: the ring GEMV does not take every projection")
            del weights
            continue
        # the chain: x (the residual, H) -> qkv; attn stand-in (H) -> o += ; gate_up(norm x) -> act; act -> down +=
        res = cp.random.standard_normal((1, H), dtype=cp.float32)
        attn = cp.random.standard_normal((1, H), dtype=cp.float32)
        qkv = cp.empty((1, NQ), dtype=cp.float32)
        act = cp.empty((1, I), dtype=cp.float32)
        nh = nwb[:H]
        depth = {op: K.ring_chunks(Kd, N, mode == "gated") for op, N, Kd, mode in ops}  # the engine's

        def layer(i, use_ring, w=weights):
            c = {op: w[op][i % len(w[op])] for op in w}
            if use_ring:
                return [lambda s, c=c: K.gemv_ring(res, c["qkv"], qkv, norm_weight=nh, chunks=depth["qkv"],
                                                   stream=s),
                        lambda s, c=c: K.gemv_ring(attn, c["o"], res, accumulate=True, chunks=depth["o"],
                                                   stream=s),
                        lambda s, c=c: K.gemv_ring(res, c["gate_up"], act, swiglu=True, norm_weight=nh,
                                                   chunks=depth["gate_up"], stream=s),
                        lambda s, c=c: K.gemv_ring(act, c["down"], res, accumulate=True, chunks=depth["down"],
                                                   stream=s)]
            return [lambda s, c=c: K.gemv(res, c["qkv"], qkv, norm_weight=nh, stream=s),
                    lambda s, c=c: K.gemv(attn, c["o"], res, accumulate=True, stream=s),
                    lambda s, c=c: K.gemv_swiglu(res, c["gate_up"], act, norm_weight=nh, stream=s),
                    lambda s, c=c: K.gemv(act, c["down"], res, accumulate=True, stream=s)]

        floor_us = chain_bytes / (read_gbs * 1e9) * 1e6
        for use_ring in (False, True):
            for pdl in (False, True):
                chain = [f for i in range(16) for f in layer(i, use_ring)]
                K.pdl = pdl
                try:
                    ms = _graph_time_ms(cp, chain)
                finally:
                    K.pdl = False
                per_layer = ms * 1e3 * 4
                print(f"  chain x16 {'ring     ' if use_ring else 'fp32 gemv'} PDL {'on ' if pdl else 'off'} "
                      f"{per_layer:8.2f} us per layer = {per_layer / floor_us:5.3f} x its floor ({floor_us:.2f} us)")
                sys.stdout.flush()
        del weights


def _pct(nbytes, ms, read_gbs) -> float:
    return 100 * nbytes / (ms * 1e-3) / 1e9 / read_gbs


def _linear(K, M: int, Kd: int, N: int, swiglu: bool):
    """(kernel, config, f(x, w, out, stream)) of the projection the rows path launches for M rows: the ring GEMV
    for one row where it fits (at the engine's depth), gemv.cu below GEMV_TC_MIN_ROWS, gemv_tc from there on."""
    from metrale_cli.backends.cuda.kernels import (GEMV_DEFAULT, GEMV_SWIGLU_DEFAULT, GEMV_TC_DEFAULT,
                                                   GEMV_TC_MIN_ROWS, GEMV_TC_SWIGLU_DEFAULT)

    if M == 1 and K.ring_fits(1, Kd, N, swiglu):
        p = K.ring_chunks(Kd, N, swiglu)
        return "ring", f"P={p}", lambda x, w, out, s: K.gemv_ring(x, w, out, swiglu=swiglu, chunks=p, stream=s)
    if M < GEMV_TC_MIN_ROWS:
        cfg = ",".join(map(str, (GEMV_SWIGLU_DEFAULT if swiglu else GEMV_DEFAULT)[M]))
        if swiglu:
            return "fp32", cfg, lambda x, w, out, s: K.gemv_swiglu(x, w, out, stream=s)
        return "fp32", cfg, lambda x, w, out, s: K.gemv(x, w, out, stream=s)
    cfg = ",".join(map(str, (GEMV_TC_SWIGLU_DEFAULT if swiglu else GEMV_TC_DEFAULT)[M]))
    return "tc", cfg, lambda x, w, out, s: K.gemv_tc(x, w, out, swiglu=swiglu, stream=s)


def main() -> int:
    import cupy as cp

    from metrale_cli.backends.cuda.kernels import Kernels

    K = Kernels()
    dev = cp.cuda.Device()
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    read_gbs = read_bandwidth_gpu(cp) / 1e9
    print(f"device: {name}, {K.num_sms} SMs")
    print(f"read-only kernel of metrale bench (4 GiB, uint4 loads): {read_gbs:8.0f} GB/s")
    print()
    if "--tc" in sys.argv[1:]:  # only the tensor-core GEMV section
        tc_section(cp, K, read_gbs)
        return 0
    if "--ring" in sys.argv[1:]:  # only the ring GEMV section
        ring_section(cp, K, read_gbs)
        return 0
    if "--pdl" in sys.argv[1:]:  # only the programmatic-dependent-launch section
        pdl_section(cp, K)
        return 0
    # each projection with the kernel the rows path takes for M rows (_linear), in its compiled configuration
    print(f"{'op':<10}{'N x K':>14}{'M':>4}{'kernel':>7}{'config':>8}{'us':>9}{'GB/s':>8}{'% read':>8}")
    shapes = [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096), (128256, 4096)]
    for N, Kd in shapes:
        nbytes_w = N * Kd * 2
        ws = _bf16_weights(cp, K, (N, Kd), _copies(nbytes_w))
        for M in (1, 2, 4, 8, 16) if (N, Kd) in ((14336, 4096), (4096, 14336)) else (1, 2, 4):
            x = cp.random.standard_normal((M, Kd), dtype=cp.float32)
            out = cp.empty((M, N), dtype=cp.float32)
            kernel, cfg, f = _linear(K, M, Kd, N, False)
            ms = _per_launch_ms(cp, ws, lambda s, w, f=f: f(x, w, out, s))
            gbs = (nbytes_w + M * Kd * 4 + M * N * 4) / (ms * 1e-3) / 1e9
            print(f"{'linear':<10}{N:>7}x{Kd:<6}{M:>4}{kernel:>7}{cfg:>8}{ms * 1e3:>9.1f}{gbs:>8.0f}"
                  f"{100 * gbs / read_gbs:>7.0f}%")
            sys.stdout.flush()
        del ws

    # fused gate/up + SiLU (Llama-3-8B MLP: 2 x 14336 rows of 4096)
    I, Kd = 14336, 4096
    nbytes_w = 2 * I * Kd * 2
    ws = _bf16_weights(cp, K, (2 * I, Kd), 3)
    for M in (1, 2, 4, 8, 16):
        x = cp.random.standard_normal((M, Kd), dtype=cp.float32)
        out = cp.empty((M, I), dtype=cp.float32)
        kernel, cfg, f = _linear(K, M, Kd, I, True)
        ms = _per_launch_ms(cp, ws, lambda s, w, f=f: f(x, w, out, s))
        gbs = (nbytes_w + M * Kd * 4 + M * I * 4) / (ms * 1e-3) / 1e9
        print(f"{'swiglu':<10}{2 * I:>7}x{Kd:<6}{M:>4}{kernel:>7}{cfg:>8}{ms * 1e3:>9.1f}{gbs:>8.0f}"
              f"{100 * gbs / read_gbs:>7.0f}%")
        sys.stdout.flush()
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
        print(f"{'attn-dec':<10}{'ctx ' + str(ctx):>14}{M:>4}{'tc':>7}{tag:>8}{ms * 1e3:>9.1f}{gbs:>8.0f}"
              f"{100 * gbs / read_gbs:>7.0f}%")
    print("(linear / swiglu: config = (R, U) of gemv.cu, (TILES, W, U) of gemv_tc, P chunks per thread and slot of"
          " the ring; attn-dec: config = number of splits, * = decode_splits' default; us per launch incl. graph node)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
