"""The "attention" mixer kind (engine/attention.py) on the CUDA engine: its state, the bf16 KV cache of the
engine's attention layers, and its ops for each pass type, the launches of kernels/attention.cu,
flash_prefill.cu and norm_rope.cu's rope_kv_append:

- `RowsAttention` (RowsPass: decode, verify, short prefills; graph-capturable): rope + KV append in one launch
  (q rotated in place in the qkv row for one row, into the q buffer for more), then split + combine attention;
- `FusedRowsAttention` (FusedRowsPass, the "fused" path): one row rotates q and appends k/v inside the attention
  split kernel where Kernels.rope_fits (rope_kv_append records the arguments, attention launches it); more rows
  take the qkv GEMV with rope + KV append in its last blocks (gemv_qkv_rope), whose operands the pass's
  `linear(out="qkv")` recorded (FusedRowsPass.take_qkv); else as RowsAttention;
- `PrefillAttention` (PrefillPass: long prompts, eager): rope + KV append, then tensor-core flash attention.

An output-gated layer (qwen3_next, qwen3_5: AttentionSpec.output_gate) projects q and its gate per head; its ops set
the gates aside first (`gate_split` into the q | k | v layout the rope kernels read; the fused path takes the
rows path's launches there) and multiply the attention output by their sigmoid (`output_gate`) before o_proj.

Attention sinks (gpt-oss: a `sinks` weight, one logit per head, kept fp32 on the device: loading.FP32_KEYS) join
the softmax in the decode combine kernel and at the end of flash prefill.  Sliding layers keep a full-length cache (the NumPy engine's ring
buffer is not on the GPU); their attention kernels read only the window."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...errors import InputError

if TYPE_CHECKING:
    from ...models.spec import AttentionSpec, Norm

# The weights of an attention sublayer the CUDA kernels compute with (engine/attention.py's keys): a family adding
# another is refused until the kernels take it.
WEIGHT_KEYS = frozenset({"input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "attn_out_norm",
                         "sinks"})


class KVCache:
    """The bf16 K and V of the engine's attention layers: bf16 bits [layers, kv_heads, max_context, head_dim]
    each (`k(layer)`, `v(layer)`: one layer's contiguous view), every position of every layer kept, so a trim
    only moves the engine's length."""

    def __init__(self, cp: Any, layers: list[int], kv_heads: int, max_context: int, head_dim: int,
                 qkv_weights: list[Any] = ()) -> None:
        self.slot = {layer: i for i, layer in enumerate(layers)}
        self._qkv = {id(w) for w in qkv_weights}  # the layers' qkv projections the fused path may fuse (fuses_qkv)
        self.max_context = max_context
        self.keys = cp.zeros((len(layers), kv_heads, max_context, head_dim), cp.uint16)
        self.values = cp.zeros((len(layers), kv_heads, max_context, head_dim), cp.uint16)

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.values.nbytes)

    def fuses_qkv(self, w: Any) -> bool:
        """Whether w is the qkv projection of one of these layers, which the fused path's attention ops launch
        themselves (with rope + KV append: FusedRowsAttention)."""
        return id(w) in self._qkv

    def k(self, layer: int) -> Any:
        return self.keys[self.slot[layer]]

    def v(self, layer: int) -> Any:
        return self.values[self.slot[layer]]

    def reset(self) -> None:
        """Nothing to clear: positions past the engine's length are never read."""

    def trim(self, length: int) -> None:
        """Every position stays in the full-length cache: any length up to max_context can be kept."""
        if not 0 <= length <= self.max_context:
            raise InputError(f"cannot trim the KV cache to {length} positions (it holds {self.max_context})")


def state(engine: Any, layers: list[int]) -> KVCache:
    """The KV cache of `engine`'s attention layers (engine/mixers.py)."""
    cfg = engine.cfg
    fusable = [i for i in layers if not cfg.definition.layers[i].mixer.output_gate]  # gated: q and gate interleaved
    return KVCache(engine.cp, layers, cfg.num_key_value_heads, engine.max_context, cfg.head_dim,
                   [engine.w.layers[i]["qkv"] for i in fusable])


