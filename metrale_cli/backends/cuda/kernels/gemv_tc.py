"""Launch wrappers of gemv_tc.cu: the tensor-core GEMV (from GEMV_TC_MIN_ROWS rows on)."""

from __future__ import annotations

from typing import Any

from .names import gemv_tc_name
from .tuning import GEMV_TC_DEFAULT, GEMV_TC_SWIGLU_DEFAULT, _ceil_div


class GemvTcKernels:

    def gemv_tc(self, x: Any, w: Any, out: Any, bias: Any = None, *, accumulate: bool = False, swiglu: bool = False,
                norm_weight: Any = None, eps: float = 1e-6, norm_offset: float = 0.0, activation: str = "silu",
                stream: Any = None) -> None:
        """Tensor-core version of gemv / gemv_swiglu (mma.sync bf16, x split into bf16 hi + lo,
        fp32 accumulation): out (=|+=) x @ w.T (+ bias), or with swiglu=True
        out (=|+=) silu(x @ Wg.T) * (x @ Wu.T) for w = concat(Wg, Wu) bf16[2I, K], out f32[M, I]
        (no bias with swiglu).  x f32[M, K] (1 <= M <= 16), w bf16[N, K], bias bf16[N], out f32[M, N];
        K a positive multiple of 8; x must not overlap out.  norm_weight bf16[K]: fused RMSNorm of x
        first, as in gemv.  The config is GEMV_TC_DEFAULT's (GEMV_TC_SWIGLU_DEFAULT's) for M.  Row m of the
        result is bit-identical whatever M is.  norm_offset and activation (the
        swiglu gate's: "silu" or "gelu_tanh") as in gemv / gemv_swiglu."""
        np = self._np
        op = "gemv_tc"
        M, K, N, norm = self._linear_operands(op, x, w, "w", out, bias, norm_weight, swiglu)
        defaults = GEMV_TC_SWIGLU_DEFAULT if swiglu else GEMV_TC_DEFAULT
        tiles, warps, u = defaults[M]
        name = gemv_tc_name(2 if M > 8 else 1, tiles, warps, u, swiglu, norm)
        grid = (_ceil_div(N, 16 * tiles),)
        args = (
            x, w, self._dummy if bias is None else bias, out,
            np.int32(M), np.int32(N), np.int32(K), np.int32(1 if accumulate else 0),
            np.int32(0 if bias is None else 1), norm_weight if norm else self._dummy, np.float32(eps),
            np.float32(norm_offset), self._act(activation),
        )
        self._launch(name, grid, (warps * 32,), args, stream)
