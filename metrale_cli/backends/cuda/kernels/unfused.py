"""Launch wrappers that the engine does not call: the unfused rope and kv_append kernels (the engine
runs rope_kv_append, which fuses them) and gemv_residual (gemv with accumulate=True).  The GPU tests
use them, the unfused kernels as references for the fused one."""

from __future__ import annotations

from typing import Any

from .tuning import _ceil_div


class UnfusedKernels:
    """Methods of `Kernels` (they use its checks, _launch, _dummy and _grid1d)."""

    def gemv_residual(self, x: Any, w: Any, out: Any, bias: Any = None, *, stream: Any = None) -> None:
        """out += x @ w.T (+ bias): the o_proj / down_proj residual add.  Same rules as gemv."""
        self.gemv(x, w, out, bias, accumulate=True, stream=stream)

    def rope(
        self,
        x: Any,
        positions: Any,
        inv_freq: Any,
        norm_weight: Any = None,
        eps: float = 1e-6,
        *,
        attention_scaling: float = 1.0,
        norm_offset: float = 0.0,
        rotary_dim: int | None = None,
        stream: Any = None,
    ) -> None:
        """In place on x f32[M, n_heads, head_dim]: optional per-head RMSNorm with
        norm_weight bf16[head_dim] (Qwen3 q_norm/k_norm; (norm_offset + w): Gemma 3's 1 + w), then HF
        rotate_half rotary embedding at positions int32[M] with inv_freq f32[rotary_dim/2] over the first
        rotary_dim dims (default head_dim; fewer: partial rotary, the rest pass through); cos/sin are
        multiplied by attention_scaling (longrope's attention factor; 1.0 otherwise).  head_dim even,
        <= 256; rotary_dim even, <= head_dim."""
        np = self._np
        self._f32(x, "x", 3)
        self._i32(positions, "positions", 1)
        self._f32(inv_freq, "inv_freq", 1)
        M, nh, hd = x.shape
        if hd % 2 or hd > 256 or hd == 0:
            raise ValueError(f"rope: head_dim = {hd} must be even and <= 256")
        rd = self._rotary_dim(hd, rotary_dim)
        self._shape(positions, "positions", (M,))
        self._shape(inv_freq, "inv_freq", (rd // 2,))
        if norm_weight is not None:
            self._bf16(norm_weight, "norm_weight", 1)
            self._shape(norm_weight, "norm_weight", (hd,))
        if M * nh == 0:
            return
        warps = 4
        args = (
            x, positions, inv_freq, self._dummy if norm_weight is None else norm_weight,
            np.int32(M), np.int32(nh), np.int32(hd), np.float32(eps),
            np.int32(0 if norm_weight is None else 1), np.float32(attention_scaling),
            np.float32(norm_offset), np.int32(rd),
        )
        self._launch("rope_kernel", (_ceil_div(M * nh, warps),), (32 * warps,), args, stream)

    def kv_append(
        self, k: Any, v: Any, k_cache: Any, v_cache: Any, positions: Any, *, stream: Any = None
    ) -> None:
        """k_cache[:, positions[m], :] = bf16(k[m]); same for v.  k, v f32[M, n_kv, head_dim];
        caches bf16[n_kv, max_ctx, head_dim]; positions int32[M] (read on the device; a position
        outside [0, max_ctx) is skipped)."""
        np = self._np
        self._f32(k, "k", 3)
        self._f32(v, "v", 3)
        self._i32(positions, "positions", 1)
        n_kv, max_ctx, hd = self._check_cache(k_cache, v_cache)
        M = k.shape[0]
        self._shape(k, "k", (M, n_kv, hd))
        self._shape(v, "v", (M, n_kv, hd))
        self._shape(positions, "positions", (M,))
        n = M * n_kv * hd
        if n == 0:
            return
        args = (k, v, k_cache, v_cache, positions, np.int32(M), np.int32(n_kv), np.int32(hd), np.int32(max_ctx))
        self._launch("kv_append_kernel", (self._grid1d(n),), (256,), args, stream)
