"""Launch wrappers of qgemv.cu, the GEMV and bf16 dequantization of weights kept in a quantized format: one kernel
body, instanced per (value policy, scale policy): (QE4m3, SF32) FP8, (QE2m1, SE4m3Mul | SE4m3Div) NVFP4, (QInt4,
SF32) int4. Each weight-format family's wrapper (fp8.py, w4.py) builds a CuPy RawModule of its own pairs' instances
(only when a model with such weights is loaded) and gives its weights' layout (scale rows, group) to
`QuantKernels`. Launches go through the engine's `Kernels` (its operand
checks and PDL setting); no method reads a device value on the host, so the GEMV is capturable in a CUDA graph."""

from __future__ import annotations

from typing import Any

QGEMV_WARPS = 4  # must match qgemv.cu
MAX_ROWS = 16
MAX_K = 1 << 16  # the kernel's group index, umulhi(k, ceil(2^32 / group)), is exact for k * group < 2^32
VALS = {"QE4m3": 16, "QE2m1": 32, "QInt4": 32}  # values a 16-byte chunk of a weight row holds
SCALE_BYTES = {"SF32": 4, "SE4m3Mul": 1, "SE4m3Div": 1}  # bytes a scale takes (the e4m3 ones with a row factor)


def rows_per_warp(m: int, swiglu: bool) -> int:
    """Output rows a warp owns for M rows of x: x is shared by more weight rows when they are few; with SwiGLU each
    output row reads two weight rows (registers: the weight rows x 8 widened weights and x M sums)."""
    return (4 if m <= 4 else 2) // (2 if swiglu else 1)


def gemv_name(pair: tuple[str, str], m: int, swiglu: bool) -> str:
    return f"qgemv_kernel<{pair[0]}, {pair[1]}, {m}, {rows_per_warp(m, swiglu)}, {'true' if swiglu else 'false'}>"


def dequant_name(pair: tuple[str, str]) -> str:
    return f"qdequant_bf16_kernel<{pair[0]}, {pair[1]}>"


