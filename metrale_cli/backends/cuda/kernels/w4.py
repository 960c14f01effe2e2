"""Python wrappers of the 4-bit weight kernels: qgemv.cu's GEMV and dequantization with its e2m1 (NVFP4, e4m3 scales
times or over a row's second-level factor) and int4 (symmetric pack-quantized, fp32 scales) policies, a CuPy
RawModule of their own built only when a model with such weights kept as stored is loaded (qgemv.QuantKernels). A
row of K 4-bit values is K / 8 32-bit words (value k in bits 4 (k % 8) .. of word k / 8), padded with zero words to
16 bytes; a scale per row and group."""

from __future__ import annotations

from typing import Any

from .nvrtc import joined_source
from .qgemv import QuantKernels, name_expressions

# (what a 4-bit code stands for, how its scales are stored) -> qgemv.cu's value and scale policies
PAIRS = {("e2m1", "e4m3_mul"): ("QE2m1", "SE4m3Mul"), ("e2m1", "e4m3_div"): ("QE2m1", "SE4m3Div"),
         ("int4", "f32"): ("QInt4", "SF32")}


def padded_words(k: int) -> int:
    """32-bit words a row of K 4-bit values takes on the device: K / 8, padded to a multiple of 4 (16 bytes)."""
    return -(-k // 32) * 4


def module_source() -> str:
    """common.cu, e4m3.cu and e2m1.cu (the conversions), gemv.cu (its epilogue), then qgemv.cu."""
    return joined_source("e4m3.cu", "e2m1.cu", "gemv.cu", "qgemv.cu")


def instance_names() -> tuple[str, ...]:
    return name_expressions(tuple(PAIRS.values()))


class W4Kernels(QuantKernels):
    """The 4-bit weight kernels, launched through `kern` (a cuda.kernels.Kernels) for its checks and PDL."""

    def __init__(self, kern: Any) -> None:
        super().__init__(kern, module_source(), tuple(PAIRS.values()), (), "4-bit weight")

    def gemv(self, x: Any, w: Any, scale: Any, group: int, code: str, scales: str, factor: Any, out: Any,
             bias: Any = None, *, accumulate: bool = False, swiglu: bool = False, norm_weight: Any = None,
             eps: float = 1e-6, norm_offset: float = 0.0, activation: str = "silu", stream: Any = None) -> None:
        """out[M, N] (=|+=) x[M, K] @ (value(w) * scale)^T (+ bias): x f32 [M, K], w uint32 [N, padded_words(K)]
        (4-bit codes, `code` "e2m1" or "int4"), scale [N, ceil(K / group)] stored as `scales` says ("f32"; "e4m3_mul" /
        "e4m3_div": e4m3 bytes, times / over factor f32 [N]), bias bf16 [N] or None, out f32 [M, N]; 1 <= M <= 16.
        norm_weight and swiglu as Fp8Kernels.gemv."""
        self._gemv(self._pair(w, code, scales), x, w, scale, factor, 1, group, out, bias, accumulate, swiglu,
                   norm_weight, eps, norm_offset, activation, stream)

    def dequant_bf16(self, w: Any, scale: Any, group: int, code: str, scales: str, factor: Any, out: Any, *,
                     stream: Any = None) -> None:
        """out = bf16(value(w) * scale of its group) [N, K], round to nearest even (the prefill path's weight)."""
        self._dequant(self._pair(w, code, scales), w, scale, factor, 1, group, out, stream)

    def _pair(self, w: Any, code: str, scales: str) -> tuple[str, str]:
        if (code, scales) not in PAIRS:
            raise ValueError(f"w4: {code} codes with {scales} scales (the kernels take "
                             f"{', '.join(' with '.join(p) for p in PAIRS)})")
        self.k._arr(w, "w")
        if w.dtype != self._np.uint32:
            raise ValueError(f"w: expected uint32 [N, KWp] (4-bit codes, eight a word), got {w.dtype} {w.shape}")
        return PAIRS[(code, scales)]