def window(a: AttentionSpec, max_context: int) -> int | None:
    """The window to pass the attention kernels: None when it holds the whole cache (sliding == full)."""
    return a.window if a.window is not None and a.window < max_context else None


class RowsAttention:
    """The rows path's attention over `cache` for the pass `p` (a RowsPass: m rows at positions p.pos)."""

    def __init__(self, p: Any, cache: KVCache) -> None:
        self.p, self.cache = p, cache
        self.e, self.k, self.s = p.e, p.k, p.s

    def plain_qkv(self, qkv, a: AttentionSpec):
        """qkv in the q | k | v layout the rope kernels read: an output-gated layer's gates set aside into the
        plain buffer (the gates stay in qkv for output_gate)."""
        if not a.output_gate:
            return qkv
        plain = self.e.buffers.qkv_plain[:self.p.m]
        self.k.gate_split(qkv, plain, a.num_heads, a.head_dim, stream=self.s)
        return plain

    def output_gate(self, y, qkv, a: AttentionSpec):
        self.k.output_gate(y, qkv, a.num_heads, a.head_dim, stream=self.s)
        return y

    def rope_kv_append(self, qkv, layer: int, a: AttentionSpec, q_norm, k_norm, norm: Norm):
        return self._rope_kv_append(self.plain_qkv(qkv, a), layer, a, q_norm, k_norm, norm)

    def _rope_kv_append(self, qkv, layer: int, a: AttentionSpec, q_norm, k_norm, norm: Norm):
        p, b = self.p, self.e.buffers
        # rotated q: in place in the GEMV output for one row, else its own contiguous buffer
        q = qkv[:, :a.q_size].reshape(1, a.num_heads, a.head_dim) if p.m == 1 else b.q[:p.m]
        self.k.rope_kv_append(qkv, p.pos, self.e.inv_freq(a.rope), q, self.cache.k(layer), self.cache.v(layer),
                              q_norm, k_norm, norm.eps, attention_scaling=a.rope.attention_scaling,
                              norm_offset=norm.offset, rotary_dim=a.rope.dims, stream=self.s)
        return q

    def attention(self, q, layer: int, a: AttentionSpec, *, sinks=None):
        m, b = self.p.m, self.e.buffers
        attn = b.attn[:m]
        self.k.attention_decode(q, self.cache.k(layer), self.cache.v(layer), self.p.pos, attn, a.scale,
                                n_splits=b.splits[m], workspace=b.ws, window=window(a, self.e.max_context),
                                softcap=a.softcap, sinks=sinks, stream=self.s)
        return attn.reshape(m, a.q_size)


