"""Per-kernel time breakdown of the CUDA decode step (M = 1) on each rows path (fused, the default; rows).

For every launch kind of one decode step (per layer: the qkv GEMV, rope + KV append, the attention split kernel
and its combine, the o / gate_up / down GEMVs; the fused path's split kernel with rope + KV append; a sparse
layer's router GEMV, route, gate_up and down; per step: the final norm, lm_head, the bf16 rounding of the
logits, argmax) it captures one CUDA graph of that launch over all L layers in order (each with its own layer's
weights and KV cache, so L2 cannot serve the weights), times `--repeats` replays with CUDA events and reports
the median per launch, beside the launch's own floor: the bytes it must read (weights, norm weight, KV cache up
to the context) over the read bandwidth measured in the same run. Then the whole step (graph replay, as metrale
bench) and the difference: the gaps between launches (and any overlap) that the isolated times do not contain.

A launch timed in isolation still pays its own ramp-up and tail and about 0.75 us of graph node overhead:
the column "% of bw" is floor / time per launch.

    PYTHONPATH=. python3 benchmarks/decode_breakdown.py --preset llama-3.1-8b --context 1024 --paths rows,fused

--ablate also times the layers' launches as one graph with each launch kind left out in turn: its cost inside
the step (docs/CUDA_ENGINE.md, section 8).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metrale_cli import bench  # noqa: E402
from metrale_cli.config import load_config  # noqa: E402
from metrale_cli.models.spec import MoeSpec  # noqa: E402


# The per-step launches (final norm, lm_head, logits to bf16, argmax) are timed STEP_REPEAT times in one graph
# and divided, like the per-layer rows over L layers: a graph of one launch also times the graph launch itself
# (the first H200 run timed them one per graph: final norm 6.7 us, logits to bf16 4.2 us, which is mostly that).
STEP_REPEAT = 8


def time_graph(eng, launch, repeats: int) -> float:
    """Median seconds of one replay of a graph of `launch()` (warmed up eagerly first)."""
    cp, s = eng.cp, eng.stream
    with s:
        launch()
    s.synchronize()
    s.begin_capture()
    try:
        with s:
            launch()
    finally:
        g = s.end_capture()
    for _ in range(3):
        g.launch(stream=s)
    s.synchronize()
    out = []
    for _ in range(repeats):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(s)
        g.launch(stream=s)
        b.record(s)
        b.synchronize()
        out.append(cp.cuda.get_elapsed_time(a, b) / 1000)
    return statistics.median(out)


def layer_ops(eng, path: str):
    """[(name, launches per layer, bytes per launch (layer i), launch(i))] of one decode layer at M = 1."""
    from metrale_cli.backends.cuda.passes import FusedRowsPass, RowsPass, _window

    cfg, w, k = eng.cfg, eng.w, eng.kern
    defs = cfg.definition.layers
    p = RowsPass(eng, 1)
    fp = FusedRowsPass(eng, 1)
    x, qkv, act = eng._x[:1], eng._qkv[:1], eng._act[:1]
    ctx = eng.length  # the cached positions the step attends over

    def nb(*arrs):
        return sum(int(a.nbytes) for a in arrs if a is not None)

    def kv_bytes(i):
        a = defs[i].mixer
        keys = min(ctx + 1, a.window or ctx + 1)
        return 2 * a.num_kv_heads * keys * a.head_dim * 2

    def qkv_rows(i):
        lw, layer = w.layers[i], defs[i]
        p.linear(x, lw["qkv"], lw.get("qkv_bias"), out="qkv", norm=(lw["input_norm"], layer.norm))

    def rope(i):
        lw, layer = w.layers[i], defs[i]
        p.rope_kv_append(qkv, i, layer.mixer, lw.get("q_norm"), lw.get("k_norm"), layer.norm)

    a0 = defs[0].mixer  # one row: rope_kv_append rotates q in place in the qkv row, on every path
    q1 = qkv[:, :a0.q_size].reshape(1, a0.num_heads, a0.head_dim)

    def attn_part(only):
        def run(i):
            a = defs[i].mixer
            k.attention_decode(q1, eng._kc[i], eng._vc[i], p.pos, eng._attn[:1], a.scale,
                               n_splits=eng._splits[1], workspace=eng._ws, window=_window(eng, a), softcap=a.softcap,
                               only=only, stream=eng.stream)
        return run

    def rope_fits(i):
        a = defs[i].mixer
        return k.rope_fits(a.head_dim, a.num_heads, a.num_kv_heads, _window(eng, a), a.softcap) is None

    rope_in_attention = path == "fused" and all(rope_fits(i) for i in range(len(defs)))

    def attn_rope(only):  # the fused path at one row: rope + KV append in the attention split kernel
        def run(i):
            a, layer = defs[i].mixer, defs[i]
            rope = fp.rope_args(a, w.layers[i].get("q_norm"), w.layers[i].get("k_norm"), layer.norm)
            k.attention_decode(qkv.reshape(1, -1, a.head_dim), eng._kc[i], eng._vc[i], p.pos, eng._attn[:1], a.scale,
                               n_splits=eng._splits[1], workspace=eng._ws, rope=rope, only=only, stream=eng.stream)
        return run

    def o(i):
        lw = w.layers[i]
        p.linear(eng._attn[:1].reshape(1, -1), lw["o"], lw.get("o_bias"), out="x", residual=x)

    def gate_up(i):
        lw, layer = w.layers[i], defs[i]
        p.gated_mlp(x, lw["gate_up"], norm=(lw["mlp_norm"], layer.norm), activation=layer.mlp.activation)

    def down(i):
        p.linear(act, w.layers[i]["down"], None, out="x", residual=x)

    lw = lambda i, key: w.layers[i].get(key)  # noqa: E731
    common = [
        ("o GEMV (+= residual)", 1, lambda i: nb(lw(i, "o"), lw(i, "o_bias")), o),
        ("gate_up GEMV (norm, act)", 1, lambda i: nb(lw(i, "gate_up"), lw(i, "mlp_norm")), gate_up),
        ("down GEMV (+= residual)", 1, lambda i: nb(lw(i, "down")), down),
    ]
    split_combine = [
        ("attention split", 1, kv_bytes, attn_part("split")),
        ("attention combine", 1, lambda i: 0, attn_part("combine")),
    ]
    common += moe_ops(eng, p, x, nb)
    qkv_op = ("qkv GEMV (norm)", 1, lambda i: nb(lw(i, "qkv"), lw(i, "qkv_bias"), lw(i, "input_norm")), qkv_rows)
    if rope_in_attention:
        return [
            qkv_op,
            ("attention split + rope + KV", 1, kv_bytes, attn_rope("split")),
            ("attention combine", 1, lambda i: 0, attn_rope("combine")),
        ] + common
    return [  # the rows path, and the fused path where rope does not fit the split kernel (e.g. a SIMT head_dim)
        qkv_op,
        ("rope + KV append", 1, lambda i: 0, rope),
    ] + split_combine + common


def moe_ops(eng, p, x, nb):
    """The sparse layers' launches (names start with "moe"; timed over the sparse layers only): the router
    GEMV, the route kernel, the shared expert's gate_up, the chosen experts' gate_up and down.  At M = 1 a step
    reads top_k experts per layer: that is their floor."""
    if eng.cfg.moe is None:
        return []
    cfg, w, st = eng.cfg, eng.w, eng.moe
    spec, defs = cfg.moe.spec, cfg.definition.layers
    lw = lambda i, key: w.layers[i].get(key)  # noqa: E731
    logits = st.logits[:1]

    def router(i):
        eng._linear(x, lw(i, "router"), logits, norm_weight=lw(i, "mlp_norm"), eps=defs[i].norm.eps)

    def route(i):
        st.kern.route(logits, x, lw(i, "mlp_norm"), defs[i].norm.eps, spec.num_experts, spec.top_k,
                      spec.norm_topk_prob, bool(spec.shared_expert_size), st.buf, stream=eng.stream)

    def shared_gate_up(i):
        eng._linear(x, lw(i, "shared_gate_up"), st.act_s[:1], swiglu=True, norm_weight=lw(i, "mlp_norm"),
                    eps=defs[i].norm.eps)

    def gate_up(i):
        st.kern.gate_up(1, lw(i, "experts_gate_up"), st.buf, st.act, stream=eng.stream)

    def down(i):
        shared = (lw(i, "shared_down"), st.act_s[:1]) if spec.shared_expert_size else None
        st.kern.down(1, lw(i, "experts_down"), st.buf, st.act, x, shared=shared, accumulate=True, stream=eng.stream)

    def chosen(key):  # top_k of the layer's experts
        return lambda i: nb(lw(i, key)) * spec.top_k // spec.num_experts

    ops = [("moe router GEMV (norm)", 1, lambda i: nb(lw(i, "router"), lw(i, "mlp_norm")), router),
           ("moe route (top-k, h, union)", 1, lambda i: 0, route)]
    if spec.shared_expert_size:
        ops.append(("moe shared gate_up GEMV", 1, lambda i: nb(lw(i, "shared_gate_up")), shared_gate_up))
    return ops + [("moe gate_up (chosen experts)", 1, chosen("experts_gate_up"), gate_up),
                  ("moe down (+ shared, += residual)", 1,
                   lambda i: chosen("experts_down")(i) + nb(lw(i, "shared_down")), down)]


def step_ops(eng):
    """[(name, bytes, launch())] of the per-step tail (final norm, lm_head, logits rounding, argmax)."""
    k, w, s = eng.kern, eng.w, eng.stream
    norm = eng.cfg.definition.norm
    h = eng._h[:1]
    return [
        ("final norm", int(w.final_norm.nbytes), lambda: k.rmsnorm(eng._x[:1], w.final_norm, norm.eps, h,
                                                                    offset=norm.offset, stream=s)),
        ("lm_head GEMV", int(w.lm_head.nbytes), lambda: eng._linear(h, w.lm_head, eng._logits32[:1])),
        ("logits to bf16", 0, lambda: k.f32_to_bf16(eng._logits32[:1], eng._decode_logits, stream=s)),
        ("argmax", 0, lambda: k.argmax(eng._decode_logits, eng._decode_amax, stream=s)),
    ]


def op_layers(eng, name: str) -> list[int]:
    """The layers a launch kind of layer_ops runs in: the MoE launches in the sparse layers, the dense MLP's GEMVs in
    the dense ones, the rest in all."""
    sparse = {i for i, layer in enumerate(eng.cfg.definition.layers) if isinstance(layer.mlp, MoeSpec)}
    if name.startswith("moe"):
        return sorted(sparse)
    if "GEMV" in name and ("gate_up" in name or "down" in name):
        return [i for i in range(eng.cfg.num_hidden_layers) if i not in sparse]
    return list(range(eng.cfg.num_hidden_layers))


def breakdown(eng, path: str, bw: float, repeats: int, decode_once, timer) -> dict:
    eng.set_path(path)
    rows = []
    x0 = eng._x.copy()
    for name, per_layer, nbytes, fn in layer_ops(eng, path):
        layers = op_layers(eng, name)
        if not layers:
            continue
        t = time_graph(eng, lambda: [fn(i) for i in layers], repeats) / len(layers)
        eng._x[...] = x0  # the residual-accumulating GEMVs grew it
        eng.cp.cuda.Device().synchronize()
        b = statistics.mean(nbytes(i) for i in layers)
        rows.append(dict(kernel=name, launches=per_layer * len(layers), us=t * 1e6, bytes=b, floor_us=b / bw * 1e6))
    for name, b, fn in step_ops(eng):  # idempotent launches: STEP_REPEAT of them per graph, as the layers' rows
        t = time_graph(eng, lambda: [fn() for _ in range(STEP_REPEAT)], repeats) / STEP_REPEAT
        rows.append(dict(kernel=name, launches=1, us=t * 1e6, bytes=b, floor_us=b / bw * 1e6))
    eng.check_fused()
    # the cache rows the isolated launches wrote at position `length` are rewritten by the next decode
    step = timer.time(decode_once, repeats)
    eng.check_fused()
    isolated = sum(r["us"] * r["launches"] for r in rows)
    launches = sum(r["launches"] for r in rows)
    return dict(path=path, rows=rows, step_us=step * 1e6, isolated_us=isolated, launches=launches)


def ablation(eng, path: str, repeats: int) -> dict:
    """What each per-layer launch kind costs inside the step, not alone: the graph of every layer's launches in
    step order (the decode step without its per-step tail), timed whole and then once with each kind left out.
    The difference is that kind's marginal cost with its neighbours' PDL overlap and gaps, which the isolated
    rows above cannot show.  The values computed are garbage (a left-out rope leaves q unrotated; a left-out MoE route
    leaves gate_up / down the previous layer's experts): time only.  A kind's saving is per layer it runs in."""
    eng.set_path(path)
    L = eng.cfg.num_hidden_layers
    ops = [(name, fn, set(op_layers(eng, name))) for name, _, _, fn in layer_ops(eng, path)]
    ops = [op for op in ops if op[2]]
    x0 = eng._x.copy()

    def chain(skip):
        def run():
            for i in range(L):
                for name, fn, layers in ops:
                    if name != skip and i in layers:
                        fn(i)
        t = time_graph(eng, run, repeats)
        eng._x[...] = x0
        eng.cp.cuda.Device().synchronize()
        return t * 1e6

    whole = chain(None)
    rows = [dict(kernel=name, without_us=(w := chain(name)), marginal_us=(whole - w) / len(layers))
            for name, _, layers in ops]
    eng.check_fused()
    return dict(path=path, chain_us=whole, rows=rows)


def render_ablation(res: dict) -> str:
    if "skipped" in res:
        return f"path {res['path']}: ablation {res['skipped']}"
    out = [f"path {res['path']}: the layers' launches in step order, one graph: {res['chain_us'] / 1e3:.3f} ms",
           f"{'left out':32} {'chain us':>9} {'us/layer saved':>15}"]
    for r in res["rows"]:
        out.append(f"{r['kernel']:32} {r['without_us']:>9.1f} {r['marginal_us']:>15.2f}")
    return "\n".join(out)


def render(res: dict, floor_us: float) -> str:
    out = [f"path {res['path']}: decode step {res['step_us'] / 1e3:.3f} ms ({res['step_us'] / floor_us:.3f} x the "
           f"{floor_us / 1e3:.3f} ms floor), {res['launches']} launches timed",
           f"{'kernel':32} {'launches':>8} {'us each':>9} {'us/step':>9} {'floor us':>9} {'% of bw':>8}"]
    for r in res["rows"]:
        pct = f"{100 * r['floor_us'] / r['us']:.1f}" if r["bytes"] else "-"
        out.append(f"{r['kernel']:32} {r['launches']:>8} {r['us']:>9.2f} {r['us'] * r['launches']:>9.1f} "
                   f"{r['floor_us']:>9.2f} {pct:>8}")
    gap = res["step_us"] - res["isolated_us"]
    out.append(f"{'sum of isolated launches':32} {'':>8} {'':>9} {res['isolated_us']:>9.1f}")
    out.append(f"{'step - sum (gaps, overlap)':32} {'':>8} {'':>9} {gap:>9.1f}")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--paths", default="rows,fused")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", default=None, help="also write the numbers here")
    ap.add_argument("--ablate", action="store_true",
                    help="also time the layers' launches as one chain with each launch kind left out in turn "
                         "(its marginal cost inside the step)")
    args = ap.parse_args()
    paths = bench.check_paths(tuple(args.paths.split(",")), "cuda")
    cfg = load_config(bench.preset_path(args.preset))
    eng = bench.build_engine(cfg, "cuda", args.context + 64)
    bw = bench.read_bandwidth_gpu(eng.cp)
    rng = np.random.default_rng(0)
    eng.prefill([int(t) for t in rng.integers(0, cfg.vocab_size, args.context)])
    eng.synchronize()
    # the isolated launches read the step's token and position from the engine's io buffer, as a decode does
    eng._io_np[0, 0], eng._io_np[1, 0] = 5, args.context
    eng._io.set(eng._io_np, stream=eng.stream)
    eng.synchronize()
    one, total = bench._expert_params(cfg)  # a sparse step reads top_k experts per sparse layer
    active = total - (one * cfg.moe.spec.top_k * len(cfg.moe.sparse_layers) if one else 0)
    floor_us = ((bench._streamed_bytes(cfg, 2) - 2 * active) + bench.kv_bytes_read(cfg, args.context, 2)) / bw * 1e6
    timer = bench._Timer(eng)

    def decode_once():
        eng.decode(5)
        eng.trim(args.context)

    print(f"{args.preset}, context {args.context}, read bandwidth {bw / 1e9:.0f} GB/s, floor {floor_us / 1e3:.3f} ms "
          f"(medians of {args.repeats} graph replays per row)")
    results = []
    for p in paths:
        res = breakdown(eng, p, bw, args.repeats, decode_once, timer)
        eng.trim(args.context)
        print(render(res, floor_us), flush=True)
        if args.ablate:
            res["ablation"] = ablation(eng, p, args.repeats)
            eng.trim(args.context)
            print(render_ablation(res["ablation"]), flush=True)
        results.append(res)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(preset=args.preset, context=args.context, read_bandwidth=bw,
                                                   floor_us=floor_us, paths=results), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
