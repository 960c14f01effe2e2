"""Compiled CPU kernels of the NumPy engine: products with bf16 weights read as stored, accumulated in fp32.

NumPy cannot fuse a dtype conversion into a matrix product: `x @ w.astype(np.float32).T` writes the whole
fp32 copy to memory and reads it back, three times the bytes of the bf16 weight, and a decode step is bound
by those bytes. numba compiles these loops with LLVM at run time (no compiler at install time: numba and
llvmlite ship as wheels), vectorised (AVX2 / AVX-512 here) and spread over threads:

- `gemm_bf16(x, w, out)`: out [M, N] = x [M, K] @ bf16(w [N, K]).T, for a few rows (decode, verify): each
  weight row is widened in registers (bf16 -> fp32 is a 16-bit shift, exact) and multiplied with every
  row of x while it is in cache, so the weight crosses memory once, as stored;
- `widen_bf16(w, out)`: the fp32 values of a block of weight rows (many rows: prefill multiplies such a
  block with BLAS while it is in cache).

The products and sums are the fp32 ones of `x @ fp32(w).T`; only their order differs (fastmath lets LLVM
reassociate the sum into vector lanes, as BLAS does).

Compiled kernels are cached on disk (numba's cache: beside this module, or in the user's cache directory
when the install is read-only), so a run pays the compilation once. Without numba (`AVAILABLE` False) the
callers fall back to NumPy, with the same numbers, at NumPy's speed.
"""

from __future__ import annotations

import os

import numpy as np

# The threads of a parallel loop sleep when they wait instead of spinning (GNU OpenMP, numba's threading layer
# here): on a machine whose cores are shared, spinning threads take the cores the others need, and a decode
# step of ~100 short parallel loops ran 3-6x slower (measured at load average 2.8 on 2 cores: 520 ms a step
# spinning, 81 ms sleeping). Read when the OpenMP runtime starts, so set before numba is imported; a value
# the user set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

try:
    import numba
    from llvmlite import ir
    from numba import prange, types
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - exercised by forcing AVAILABLE off in the tests
    numba = None

AVAILABLE = numba is not None


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def set_threads(n: int) -> None:
    """Run the compiled kernels (and NumPy's BLAS, where it says how) on n threads."""
    if AVAILABLE:
        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
    _blas_threads(n)


def _blas_threads(n: int) -> None:
    """OpenBLAS (NumPy's wheels) on n threads, when its library exposes the call; else left as it is."""
    import ctypes
    import glob

    libs = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    for path in glob.glob(os.path.join(libs, "*openblas*")):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads"):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn(ctypes.c_int(n))
                return


def _jit(**kw):
    """numba.njit with the on-disk cache; without a writable cache location, compiled for this run only."""
    def wrap(fn):
        try:
            return numba.njit(cache=True, **kw)(fn)
        except RuntimeError:  # no cache locator (read-only install and no writable cache directory)
            return numba.njit(**kw)(fn)
    return wrap


if AVAILABLE:
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
else:
    gemm_bf16 = widen_bf16 = None
