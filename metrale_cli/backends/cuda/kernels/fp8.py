"""Python wrappers of the FP8 weight kernels: qgemv.cu's GEMV and dequantization with its e4m3 policy (QE4m3) for
weights in e4m3 with block scales, and fp8.cu's activation quantization; a CuPy RawModule of their own, built only
when a model with FP8 weights is loaded (qgemv.QuantKernels)."""

from __future__ import annotations

from typing import Any

from .nvrtc import joined_source
from .qgemv import QuantKernels, name_expressions

PAIR = ("QE4m3", "SF32")  # qgemv.cu's value and scale policies
PLAIN = ("fp8_act_quant_kernel",)


def module_source() -> str:
    """common.cu, e4m3.cu and e2m1.cu (the conversions), gemv.cu (its epilogue), qgemv.cu, then fp8.cu."""
    return joined_source("e4m3.cu", "e2m1.cu", "gemv.cu", "qgemv.cu", "fp8.cu")


def instance_names() -> tuple[str, ...]:
    return name_expressions((PAIR,))


class Fp8Kernels(QuantKernels):
    """The FP8 kernels, launched through `kern` (a cuda.kernels.Kernels) for its checks and PDL."""

    def __init__(self, kern: Any) -> None:
        super().__init__(kern, module_source(), (PAIR,), PLAIN, "FP8")

    def gemv(self, x: Any, w: Any, scale: Any, srow: int, bk: int, out: Any, bias: Any = None, *,
             accumulate: bool = False, swiglu: bool = False, norm_weight: Any = None, eps: float = 1e-6,
             norm_offset: float = 0.0, activation: str = "silu", stream: Any = None) -> None:
        """out[M, N] (=|+=) x[M, K] @ (w * scale)^T (+ bias): x f32, w e4m3 bytes uint8 [N, K], scale f32
        [ceil(N / srow), ceil(K / bk)], bias bf16 [N] or None, out f32 [M, N]; 1 <= M <= 16; K and bk multiples
        of 16. With norm_weight bf16 [K]: x is the un-normalised input, and the product is that of its RMSNorm (eps,
        norm_offset added to the weight); with swiglu, w holds [gate, up] (2N rows) and out = act(gate) * up."""
        self._check(w, bk)
        self._gemv(PAIR, x, w, scale, None, srow, bk, out, bias, accumulate, swiglu, norm_weight, eps, norm_offset,
                   activation, stream)

    def dequant_bf16(self, w: Any, scale: Any, srow: int, bk: int, out: Any, *, stream: Any = None) -> None:
        """out = bf16(e4m3(w) * scale of its block) [N, K], round to nearest even (the prefill path's weight)."""
        self._check(w, bk)
        self._dequant(PAIR, w, scale, None, srow, bk, out, stream)

    def _check(self, w: Any, bk: int) -> None:
        self.k._arr(w, "w")
        if w.dtype != self._np.uint8 or w.ndim != 2:
            raise ValueError(f"w: expected uint8 [N, K] (e4m3 bytes), got {w.dtype} {w.shape}")
        if w.shape[1] % 16 or bk % 16 or bk <= 0:
            raise ValueError(f"fp8: K ({w.shape[1]}) and the scale block width ({bk}) must be multiples of 16")

    def act_quant(self, x: Any, group: int, ue8m0: bool, static_scale: Any, out: Any, *, stream: Any = None) -> None:
        """out = x quantized to e4m3 and back, as an FP8 W8A8 engine quantizes a weight's input: per row and
        `group` columns with a dynamic scale (amax / 448, a power of two with ue8m0), or the static scale
        `static_scale` (f32 [1] on the device) when given; x, out f32 [M, K] (out may be x)."""
        k, np = self.k, self._np
        k._f32(x, "x", 2)
        k._f32(out, "out", 2)
        k._shape(out, "out", x.shape)
        if static_scale is not None:
            k._f32(static_scale, "static_scale", 1)
            k._shape(static_scale, "static_scale", (1,))
        m, kk = x.shape
        if group <= 0:
            raise ValueError(f"fp8: activation group width {group}")
        if m == 0 or kk == 0:
            return
        args = (x, np.int32(kk), np.int32(group), np.int32(bool(ue8m0)),
                static_scale if static_scale is not None else x, np.int32(static_scale is not None), out)
        self._launch("fp8_act_quant_kernel", (-(-kk // group), m), (128,), args, stream)

