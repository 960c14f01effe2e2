"""Launch wrappers of norm_rope.cu: RMSNorm (with the residual add), the sandwich post-norm add, rope + KV append
in one launch, and the unfused rope (a reference for the fused kernels in the GPU tests)."""

from __future__ import annotations

from typing import Any

from .tuning import _ceil_div


class NormRopeKernels:

    def rmsnorm(
        self, x: Any, weight: Any, eps: float, out: Any, residual: Any = None, *, offset: float = 0.0,
        stream: Any = None
    ) -> None:
        """out = (offset + weight) * (h * rsqrt(mean(h^2) + eps)) per row, h = x, or, with residual
        given, residual += x (in place) and h = the new residual.  x, out, residual f32[M, H], weight
        bf16[H]; offset 1.0: Gemma's (1 + w), added in fp32.  out may be x itself; residual must not
        overlap x or out."""
        np = self._np
        self._f32(x, "x", 2)
        self._bf16(weight, "weight", 1)
        self._f32(out, "out", 2)
        M, H = x.shape
        self._shape(weight, "weight", (H,))
        self._shape(out, "out", (M, H))
        if residual is not None:
            self._f32(residual, "residual", 2)
            self._shape(residual, "residual", (M, H))
            self._disjoint(residual, "residual", x, "x")
            self._disjoint(residual, "residual", out, "out")
        elif out.data.ptr != x.data.ptr:
            self._disjoint(x, "x", out, "out")
        if M == 0:
            return
        block = 512 if H >= 2048 else 256 if H >= 512 else 128
        args = (
            x, weight, out, self._dummy if residual is None else residual,
            np.int32(H), np.float32(eps), np.int32(0 if residual is None else 1), np.float32(offset),
        )
        self._launch("rmsnorm_kernel", (M,), (block,), args, stream)

    def rmsnorm_add(self, x: Any, weight: Any, eps: float, residual: Any, *, offset: float = 0.0,
                    stream: Any = None) -> None:
        """residual += (offset + weight) * (x * rsqrt(mean(x^2) + eps)) per row: a sandwich block's
        post-norm before its residual add.  x, residual f32[M, H] (disjoint), weight bf16[H]."""
        np = self._np
        self._f32(x, "x", 2)
        self._bf16(weight, "weight", 1)
        self._f32(residual, "residual", 2)
        M, H = x.shape
        self._shape(weight, "weight", (H,))
        self._shape(residual, "residual", (M, H))
        self._disjoint(x, "x", residual, "residual")
        if M == 0:
            return
        block = 512 if H >= 2048 else 256 if H >= 512 else 128
        args = (x, weight, residual, np.int32(H), np.float32(eps), np.float32(offset))
        self._launch("rmsnorm_add_kernel", (M,), (block,), args, stream)

    def rope_kv_append(self, qkv: Any, positions: Any, inv_freq: Any, q_out: Any, k_cache: Any, v_cache: Any,
                       q_norm: Any = None, k_norm: Any = None, eps: float = 1e-6, *, attention_scaling: float = 1.0,
                       norm_offset: float = 0.0, rotary_dim: int | None = None, stream: Any = None) -> None:
        """rope on q and k plus kv_append, in one launch, from the fused QKV GEMV output
        (norm_offset, rotary_dim and attention_scaling as in rope):
        qkv f32[M, (n_heads + 2 n_kv) * head_dim] (per row: q heads, k heads, v heads).
        q_out f32[M, n_heads, head_dim] = rope(q) (optional per-head q_norm first), and
        k_cache[:, positions[m], :] = bf16(rope(k)) (optional k_norm), v_cache[...] = bf16(v):
        the same as rope(q), rope(k) and kv_append(k, v) (bit-identical up to the fp32 rounding
        of the rotation).  Caches bf16[n_kv, max_ctx, head_dim]; positions int32[M] (device; a
        position outside [0, max_ctx) skips the cache writes).  q_out must not overlap qkv,
        except that for M == 1 it may be the q part of qkv itself (rotation in place).
        qkv is not modified (except through that in-place q_out)."""
        np = self._np
        self._f32(qkv, "qkv", 2)
        self._i32(positions, "positions", 1)
        self._f32(inv_freq, "inv_freq", 1)
        self._f32(q_out, "q_out", 3)
        n_kv, max_ctx, hd = self._check_cache(k_cache, v_cache)
        M, nh, qhd = q_out.shape
        if qhd != hd:
            raise ValueError(f"q_out: head_dim {qhd} differs from the cache's {hd}")
        if hd % 2 or hd > 256 or hd == 0:
            raise ValueError(f"rope_kv_append: head_dim = {hd} must be even and <= 256")
        rd = self._rotary_dim(hd, rotary_dim)
        self._shape(qkv, "qkv", (M, (nh + 2 * n_kv) * hd))
        self._shape(positions, "positions", (M,))
        self._shape(inv_freq, "inv_freq", (rd // 2,))
        for a, an in ((q_norm, "q_norm"), (k_norm, "k_norm")):
            if a is not None:
                self._bf16(a, an, 1)
                self._shape(a, an, (hd,))
        if not (M == 1 and q_out.data.ptr == qkv.data.ptr):
            self._disjoint(q_out, "q_out", qkv, "qkv")
        for c, cn in ((k_cache, "k_cache"), (v_cache, "v_cache")):
            self._disjoint(c, cn, qkv, "qkv")
            self._disjoint(c, cn, q_out, "q_out")
        slots = nh + 2 * n_kv
        if M * slots == 0:
            return
        warps = 4
        args = (
            qkv, positions, inv_freq,
            self._dummy if q_norm is None else q_norm, self._dummy if k_norm is None else k_norm,
            q_out, k_cache, v_cache,
            np.int32(M), np.int32(nh), np.int32(n_kv), np.int32(hd), np.int32(max_ctx), np.float32(eps),
            np.int32(0 if q_norm is None else 1), np.int32(0 if k_norm is None else 1),
            np.float32(attention_scaling), np.float32(norm_offset), np.int32(rd),
        )
        self._launch("rope_kv_append_kernel", (_ceil_div(M * slots, warps),), (32 * warps,), args, stream)

    def rope(self, x: Any, positions: Any, inv_freq: Any, norm_weight: Any = None, eps: float = 1e-6, *,
             attention_scaling: float = 1.0, norm_offset: float = 0.0, rotary_dim: int | None = None,
             stream: Any = None) -> None:
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
