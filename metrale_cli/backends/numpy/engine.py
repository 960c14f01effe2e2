"""The reference engine: every family's decoder in fp32 NumPy.

It is the oracle the CUDA engine is tested against, and the engine users without a GPU run, so it is
written to be read and to be fast enough: whole heads and rows at once, weights fused and converted to
fp32 once at load, a preallocated KV cache written by position. The block order is engine/loop.py's;
this module implements its ops (`NumpyPass`) plainly, with no fusion.

Passes (all start at the current cache length `self.length`): see engine/protocols.py.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ...config import ModelConfig
from ...engine.loop import Tap, decoder_forward
from ...engine_base import EngineBase, check_context
from ...logits import DevicePtr, bf16_bits_to_fp32, fp32_to_bf16_bits, host_argmax
from ...models.spec import AttentionSpec, MoeSpec, Norm
from ...models.weights import WeightSource, Weights, check_checkpoint, load_weights
from . import moe

# Queries per prefill chunk: bounds the attention scores to heads x chunk x context floats.
PREFILL_CHUNK = 256


def read_weights(cfg: ModelConfig, source: WeightSource, progress: Callable[[int], None] | None = None) -> Weights:
    """Convert the checkpoint to fp32, fusing multi-part params. Each tensor is read once from the memory
    map and its pages released right after, so peak memory stays near the fp32 weights."""
    if not source.made_from_definition:
        check_checkpoint(cfg, source)

    def f32(name: str) -> np.ndarray:
        out = as_fp32(source.array(name, bf16_bits=True))
        source.release(name)
        if progress is not None:
            progress(out.nbytes // 2 if source.info(name).dtype != "F32" else out.nbytes)
        return out

    def mapped(name: str) -> np.ndarray:
        return source.array(name, bf16_bits=True)  # stays memory-mapped: a lookup touches only its rows

    return load_weights(cfg.definition, f32, lambda parts: np.concatenate(parts, axis=0), embed=mapped)


def as_fp32(a: np.ndarray) -> np.ndarray:
    """A weight as fp32. BF16 tensors are read as their uint16 bit patterns (no ml_dtypes import; no
    runnable checkpoint dtype is stored as U16, so uint16 here always means bf16)."""
    return bf16_bits_to_fp32(a) if a.dtype == np.uint16 else np.array(a, dtype=np.float32)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """HF RMSNorm over the last axis: weight * x / sqrt(mean(x^2) + eps), in fp32."""
    var = np.mean(np.square(x), axis=-1, keepdims=True)
    return weight * (x / np.sqrt(var + np.float32(eps)))


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate x [T, heads, d] by HF's rotate_half convention; cos/sin are [T, d/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]  # (T, 1, d/2): broadcast over heads
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


ACTIVATIONS = {"silu": silu}


class NumpyPass:
    """engine/loop.py's ops for one pass of T rows at positions start..start+T-1 (plain NumPy)."""

    def __init__(self, engine: NumpyEngine, ids: np.ndarray, tap: Tap | None = None) -> None:
        self.e, self.ids, self.t, self.start = engine, ids, len(ids), engine.length
        self._tap = tap
        self._rope: dict[object, tuple[np.ndarray, np.ndarray]] = {}

    def embed(self, table) -> np.ndarray:
        return as_fp32(table[self.ids])  # [T, H]

    def linear(self, x, w, bias=None, *, out, norm=None, residual=None, tap=None):
        if norm is not None:
            x = rms_norm(x, norm[0], norm[1].eps)
        y = x @ w.T
        if bias is not None:
            y += bias
        if tap is not None:
            self.tap(tap, y)
        return y if residual is None else residual + y

    def norm(self, x, weight, norm: Norm, *, out):
        return rms_norm(x, weight, norm.eps)

    def gated_mlp(self, x, w_gate_up, *, norm, activation):
        gu = self.linear(x, w_gate_up, out="gate_up", norm=norm)  # [T, 2I]
        i = gu.shape[1] // 2
        return ACTIVATIONS[activation](gu[:, :i]) * gu[:, i:]  # [T, I]

    def route(self, x, w_router, spec: MoeSpec, *, norm):
        return moe.route(rms_norm(x, norm[0], norm[1].eps), w_router, spec)

    def experts(self, x, route, w_gate_up, w_down, spec: MoeSpec, *, norm, shared, tap):
        h = rms_norm(x, norm[0], norm[1].eps)
        act = ACTIVATIONS[spec.activation]
        y = moe.experts(h, route, w_gate_up, w_down, act)
        if shared is not None:  # qwen2_moe: + sigmoid(shared_expert_gate(h)) * shared_expert(h)
            y = y + route.shared_gate * (moe.gated(h, shared[0], act) @ shared[1].T)
        self.tap(tap, y)
        return x + y

    def rope_kv_append(self, qkv, layer: int, a: AttentionSpec, q_norm, k_norm, norm: Norm):
        t, d, nkv = self.t, a.head_dim, a.num_kv_heads
        q = qkv[:, :a.q_size].reshape(t, a.num_heads, d)  # (T, nh, d)
        k = qkv[:, a.q_size:a.q_size + a.kv_size].reshape(t, nkv, d)  # (T, nkv, d)
        v = qkv[:, a.q_size + a.kv_size:].reshape(t, nkv, d)  # (T, nkv, d)
        if q_norm is not None:
            q = rms_norm(q, q_norm, norm.eps)
            k = rms_norm(k, k_norm, norm.eps)
        cos, sin = self._cos_sin(a)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        end = self.start + t
        self.e._k[layer, :, self.start:end] = k.transpose(1, 0, 2)  # (nkv, T, d)
        self.e._v[layer, :, self.start:end] = v.transpose(1, 0, 2)
        return q

    def attention(self, q, layer: int, a: AttentionSpec):
        t, d, nkv, rep = self.t, a.head_dim, a.num_kv_heads, a.n_rep
        start, end = self.start, self.start + t
        keys, values = self.e._k[layer, :, :end], self.e._v[layer, :, :end]  # (nkv, L, d)
        # Query head h reads KV head h // rep: group the rep query heads of each KV head together.
        qg = q.reshape(t, nkv, rep, d).transpose(1, 2, 0, 3).reshape(nkv, rep * t, d)  # (nkv, rep*T, d)
        scores = (qg @ keys.transpose(0, 2, 1)) * np.float32(a.scale)  # (nkv, rep*T, L)
        if t > 1:  # query i (position start+i) sees keys 0..start+i
            future = np.arange(end)[None, :] > (start + np.arange(t))[:, None]  # (T, L)
            scores = scores.reshape(nkv, rep, t, end)
            scores[:, :, future] = -np.inf
            scores = scores.reshape(nkv, rep * t, end)
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        return (p @ values).reshape(nkv, rep, t, d).transpose(2, 0, 1, 3).reshape(t, a.q_size)  # (T, nh*d)

    def tap(self, name: str, x) -> None:
        if self._tap is not None:
            self._tap(name, x)

    def _cos_sin(self, a: AttentionSpec) -> tuple[np.ndarray, np.ndarray]:
        """cos/sin [T, d/2] of this pass's positions, once per distinct rope (layers share it)."""
        if a.rope not in self._rope:
            inv = self.e.inv_freq(a.rope)
            angles = np.arange(self.start, self.start + self.t, dtype=np.float32)[:, None] * inv[None, :]
            self._rope[a.rope] = (np.cos(angles), np.sin(angles))
        return self._rope[a.rope]