class FusedRowsAttention(RowsAttention):
    """The fused path's attention (see the module docstring); values equal RowsAttention's within fp32 rounding
    (the same rope code, rope_kv_slot; the same GEMV).  decoder_forward always calls linear(out="qkv"),
    rope_kv_append and attention in that order."""

    def __init__(self, p: Any, cache: KVCache) -> None:
        super().__init__(p, cache)
        self._rope = None  # one row: rope_kv_append's arguments, for the attention split kernel

    def rope_args(self, a: AttentionSpec, q_norm, k_norm, norm: Norm) -> dict:
        """attention_decode's `rope`: rope_kv_append's arguments for this layer."""
        return dict(inv_freq=self.e.inv_freq(a.rope), q_norm=q_norm, k_norm=k_norm, eps=norm.eps,
                    attention_scaling=a.rope.attention_scaling, norm_offset=norm.offset, rotary_dim=a.rope.dims)

    def rope_kv_append(self, qkv, layer: int, a: AttentionSpec, q_norm, k_norm, norm: Norm):
        p = self.p
        pending = p.take_qkv()
        if pending is None:
            qkv = self.plain_qkv(qkv, a)
            if p.m == 1 and self.k.rope_fits(a.head_dim, a.num_heads, a.num_kv_heads,
                                             window(a, self.e.max_context), a.softcap) is None:
                self._rope = self.rope_args(a, q_norm, k_norm, norm)
                return qkv  # unrotated: attention rotates it
            return self._rope_kv_append(qkv, layer, a, q_norm, k_norm, norm)
        x, w, bias, (nw, nk) = pending
        b = self.e.buffers
        q = b.q[:p.m]
        self.k.gemv_qkv_rope(x, w, bias, nw, qkv, p.pos, self.e.inv_freq(a.rope), q, self.cache.k(layer),
                             self.cache.v(layer), b.qkv_counters, eps=nk.eps, norm_offset=nk.offset, q_norm=q_norm,
                             k_norm=k_norm, rope_eps=norm.eps, attention_scaling=a.rope.attention_scaling,
                             rope_norm_offset=norm.offset, rotary_dim=a.rope.dims, stream=self.s)
        return q

    def attention(self, q, layer: int, a: AttentionSpec, *, sinks=None):
        if self._rope is None:
            return super().attention(q, layer, a, sinks=sinks)
        m, b = self.p.m, self.e.buffers
        attn = b.attn[:m]
        rope, self._rope = self._rope, None  # q: the unrotated qkv row
        self.k.attention_decode(q.reshape(1, -1, a.head_dim), self.cache.k(layer), self.cache.v(layer), self.p.pos,
                                attn, a.scale, n_splits=b.splits[m], workspace=b.ws, rope=rope, sinks=sinks,
                                stream=self.s)
        return attn.reshape(m, a.q_size)


class PrefillAttention:
    """The prefill path's attention over `cache` for the pass `p` (a PrefillPass: p.t rows from p.start, its own
    q and attn chunk buffers)."""

    def __init__(self, p: Any, cache: KVCache) -> None:
        self.p, self.cache = p, cache
        self.e, self.k, self.s = p.e, p.k, p.s

    def rope_kv_append(self, qkv, layer: int, a: AttentionSpec, q_norm, k_norm, norm: Norm):
        p = self.p
        if a.output_gate:  # the gates set aside (they stay in qkv for output_gate)
            plain = self.e.cp.empty((p.t, a.q_size + 2 * a.kv_size), self.e.cp.float32)
            self.k.gate_split(qkv, plain, a.num_heads, a.head_dim, stream=self.s)
            qkv = plain
        # rope on q and k (+ qk norm) and the KV append in one pass over the GEMM output
        self.k.rope_kv_append(qkv, p.pos, self.e.inv_freq(a.rope), p.q, self.cache.k(layer), self.cache.v(layer),
                              q_norm, k_norm, norm.eps, attention_scaling=a.rope.attention_scaling,
                              norm_offset=norm.offset, rotary_dim=a.rope.dims, stream=self.s)
        return p.q

    def attention(self, q, layer: int, a: AttentionSpec, *, sinks=None):
        p = self.p
        self.k.attention_prefill(q, self.cache.k(layer), self.cache.v(layer), p.start, p.t, p.attn, a.scale,
                                 window=window(a, self.e.max_context), softcap=a.softcap, sinks=sinks, stream=self.s)
        return p.attn.reshape(p.t, a.q_size)

    def output_gate(self, y, qkv, a: AttentionSpec):
        self.k.output_gate(y, qkv, a.num_heads, a.head_dim, stream=self.s)
        return y


OPS = {"rows": RowsAttention, "fused": FusedRowsAttention, "prefill": PrefillAttention}


def ops(p: Any, cache: KVCache) -> RowsAttention | PrefillAttention:
    """The attention ops of pass `p` (its `kind`: "rows", "fused" or "prefill") over `cache`."""
    return OPS[p.kind](p, cache)
