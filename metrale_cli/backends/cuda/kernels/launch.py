"""`Kernels`: the launch wrappers of the kernels, one method per kernel (see the package docstring
for the conventions they share)."""

from __future__ import annotations

from typing import Any

from .checks import OperandChecks
from .names import (
    PLAIN_KERNELS,
    decode_name,
    fused_name_expressions,
    fused_qkv_fp32_rows,
    gemv_name,
    gemv_qkv_rope_name,
    gemv_ring_name,
    gemv_tc_name,
    gemv_tc_qkv_rope_name,
    name_expressions,
    prefill_name,
)
from .nvrtc import compile_module
from .pdl import PdlLauncher
from .tuning import (
    ARGMAX_CHUNK,
    ARGMAX_THREADS,
    ATTN_CHUNK_ALIGN,
    ATTN_COMBINE_BATCH,
    ATTN_TC_WARPS,
    ATTN_WARPS,
    DECODE_HEAD_DIMS,
    DECODE_SIMT_SPLITS,
    DECODE_TC_HEAD_DIMS,
    GEMV_DEFAULT,
    GEMV_RING_CHUNKS,
    GEMV_RING_DEEP_BYTES,
    GEMV_RING_K_MULTIPLE,
    GEMV_RING_MAX_N,
    GEMV_RING_SMEM_SLACK,
    GEMV_RING_STAGES,
    GEMV_RING_THREADS,
    GEMV_SWIGLU_DEFAULT,
    GEMV_TC_DEFAULT,
    GEMV_TC_SWIGLU_DEFAULT,
    LOG2E,
    PREFILL_BQ,
    PREFILL_BQS,
    PREFILL_HEAD_DIMS,
    _ceil_div,
    _decode_qb,
    _gemv_block_rows,
    prefill_smem_bytes,
    ring_fixed_smem_bytes,
    uses_tc,
)
from .unfused import UnfusedKernels


