"""Where a decode (or verify, or prefill) step's GPU time goes, per kernel, on a preset's random weights:

    PYTHONPATH=. python3 benchmarks/profile_decode.py --preset deepseek-v2-lite --context 1024 [--rows 4]
    PYTHONPATH=. python3 benchmarks/profile_decode.py --preset deepseek-v2-lite --prefill 2048

The step runs eagerly (no graph, no programmatic dependent launch) with a CUDA event recorded before and after each
kernel launch of every kernel module (the engine's, and those of the mixer kinds and weight formats), so each
kernel's own device time is measured (cuBLAS's gemmEx calls too, as "cublas ..."); the table sums them per kernel name over the step (median of --repeats
steps) beside the step's whole eager time and the captured graph's time (bench's timer). The gap between the sum
and the eager step is launch gaps and work outside the kernel modules (cuBLAS, CuPy's own kernels)."""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from metrale_cli import bench  # noqa: E402
from metrale_cli.config import load_config  # noqa: E402


class Recorder:
    """Wraps every compiled kernel of the live kernel modules (objects holding a `_fn` dict of CuPy kernels) with
    one that records an event pair around its launch."""

    def __init__(self, cp) -> None:
        self.cp, self.on, self.marks = cp, False, []
        for obj in gc.get_objects():
            fns = getattr(obj, "_fn", None) if not isinstance(obj, type) else None
            if isinstance(fns, dict) and fns and all(type(f).__name__ == "RawKernel" for f in fns.values()):
                for name, fn in list(fns.items()):
                    fns[name] = self._wrap(name, fn)
        from cupy_backends.cuda.libs import cublas

        for name in ("gemmEx", "gemmStridedBatchedEx"):
            setattr(cublas, name, self._wrap_call(f"cublas {name}", getattr(cublas, name)))

    def _wrap_call(self, name, fn):
        def call(*args):
            if not self.on:
                return fn(*args)
            s = self.cp.cuda.get_current_stream()
            a, b = self.cp.cuda.Event(), self.cp.cuda.Event()
            a.record(s)
            fn(*args)
            b.record(s)
            self.marks.append((name, a, b))
        return call

    def _wrap(self, name, fn):
        def launch(grid, block, args, stream=None, shared_mem=0):
            if not self.on:
                return fn(grid, block, args, stream=stream, shared_mem=shared_mem)
            s = stream if stream is not None else self.cp.cuda.get_current_stream()
            a, b = self.cp.cuda.Event(), self.cp.cuda.Event()
            a.record(s)
            fn(grid, block, args, stream=stream, shared_mem=shared_mem)
            b.record(s)
            self.marks.append((name, a, b))
        return launch

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        """(ms, launches) per kernel name of the marks recorded since the last take."""
        self.cp.cuda.runtime.deviceSynchronize()
        ms: dict[str, float] = defaultdict(float)
        n: dict[str, int] = defaultdict(int)
        for name, a, b in self.marks:
            ms[name] += self.cp.cuda.get_elapsed_time(a, b)
            n[name] += 1
        self.marks = []
        return ms, n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="deepseek-v2-lite")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=1, help="1: a decode step; k > 1: a verify pass of k rows")
    ap.add_argument("--prefill", type=int, default=0, help="N > 0: a prefill of N tokens instead (from position 0)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--path", default="fused", choices=("fused", "rows"))
    a = ap.parse_args()
    cfg = load_config(bench.preset_path(a.preset))
    eng = bench.build_engine(cfg, "cuda", max(a.context + a.rows + 1, a.prefill))
    eng.set_path(a.path)
    cp = eng.cp
    rng = np.random.default_rng(0)
    if not a.prefill:
        eng.prefill([int(t) for t in rng.integers(0, cfg.vocab_size, a.context)])
    rows = [int(t) for t in rng.integers(0, cfg.vocab_size, max(a.rows, a.prefill))]

    def step():
        if a.prefill:
            eng.reset()
            eng.prefill(rows)
            return
        eng.trim(a.context)
        if a.rows == 1:
            eng.decode(rows[0])
        else:
            eng.verify(rows)

    timer = bench._Timer(eng)
    graph_ms = timer.time(step, a.repeats) * 1e3
    eng.use_graphs, eng.graphs.use_pdl = False, False
    eager_ms = timer.time(step, a.repeats) * 1e3
    rec = Recorder(cp)
    rec.on = True
    runs, launches = [], {}
    for _ in range(a.repeats):
        step()
        ms, launches = rec.take()
        runs.append(ms)
    names = sorted({n for r in runs for n in r}, key=lambda n: -statistics.median(r.get(n, 0.0) for r in runs))
    per = {n: statistics.median(r.get(n, 0.0) for r in runs) for n in names}
    total = sum(per.values())
    what = f"prefill {a.prefill}" if a.prefill else "decode step" if a.rows == 1 else f"verify k={a.rows}"
    wall = time.perf_counter()
    step()
    eng.synchronize()
    wall_ms = (time.perf_counter() - wall) * 1e3
    print(f"{a.preset} {what} at context {a.context} ({a.path} path): graph {graph_ms:.3f} ms, eager "
          f"{eager_ms:.3f} ms, host wall (eager, events on) {wall_ms:.3f} ms, sum of kernel times {total:.3f} ms")
    print(f"{'kernel':60s} {'launches':>8s} {'ms':>8s} {'share':>6s}")
    for n in names:
        print(f"{n[:60]:60s} {launches.get(n, 0):8d} {per[n]:8.3f} {per[n] / total:6.1%}")


if __name__ == "__main__":
    main()
