"""Where the one-launch sparse layer (moe_layer_kernel) spends its time, phase by phase: the kernel compiled with
MOE_LAYER_STAMPS writes every block's %globaltimer at its entry and at each phase boundary.

    PYTHONPATH=. python3 scripts/moe_layer_phases.py --preset qwen3-30b-a3b [--rows 1] [--no-o] [--chain 24]

One launch alone (eager, on a stream): per boundary, the median / max over blocks of the time since the earliest
block passed pdl_wait (median of `--repeats` launches).  With --chain N: N launches, each on its own layer's expert
weights (as a step's layers, so L2 cannot serve them), in one CUDA graph with PDL, against a graph of one launch;
then, per launch of the chain (medians over the launches and replays): when its blocks entered (first / last, from
the previous launch's last block end), when they passed pdl_wait, how long its phases took, and its end.
Shapes from the preset, random bf16 weights."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metrale_cli import bench  # noqa: E402
from metrale_cli.config import load_config  # noqa: E402

# (stamp index, boundary) in the kernel's order (moe.cu's MOE_STAMP calls)
PHASES = [(0, "pdl_wait done"), (1, "o rows done"), (2, "barrier 0"), (3, "router rows done"), (4, "barrier 1"),
          (9, "logits in shared"), (10, "top-k done"), (5, "routing done"), (6, "gate_up done"), (7, "barrier 2"),
          (8, "down done")]
LAUNCHES, BLOCKS = 64, 1024  # moe.cu's MOE_STAMP_LAUNCHES, the stamps' blocks per launch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-o", action="store_true")
    ap.add_argument("--chain", type=int, default=0, help="also time N launches back to back in one graph with PDL")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                    help="a macro for moe.cu (an experiment's variant, e.g. MOE_DOWN_PREFETCH=0)")
    a = ap.parse_args()
    import cupy as cp

    from metrale_cli.backends.cuda.kernels import Kernels, moe

    moe.define_macros(["MOE_LAYER_STAMPS"] + a.define)
    kern = Kernels()
    mk = moe.MoeKernels(kern)
    cfg = load_config(bench.preset_path(a.preset))
    spec = cfg.moe.spec
    E, k, H, inter, m = spec.num_experts, spec.top_k, cfg.hidden_size, spec.intermediate_size, a.rows
    q = cfg.definition.layers[0].attention.q_size
    rng = np.random.default_rng(0)
    if a.chain > LAUNCHES:
        raise SystemExit(f"--chain {a.chain}: at most {LAUNCHES}")

    def w(*shape):  # random bf16 bits (truncated fp32)
        return ((cp.random.standard_normal(shape, dtype=cp.float32) * 0.02).view(cp.uint32) >> 16).astype(cp.uint16)

    x = cp.asarray(rng.standard_normal((m, H)).astype(np.float32))
    b = moe.RouteBuffers.allocate(cp, E, k, H)
    logits = cp.zeros((m, E), cp.float32)
    act = cp.zeros((16 * k, inter), cp.float32)
    o = None if a.no_o else (cp.asarray(rng.standard_normal((m, q)).astype(np.float32)), w(H, q))
    nw, wr = w(H), w(E, H)
    stamps = cp.ndarray((LAUNCHES, BLOCKS, 16), cp.uint64, mk._module.get_global("moe_layer_stamps"))
    counter = cp.ndarray((1,), cp.uint32, mk._module.get_global("moe_layer_launch"))
    s = cp.cuda.Stream(non_blocking=True)
    G = kern.num_sms

    def launch(experts_w):
        mk.layer(m, x, nw, 1e-6, wr, logits, *experts_w, b, act, experts=E, top_k=k, norm_topk=spec.norm_topk_prob,
                 o=o, stream=s)

    def reset():
        with s:
            stamps.fill(0)
            counter.fill(0)

    one = (w(E, 2 * inter, H), w(E, H, inter))
    runs = []
    for i in range(a.repeats + 3):
        reset()
        launch(one)
        s.synchronize()
        if i >= 3:
            runs.append(stamps[0, :G].get().astype(np.int64))
    print(f"{a.preset}: M = {m}, {G} blocks, o {'off' if a.no_o else 'on'}; one launch alone, us since the first "
          f"block passed pdl_wait (median over {a.repeats} launches of: median / max over blocks)")
    for j, name in PHASES:
        if a.no_o and j in (1, 2):
            continue
        med, mx = [], []
        for r in runs:
            t = (r[:, j] - r[:, 0].min()) / 1e3
            t = t[r[:, j] > 0]
            if len(t):
                med.append(np.median(t))
                mx.append(t.max())
        print(f"  {name:18s} {np.median(med):8.2f} {np.median(mx):8.2f}")
    if a.chain:
        chain(cp, kern, a, launch, reset, stamps, s, w, E, inter, H, G)
    return 0


def chain(cp, kern, a, launch, reset, stamps, s, w, E, inter, H, G) -> None:
    layers = [(w(E, 2 * inter, H), w(E, H, inter)) for _ in range(a.chain)]
    kern.pdl = True

    def graph(n):
        s.begin_capture()
        for i in range(n):
            launch(layers[i])
        return s.end_capture()

    def timed(g, n):
        out, seen = [], []
        for i in range(a.repeats + 3):
            reset()
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(s)
            g.launch(stream=s)
            e1.record(s)
            e1.synchronize()
            if i >= 3:
                out.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / n)
                seen.append(stamps[:n, :G].get().astype(np.int64))
        return float(np.median(out)), seen

    alone, _ = timed(graph(1), 1)
    per, seen = timed(graph(a.chain), a.chain)
    kern.pdl = False
    print(f"graph of 1 launch: {alone:.2f} us; graph of {a.chain} launches with PDL: {per:.2f} us per launch")
    rows = {"first block entered": [], "last block entered": [], "first pdl_wait done": [], "last pdl_wait done": [],
            "barrier 1 passed": [], "routing done (max)": [], "gate_up done (max)": [], "barrier 2 passed": [],
            "last block done": []}
    for st in seen:  # [launch, block, stamp]
        for i in range(1, len(st)):
            prev_end = st[i - 1][:, [7, 8]].max()
            r = st[i]
            put = lambda key, v: rows[key].append((v - prev_end) / 1e3)  # noqa: E731
            put("first block entered", r[:, 15].min())
            put("last block entered", r[:, 15].max())
            put("first pdl_wait done", r[:, 0].min())
            put("last pdl_wait done", r[:, 0].max())
            put("barrier 1 passed", r[:, 4].min())
            put("routing done (max)", r[:, 5].max())
            put("gate_up done (max)", r[:, 6].max())
            put("barrier 2 passed", r[:, 7].min())
            put("last block done", r[:, [7, 8]].max())
    print("  per launch of the chain, us from the previous launch's last block end (medians):")
    for key, v in rows.items():
        print(f"  {key:22s} {np.median(v):8.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
