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


@_jit(parallel=True, fastmath=True)
def gemm_bf16_pairs(x, w, out):  # pragma: no cover - compiled
    """gemm_bf16 for 2..16 rows of x: two weight rows a pass, so each load of x feeds two products (at 4 rows
    of x, 6 loads for 8 FMAs instead of 5 for 4: about twice gemm_bf16's rate there)."""
    m_rows, k = x.shape
    n = w.shape[0]
    blocks = (n + 15) // 16
    for b in prange(blocks):
        j = b * 16
        end = min(n, j + 16)
        while j < end:
            r0 = w[j]
            r1 = w[j + 1] if j + 1 < end else w[j]  # an odd last row: computed twice, stored once
            m = 0
            while m + 4 <= m_rows:
                x0, x1, x2, x3 = x[m], x[m + 1], x[m + 2], x[m + 3]
                a0 = a1 = a2 = a3 = c0 = c1 = c2 = c3 = np.float32(0.0)
                for i in range(k):
                    v = _bf16(r0[i])
                    u = _bf16(r1[i])
                    a0 += x0[i] * v
                    a1 += x1[i] * v
                    a2 += x2[i] * v
                    a3 += x3[i] * v
                    c0 += x0[i] * u
                    c1 += x1[i] * u
                    c2 += x2[i] * u
                    c3 += x3[i] * u
                out[m, j], out[m + 1, j], out[m + 2, j], out[m + 3, j] = a0, a1, a2, a3
                if j + 1 < end:
                    out[m, j + 1], out[m + 1, j + 1], out[m + 2, j + 1], out[m + 3, j + 1] = c0, c1, c2, c3
                m += 4
            while m < m_rows:
                xm = x[m]
                a = c = np.float32(0.0)
                for i in range(k):
                    a += xm[i] * _bf16(r0[i])
                    c += xm[i] * _bf16(r1[i])
                out[m, j] = a
                if j + 1 < end:
                    out[m, j + 1] = c
                m += 1
            j += 2


@_jit(parallel=True)
def widen_bf16(w, out):  # pragma: no cover - compiled
    n, k = w.shape
    bits = out.view(np.uint32)
    for j in prange(n):
        for i in range(k):
            bits[j, i] = np.uint32(w[j, i]) << np.uint32(16)