class NumpyEngine(EngineBase):
    """The fp32 NumPy engine behind the ModelLogits interface."""

    device = "cpu"

    def __init__(self, cfg: ModelConfig, weights: Weights, max_context: int, fp32_logits: bool = False):
        check_context(cfg, max_context)
        self.cfg = cfg
        self.w = weights
        self.max_context = max_context
        self.length = 0  # positions held in the KV cache
        self._fp32_logits = fp32_logits
        self._inv_freq: dict[object, np.ndarray] = {}  # Rope -> [d/2] fp32
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, max_context, cfg.head_dim)
        self._k = np.zeros(shape, np.float32)  # [L, nkv, ctx, d]; np.zeros maps pages lazily
        self._v = np.zeros(shape, np.float32)
        self._logits_dtype = np.float32 if fp32_logits else np.uint16  # bf16 rows as bit patterns
        self._logits = np.zeros((1, cfg.vocab_size), self._logits_dtype)  # [rows, V], grown on demand
        self._decode_logits = np.zeros((1, cfg.vocab_size), self._logits_dtype)  # [1, V]
        self._hidden = np.zeros((1, cfg.hidden_size), np.float32)  # [1, H]

    def inv_freq(self, rope) -> np.ndarray:
        if rope not in self._inv_freq:
            self._inv_freq[rope] = rope.inv_freq()
        return self._inv_freq[rope]

    # -- passes ------------------------------------------------------------------------------------------
    def prefill(self, tokens: Sequence[int], all_logits: bool = False) -> int:
        """Run the prompt; write every row's logits (all_logits) or only the last row's to the logits
        buffer. Returns the number of rows written."""
        ids = self._check_tokens(tokens)
        rows = []
        for start in range(0, len(ids), PREFILL_CHUNK):
            chunk = ids[start:start + PREFILL_CHUNK]
            last_chunk = start + PREFILL_CHUNK >= len(ids)
            h = self._forward(chunk)
            if all_logits or last_chunk:
                rows.append(h if all_logits else h[-1:])
        self._write_rows(np.concatenate(rows, axis=0))
        return len(ids) if all_logits else 1

    def decode(self, token: int) -> None:
        h = self._forward(self._check_tokens([token]))
        self._decode_logits[:] = self._round_logits(self._lm_head(h))
        self._hidden_rows = h  # [1, H]

    def verify(self, tokens: Sequence[int]) -> int:
        """k draft tokens at the next k positions in one forward; rows [k, vocab] in the logits buffer."""
        ids = self._check_tokens(tokens)
        self._write_rows(self._forward(ids))
        return len(ids)

    # -- the forward ---------------------------------------------------------------------------------------
    def _forward(self, ids: np.ndarray) -> np.ndarray:
        """Run ids [T] at positions length..length+T-1, append their K/V, return the post-final-norm
        hidden states [T, H]. The hidden state of the last position is kept for hidden_after_norm()."""
        h = decoder_forward(NumpyPass(self, ids, self.tap), self.cfg.definition, self.w)
        self.length += len(ids)
        self._hidden[0] = h[-1]
        return h

    def _lm_head(self, h: np.ndarray) -> np.ndarray:
        return h @ self.w.lm_head.T  # [rows, V]

    # -- buffers -------------------------------------------------------------------------------------------
    def _write_rows(self, h: np.ndarray) -> None:
        """lm_head over the post-norm rows h [n, H]; the logits buffer holds exactly these n rows."""
        logits = self._lm_head(h)
        self._hidden_rows = h  # the rows behind these logits (hidden_rows_ptr)
        if self._logits.shape[0] != logits.shape[0]:
            self._logits = np.empty((logits.shape[0], self.cfg.vocab_size), self._logits_dtype)
        self._logits[:] = self._round_logits(logits)
        self._n_rows = logits.shape[0]

    def _round_logits(self, logits: np.ndarray) -> np.ndarray:
        """fp32 logits in the buffers' dtype: kept as they are, or rounded to bf16 (nearest even)."""
        return logits if self._fp32_logits else fp32_to_bf16_bits(logits)

    # -- LogitsBuffers hooks -----------------------------------------------------------------------------
    def _row_to_host(self, ptr: DevicePtr) -> np.ndarray:
        return ptr._buffer[ptr.row]

    def _argmax_rows(self, ptr: DevicePtr, n: int, stream: int) -> np.ndarray:
        rows = ptr._buffer[ptr.row:ptr.row + n]
        return host_argmax(bf16_bits_to_fp32(rows) if rows.dtype == np.uint16 else rows)


def load_numpy_engine(cfg: ModelConfig, source: WeightSource, max_context: int, fp32_logits: bool = False,
                      progress=None) -> NumpyEngine:
    check_context(cfg, max_context)  # refuse before converting gigabytes of weights
    return NumpyEngine(cfg, read_weights(cfg, source, progress), max_context, fp32_logits)