class Kernels(OperandChecks, UnfusedKernels):
    """All kernels of the CUDA engine.  Construct once per process (after choosing the device)."""

    def __init__(self) -> None:
        import cupy  # lazily: this module is imported only when the CUDA engine is chosen
        import numpy

        self._cp = cupy
        self._np = numpy
        self._names = name_expressions()
        self._module = compile_module(cupy, self._names)
        # Fetch every function now: compiling and loading must not happen during a capture.
        self._fn = {n: self._module.get_function(n) for n in self._names + PLAIN_KERNELS}
        self._fused_names = frozenset(fused_name_expressions())
        self._fused_module = None
        dev = cupy.cuda.Device()
        self.device_id = dev.id
        self.num_sms = int(dev.attributes["MultiProcessorCount"])
        self.regs_per_sm = int(dev.attributes["MaxRegistersPerMultiprocessor"])
        self.smem_per_sm = int(dev.attributes["MaxSharedMemoryPerMultiprocessor"])
        self.smem_per_block_optin = int(dev.attributes["MaxSharedMemoryPerBlockOptin"])
        self._bf16_dtype = None
        try:
            import ml_dtypes

            self._bf16_dtype = numpy.dtype(ml_dtypes.bfloat16)
        except ImportError:  # pragma: no cover - ml_dtypes is a runtime dependency
            pass
        self._dummy = cupy.zeros(8, dtype=cupy.uint16)  # stands for an absent optional operand
        self._workspace = None  # decode scratch, grown on demand (eager calls only)
        # Programmatic dependent launch: while True, every launch lets the kernel start before the
        # previous kernel of the stream has finished (the kernels' pdl_wait() orders their reads and
        # writes).  The engine turns it on for the captured rows path.  Needs compute capability 9.0.
        self.pdl = False
        self.pdl_supported = int(dev.compute_capability) >= 90
        self._pdl_launcher = None

    # ------------------------------------------------------------------ launching
    def _grid1d(self, n: int, block: int = 256) -> int:
        return max(1, min(_ceil_div(n, block), self.num_sms * 16))

    def load_fused(self) -> None:
        """Compile the fused module (names.fused_name_expressions: the fused rows path's kernels) now; the
        engine does so when it takes the fused path, before any capture."""
        if self._fused_module is None:
            names = tuple(sorted(self._fused_names))
            self._fused_module = compile_module(self._cp, names)
            self._fn.update({n: self._fused_module.get_function(n) for n in names})

    def _has(self, name: str) -> bool:
        """Whether the kernel instance `name` is compiled (compiling the fused module if it is there)."""
        if name not in self._fn and name in self._fused_names:
            self.load_fused()
        return name in self._fn

    def _launch(self, name: str, grid: tuple, block: tuple, args: tuple, stream: Any, shared_mem: int = 0) -> None:
        """Launch with PDL while self.pdl (through cuLaunchKernelEx: CuPy's launcher does not have it)."""
        if self.pdl:
            if self._pdl_launcher is None:
                self._pdl_launcher = PdlLauncher(self._cp)
            self._pdl_launcher.launch(self._fn[name], grid, block, args, stream, shared_mem=shared_mem)
        else:
            self._fn[name](grid, block, args, stream=stream, shared_mem=shared_mem)

    # ------------------------------------------------------------------ kernels
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

    def gemv(
        self,
        x: Any,
        w: Any,
        out: Any,
        bias: Any = None,
        *,
        accumulate: bool = False,
        norm_weight: Any = None,
        eps: float = 1e-6,
        norm_offset: float = 0.0,
        stream: Any = None,
    ) -> None:
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

    def gemv_swiglu(
        self,
        x: Any,
        w_gate_up: Any,
        out: Any,
        *,
        norm_weight: Any = None,
        eps: float = 1e-6,
        norm_offset: float = 0.0,
        activation: str = "silu",
        stream: Any = None,
    ) -> None:
        """out = act(x @ Wg.T) * (x @ Wu.T) in one pass over the fused weight
        w_gate_up bf16[2I, K] = concat(gate_proj.weight, up_proj.weight).  x f32[M, K], out f32[M, I];
        act: "silu" (SwiGLU) or "gelu_tanh" (GeGLU).  norm_weight bf16[K]: fused RMSNorm of x first,
        as in gemv (norm_offset likewise)."""
        self._gemv("gemv_swiglu", x, w_gate_up, "w_gate_up", out, None, True, False, norm_weight, eps,
                   stream, norm_offset=norm_offset, activation=activation)

    def gemv_tc(
        self,
        x: Any,
        w: Any,
        out: Any,
        bias: Any = None,
        *,
        accumulate: bool = False,
        swiglu: bool = False,
        norm_weight: Any = None,
        eps: float = 1e-6,
        norm_offset: float = 0.0,
        activation: str = "silu",
        stream: Any = None,
    ) -> None:
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

    def ring_fits(self, m: int, k: int, n: int, gated: bool = False) -> bool:
        """Whether the engine's rows path takes gemv_ring for this projection: one row, K a multiple of
        GEMV_RING_K_MULTIPLE, at most GEMV_RING_MAX_N outputs, and x, the partials and a one-chunk ring
        within a block's shared memory."""
        if m != 1 or k % GEMV_RING_K_MULTIPLE or n > GEMV_RING_MAX_N:
            return False
        return self._ring_fit(k, n, gated)[3] >= 1

    @staticmethod
    def ring_chunks(k: int, n: int, gated: bool) -> int:
        """gemv_ring's chunks per thread and slot on the engine's rows path (tuning.py, GEMV_RING_DEEP_BYTES)."""
        return 2 if (2 if gated else 1) * n * k * 2 >= GEMV_RING_DEEP_BYTES else 1

    def _ring_fit(self, k: int, n: int, gated: bool) -> tuple[int, int, int, int]:
        """(grid, shared bytes besides the ring, ring bytes per chunk per thread and slot, the most chunks per
        thread and slot that fit) of gemv_ring: one block per SM, within all the shared memory a block may have."""
        grid = min(n, self.num_sms)
        fixed = ring_fixed_smem_bytes(k, n, grid, gated, GEMV_RING_THREADS)
        per_chunk = GEMV_RING_STAGES * GEMV_RING_THREADS * 16
        budget = self.smem_per_block_optin + 1024
        return grid, fixed, per_chunk, (budget - GEMV_RING_SMEM_SLACK - fixed) // per_chunk

    def _ring_geometry(self, norm: bool, k: int, n: int, gated: bool, chunks: int | None) -> tuple[str, int, int]:
        """(kernel name, grid, shared bytes) of a gemv_ring launch, computed once per shape (_ring_fit): the
        deepest compiled ring (GEMV_RING_CHUNKS chunks per thread and slot) that fits, or `chunks`."""
        cache = self.__dict__.setdefault("_ring_geometries", {})
        key = (norm, k, n, gated, chunks)
        if key not in cache:
            grid, fixed, per_chunk, fit = self._ring_fit(k, n, gated)
            p = max((c for c in GEMV_RING_CHUNKS if c <= fit), default=0) if chunks is None else chunks
            if p < 1 or p > fit:
                raise ValueError(f"gemv_ring: K = {k}, N = {n}: a ring of {p} chunks per thread does not fit "
                                 f"(at most {fit})")
            name = gemv_ring_name(norm, gated, p, GEMV_RING_THREADS)
            fn = self._fn[name]
            # opt in to more than 48 KiB of dynamic shared memory: the device's most, once for every geometry (a
            # launch with more than the function's limit fails, and the geometries of one kernel differ)
            fn.max_dynamic_shared_size_bytes = self.smem_per_block_optin - int(fn.attributes.get("shared_size_bytes", 0))
            cache[key] = (name, grid, fixed + p * per_chunk)
        return cache[key]

    def gemv_ring(
        self,
        x: Any,
        w: Any,
        out: Any,
        bias: Any = None,
        *,
        norm_weight: Any = None,
        accumulate: bool = False,
        swiglu: bool = False,
        activation: str = "silu",
        eps: float = 1e-6,
        norm_offset: float = 0.0,
        chunks: int | None = None,
        stream: Any = None,
    ) -> None:
        """The ring GEMV (gemv_ring.cu), one row: the function of gemv / gemv_swiglu for M = 1 (the norm fused
        when norm_weight is given, norm_offset added to it in fp32), x f32[1, K] with K a multiple of
        GEMV_RING_K_MULTIPLE.  `chunks`: 16-byte chunks per thread in each ring slot (None: the most that fit).
        The result depends on (N, K, the grid) only: fixed for a device, whatever the ring."""
        np = self._np
        op = "gemv_ring"
        M, K, N, norm = self._linear_operands(op, x, w, "w", out, bias, norm_weight, swiglu)
        if M != 1:
            raise ValueError(f"{op}: M = {M} rows; this kernel takes 1")
        if K % GEMV_RING_K_MULTIPLE:
            raise ValueError(f"{op}: K = {K} must be a multiple of {GEMV_RING_K_MULTIPLE}")
        if swiglu and accumulate:
            raise ValueError(f"{op}: accumulate is not supported with swiglu")
        if chunks is not None and chunks not in GEMV_RING_CHUNKS:
            raise ValueError(f"{op}: chunks = {chunks}: compiled {', '.join(map(str, GEMV_RING_CHUNKS))}")
        name, grid, smem = self._ring_geometry(norm, K, N, swiglu, chunks)
        args = (
            x, w, self._dummy if bias is None else bias, out, np.int32(N), np.int32(K),
            np.int32(1 if accumulate else 0), np.int32(0 if bias is None else 1),
            norm_weight if norm else self._dummy, np.float32(eps), np.float32(norm_offset), self._act(activation),
        )
        self._launch(name, (grid,), (GEMV_RING_THREADS,), args, stream, shared_mem=smem)

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

    def rope_kv_append(
        self,
        qkv: Any,
        positions: Any,
        inv_freq: Any,
        q_out: Any,
        k_cache: Any,
        v_cache: Any,
        q_norm: Any = None,
        k_norm: Any = None,
        eps: float = 1e-6,
        *,
        attention_scaling: float = 1.0,
        norm_offset: float = 0.0,
        rotary_dim: int | None = None,
        stream: Any = None,
    ) -> None:
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

    @staticmethod
    def qkv_rope_fusable(m: int) -> str | None:
        """None when gemv_qkv_rope has an instance for m rows (the GEMV the rows path takes for m rows), else
        why not (the fused rows path then runs the unfused qkv GEMV and rope_kv_append for that row count)."""
        if uses_tc(m):
            return None if m <= 16 else f"no tensor-core GEMV for {m} rows"
        if m not in fused_qkv_fp32_rows():
            return f"no fused qkv instance of the fp32-FMA GEMV for {m} rows"
        return None

    def gemv_qkv_rope(
        self,
        x: Any,
        w: Any,
        bias: Any,
        norm_weight: Any,
        qkv: Any,
        positions: Any,
        inv_freq: Any,
        q_out: Any,
        k_cache: Any,
        v_cache: Any,
        counters: Any,
        *,
        eps: float = 1e-6,
        norm_offset: float = 0.0,
        q_norm: Any = None,
        k_norm: Any = None,
        rope_eps: float = 1e-6,
        attention_scaling: float = 1.0,
        rope_norm_offset: float = 0.0,
        rotary_dim: int | None = None,
        stream: Any = None,
    ) -> None:
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

    def decode_splits(self, max_ctx: int, n_kv: int, n_rows: int = 1, n_heads: int | None = None,
                      head_dim: int | None = None) -> int:
        """Number of context splits for attention_decode of n_rows query rows (any n_rows >= 1;
        pass the M the call will use: the split count is fixed in a captured graph).

        Tensor-core kernel (head_dim None or in DECODE_TC_HEAD_DIMS): it runs n_kv * ceil(n_rows * G / R) *
        n_splits blocks (G = n_heads / n_kv; R = 8 query vectors per block when n_rows * G <= 8, else 16).
        At the longest context we want about 2 blocks of 4 warps per SM (each warp keeps ~8 KiB of K/V
        loads in flight, 64 KiB per SM covers the HBM latency), so n_splits = ceil(2 * SMs / (n_kv * row
        blocks)), but no split shorter than ATTN_CHUNK_ALIGN keys at max_ctx.  On the device the split
        size is ceil(L / n_splits) rounded up to ATTN_CHUNK_ALIGN for the current length L, so shorter
        contexts use fewer, still >= 64-key, splits.
        SIMT kernel (head_dim 96, 256; its query blocks of _decode_qb vectors; DECODE_SIMT_SPLITS): latency-bound
        (one warp per scheduler), so head_dim 96 (64 registers) takes 32-key splits, about 4 blocks per SM, and
        head_dim 256 (161 registers) 64-key splits, 2 per SM.
        A count just past ATTN_COMBINE_BATCH (33..35) becomes the batch: the combine merges its splits in batches of
        32, and a second batch is a second round of loads."""
        n_heads = n_kv if n_heads is None else n_heads
        n_kv = max(1, int(n_kv))
        qvec = max(1, int(n_rows)) * max(1, int(n_heads) // n_kv)
        if head_dim is None or head_dim in DECODE_TC_HEAD_DIMS:
            align, per_sm = ATTN_CHUNK_ALIGN, 2
            row_blocks = _ceil_div(qvec, 8 if qvec <= 8 else 16)
        else:
            align, per_sm = DECODE_SIMT_SPLITS[head_dim]
            row_blocks = _ceil_div(qvec, _decode_qb(head_dim, qvec))
        want = _ceil_div(per_sm * self.num_sms, n_kv * row_blocks)
        if ATTN_COMBINE_BATCH < want <= ATTN_COMBINE_BATCH * 11 // 10:
            want = ATTN_COMBINE_BATCH  # a few splits past one combine batch cost a second merge round
        return max(1, min(want, _ceil_div(max(1, int(max_ctx)), align), 65535))

    @staticmethod
    def decode_workspace_size(n_rows: int, n_heads: int, head_dim: int, n_splits: int) -> int:
        """float32 elements of the attention_decode scratch buffer: per split and query vector
        (row x head) head_dim partial sums plus (max, sum).  Its content need not be initialised:
        every call writes what it reads."""
        return n_splits * n_rows * n_heads * (head_dim + 2)

    def attention_decode(
        self,
        q: Any,
        k_cache: Any,
        v_cache: Any,
        positions: Any,
        out: Any,
        scale: float,
        *,
        n_splits: int | None = None,
        workspace: Any = None,
        window: int | None = None,
        softcap: float | None = None,
        rope: dict | None = None,
        stream: Any = None,
    ) -> None:
        """Causal attention of M query rows (decode M=1, verify M=k) against the cache:
        row m attends to cache rows 0..positions[m] inclusive (a position >= max_ctx counts as
        max_ctx - 1; a row with a negative position gets NaN).  q, out f32[M, n_heads, head_dim];
        caches bf16[n_kv, max_ctx, head_dim], 16-byte aligned; positions int32[M] (device).
        head_dim in DECODE_HEAD_DIMS; n_heads a multiple of n_kv.  Flash-decoding in two
        launches (split + combine): `n_splits` (default decode_splits(max_ctx, n_kv, M, n_heads))
        fixed at capture time; the length L = max(positions) + 1 and the split size are computed
        on the device, splits past L exit at once.  head_dim <= 128 runs on tensor cores with q
        and the softmax weights each split into two bf16 terms (hi + lo): about fp32 accuracy.
        `workspace`: f32 buffer of >= decode_workspace_size(M, n_heads, head_dim, n_splits)
        elements, any content; if None an internal one is used (grown on demand: make one eager
        call before capturing, or pass your own, and pass your own when calls on different streams
        may overlap).
        `window`: row m sees only keys (positions[m] - window, positions[m]], and the split work covers
        only the keys some row sees (a long context costs what the window costs).  `softcap`: scores
        -> softcap * tanh(scores / softcap) before the mask (Gemma 2).  Both fixed at capture time.
        `rope` (the fused rows path, one row): rope_kv_append's arguments (inv_freq, q_norm, k_norm, eps,
        attention_scaling, norm_offset, rotary_dim) and `q` the unrotated qkv projection viewed as
        [1, n_heads + 2 n_kv, head_dim]: the split kernel rotates q itself and the split holding the position
        appends k and v to the cache (rope_fits says where it can: no rope_kv_append launch)."""
        np = self._np
        self._f32(q, "q", 3)
        self._f32(out, "out", 3)
        self._i32(positions, "positions", 1)
        n_kv, max_ctx, hd = self._check_cache(k_cache, v_cache)
        M, nh, qhd = q.shape
        qkv = None
        if rope is not None:  # q: the qkv rows' q heads (a view); the kernel reads the whole row from qkv
            qkv, q = q, q[:, : q.shape[1] - 2 * n_kv]
            M, nh, qhd = q.shape
        if qhd != hd:
            raise ValueError(f"q: head_dim {qhd} differs from the cache's {hd}")
        if hd not in DECODE_HEAD_DIMS:
            raise ValueError(f"attention_decode: head_dim {hd} not in {DECODE_HEAD_DIMS}")
        if n_kv == 0 or nh % n_kv:
            raise ValueError(f"attention_decode: n_heads {nh} is not a multiple of n_kv {n_kv}")
        if M == 0 or max_ctx == 0:
            raise ValueError("attention_decode: empty q or cache")
        self._shape(out, "out", (M, nh, hd))
        self._shape(positions, "positions", (M,))
        self._disjoint(q, "q", out, "out")
        self._aligned(k_cache, "k_cache")
        self._aligned(v_cache, "v_cache")
        G = nh // n_kv
        if n_splits is None:
            n_splits = self.decode_splits(max_ctx, n_kv, M, nh, hd)
        n_splits = int(n_splits)
        if not 1 <= n_splits <= 65535:
            raise ValueError(f"attention_decode: n_splits = {n_splits} must be in 1..65535")
        need = self.decode_workspace_size(M, nh, hd, n_splits)
        if workspace is None:
            if self._workspace is None or self._workspace.size < need:
                self._workspace = self._cp.empty(max(need, 1 << 20), dtype=self._cp.float32)
            workspace = self._workspace
        else:
            self._f32(workspace, "workspace")
            if workspace.size < need:
                raise ValueError(f"workspace: {workspace.size} float32 elements, need {need}")
        for a, an in ((q, "q"), (out, "out"), (positions, "positions"), (k_cache, "k_cache"), (v_cache, "v_cache")):
            self._disjoint(workspace, "workspace", a, an)
        ws = workspace.reshape(-1)
        n_acc = n_splits * M * nh * hd
        part_acc = ws[:n_acc]
        part_ml = ws[n_acc : n_acc + 2 * n_splits * M * nh]
        qb = _decode_qb(hd, M * G)
        win, cap2 = self._window_softcap(window, softcap)
        ext = bool(win or cap2)  # the tensor-core instance with the window / softcap code
        if hd in DECODE_TC_HEAD_DIMS:
            grid = (_ceil_div(M * G, qb), n_splits, n_kv)
            threads = ATTN_TC_WARPS * 32
        else:
            grid = (n_kv, n_splits, _ceil_div(M * G, qb))
            threads = ATTN_WARPS * 32
        qscale = np.float32(float(scale) * LOG2E)
        args = (
            q, k_cache, v_cache, positions, part_acc, part_ml,
            np.int32(M), np.int32(nh), np.int32(n_kv), np.int32(max_ctx), np.int32(n_splits), qscale,
            win, cap2,
        )
        tc_tail = self._decode_rope_args(rope, qkv, k_cache, v_cache, M, n_kv, hd, G, window, softcap)
        if hd not in DECODE_TC_HEAD_DIMS:
            tc_tail = ()
        self._launch(decode_name(hd, qb, ext, rope=rope is not None), grid, (threads,), args + tc_tail, stream)
        args2 = (
            part_acc, part_ml, positions, out,
            np.int32(M), np.int32(nh), np.int32(hd), np.int32(max_ctx), np.int32(n_splits), win,
        )
        self._launch("attn_decode_combine_kernel", (M * nh,), (hd,), args2, stream)

    def rope_fits(self, head_dim: int, n_heads: int, n_kv: int, window: int | None = None,
                  softcap: float | None = None) -> str | None:
        """None when attention_decode can take rope + KV append into its split kernel for one row (tensor-core
        head dims, at most 8 query heads per KV head, no window or softcap), else why not."""
        if head_dim not in DECODE_TC_HEAD_DIMS:
            return f"head_dim {head_dim}: the SIMT split kernel has no rope prologue"
        if n_heads // n_kv > 8:
            return f"{n_heads // n_kv} query heads per KV head: the rope prologue takes at most 8"
        if window or softcap:
            return "a window or softcap: the rope prologue is in the plain instance only"
        return None

    def _decode_rope_args(self, rope: dict | None, qkv: Any, k_cache: Any, v_cache: Any, M: int, n_kv: int, hd: int,
                          G: int, window: int | None, softcap: float | None) -> tuple:
        """The tensor-core split kernel's rope arguments: rope_kv_append's (checked as there), or dummies."""
        np = self._np
        if rope is None:
            d = self._dummy
            return (d, d, d, d, d, np.float32(0), np.int32(0), np.int32(0), np.float32(1), np.float32(0), np.int32(0))
        why = self.rope_fits(hd, G * n_kv, n_kv, window, softcap)
        if why is not None or M != 1:
            raise ValueError(f"attention_decode: rope in the split kernel: {why or 'one row only'}")
        inv_freq, q_norm, k_norm = rope["inv_freq"], rope.get("q_norm"), rope.get("k_norm")
        rd = self._rotary_dim(hd, rope.get("rotary_dim"))
        self._f32(inv_freq, "inv_freq", 1)
        self._shape(inv_freq, "inv_freq", (rd // 2,))
        for a, an in ((q_norm, "q_norm"), (k_norm, "k_norm")):
            if a is not None:
                self._bf16(a, an, 1)
                self._shape(a, an, (hd,))
        for c, cn in ((k_cache, "k_cache"), (v_cache, "v_cache")):
            self._disjoint(c, cn, qkv, "qkv")
        return (inv_freq, self._dummy if q_norm is None else q_norm, self._dummy if k_norm is None else k_norm,
                k_cache, v_cache, np.float32(rope.get("eps", 1e-6)), np.int32(0 if q_norm is None else 1),
                np.int32(0 if k_norm is None else 1), np.float32(rope.get("attention_scaling", 1.0)),
                np.float32(rope.get("norm_offset", 0.0)), np.int32(rd))

    def attention_prefill(
        self,
        q: Any,
        k_cache: Any,
        v_cache: Any,
        start_pos: int,
        T: int,
        out: Any,
        scale: float,
        *,
        block_q: int | None = None,
        window: int | None = None,
        softcap: float | None = None,
        stream: Any = None,
    ) -> None:
        """Causal attention of a prompt chunk: query row t (position start_pos + t) attends to
        cache rows 0..start_pos+t (with `window`: only the last `window` of them; tiles before every
        row's window are skipped), whose K/V were appended before.  `softcap` as in attention_decode.
        q, out f32[>=T, n_heads, head_dim] (rows T.. untouched); head_dim in PREFILL_HEAD_DIMS;
        start_pos + T <= max_ctx.
        Tensor cores (flash_prefill.cu): q and the softmax weights P are rounded to bf16 for the
        mma (as bf16 attention in transformers does), the softmax state and sums stay fp32.
        `block_q`: query rows per block, one of PREFILL_BQS (default PREFILL_BQ).  Eager only:
        launched without PDL, with dynamic shared memory."""
        np = self._np
        self._f32(q, "q", 3)
        self._f32(out, "out", 3)
        n_kv, max_ctx, hd = self._check_cache(k_cache, v_cache)
        start_pos, T = int(start_pos), int(T)
        if q.shape[1:] != out.shape[1:] or q.shape[2] != hd:
            raise ValueError(f"q {q.shape} / out {out.shape} do not match the cache head_dim {hd}")
        nh = q.shape[1]
        if hd not in PREFILL_HEAD_DIMS:
            raise ValueError(f"attention_prefill: head_dim {hd} not in {PREFILL_HEAD_DIMS}")
        if n_kv == 0 or nh % n_kv:
            raise ValueError(f"attention_prefill: n_heads {nh} is not a multiple of n_kv {n_kv}")
        if T < 1 or q.shape[0] < T or out.shape[0] < T:
            raise ValueError(f"attention_prefill: T = {T} rows, q has {q.shape[0]}, out {out.shape[0]}")
        if start_pos < 0 or start_pos + T > max_ctx:
            raise ValueError(f"attention_prefill: positions {start_pos}..{start_pos + T - 1} outside max_ctx {max_ctx}")
        bq = PREFILL_BQ if block_q is None else int(block_q)
        if bq not in PREFILL_BQS:
            raise ValueError(f"attention_prefill: block_q {bq} not in {PREFILL_BQS}")
        self._disjoint(q, "q", out, "out")
        for a, an, nbytes in ((q, "q", 8), (out, "out", 8), (k_cache, "k_cache", 16), (v_cache, "v_cache", 16)):
            self._aligned(a, an, nbytes)
        win, cap2 = self._window_softcap(window, softcap)
        name = prefill_name(hd, bq, ext=bool(win or cap2))  # the instance with the window / softcap code
        fn = self._fn[name]
        smem = prefill_smem_bytes(hd)
        done = self.__dict__.setdefault("_prefill_smem_set", set())
        if name not in done:  # opt in to more than 48 KiB of dynamic shared memory, once
            fn.max_dynamic_shared_size_bytes = smem
            done.add(name)
        grid = (nh, _ceil_div(T, bq))  # heads vary fastest; the kernel starts the longest blocks first
        args = (
            q, k_cache, v_cache, out, np.int32(T), np.int32(start_pos), np.int32(nh),
            np.int32(n_kv), np.int32(max_ctx), np.float32(float(scale) * LOG2E), win, cap2,
        )
        fn(grid, (bq // 16 * 32,), args, shared_mem=smem, stream=stream)

    def swiglu(self, gate_up: Any, out: Any, *, activation: str = "silu", stream: Any = None) -> None:
        """out = act(gate_up[:, :I]) * gate_up[:, I:], act "silu" or "gelu_tanh".  gate_up f32[M, 2I],
        out f32[M, I]."""
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
        args = (gate_up, out, np.int32(M), np.int32(I2 // 2), self._act(activation))
        self._launch("swiglu_kernel", (self._grid1d(n),), (256,), args, stream)

    def argmax_blocks(self, n: int, V: int) -> int:
        """Blocks per row of the split argmax (argmax_split_*_kernel) for n rows of V, or 0 for the one-block-
        per-row kernel: one block per ARGMAX_CHUNK elements, at most 8 resident-sized waves of the GPU over
        all rows; the one-block kernel when the row fits in two chunks or n rows alone fill the SMs."""
        chunks = _ceil_div(int(V), ARGMAX_CHUNK)
        if chunks < 2 or n >= self.num_sms:
            return 0
        return max(2, min(chunks, (8 * self.num_sms) // max(1, int(n))))

    @staticmethod
    def argmax_workspace_size(n: int, nb: int) -> int:
        """int32 elements of the split argmax's workspace: n counters (zero before and after every launch)
        and nb (value, index) partials per row."""
        return int(n) + 2 * int(n) * int(nb)

    def argmax(self, rows: Any, out: Any, *, workspace: Any = None, stream: Any = None) -> None:
        """out[i] = index of the first maximum of rows[i] (torch.argmax), or -1 if rows[i] holds
        any NaN or +-Inf.  rows f32 or bf16 [n, V]; out int32[n].
        Fewer rows than SMs (argmax_blocks > 0): several blocks per row in one launch, the last block of
        each row reducing their partials (argmax_split_*_kernel); else one block per row.  The same index
        either way (ties, NaN, Inf: tests/gpu/test_kernels.py).  The split kernel needs `workspace`:
        int32[>= argmax_workspace_size(n, argmax_blocks(n, V))] whose first n elements are zero (every
        launch leaves them zero; the rest is scratch), used for this row count n only (another n's partials
        would lie on its counters); None: an internal one per n, grown on demand (zeroed and
        synchronised: make one eager call before capturing, or pass your own, and pass your own when calls
        on different streams may overlap)."""
        np = self._np
        self._arr(rows, "rows")
        self._i32(out, "out", 1)
        self._ndim(rows, "rows", 2)
        n, V = rows.shape
        self._shape(out, "out", (n,))
        if V == 0 or V >= 2**31:
            raise ValueError(f"argmax: V = {V} must be in 1..2^31-1")
        kind = self._f32_or_bf16(rows, "rows")
        if n == 0:
            return
        nb = self.argmax_blocks(n, V)
        if nb == 0:
            self._launch(f"argmax_{kind}_kernel", (n,), (1024,), (rows, out, np.int32(V)), stream)
            return
        need = self.argmax_workspace_size(n, nb)
        if workspace is None:  # one per row count: n's counters must not lie where another n's partials went
            spaces = self.__dict__.setdefault("_argmax_ws", {})
            ws = spaces.get(n)
            if ws is None or ws.size < need:
                ws = self._cp.zeros(max(need, 1 << 12), dtype=self._cp.int32)
                self._cp.cuda.Device().synchronize()  # the zero fill ran on the current stream
                spaces[n] = ws
            workspace = ws
        else:
            self._i32(workspace, "workspace", 1)
            if workspace.shape[0] < need:
                raise ValueError(f"workspace: {workspace.shape[0]} int32 elements, need {need}")
            self._disjoint(workspace, "workspace", out, "out")
        self._launch(f"argmax_split_{kind}_kernel", (nb, n), (ARGMAX_THREADS,), (rows, out, np.int32(V), workspace),
                     stream)

    def f32_to_bf16(self, x: Any, out: Any, *, stream: Any = None) -> None:
        """out = bf16(x), round to nearest even, NaN -> 0x7FC0 (torch CPU semantics).
        x f32[...]; out bf16 or uint16, same shape."""
        np = self._np
        self._f32(x, "x")
        self._bf16(out, "out")
        self._shape(out, "out", x.shape)
        if x.size == 0:
            return
        self._launch("f32_to_bf16_kernel", (self._grid1d(x.size),), (256,), (x, out, np.int64(x.size)), stream)

    def bf16_to_f32(self, x: Any, out: Any, *, stream: Any = None) -> None:
        """out = float32(x) (exact).  x bf16 or uint16 [...]; out f32, same shape."""
        np = self._np
        self._bf16(x, "x")
        self._f32(out, "out")
        self._shape(out, "out", x.shape)
        if x.size == 0:
            return
        self._launch("bf16_to_f32_kernel", (self._grid1d(x.size),), (256,), (x, out, np.int64(x.size)), stream)
