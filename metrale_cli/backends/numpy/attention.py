"""The "attention" mixer kind on the NumPy engine (engine/attention.py): rope, the KV cache, softmax
attention with windows, score softcaps and sinks; plain fp32, the reference.

The KV cache keeps one [kv_heads, slots, head_dim] pair per attention layer. Full layers keep every
position (slot = position). A sliding layer keeps `ring_slots` positions (slot = position % slots,
engine/kv_layout.py), so a long context costs it about its window, not the context. `read` hands keys
back in position order, so attention over a ring computes the same sums in the same order as over a
full cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...engine.kv_layout import ring_rollback, ring_slots
from ...errors import InputError
from .ops import apply_rope, rms_norm, sigmoid, softcap

if TYPE_CHECKING:
    from ...models.spec import AttentionSpec, ModelDefinition, Norm


class KVCache:
    """The K and V of every attention layer of `definition` (other kinds' layers hold nothing here)."""

    def __init__(self, definition: ModelDefinition, max_context: int, rows: int,
                 layers: list[int] | None = None) -> None:
        """`rows`: the most positions one pass writes (the engine chunks longer passes); `layers`: the
        attention layers (None: every layer)."""
        layers = range(len(definition.layers)) if layers is None else layers
        specs = {i: definition.layers[i].mixer for i in layers}
        self.max_context = max_context
        self.slots = {i: ring_slots(a.window, max_context, rows) for i, a in specs.items()}
        self.rollback = {i: ring_rollback(a.window, self.slots[i], max_context) for i, a in specs.items()}
        # np.zeros maps pages lazily: an unused tail of a full layer costs no memory
        self.k = {i: np.zeros((a.num_kv_heads, self.slots[i], a.head_dim), np.float32) for i, a in specs.items()}
        self.v = {i: np.zeros_like(k) for i, k in self.k.items()}
        self.written = 0  # one past the highest position written since the last reset

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.k.values(), self.v.values()))

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """k, v [kv_heads, T, d] at positions start..start+T-1."""
        end = start + k.shape[1]
        self.written = max(self.written, end)
        slots = self._slots(layer, start, end)
        self.k[layer][:, slots] = k
        self.v[layer][:, slots] = v

    def read(self, layer: int, lo: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values [kv_heads, end - lo, d] of positions lo..end-1, in position order."""
        slots = self._slots(layer, lo, end)
        return self.k[layer][:, slots], self.v[layer][:, slots]

    def trim(self, length: int) -> None:
        """Refuse a trim to `length` that would need ring positions already overwritten (the positions
        themselves stay: the engine's length says which are valid)."""
        dropped = self.written - length
        for layer, limit in self.rollback.items():
            if limit is not None and dropped > limit:
                raise InputError(
                    f"cannot trim back {dropped} positions: sliding layer {layer} keeps a ring of "
                    f"{self.slots[layer]} positions, which allows dropping at most {limit}")

    def reset(self) -> None:
        self.written = 0

    def _slots(self, layer: int, lo: int, end: int) -> slice | np.ndarray:
        n = self.slots[layer]
        if end <= n:  # no wrap: a view, not a copy
            return slice(lo, end)
        return np.arange(lo, end) % n


def state(engine, layers: list[int]) -> KVCache:
    """The KV cache of `engine`'s attention layers (engine/mixers.py)."""
    return KVCache(engine.cfg.definition, engine.max_context, engine.pass_rows, layers)


class AttentionOps:
    """engine/attention.py's ops for one NumPy pass (`p`: a NumpyPass, whose rows sit at positions
    p.start..p.start+p.t-1) over the cache `cache`."""

    def __init__(self, p, cache: KVCache) -> None:
        self.p, self.cache = p, cache

    def rope_kv_append(self, qkv, layer: int, a: AttentionSpec, q_norm, k_norm, norm: Norm):
        t, d, nkv = self.p.t, a.head_dim, a.num_kv_heads
        qp = a.q_proj_size
        q = qkv[:, :qp].reshape(t, a.num_heads, qp // a.num_heads)[..., :d]  # (T, nh, d); a gate's rows follow
        k = qkv[:, qp:qp + a.kv_size].reshape(t, nkv, d)  # (T, nkv, d)
        v = qkv[:, qp + a.kv_size:].reshape(t, nkv, d)  # (T, nkv, d)
        r = self.p.r
        fine = self.p.fine_taps
        pre = f"model.layers.{layer}.self_attn."
        if q_norm is not None:
            q = rms_norm(q, q_norm, norm.eps, norm.offset, r)
            k = rms_norm(k, k_norm, norm.eps, norm.offset, r)
            if fine:
                self.p.tap(pre + "q_norm", q.reshape(t, -1)), self.p.tap(pre + "k_norm", k.reshape(t, -1))
        cos, sin = self.p.cos_sin(a.rope)
        q, k = apply_rope(q, cos, sin, r), apply_rope(k, cos, sin, r)
        if fine:
            self.p.tap(pre + "q_rope", q.reshape(t, -1)), self.p.tap(pre + "k_rope", k.reshape(t, -1))
        self.cache.write(layer, self.p.start, k.transpose(1, 0, 2), v.transpose(1, 0, 2))  # (nkv, T, d)
        return q

    def attention(self, q, layer: int, a: AttentionSpec, *, sinks=None):
        t, d, nkv, rep, r = self.p.t, a.head_dim, a.num_kv_heads, a.n_rep, self.p.r
        start, end = self.p.start, self.p.start + t
        # A sliding layer reads only the keys some query of this pass can see: (start - window, end).
        lo = 0 if a.window is None else max(0, start - a.window + 1)
        keys, values = self.cache.read(layer, lo, end)  # (nkv, L, d), positions lo..end-1
        n = end - lo
        # Query head h reads KV head h // rep: group the rep query heads of each KV head together.
        qg = q.reshape(t, nkv, rep, d).transpose(1, 2, 0, 3).reshape(nkv, rep * t, d)  # (nkv, rep*T, d)
        scores = r(r(qg @ keys.transpose(0, 2, 1)) * np.float32(a.scale))  # (nkv, rep*T, L)
        if a.softcap is not None:
            scores = softcap(scores, a.softcap, r)
        # query i (position start+i) sees keys in (start+i - window, start+i]
        kpos, qpos = np.arange(lo, end)[None, :], (start + np.arange(t))[:, None]
        hidden = kpos > qpos
        if a.window is not None:
            hidden |= kpos <= qpos - a.window
        if hidden.any():
            scores = scores.reshape(nkv, rep, t, n)
            scores[:, :, hidden] = -np.inf
            scores = scores.reshape(nkv, rep * t, n)
        if sinks is not None:  # one more column per head, its learned logit, dropped after the softmax
            sink = np.repeat(np.asarray(sinks, np.float32).reshape(nkv, rep), t, axis=1)[:, :, None]  # (nkv, rep*T, 1)
            scores = np.concatenate([scores, sink], axis=-1)
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        p = r(p[..., :n])
        return r(p @ values).reshape(nkv, rep, t, d).transpose(2, 0, 1, 3).reshape(t, a.q_size)  # (T, nh*d)

    def output_gate(self, y, qkv, a: AttentionSpec):
        """y [T, heads * d] times sigmoid of each head's gate rows of the doubled q projection."""
        gate = qkv[:, :a.q_proj_size].reshape(self.p.t, a.num_heads, 2 * a.head_dim)[..., a.head_dim:]
        r = self.p.r
        return r(y * r(sigmoid(gate.reshape(self.p.t, a.q_size))))


def ops(p, cache: KVCache) -> AttentionOps:
    return AttentionOps(p, cache)
