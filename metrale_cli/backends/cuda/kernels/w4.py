"""Python wrappers of the 4-bit weight kernels (w4.cu: NVFP4 and symmetric int4), a CuPy RawModule of their own.

Built from common.cu + e2m1.cu + w4.cu only when a model with such weights kept as stored is loaded. Launches go through
the engine's `Kernels` (its operand checks and PDL setting, as fp8.py launches); no method reads a device value on
the host, so the GEMV is capturable in a CUDA graph.
"""

from __future__ import annotations

from typing import Any

from .fp8 import Fp8Kernels, rows_per_warp
from .nvrtc import joined_source

W4_WARPS = 4  # must match w4.cu
CODES = {"e2m1": 0, "int4": 1}  # w4.cu's FMT: what a 4-bit code stands for


def padded_words(k: int) -> int:
    """32-bit words a row of K 4-bit values takes on the device: K / 8, padded to a multiple of 4 (16 bytes)."""
    return -(-k // 32) * 4


def gemv_name(code: str, m: int) -> str:
    return f"gemv_w4_kernel<{CODES[code]}, {m}, {rows_per_warp(m)}>"


def dequant_name(code: str) -> str:
    return f"dequant_w4_bf16_kernel<{CODES[code]}>"


def module_source() -> str:
    return joined_source('e2m1.cu', 'w4.cu')


def name_expressions() -> tuple[str, ...]:
    return tuple(gemv_name(c, m) for c in CODES for m in range(1, 17)) + tuple(dequant_name(c) for c in CODES)


class W4Kernels:
    """The 4-bit weight kernels, launched through `kern` (a cuda.kernels.Kernels) for its checks and PDL."""

    _launch = Fp8Kernels._launch  # the same launch: PDL when the engine has it on

    def __init__(self, kern: Any) -> None:
        cp = kern._cp
        self.k, self._cp, self._np = kern, cp, kern._np
        names = name_expressions()
        try:
            module = cp.RawModule(code=module_source(), options=("-std=c++17",), name_expressions=names)
            self._fn = {n: module.get_function(n) for n in names}
        except Exception as e:  # an NVRTC or driver failure: one clear line
            from ....errors import DeviceError

            raise DeviceError(f"cannot compile the 4-bit weight kernels ({type(e).__name__}: "
                              f"{str(e).splitlines()[0]})") from None

    def _weight(self, w: Any, scale: Any, group: int, code: str, k_in: int) -> tuple[int, int]:
        """(N, G) of a packed weight for an input width of k_in, after checking its operands."""
        k, np = self.k, self._np
        if code not in CODES:
            raise ValueError(f"w4: code {code!r} (expected one of {', '.join(CODES)})")
        if k_in % 8 or k_in <= 0 or group % 8 or group <= 0:
            raise ValueError(f"w4: K ({k_in}) and the group ({group}) must be positive multiples of 8")
        k._arr(w, "w")
        if w.dtype != np.uint32 or w.ndim != 2:
            raise ValueError(f"w: expected uint32 [N, KWp] (4-bit codes, eight a word), got {w.dtype} {w.shape}")
        n = w.shape[0]
        k._shape(w, "w", (n, padded_words(k_in)))
        k._f32(scale, "scale", 2)
        g = -(-k_in // group)
        k._shape(scale, "scale", (n, g))
        return n, g

    def gemv(self, x: Any, w: Any, scale: Any, group: int, code: str, out: Any, bias: Any = None, *,
             accumulate: bool = False, stream: Any = None) -> None:
        """out[M, N] (=|+=) x[M, K] @ (value(w) * scale)^T (+ bias): x f32 [M, K], w uint32 [N, padded_words(K)]
        (4-bit codes, `code` "e2m1" or "int4"), scale f32 [N, ceil(K / group)], bias bf16 [N] or None, out f32
        [M, N]; 1 <= M <= 16."""
        k, np = self.k, self._np
        k._f32(x, "x", 2)
        m, kk = x.shape
        n, g = self._weight(w, scale, group, code, kk)
        k._f32(out, "out", 2)
        if not 1 <= m <= 16:
            raise ValueError(f"x: {m} rows (the 4-bit GEMV takes 1 to 16)")
        k._shape(out, "out", (m, n))
        k._disjoint(x, "x", out, "out")
        if bias is not None:
            k._bf16(bias, "bias", 1)
            k._shape(bias, "bias", (n,))
        grid = (-(-n // (W4_WARPS * rows_per_warp(m))),)
        args = (x, w, scale, bias if bias is not None else out, out, np.int32(n), np.int32(kk), np.int32(group),
                np.int32(g), np.int32(bool(accumulate)), np.int32(bias is not None))
        self._launch(gemv_name(code, m), grid, (W4_WARPS * 32,), args, stream)

    def dequant_bf16(self, w: Any, scale: Any, group: int, code: str, out: Any, *, stream: Any = None) -> None:
        """out = bf16(value(w) * scale of its group) [N, K], round to nearest even (the prefill path's weight)."""
        np = self._np
        self.k._bf16(out, "out", 2)
        n, kk = out.shape
        _, g = self._weight(w, scale, group, code, kk)
        self.k._shape(out, "out", (w.shape[0], kk))
        words = n * (kk // 8)
        if words == 0:
            return
        args = (w, scale, out, np.int32(n), np.int32(kk), np.int32(group), np.int32(g))
        self._launch(dequant_name(code), (-(-words // 256),), (256,), args, stream)
