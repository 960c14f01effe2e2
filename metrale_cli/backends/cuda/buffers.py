"""The CUDA engine's preallocated device buffers: what the rows path's passes write (a captured graph reads
and writes the same addresses on every replay), the token ids and positions a replay reads, the logits and
argmax outputs, and the attention workspace.  The KV cache is the attention kind's state (attention.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import DeviceError

MAX_ROWS = 16  # rows the rows path takes (decode, verify k <= 15 plus one, short prefills): the GEMV kernels' M
IO_SLOTS = 4  # pinned host slots the token ids and positions are staged in (Buffers.stage_rows)


def oom_error(cp: Any, what: str, nbytes: int) -> DeviceError:
    """The DeviceError of an out-of-memory while `what`, with what was needed and what is free."""
    free, total = cp.cuda.runtime.memGetInfo()
    need = f"needed {nbytes / 2**20:.0f} MiB more, " if nbytes else ""
    return DeviceError(f"CUDA out of memory {what}: {need}{free / 2**20:.0f} MiB free of {total / 2**20:.0f} MiB")


class Buffers:
    """Allocated once per engine (shapes: R = MAX_ROWS rows, H hidden, V the logits width: a tensor-parallel
    rank's vocabulary rows).  The fused path's last-block counters are allocated when it is first taken."""

    def __init__(self, cp: Any, kern: Any, cfg: Any, max_context: int, vocab_rows: int, fp32_logits: bool) -> None:
        R, H, V = MAX_ROWS, cfg.hidden_size, vocab_rows
        nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        ldt = cp.float32 if fp32_logits else cp.uint16
        self.io = cp.zeros((2, R), cp.int32)  # int32 [2, R]: row 0 token ids, row 1 positions (graph inputs)
        self.x = cp.zeros((R, H), cp.float32)  # f32 [R, H]: the residual stream
        self.h = cp.zeros((R, H), cp.float32)  # f32 [R, H]: normed activations (rows path: the final norm only)
        # f32 [R, q + 2 kv]; with an attention output gate [R, 2 q + 2 kv] (q and its gate per head) and the plain
        # layout the rope kernels read beside it
        gated = any(getattr(layer.mixer, "output_gate", False) for layer in cfg.definition.layers)
        self.qkv = cp.zeros((R, (2 if gated else 1) * cfg.q_size + 2 * cfg.kv_size), cp.float32)
        self.qkv_plain = cp.zeros((R, cfg.q_size + 2 * cfg.kv_size), cp.float32) if gated else None
        self.q = cp.zeros((R, nh, d), cp.float32)  # f32 [R, heads, d]: rotated q when m > 1
        self.attn = cp.zeros((R, nh, d), cp.float32)  # f32 [R, heads, d]: the attention output
        self.act = cp.zeros((R, cfg.intermediate_size), cp.float32)  # f32 [R, I]: the gated MLP's activations
        self.logits32 = cp.zeros((R, V), cp.float32)  # f32 [R, V]: the lm_head's output before bf16 rounding
        self.rows_logits = cp.zeros((R, V), ldt)  # bf16 bits (or f32) [R, V]: the rows path's logits
        self.decode_logits = cp.zeros((1, V), ldt)  # bf16 bits (or f32) [1, V]: a decode step's logits
        self.hidden = cp.zeros((1, H), cp.float32)  # f32 [1, H]: the last row's post-final-norm hidden state
        self.amax = cp.zeros((R,), cp.int32)  # int32 [R]: the argmax of up to R logits rows
        self.decode_amax = cp.zeros((1,), cp.int32)  # int32 [1]: the decode row's argmax, computed in the graph
        # int32 [n + 2 n blocks] per row count n: the split argmax's workspaces (n's counters are the first n
        # elements, where a smaller count's partials would lie; they start at zero and every launch leaves them so)
        self.amax_ws = {m: cp.zeros((max(1, kern.argmax_workspace_size(m, kern.argmax_blocks(m, V))),), cp.int32)
                        for m in range(1, R + 1)}
        # attention splits per row count (fixed in each captured graph; the length is read on the device), and
        # f32 [the largest decode_workspace_size]: the split kernel's partials
        # (a model without attention layers, latent attention's say, has one split of a one-float workspace)
        attention = any(layer.mixer.kind == "attention" for layer in cfg.definition.layers)
        self.splits = {m: kern.decode_splits(max_context, nkv, m, nh, d) if attention else 1 for m in range(1, R + 1)}
        self.ws = cp.zeros(max(kern.decode_workspace_size(m, nh, d, s) for m, s in self.splits.items())
                           if attention else 1, cp.float32)
        # pinned host memory behind io's async copies: IO_SLOTS int32 [2, R] slots, each with the event recorded
        # after the last copy that reads it (stage_rows)
        self.io_host = cp.cuda.alloc_pinned_memory(IO_SLOTS * 2 * R * 4)
        self.io_np = np.frombuffer(self.io_host, np.int32, IO_SLOTS * 2 * R).reshape(IO_SLOTS, 2, R)
        self.io_copied = [cp.cuda.Event(disable_timing=True) for _ in range(IO_SLOTS)]
        self._io_slot = 0
        self.qkv_counters = None  # int32 [max heads + 2 kv heads]: the fused qkv GEMV's last-block counters

    def stage_rows(self, ids: Any, start: int, stream: Any) -> None:
        """Queue the copy of m rows' token ids and positions start..start + m - 1 into `io` on `stream`, from the
        next pinned slot. A copy from pinned memory reads it when the stream reaches it, so the host waits (on that
        slot's event, usually long since passed) until the copy that last read the slot has run before writing it:
        back-to-back decode steps that nobody reads between would otherwise each send the last step's token."""
        i, m = self._io_slot, len(ids)
        self._io_slot = (i + 1) % len(self.io_copied)
        self.io_copied[i].synchronize()
        host = self.io_np[i]
        host[0, :m] = ids
        host[1, :m] = np.arange(start, start + m)
        self.io.set(host, stream=stream)
        self.io_copied[i].record(stream)

    @staticmethod
    def nbytes_estimate(cfg: Any, max_context: int, vocab_rows: int) -> int:
        """About what the buffers and the KV cache need (an out-of-memory message's figure)."""
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * max_context * cfg.head_dim * 2 \
            + MAX_ROWS * vocab_rows * 8