def name_expressions(pairs: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    return tuple(gemv_name(p, m, s) for p in pairs for m in range(1, MAX_ROWS + 1) for s in (False, True)) + \
        tuple(dequant_name(p) for p in pairs)


def chunks(policy: str, k: int) -> int:
    """16-byte chunks a weight row of K values takes (its last one padded)."""
    return -(-k // VALS[policy])


class QuantKernels:
    """qgemv.cu's instances for `pairs` (value policy, scale policy) and the extra kernels `plain` of `source`,
    launched through `kern` (a cuda.kernels.Kernels) for its checks and PDL. Each pair's instances are a module of
    their own, compiled on its first launch (a model uses one or two pairs; compiling all of a family's would cost
    seconds of NVRTC for nothing); `plain` comes with the first pair's. `what` names the weights in a compile error."""

    def __init__(self, kern: Any, source: str, pairs: tuple[tuple[str, str], ...], plain: tuple[str, ...],
                 what: str) -> None:
        self.k, self._cp, self._np = kern, kern._cp, kern._np
        self._source, self._what = source, what
        self._pair_of = {n: p for p in pairs for n in name_expressions((p,))}
        self._pair_of.update({n: pairs[0] for n in plain})
        self._plain, self._first = plain, pairs[0]
        self._fn: dict[str, Any] = {}

    def _function(self, name: str) -> Any:
        if name not in self._fn:
            pair = self._pair_of[name]
            names = name_expressions((pair,))
            plain = self._plain if pair == self._first else ()
            try:
                module = self._cp.RawModule(code=self._source, options=("-std=c++17",), name_expressions=names)
                self._fn.update({n: module.get_function(n) for n in names + plain})
            except Exception as e:  # an NVRTC or driver failure: one clear line
                from ....errors import DeviceError

                raise DeviceError(f"cannot compile the {self._what} kernels ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0]})") from None
        return self._fn[name]

    def _launch(self, name: str, grid: tuple, block: tuple, args: tuple, stream: Any) -> None:
        k, fn = self.k, self._function(name)
        if k.pdl:
            if k._pdl_launcher is None:
                from .pdl import PdlLauncher

                k._pdl_launcher = PdlLauncher(self._cp)
            k._pdl_launcher.launch(fn, grid, block, args, stream, 0)
        else:
            fn(grid, block, args, stream=stream)

    def _quant_weight(self, pair: tuple[str, str], w: Any, scale: Any, factor: Any, srow: int, group: int,
                      k_in: int) -> int:
        """N of weight w (rows of chunks of pair[0] holding k_in values) after checking it, its scales [ceil(N /
        srow), ceil(k_in / group)] (f32, or e4m3 bytes uint8 with the f32 row factors `factor` [N])."""
        k, np = self.k, self._np
        policy = pair[0]
        if k_in % 8 or not 0 < k_in <= MAX_K or group % 8 or not 0 < group <= MAX_K or srow <= 0:
            raise ValueError(f"quantized weight: K ({k_in}) and the scale group ({group}) must be multiples of 8 in "
                             f"8..{MAX_K}, the scale block height ({srow}) positive")
        k._arr(w, "w")
        if w.ndim != 2 or w.shape[1] * w.dtype.itemsize != 16 * chunks(policy, k_in):
            raise ValueError(f"w: {w.dtype} {w.shape} is not rows of {chunks(policy, k_in)} 16-byte chunks "
                             f"({k_in} values)")
        n = w.shape[0]
        k._arr(scale, "scale")
        if SCALE_BYTES[pair[1]] == 4:
            k._f32(scale, "scale", 2)
        else:
            if scale.dtype != np.uint8 or scale.ndim != 2:
                raise ValueError(f"scale: expected uint8 [rows, groups] (e4m3 bytes), got {scale.dtype} {scale.shape}")
            if factor is None:
                raise ValueError("scale: e4m3 scales need their rows' factors")
            k._f32(factor, "factor", 1)
            k._shape(factor, "factor", (n,))
        k._shape(scale, "scale", (-(-n // srow), -(-k_in // group)))
        return n

    def _gemv(self, pair: tuple[str, str], x: Any, w: Any, scale: Any, factor: Any, srow: int, group: int, out: Any,
              bias: Any, accumulate: bool, swiglu: bool, norm_weight: Any, eps: float, norm_offset: float,
              activation: str, stream: Any) -> None:
        k, np = self.k, self._np
        k._f32(x, "x", 2)
        m, kk = x.shape
        n = self._quant_weight(pair, w, scale, factor, srow, group, kk)
        k._f32(out, "out", 2)
        if not 1 <= m <= MAX_ROWS:
            raise ValueError(f"x: {m} rows (the quantized GEMV takes 1 to {MAX_ROWS})")
        if swiglu and (n % 2 or bias is not None or accumulate):
            raise ValueError(f"swiglu: w needs [gate, up] rows (got {n}), and no bias or accumulate")
        n_out = n // 2 if swiglu else n
        k._shape(out, "out", (m, n_out))
        k._disjoint(x, "x", out, "out")
        if bias is not None:
            k._bf16(bias, "bias", 1)
            k._shape(bias, "bias", (n,))
        if norm_weight is not None:
            k._bf16(norm_weight, "norm_weight", 1)
            k._shape(norm_weight, "norm_weight", (kk,))
        grid = (-(-n_out // (QGEMV_WARPS * rows_per_warp(m, swiglu))),)
        args = (x, w, scale, k._dummy if factor is None else factor, np.int32(srow), np.int32(-(-(1 << 32) // group)),
                np.int32(-(-kk // group)), bias if bias is not None else out, out, np.int32(n_out), np.int32(kk),
                np.int32(bool(accumulate)), np.int32(bias is not None),
                norm_weight if norm_weight is not None else k._dummy, np.int32(norm_weight is not None),
                np.float32(eps), np.float32(norm_offset), k._act(activation))
        self._launch(gemv_name(pair, m, swiglu), grid, (QGEMV_WARPS * 32,), args, stream)

    def _dequant(self, pair: tuple[str, str], w: Any, scale: Any, factor: Any, srow: int, group: int, out: Any,
                 stream: Any) -> None:
        np = self._np
        self.k._bf16(out, "out", 2)
        n, kk = out.shape
        self._quant_weight(pair, w, scale, factor, srow, group, kk)
        self.k._shape(out, "out", (w.shape[0], kk))
        eights = n * (kk // 8)
        if eights == 0:
            return
        args = (w, scale, self.k._dummy if factor is None else factor, np.int32(srow), np.int32(group),
                np.int32(-(-kk // group)), out, np.int32(n), np.int32(kk))
        self._launch(dequant_name(pair), (-(-eights // 256),), (256,), args, stream)
