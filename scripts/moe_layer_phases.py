"""Where the one-launch sparse layer (moe_layer_kernel) spends its time, phase by phase: the kernel compiled with
MOE_LAYER_STAMPS writes every block's %globaltimer at each phase boundary; this prints, per boundary, the
median / max over blocks of the time since the earliest block passed pdl_wait (median of `--repeats` launches).

    PYTHONPATH=. python3 scripts/moe_layer_phases.py --preset qwen3-30b-a3b [--rows 1] [--no-o]

Shapes from the preset, random bf16 weights (one layer), eager launches on a stream (no PDL overlap)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metrale_cli import bench  # noqa: E402
from metrale_cli.config import load_config  # noqa: E402

PHASES = ["pdl_wait done", "o rows done", "barrier 0", "router rows done", "barrier 1", "routing done",
          "gate_up done", "barrier 2", "down done"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-o", action="store_true")
    ap.add_argument("--chain", type=int, default=0,
                    help="also time N launches back to back in one CUDA graph with PDL (us per launch, against one "
                         "launch alone in a graph), each on its own layer's weights")
    a = ap.parse_args()
    import cupy as cp

    from metrale_cli.backends.cuda.kernels import Kernels, moe

    plain = moe.module_source
    moe.module_source = lambda: "#define MOE_LAYER_STAMPS\n" + plain()
    kern = Kernels()
    mk = moe.MoeKernels(kern)
    cfg = load_config(bench.preset_path(a.preset))
    spec = cfg.moe.spec
    E, k, H, inter, m = spec.num_experts, spec.top_k, cfg.hidden_size, spec.intermediate_size, a.rows
    q = cfg.definition.layers[0].attention.q_size
    rng = np.random.default_rng(0)

    def w(*shape):  # random bf16 bits (truncated fp32)
        return ((cp.random.standard_normal(shape, dtype=cp.float32) * 0.02).view(cp.uint32) >> 16).astype(cp.uint16)

    x = cp.asarray(rng.standard_normal((m, H)).astype(np.float32))
    b = moe.RouteBuffers.allocate(cp, E, k, H)
    logits = cp.zeros((m, E), cp.float32)
    act = cp.zeros((16 * k, inter), cp.float32)
    o = None if a.no_o else (cp.asarray(rng.standard_normal((m, q)).astype(np.float32)), w(H, q))
    args = (m, x, w(H), 1e-6, w(E, H), logits, w(E, 2 * inter, H), w(E, H, inter), b, act)
    stamps = cp.ndarray((1024 * 16,), cp.uint64, mk._module.get_global("moe_layer_stamps"))
    s = cp.cuda.Stream(non_blocking=True)
    runs = []
    for i in range(a.repeats + 3):
        stamps.fill(0)
        mk.layer(*args, experts=E, top_k=k, norm_topk=spec.norm_topk_prob, o=o, stream=s)
        s.synchronize()
        if i >= 3:
            runs.append(stamps.get().reshape(-1, 16)[:kern.num_sms].astype(np.int64))
    if a.chain:
        chain_time(cp, kern, mk, a, args, E, k, H, inter, spec, o, w, s)
    print(f"{a.preset}: M = {m}, {kern.num_sms} blocks, o {'off' if a.no_o else 'on'}; us since the first block "
          f"passed pdl_wait (median over {a.repeats} launches of: median / max over blocks)")
    for j, name in enumerate(PHASES):
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
    return 0


def chain_time(cp, kern, mk, a, args, E, k, H, inter, spec, o, w, s) -> None:
    """us per launch of `a.chain` launches in one graph (PDL on; each launch its own layer's expert weights, as a
    step's layers, so L2 cannot serve them) against a graph of one launch."""
    m, x, nw, eps, wr, logits, _, _, b, act = args
    layers = [(w(E, 2 * inter, H), w(E, H, inter)) for _ in range(a.chain)]
    kern.pdl = True

    def timed(n):
        s.begin_capture()
        with s:
            for i in range(n):
                mk.layer(m, x, nw, eps, wr, logits, *layers[i], b, act, experts=E, top_k=k,
                         norm_topk=spec.norm_topk_prob, o=o, stream=s)
        g = s.end_capture()
        for _ in range(3):
            g.launch(stream=s)
        s.synchronize()
        out = []
        for _ in range(a.repeats):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(s)
            g.launch(stream=s)
            e1.record(s)
            e1.synchronize()
            out.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
        return float(np.median(out))

    one, many = timed(1), timed(a.chain)
    print(f"graph of 1 launch: {one:.2f} us; graph of {a.chain} launches (PDL): {many / a.chain:.2f} us per launch")
    kern.pdl = False


if __name__ == "__main__":
    raise SystemExit(main())
