"""Launch wrappers of elementwise.cu: embedding, softcap, fp32 <-> bf16, the gated MLP activation of the prefill
path, the unfused KV append (a reference for the fused one in the GPU tests), and the attention output gate's
two launches (gate_split before rope, output_gate after attention)."""

from __future__ import annotations

from typing import Any

from .tuning import GLU_OAI


class ElementwiseKernels:

    def embedding(self, ids: Any, table: Any, out: Any, *, scale: float | None = None, stream: Any = None) -> None:
        """out[m, :] = float32(table[ids[m], :]) (* scale, an fp32 value: Gemma's sqrt(hidden)).
        ids int32[M], table bf16[V, H], out f32[M, H].  An id outside [0, V) yields a row of NaN."""
        np = self._np
        self._i32(ids, "ids", 1)
        self._bf16(table, "table", 2)
        self._f32(out, "out", 2)
        (M,), (V, H) = ids.shape, table.shape
        self._shape(out, "out", (M, H))
        if M == 0:
            return
        s = np.float32(1.0 if scale is None else scale)
        self._launch("embedding_kernel", (M,), (256,), (ids, table, out, np.int32(V), np.int32(H), s), stream)

    def softcap(self, x: Any, cap: float, *, stream: Any = None) -> None:
        """x = cap * tanh(x / cap) in place, x f32[...] (final-logit softcapping)."""
        np = self._np
        self._f32(x, "x")
        if not float(cap) > 0:
            raise ValueError(f"softcap: cap = {cap} must be positive")
        if x.size == 0:
            return
        args = (x, np.int64(x.size), np.float32(cap))
        self._launch("softcap_kernel", (self._grid1d(x.size),), (256,), args, stream)

    def swiglu(self, gate_up: Any, out: Any, *, activation: str = "silu", limit: float | None = None,
               alpha: float = 1.702, stream: Any = None) -> None:
        """out = act(gate_up[:, :I]) * gate_up[:, I:], act "silu" or "gelu_tanh"; activation "swiglu_oai" (the
        mixture-of-experts prefill of gpt-oss, kernels/moe.MOE_ACTIVATIONS): min(g, limit) * sigmoid(alpha
        min(g, limit)) * (clip(u, -limit, limit) + 1), `limit` required.  gate_up f32[M, 2I], out f32[M, I]."""
        np = self._np
        self._f32(gate_up, "gate_up", 2)
        self._f32(out, "out", 2)
        M, I2 = gate_up.shape
        if I2 % 2:
            raise ValueError(f"gate_up: second dimension {I2} must be even (2 * I)")
        self._shape(out, "out", (M, I2 // 2))
        self._disjoint(gate_up, "gate_up", out, "out")
        n = M * (I2 // 2)
        if n == 0:
            return
        if activation == "swiglu_oai":
            if limit is None or not float(limit) > 0:
                raise ValueError(f"swiglu: swiglu_oai needs a positive limit, got {limit}")
            act = np.int32(GLU_OAI)
        else:
            act = self._act(activation)
        args = (gate_up, out, np.int32(M), np.int32(I2 // 2), act, np.float32(limit or 0.0), np.float32(alpha))
        self._launch("swiglu_kernel", (self._grid1d(n),), (256,), args, stream)

    def f32_to_bf16(self, x: Any, out: Any, *, stream: Any = None) -> None:
        """out = bf16(x), round to nearest even, NaN -> 0x7FC0 (torch CPU semantics).
        x f32[...]; out bf16 or uint16, same shape."""
        self._f32(x, "x")
        self._bf16(out, "out")
        self._convert("f32_to_bf16_kernel", x, out, stream)

    def bf16_to_f32(self, x: Any, out: Any, *, stream: Any = None) -> None:
        """out = float32(x) (exact).  x bf16 or uint16 [...]; out f32, same shape."""
        self._bf16(x, "x")
        self._f32(out, "out")
        self._convert("bf16_to_f32_kernel", x, out, stream)

    def _convert(self, kernel: str, x: Any, out: Any, stream: Any) -> None:
        """An elementwise conversion of x into out (dtypes checked by the caller), one thread per element."""
        self._shape(out, "out", x.shape)
        if x.size == 0:
            return
        self._launch(kernel, (self._grid1d(x.size),), (256,), (x, out, self._np.int64(x.size)), stream)

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

    def _gated_qkv(self, gated: Any, M: int, n_heads: int, head_dim: int) -> int:
        """The kv width of a gated qkv f32 [M, 2 n_heads head_dim + kv] (checked)."""
        self._f32(gated, "gated", 2)
        q = n_heads * head_dim
        kv = gated.shape[1] - 2 * q
        if kv < 0 or gated.shape[0] != M:
            raise ValueError(f"gated qkv: shape {gated.shape} for {M} rows of {n_heads} heads of {head_dim} "
                             "(q and its gate per head, then k and v)")
        return kv

    def gate_split(self, gated: Any, plain: Any, n_heads: int, head_dim: int, *, stream: Any = None) -> None:
        """The attention output gate's doubled q projection set aside: plain f32 [M, n_heads head_dim + kv] = the
        q rows of each head of gated f32 [M, 2 n_heads head_dim + kv] (per head [q_h; gate_h]), then its kv
        columns, the layout rope_kv_append reads."""
        np = self._np
        self._f32(plain, "plain", 2)
        M = plain.shape[0]
        kv = self._gated_qkv(gated, M, n_heads, head_dim)
        self._shape(plain, "plain", (M, n_heads * head_dim + kv))
        self._disjoint(gated, "gated", plain, "plain")
        n = plain.size
        if n == 0:
            return
        args = (gated, plain, np.int32(M), np.int32(n_heads), np.int32(head_dim), np.int32(kv))
        self._launch("gate_split_kernel", (self._grid1d(n),), (256,), args, stream)

    def output_gate(self, y: Any, gated: Any, n_heads: int, head_dim: int, *, stream: Any = None) -> None:
        """y f32 [M, n_heads head_dim] *= sigmoid(gate) in place, gate_h the second half of head h's rows of the
        gated qkv f32 [M, 2 n_heads head_dim + kv]."""
        np = self._np
        self._f32(y, "y", 2)
        M = y.shape[0]
        kv = self._gated_qkv(gated, M, n_heads, head_dim)
        self._shape(y, "y", (M, n_heads * head_dim))
        n = y.size
        if n == 0:
            return
        args = (y, gated, np.int32(M), np.int32(n_heads), np.int32(head_dim), np.int32(kv))
        self._launch("output_gate_kernel", (self._grid1d(n),), (256,), args, stream)
