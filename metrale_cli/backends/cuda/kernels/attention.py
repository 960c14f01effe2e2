"""Launch wrappers of attention.cu: flash-decoding attention (split + combine; one row: rope + KV append in the
split kernel)."""

from __future__ import annotations

from typing import Any

from .names import decode_name
from .tuning import (
    ATTN_CHUNK_ALIGN,
    ATTN_COMBINE_BATCH,
    ATTN_TC_WARPS,
    ATTN_WARPS,
    DECODE_HEAD_DIMS,
    DECODE_SIMT_SPLITS,
    DECODE_TC_HEAD_DIMS,
    LOG2E,
    _ceil_div,
    _decode_qb,
)


class AttentionKernels:

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
        sinks: Any = None,
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
        appends k and v to the cache (rope_fits says where it can: no rope_kv_append launch).
        `sinks` f32 [n_heads] (gpt-oss): one learned logit per head joining every row's softmax denominator
        (the combine kernel adds it)."""
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
            *self._sinks(sinks, nh),
        )
        self._launch("attn_decode_combine_kernel", (M * nh,), (hd,), args2, stream)

    def _sinks(self, sinks: Any, n_heads: int) -> tuple:
        """The attention kernels' (sinks, use_sinks) arguments: f32 [n_heads] checked, or a stand-in."""
        if sinks is None:
            return self._dummy, self._np.int32(0)
        self._f32(sinks, "sinks", 1)
        self._shape(sinks, "sinks", (n_heads,))
        return sinks, self._np.int32(1)

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
