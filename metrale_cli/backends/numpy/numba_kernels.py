"""The numba kernels of kernels.py (imported on first use: see there what they compute and why)."""

from __future__ import annotations

import os

import numpy as np

# The threads of a parallel loop sleep when they wait instead of spinning (GNU OpenMP, numba's threading layer
# here): on a machine whose cores are shared, spinning threads take the cores the others need, and a decode
# step of ~100 short parallel loops ran 3-6x slower (measured at load average 2.8 on 2 cores: 520 ms a step
# spinning, 81 ms sleeping). Read when the OpenMP runtime starts, so set before numba is imported; a value
# the user set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numba  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import prange, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402


def set_threads(n: int) -> None:
    """The threads of the parallel loops (at most the threads numba started with)."""
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))


def _jit(**kw):
    """numba.njit with the on-disk cache; without a writable cache location, compiled for this run only."""
    def wrap(fn):
        try:
            return numba.njit(cache=True, **kw)(fn)
        except RuntimeError:  # no cache locator (read-only install and no writable cache directory)
            return numba.njit(**kw)(fn)
    return wrap


@intrinsic
def _bits_as_f32(typingctx, bits):
    """The float32 whose bit pattern is the uint32 `bits` (a register move)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@numba.njit(inline="always")
def _bf16(v):
    return _bits_as_f32(np.uint32(v) << np.uint32(16))


@_jit(parallel=True, fastmath=True)
def gemm_bf16(x, w, out):  # pragma: no cover - compiled
    m_rows, k = x.shape
    n = w.shape[0]
    blocks = (n + 15) // 16
    for b in prange(blocks):
        for j in range(b * 16, min(n, b * 16 + 16)):
            row = w[j]
            m = 0
            while m + 4 <= m_rows:  # four rows of x per pass over the weight row
                x0, x1, x2, x3 = x[m], x[m + 1], x[m + 2], x[m + 3]
                a0 = a1 = a2 = a3 = np.float32(0.0)
                for i in range(k):
                    v = _bf16(row[i])
                    a0 += x0[i] * v
                    a1 += x1[i] * v
                    a2 += x2[i] * v
                    a3 += x3[i] * v
                out[m, j], out[m + 1, j], out[m + 2, j], out[m + 3, j] = a0, a1, a2, a3
                m += 4
            while m < m_rows:
                xm = x[m]
                a = np.float32(0.0)
                for i in range(k):
                    a += xm[i] * _bf16(row[i])
                out[m, j] = a
                m += 1


@_jit(parallel=True)
def widen_bf16(w, out):  # pragma: no cover - compiled
    n, k = w.shape
    bits = out.view(np.uint32)
    for j in prange(n):
        for i in range(k):
            bits[j, i] = np.uint32(w[j, i]) << np.uint32(16)
