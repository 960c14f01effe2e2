"""Python wrappers of the FP8 weight kernels (fp8.cu), a CuPy RawModule of their own.

Built from common.cu + fp8.cu only when a model with FP8 weights is loaded. Launches go through the engine's
`Kernels` (its operand checks and PDL setting); no method reads a device value on the host, so the GEMV is
capturable in a CUDA graph.
"""

from __future__ import annotations

from typing import Any

from .nvrtc import joined_source

FP8_WARPS = 4  # must match fp8.cu


def rows_per_warp(m: int) -> int:
    """Weight rows a warp owns for M rows of x: x chunks are shared by more rows when they are few (registers:
    R x 16 widened weights and R x M sums)."""
    return 4 if m <= 4 else 2


def gemv_name(m: int) -> str:
    return f"gemv_fp8_kernel<{m}, {rows_per_warp(m)}>"


def module_source() -> str:
    """common.cu, e4m3.cu (the e4m3 conversions), then fp8.cu."""
    return joined_source('e4m3.cu', 'fp8.cu')


def name_expressions() -> tuple[str, ...]:
    return tuple(gemv_name(m) for m in range(1, 17))


PLAIN = ("dequant_fp8_bf16_kernel", "fp8_act_quant_kernel")


class Fp8Kernels:
    """The FP8 kernels, launched through `kern` (a cuda.kernels.Kernels) for its checks and PDL."""

    def __init__(self, kern: Any) -> None:
        cp = kern._cp
        self.k, self._cp, self._np = kern, cp, kern._np
        names = name_expressions()
        try:
            module = cp.RawModule(code=module_source(), options=("-std=c++17",), name_expressions=names)
            self._fn = {n: module.get_function(n) for n in names + PLAIN}
        except Exception as e:  # an NVRTC or driver failure: one clear line
            from ....errors import DeviceError

            raise DeviceError(f"cannot compile the FP8 kernels ({type(e).__name__}: {str(e).splitlines()[0]})") from None

    def _launch(self, name: str, grid: tuple, block: tuple, args: tuple, stream: Any) -> None:
        k = self.k
        if k.pdl:
            if k._pdl_launcher is None:
                from .pdl import PdlLauncher

                k._pdl_launcher = PdlLauncher(self._cp)
            k._pdl_launcher.launch(self._fn[name], grid, block, args, stream, 0)
        else:
            self._fn[name](grid, block, args, stream=stream)

    def _weight(self, w: Any, scale: Any, srow: int, bk: int) -> tuple[int, int, int]:
        k, np = self.k, self._np
        k._arr(w, "w")
        if w.dtype != np.uint8 or w.ndim != 2:
            raise ValueError(f"w: expected uint8 [N, K] (e4m3 bytes), got {w.dtype} {w.shape}")
        k._f32(scale, "scale", 2)
        n, kk = w.shape
        if kk % 16 or bk % 16 or bk <= 0 or srow <= 0:
            raise ValueError(f"fp8: K ({kk}) and the scale block width ({bk}) must be multiples of 16")
        kb = -(-kk // bk)
        k._shape(scale, "scale", (-(-n // srow), kb))
        return n, kk, kb

    def gemv(self, x: Any, w: Any, scale: Any, srow: int, bk: int, out: Any, bias: Any = None, *,
             accumulate: bool = False, stream: Any = None) -> None:
        """out[M, N] (=|+=) x[M, K] @ (w * scale)^T (+ bias): x f32, w e4m3 bytes uint8 [N, K], scale f32
        [ceil(N / srow), ceil(K / bk)], bias bf16 [N] or None, out f32 [M, N]; 1 <= M <= 16."""
        k, np = self.k, self._np
        n, kk, kb = self._weight(w, scale, srow, bk)
        k._f32(x, "x", 2)
        k._f32(out, "out", 2)
        m = x.shape[0]
        if not 1 <= m <= 16:
            raise ValueError(f"x: {m} rows (the FP8 GEMV takes 1 to 16)")
        k._shape(x, "x", (m, kk))
        k._shape(out, "out", (m, n))
        k._disjoint(x, "x", out, "out")
        if bias is not None:
            k._bf16(bias, "bias", 1)
            k._shape(bias, "bias", (n,))
        grid = (-(-n // (FP8_WARPS * rows_per_warp(m))),)
        args = (x, w, scale, bias if bias is not None else out, out, np.int32(n), np.int32(kk), np.int32(srow),
                np.int32(bk), np.int32(kb), np.int32(bool(accumulate)), np.int32(bias is not None))
        self._launch(gemv_name(m), grid, (FP8_WARPS * 32,), args, stream)

    def dequant_bf16(self, w: Any, scale: Any, srow: int, bk: int, out: Any, *, stream: Any = None) -> None:
        """out = bf16(e4m3(w) * scale of its block) [N, K], round to nearest even (the prefill path's weight)."""
        np = self._np
        n, kk, kb = self._weight(w, scale, srow, bk)
        self.k._bf16(out, "out", 2)
        self.k._shape(out, "out", (n, kk))
        chunks = n * (kk // 16)
        if chunks == 0:
            return
        args = (w, scale, out, np.int32(n), np.int32(kk), np.int32(srow), np.int32(bk), np.int32(kb))
        self._launch("dequant_fp8_bf16_kernel", (-(-chunks // 256),), (256,), args, stream)

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

