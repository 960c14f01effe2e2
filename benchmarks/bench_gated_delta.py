"""The Gated DeltaNet prefill rule on the CUDA engine: the sequential kernel (recurrent(prenormed=True),
gdn_recurrent_pre) against the chunked one (recurrent_chunked: gdn_chunk_prep + gdn_chunk_state) on one layer of
qwen3.5-27b's shape (48 value heads, 16 key heads, dk = dv = 128), fresh random inputs. Needs CuPy and a CUDA GPU:

    PYTHONPATH=. python3 -m benchmarks.bench_gated_delta            # T = 2048
    PYTHONPATH=. python3 -m benchmarks.bench_gated_delta 17 64 512  # other row counts

Eager launches (as the prefill path runs them), CUDA events, the median of 20 after 3 warm-ups; the chunked
time includes its work area's allocation from CuPy's pool (as PrefillLinear allocates it), not qk_norm (both
read its output). 'x48' is the time for the model's 48 linear-attention layers.
"""

from __future__ import annotations

import statistics
import sys

HK, HV, DK, DV, LAYERS = 16, 48, 128, 128, 48


def _time_ms(cp, f, repeats: int = 20) -> float:
    for _ in range(3):
        f()
    times = []
    for _ in range(repeats):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        f()
        e1.record()
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1))
    return statistics.median(times)


def main() -> int:
    import cupy as cp
    import numpy as np

    from metrale_cli.backends.cuda.kernels import Kernels
    from metrale_cli.backends.cuda.kernels.gated_delta import GatedDeltaKernels, chunk_work_shapes
    from metrale_cli.models.spec import LinearAttentionSpec

    rows = [int(a) for a in sys.argv[1:]] or [2048]
    gk = GatedDeltaKernels(Kernels())
    spec = LinearAttentionSpec(HK, HV, DK, DV, 4, 1e-6, grouped=False)
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
    print(f"device: {name}; layer Hv {HV}, Hk {HK}, dk {DK}, dv {DV}")
    print(f"{'T':>6}{'sequential ms':>15}{'chunked ms':>12}{'speedup':>9}{'seq x48 ms':>12}{'chk x48 ms':>12}"
          f"{'state rel diff':>16}")
    rs = cp.random.RandomState(1)
    for t in rows:
        conv = rs.standard_normal((t, spec.conv_dim), dtype=cp.float32)
        gk.qk_norm(conv, spec)
        beta = rs.uniform(0.05, 0.95, (t, HV)).astype(cp.float32)
        g = -rs.uniform(0.01, 1.0, (t, HV)).astype(cp.float32)
        pos = cp.arange(0, t, dtype=cp.int32)
        init = rs.standard_normal((HV, DK, DV), dtype=cp.float32) * 0.1
        rings = {c: cp.zeros((17, HV, DK, DV), cp.float32) for c in (False, True)}
        outs = {c: cp.empty((t, HV, DV), cp.float32) for c in (False, True)}

        def sequential():
            rings[False][0] = init
            gk.recurrent(conv, beta, g, rings[False], pos, outs[False], spec, every=False, prenormed=True)

        def chunked():
            rings[True][0] = init
            work = {n: cp.empty(s, cp.float32) for n, s in chunk_work_shapes(t, spec).items()}
            gk.recurrent_chunked(conv, beta, g, rings[True], pos, outs[True], spec, work)

        ms_seq, ms_chk = _time_ms(cp, sequential), _time_ms(cp, chunked)
        last = t % 17
        diff = float(cp.abs(rings[True][last] - rings[False][last]).max() / cp.abs(rings[False][last]).max())
        print(f"{t:>6}{ms_seq:>15.3f}{ms_chk:>12.3f}{ms_seq / ms_chk:>9.2f}{ms_seq * LAYERS:>12.1f}"
              f"{ms_chk * LAYERS:>12.1f}{diff:>16.1e}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
