"""The "mla" mixer kind on the NumPy engine (engine/mla.py): DeepSeek's latent attention in fp32, the
reference, in both algebras.

The cache keeps, per latent-attention layer, one row per position: the normed latent c [kv_lora_rank] and
the rotated shared key k_pe [qk_rope_head_dim] (MlaSpec.latent_size floats), as inference engines keep it.
Each pass then attends over those rows in the engine's form (`NumpyEngine.mla`):

- naive (the default, as transformers computes): kv_b_proj decompresses every cached latent into per-head
  keys [k_nope; k_pe] and values, then softmax(q k^T * scale) v;
- absorbed: the query's nope part is folded through kv_b_proj's key rows (q_lat = q_nope W_k, per head,
  [kv_lora_rank]), scores = q_lat . c + q_pe . k_pe over the latents themselves, the probabilities weigh
  the latents (o_lat = p c) and kv_b_proj's value rows map that to the head's output (o_lat W_v^T).

Both are the same sums in another order; they differ by fp32 rounding only (tests/test_mla.py measures it).

With DeepSeek sparse attention's indexer (MlaSpec.indexer, deepseek_v32) the cache also keeps each position's
indexer key [index_head_dim], and each query attends only to the positions the indexer chose for it, in either form.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...engine.mla import FORMS
from ...errors import UsageError
from .ops import apply_rope, layer_norm, rms_norm
from .stored import dense, matmul

if TYPE_CHECKING:
    from ...models.spec import MlaSpec


class LatentCache:
    """The latent rows [max_context, kv_lora_rank + qk_rope_head_dim] of each latent-attention layer, and the
    indexer's keys [max_context, index_head_dim] of the layers with an indexer."""

    def __init__(self, definition, max_context: int, layers: list[int]) -> None:
        # np.zeros maps pages lazily: the unused tail costs no memory
        specs = {i: definition.layers[i].mixer for i in layers}
        self.latent = {i: np.zeros((max_context, m.latent_size), np.float32) for i, m in specs.items()}
        self.index_keys = {i: np.zeros((max_context, m.indexer.head_dim), np.float32)
                           for i, m in specs.items() if m.indexer is not None and not m.indexer.shared}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.latent.values()) + sum(a.nbytes for a in self.index_keys.values())

    def write(self, layer: int, start: int, rows: np.ndarray) -> None:
        self.latent[layer][start:start + len(rows)] = rows

    def read(self, layer: int, end: int) -> np.ndarray:
        return self.latent[layer][:end]

    def trim(self, length: int) -> None:
        """Every position is kept: any trim is honoured (the engine's length says which rows are valid)."""

    def reset(self) -> None:
        pass


def state(engine, layers: list[int]) -> LatentCache:
    """The latent cache of `engine`'s latent-attention layers (engine/mixers.py)."""
    form = getattr(engine, "mla", "naive")
    if form not in FORMS:
        raise UsageError(f"--mla must be one of {', '.join(FORMS)}, got {form!r}")
    return LatentCache(engine.cfg.definition, engine.max_context, layers)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleave: bool, r) -> np.ndarray:
    """RoPE on x [T, heads, rope]. Interleaved pairs (x0, x1), (x2, x3), ... come out as transformers'
    DeepSeek-V3 writes them, the rotated even members first, then the odd ones (q and k alike, so the scores
    are those of the pairs in place); otherwise rotate_half pairs."""
    if interleave:
        x = np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return apply_rope(x, cos, sin, r)


