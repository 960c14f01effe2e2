"""Launch wrappers of gemv.cu: the fp32-FMA GEMV (rows below GEMV_TC_MIN_ROWS, and one-row projections the ring
GEMV does not take) and the fused rows path's qkv GEMV with rope + KV append in its last blocks (its gemv.cu
instance below GEMV_TC_MIN_ROWS rows, its gemv_tc.cu instance from there on)."""

from __future__ import annotations

from typing import Any

from .names import fused_qkv_fp32_rows, gemv_name, gemv_qkv_rope_name, gemv_tc_qkv_rope_name
from .tuning import GEMV_DEFAULT, GEMV_SWIGLU_DEFAULT, GEMV_TC_DEFAULT, _ceil_div, _gemv_block_rows, uses_tc


class GemvKernels:

    def gemv(self, x: Any, w: Any, out: Any, bias: Any = None, *, accumulate: bool = False, norm_weight: Any = None,
             eps: float = 1e-6, norm_offset: float = 0.0, stream: Any = None) -> None:
        """out = x @ w.T (+ bias), or out += x @ w.T (+ bias) with accumulate=True.

        x f32[M, K] (1 <= M <= 16), w bf16[N, K] (HF [out, in]), bias bf16[N] or None,
        out f32[M, N].  K must be a multiple of 8 (16-byte weight rows); N is arbitrary.
        x must not overlap out.  Compiled for the row counts of GEMV_DEFAULT (below GEMV_TC_MIN_ROWS).
        With norm_weight bf16[K] (16-byte aligned): fused RMSNorm prologue, x is the
        un-normalised input and the result is that of rmsnorm(x, norm_weight, eps) followed by
        this GEMV (within fp32 rounding).
        norm_offset is added to the norm weight in fp32 (Gemma's (1 + w): 1.0)."""
        self._gemv("gemv", x, w, "w", out, bias, False, accumulate, norm_weight, eps, stream,
                   norm_offset=norm_offset)

    def _gemv(self, op: str, x: Any, w: Any, wname: str, out: Any, bias: Any, swiglu: bool, accumulate: bool,
              norm_weight: Any, eps: float, stream: Any, *,
              norm_offset: float = 0.0, activation: str = "silu") -> None:
        """Check and launch the fp32-FMA GEMV (gemv.cu) for gemv and gemv_swiglu: the config (R, U) of
        GEMV_DEFAULT / GEMV_SWIGLU_DEFAULT for M."""
        np = self._np
        M, K, N, norm = self._linear_operands(op, x, w, wname, out, bias, norm_weight, swiglu=swiglu)
        table = GEMV_SWIGLU_DEFAULT if swiglu else GEMV_DEFAULT
        if M not in table:
            raise ValueError(f"{op}: M = {M} rows; compiled for {', '.join(map(str, table))} (use gemv_tc)")
        r, u = table[M]
        name = gemv_name(M, r, u, swiglu, norm)
        threads, rows = _gemv_block_rows(r, u)
        grid = (_ceil_div(N, rows),)
        args = (
            x, w, self._dummy if bias is None else bias, out,
            np.int32(N), np.int32(K), np.int32(1 if accumulate else 0), np.int32(0 if bias is None else 1),
            norm_weight if norm else self._dummy, np.float32(eps), np.float32(norm_offset), self._act(activation),
        )
        self._launch(name, grid, (threads,), args, stream)

    def gemv_swiglu(self, x: Any, w_gate_up: Any, out: Any, *, norm_weight: Any = None, eps: float = 1e-6,
                    norm_offset: float = 0.0, activation: str = "silu", stream: Any = None) -> None:
        """out = act(x @ Wg.T) * (x @ Wu.T) in one pass over the fused weight
        w_gate_up bf16[2I, K] = concat(gate_proj.weight, up_proj.weight).  x f32[M, K], out f32[M, I];
        act: "silu" (SwiGLU) or "gelu_tanh" (GeGLU).  norm_weight bf16[K]: fused RMSNorm of x first,
        as in gemv (norm_offset likewise)."""
        self._gemv("gemv_swiglu", x, w_gate_up, "w_gate_up", out, None, True, False, norm_weight, eps,
                   stream, norm_offset=norm_offset, activation=activation)

    def gemv_residual(self, x: Any, w: Any, out: Any, bias: Any = None, *, stream: Any = None) -> None:
        """out += x @ w.T (+ bias): the o_proj / down_proj residual add.  Same rules as gemv."""
        self.gemv(x, w, out, bias, accumulate=True, stream=stream)

    @staticmethod
    def qkv_rope_fusable(m: int) -> str | None:
        """None when gemv_qkv_rope has an instance for m rows (the GEMV the rows path takes for m rows), else
        why not (the fused rows path then runs the unfused qkv GEMV and rope_kv_append for that row count)."""
        if uses_tc(m):
            return None if m <= 16 else f"no tensor-core GEMV for {m} rows"
        if m not in fused_qkv_fp32_rows():
            return f"no fused qkv instance of the fp32-FMA GEMV for {m} rows"
        return None

    def gemv_qkv_rope(self, x: Any, w: Any, bias: Any, norm_weight: Any, qkv: Any, positions: Any, inv_freq: Any,
                      q_out: Any, k_cache: Any, v_cache: Any, counters: Any, *, eps: float = 1e-6,
                      norm_offset: float = 0.0, q_norm: Any = None, k_norm: Any = None, rope_eps: float = 1e-6,
                      attention_scaling: float = 1.0, rope_norm_offset: float = 0.0, rotary_dim: int | None = None,
                      stream: Any = None) -> None:
        """The fused rows path's qkv projection in one launch: qkv = rmsnorm(x, norm_weight) @ w.T (+ bias)
        (as gemv / gemv_tc with norm_weight), then rope_kv_append(qkv, positions, inv_freq, q_out, k_cache,
        v_cache, q_norm, k_norm, rope_eps, ...) done by the block that finishes each head slot's last rows
        (the split-K "last block" pattern over `counters`).  Same values as the two unfused launches.
        x f32[M, K], w bf16[(n_heads + 2 n_kv) head_dim, K], bias bf16[N] or None, norm_weight bf16[K],
        qkv f32[M, N] (written, then read back by the epilogue), q_out f32[M, n_heads, head_dim] (disjoint
        from qkv), caches as rope_kv_append.  counters: int32[>= n_heads + 2 n_kv], all zero; every launch
        leaves them zero (a non-zero counter afterwards means a broken launch: see check_counters).
        The GEMV is the rows path's for M rows (uses_tc: the fp32-FMA GEMV below GEMV_TC_MIN_ROWS rows, else
        tensor cores); qkv_rope_fusable says which row counts have an instance."""
        np = self._np
        if norm_weight is None:
            raise ValueError("gemv_qkv_rope: norm_weight is required (the fused qkv GEMV has the norm prologue)")
        M, K, N, _ = self._linear_operands("gemv_qkv_rope", x, w, "w", qkv, bias, norm_weight, swiglu=False)
        self._i32(positions, "positions", 1)
        self._f32(inv_freq, "inv_freq", 1)
        self._f32(q_out, "q_out", 3)
        self._i32(counters, "counters", 1)
        n_kv, max_ctx, hd = self._check_cache(k_cache, v_cache)
        Mq, nh, qhd = q_out.shape
        if Mq != M or qhd != hd:
            raise ValueError(f"q_out: shape {q_out.shape} does not match x rows {M} / the cache's head_dim {hd}")
        if hd % 2 or hd > 256 or hd == 0:
            raise ValueError(f"gemv_qkv_rope: head_dim = {hd} must be even and <= 256")
        slots = nh + 2 * n_kv
        if N != slots * hd:
            raise ValueError(f"gemv_qkv_rope: w has {N} rows, expected (n_heads + 2 n_kv) * head_dim = {slots * hd}")
        rd = self._rotary_dim(hd, rotary_dim)
        self._shape(positions, "positions", (M,))
        self._shape(inv_freq, "inv_freq", (rd // 2,))
        if counters.shape[0] < slots:
            raise ValueError(f"counters: {counters.shape[0]} int32, need {slots}")
        for a, an in ((q_norm, "q_norm"), (k_norm, "k_norm")):
            if a is not None:
                self._bf16(a, an, 1)
                self._shape(a, an, (hd,))
        self._disjoint(q_out, "q_out", qkv, "qkv")
        for c, cn in ((k_cache, "k_cache"), (v_cache, "v_cache")):
            self._disjoint(c, cn, qkv, "qkv")
            self._disjoint(c, cn, q_out, "q_out")
        for a, an in ((qkv, "qkv"), (q_out, "q_out"), (k_cache, "k_cache"), (v_cache, "v_cache")):
            self._disjoint(counters, "counters", a, an)
        why = self.qkv_rope_fusable(M)
        if why is not None:
            raise ValueError(f"gemv_qkv_rope: {why}")
        rope = (
            positions, inv_freq, self._dummy if q_norm is None else q_norm, self._dummy if k_norm is None else k_norm,
            q_out, k_cache, v_cache, np.int32(nh), np.int32(n_kv), np.int32(hd), np.int32(max_ctx),
            np.float32(rope_eps), np.int32(0 if q_norm is None else 1), np.int32(0 if k_norm is None else 1),
            np.float32(attention_scaling), np.float32(rope_norm_offset), np.int32(rd), counters,
        )
        head = (x, w, self._dummy if bias is None else bias, qkv)
        tail = (np.int32(0 if bias is None else 1), norm_weight, np.float32(eps), np.float32(norm_offset))
        if uses_tc(M):
            tiles, warps, u = GEMV_TC_DEFAULT[M]
            block_rows, threads = 16 * tiles, warps * 32
            name = gemv_tc_qkv_rope_name(2 if M > 8 else 1, tiles, warps, u)
            args = head + (np.int32(M), np.int32(N), np.int32(K)) + tail + rope
        else:
            r, u = GEMV_DEFAULT[M]
            threads, block_rows = _gemv_block_rows(r, u)
            name = gemv_qkv_rope_name(M, r, u)
            args = head + (np.int32(N), np.int32(K)) + tail + rope
        if block_rows > 31 * hd:  # qkv_rope_tail counts a block in for at most 32 head slots
            raise ValueError(f"gemv_qkv_rope: {block_rows} rows per block span too many heads of {hd}")
        if not self._has(name):
            raise ValueError(f"gemv_qkv_rope: no compiled instance {name}")
        self._launch(name, (_ceil_div(N, block_rows),), (threads,), args, stream)

    def check_counters(self, counters: Any, what: str = "fused kernels") -> None:
        """Raise RuntimeError if any of the last-block counters of the fused kernels is non-zero (reads them:
        synchronises the device).  Each fused launch leaves its counters at zero; one that does not means a
        block count that does not match the launch, and results that cannot be trusted."""
        host = counters.get()
        bad = self._np.flatnonzero(host)
        if bad.size:
            raise RuntimeError(f"{what}: {bad.size} last-block counters left non-zero (first: [{int(bad[0])}] = "
                               f"{int(host[bad[0]])}): a fused launch lost blocks; its results are wrong")
