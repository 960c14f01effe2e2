"""Compiled CPU kernels of the NumPy engine: products with weights read as stored (bf16, FP8, MXFP4), in fp32.

NumPy cannot fuse a dtype conversion into a matrix product: `x @ w.astype(np.float32).T` writes the whole
fp32 copy to memory and reads it back, three times the bytes of the bf16 weight, and a decode step is bound
by those bytes. numba compiles these loops with LLVM at run time (no compiler at install time: numba and
llvmlite ship as wheels), vectorised (AVX2 / AVX-512 here) and spread over threads:

- `gemm_bf16(x, ws, blocks, out)`: out [M, N] = x [M, K] @ bf16(ws[0] | ws[1] | ...).T for a few rows (decode,
  verify): the parts of a fused projection in one parallel loop; each weight row is widened in registers
  (bf16 -> fp32 is a 16-bit shift, exact) and multiplied with every row of x while it is in cache, so the weight
  crosses memory once, as stored;
- `widen_bf16(w, out)`: the fp32 values of a block of weight rows (many rows: prefill multiplies such a
  block with BLAS while it is in cache);
- `gemm_fp8`, `gemm_mxfp4`, `gemm_nvfp4`, `gemm_packed` and `rows_fp8`, `rows_mxfp4`, `rows_nvfp4`, `rows_packed`:
  the same two for FP8 (e4m3 with block or tensor scales), MXFP4, NVFP4 and packed int4 / int8 weights, each value formed as the format's dequantization forms it (stored.COMPILED).

The products and sums are the fp32 ones of `x @ fp32(w).T`; only their order differs (fastmath lets LLVM
reassociate the sum into vector lanes, as BLAS does).

numba is imported on the first product that uses a kernel (`compiled()`; weights of at least `FUSED_MIN`
elements), never for a small model: numba's import alone takes about a second, more than a small model's
whole run. The kernels themselves are in numba_kernels.py, cached on disk (numba's cache: beside that
module, or in the user's cache directory when the install is read-only), so a run pays the compilation
once. Without numba (`AVAILABLE` False) the callers fall back to NumPy, with the same numbers, at NumPy's
speed.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np

AVAILABLE = importlib.util.find_spec("numba") is not None
FUSED_MIN = 1 << 20  # weights of fewer elements are multiplied by NumPy (a small model never imports numba)
_threads: int | None = None  # --threads, applied when numba is loaded
_compiled = None


def compiled():
    """The compiled kernels' module (numba_kernels), imported on first use with the threads set."""
    global _compiled
    if _compiled is None:
        from . import numba_kernels

        _compiled = numba_kernels
        if _threads is not None:
            numba_kernels.set_threads(_threads)
    return _compiled


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def set_threads(n: int) -> None:
    """Run the compiled kernels (once loaded) and NumPy's BLAS, where it says how, on n threads."""
    global _threads
    _threads = n
    if _compiled is not None:
        _compiled.set_threads(n)
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