class MlaOps:
    """engine/mla.py's ops for one NumPy pass (`p`: a NumpyPass at positions p.start..p.start+p.t-1)."""

    def __init__(self, p, cache: LatentCache) -> None:
        self.p, self.cache = p, cache
        self.form = getattr(p.e, "mla", "naive")
        self._last_index = None  # the positions the pass's last indexer chose

    def append_latent(self, kv, layer: int, m: MlaSpec, kv_norm):
        r = self.p.r
        latent = rms_norm(kv[:, :m.kv_lora_rank], kv_norm, m.latent_norm.eps, m.latent_norm.offset, r)
        cos, sin = self.p.cos_sin(m.rope)
        k_pe = rotate(kv[:, None, m.kv_lora_rank:], cos, sin, m.rope_interleave, r)[:, 0]
        self.cache.write(layer, self.p.start, np.concatenate([latent, k_pe], axis=-1))
        return latent

    def index(self, q_idx, k_idx, weights, layer: int, m: MlaSpec, k_norm):
        ix, t, r = m.indexer, self.p.t, self.p.r
        cos, sin = self.p.cos_sin(m.rope)
        rope = m.qk_rope_head_dim

        def rotated(x):  # [T, heads, head_dim]: the first rope dims rotated, the rest as they are
            return np.concatenate([rotate(x[..., :rope], cos, sin, ix.interleave, r), x[..., rope:]], axis=-1)

        k = layer_norm(k_idx, k_norm[0], k_norm[1], ix.eps, r)
        end = self.p.start + t
        keys = self.cache.index_keys[layer]
        keys[self.p.start:end] = rotated(k[:, None, :])[:, 0]
        q = rotated(q_idx.reshape(t, ix.num_heads, ix.head_dim)).transpose(1, 0, 2)  # (heads, T, D)
        # the scores in fp32 under --compute bf16 too, as transformers' indexer computes them (q.float(), k.float());
        # `weights` (idx_w's output) is rounded there like every projection's, where transformers keeps
        # weights_proj in fp32: under bf16 this engine's indexer scores differ from transformers' by that rounding
        scores = np.maximum((q @ keys[:end].T) * np.float32(ix.head_dim ** -0.5), np.float32(0))  # (heads, T, L)
        w = weights * np.float32(ix.num_heads ** -0.5)  # (T, heads)
        total = np.einsum("th,htl->tl", w, scores)  # (T, L)
        hidden = self._hidden(t, end)
        total = np.where(hidden, np.float32(-np.inf), total)
        # the best min(topk, end) by score (a stable sort takes a tie's lower position: torch.topk leaves it open),
        # then in ascending order, -1 in place of a position the row may not see, last
        chosen = np.argsort(-total, axis=-1, kind="stable")[:, :min(ix.topk, end)]
        chosen = np.sort(np.where(np.take_along_axis(hidden, chosen, -1), end, chosen), axis=-1)
        self._last_index = np.where(chosen == end, -1, chosen).astype(np.int32)
        return self._last_index

    def last_index(self):
        if self._last_index is None:
            raise ValueError("a shared indexer layer before any layer with its own indexer")
        return self._last_index

    def attention(self, q, layer: int, m: MlaSpec, kv_b, chosen=None):
        t, h, nope, r = self.p.t, m.num_heads, m.qk_nope_head_dim, self.p.r
        q = q.reshape(t, h, m.qk_head_dim)
        cos, sin = self.p.cos_sin(m.rope)
        q_nope = q[..., :nope].transpose(1, 0, 2)  # (h, T, nope)
        q_pe = rotate(q[..., nope:], cos, sin, m.rope_interleave, r).transpose(1, 0, 2)  # (h, T, rope)
        end = self.p.start + t
        rows = self.cache.read(layer, end)  # (L, kv_lora + rope)
        c, k_pe = rows[:, :m.kv_lora_rank], rows[:, m.kv_lora_rank:]
        if self.form == "naive":
            kv = r(matmul(c, kv_b)).reshape(end, h, nope + m.v_head_dim).transpose(1, 0, 2)  # (h, L, nope + v)
            keys = np.concatenate([kv[..., :nope], np.broadcast_to(k_pe, (h,) + k_pe.shape)], axis=-1)
            scores = r(np.concatenate([q_nope, q_pe], axis=-1) @ keys.transpose(0, 2, 1))  # (h, T, L)
            probs = self._softmax(r(scores * np.float32(m.scale)), t, end, chosen)
            y = r(probs @ kv[..., nope:])  # (h, T, v)
        else:
            w = dense(kv_b).reshape(h, nope + m.v_head_dim, m.kv_lora_rank)  # per head: [W_k; W_v]
            q_lat = r(q_nope @ w[:, :nope])  # (h, T, kv_lora): q_nope folded through W_k
            scores = r(r(q_lat @ c.T) + r(q_pe @ k_pe.T))  # (h, T, L)
            probs = self._softmax(r(scores * np.float32(m.scale)), t, end, chosen)
            y = r(r(probs @ c) @ w[:, nope:].transpose(0, 2, 1))  # (h, T, v): the latent mix through W_v
        return y.transpose(1, 0, 2).reshape(t, h * m.v_head_dim)

    def _hidden(self, t: int, end: int) -> np.ndarray:
        """[T, end]: the positions each query at start..start+t-1 may not see (later ones)."""
        return np.arange(end)[None, :] > (self.p.start + np.arange(t))[:, None]

    def _softmax(self, scores: np.ndarray, t: int, end: int, chosen=None) -> np.ndarray:
        """Causal softmax over the keys of positions 0..end-1 for queries at start..start+t-1 (fp32), over only the
        `chosen` positions [T, k] of each row when given."""
        hidden = self._hidden(t, end)
        if chosen is not None:  # -1: no position (a row that sees fewer than topk)
            chosen = np.asarray(chosen, np.int64)
            picked = np.zeros((t, end + 1), bool)
            np.put_along_axis(picked, np.where(chosen < 0, end, chosen), True, axis=-1)
            hidden |= ~picked[:, :end]
        if hidden.any():
            scores = np.where(hidden, np.float32(-np.inf), scores)
        scores = scores - scores.max(axis=-1, keepdims=True)
        e = np.exp(scores)
        return self.p.r(e / e.sum(axis=-1, keepdims=True))


def ops(p, cache: LatentCache) -> MlaOps:
    return MlaOps(p, cache)
