"""Launch wrappers of flash_prefill.cu: causal tensor-core flash attention of a prompt chunk (the prefill path)."""

from __future__ import annotations

from typing import Any

from .names import prefill_name
from .tuning import LOG2E, PREFILL_BQ, PREFILL_BQS, PREFILL_HEAD_DIMS, _ceil_div, prefill_smem_bytes


class FlashPrefillKernels:

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
        sinks: Any = None,
        stream: Any = None,
    ) -> None:
        """Causal attention of a prompt chunk: query row t (position start_pos + t) attends to
        cache rows 0..start_pos+t (with `window`: only the last `window` of them; tiles before every
        row's window are skipped), whose K/V were appended before.  `softcap` and `sinks` (f32 [n_heads])
        as in attention_decode.
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
        sink_args = self._sinks(sinks, nh)
        name = prefill_name(hd, bq, ext=bool(win or cap2 or sinks is not None))  # the window / softcap / sinks code
        fn = self._fn[name]
        smem = prefill_smem_bytes(hd)
        done = self.__dict__.setdefault("_prefill_smem_set", set())
        if name not in done:  # opt in to more than 48 KiB of dynamic shared memory, once
            fn.max_dynamic_shared_size_bytes = smem
            done.add(name)
        grid = (nh, _ceil_div(T, bq))  # heads vary fastest; the kernel starts the longest blocks first
        args = (
            q, k_cache, v_cache, out, np.int32(T), np.int32(start_pos), np.int32(nh),
            np.int32(n_kv), np.int32(max_ctx), np.float32(float(scale) * LOG2E), win, cap2, *sink_args,
        )
        fn(grid, (bq // 16 * 32,), args, shared_mem=smem, stream=stream)
