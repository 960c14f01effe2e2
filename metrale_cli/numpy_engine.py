"""The reference engine: a Llama-family decoder in fp32 NumPy.

It is the oracle the CUDA engine is tested against, and the engine users without a GPU run, so it is
written to be read and to be fast enough: whole heads and rows at once, weights fused and converted to
fp32 once at load, a preallocated KV cache written by position.

Passes (all start at the current cache length `self.length`):
    prefill(tokens)   the prompt in one forward (chunked so scratch memory stays bounded)
    decode(token)     one token; its logits row goes to the decode buffer
    verify(tokens)    k tokens in one forward; [k, vocab] rows go to the logits buffer
    trim(length)      keep only the first `length` cached positions (rolls back rejected drafts)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .checkpoint import Checkpoint
from .config import ModelConfig
from .engine_base import EngineBase, check_context
from .logits import DevicePtr, bf16_bits_to_fp32, fp32_to_bf16_bits, host_argmax
from .weights import EMBED, FINAL_NORM, LM_HEAD, check_checkpoint, layer_names

# Queries per prefill chunk: bounds the attention scores to heads x chunk x context floats.
PREFILL_CHUNK = 256


@dataclass
class LayerWeights:
    input_norm: np.ndarray  # [H]
    wqkv: np.ndarray  # [q + 2 kv, H]  q, k, v projections fused along the output axis
    bqkv: np.ndarray | None  # [q + 2 kv]
    q_norm: np.ndarray | None  # [head_dim] (qwen3)
    k_norm: np.ndarray | None  # [head_dim]
    wo: np.ndarray  # [H, q]
    bo: np.ndarray | None  # [H]
    post_norm: np.ndarray  # [H]
    w_gate_up: np.ndarray  # [2 I, H]  gate then up, fused
    w_down: np.ndarray  # [H, I]


@dataclass
class Weights:
    embed: np.ndarray  # [V, H] in the checkpoint's dtype, BF16 as uint16 bits (rows converted on lookup)
    layers: list[LayerWeights]
    final_norm: np.ndarray  # [H]
    lm_head: np.ndarray  # [V, H] fp32 (the embedding itself when tied)

    def embed_rows(self, ids: np.ndarray) -> np.ndarray:
        """The embedding rows of ids as fp32 [T, H]."""
        return _fp32(self.embed[ids])


def _fp32(a: np.ndarray) -> np.ndarray:
    """A weight as fp32. BF16 tensors are read as their uint16 bit patterns (no ml_dtypes import; no
    runnable checkpoint dtype is stored as U16, so uint16 here always means bf16)."""
    return bf16_bits_to_fp32(a) if a.dtype == np.uint16 else np.array(a, dtype=np.float32)


def load_weights(cfg: ModelConfig, ckpt: Checkpoint, progress=None) -> Weights:
    """Convert the checkpoint to fp32, fusing q/k/v and gate/up. Each tensor is read once from the
    memory map and its pages released right after, so peak memory stays near the fp32 weights."""
    check_checkpoint(cfg, ckpt)

    def f32(name: str | None) -> np.ndarray | None:
        if name is None:
            return None
        out = _fp32(ckpt.array(name, bf16_bits=True))
        ckpt.release(name)
        if progress is not None:
            progress(out.nbytes // 2 if ckpt.info(name).dtype != "F32" else out.nbytes)
        return out

    def fused(*names: str | None) -> np.ndarray | None:
        if names[0] is None:
            return None
        return np.concatenate([f32(n) for n in names], axis=0)

    layers = []
    for i in range(cfg.num_hidden_layers):
        n = layer_names(cfg, i)
        layers.append(LayerWeights(
            input_norm=f32(n.input_norm),
            wqkv=fused(n.q, n.k, n.v),
            bqkv=fused(n.q_bias, n.k_bias, n.v_bias),
            q_norm=f32(n.q_norm),
            k_norm=f32(n.k_norm),
            wo=f32(n.o),
            bo=f32(n.o_bias),
            post_norm=f32(n.post_norm),
            w_gate_up=fused(n.gate, n.up),
            w_down=f32(n.down),
        ))
    if cfg.tie_word_embeddings:
        lm_head = f32(EMBED)
        embed = lm_head  # one fp32 table serves both
    else:
        lm_head = f32(LM_HEAD)
        embed = ckpt.array(EMBED, bf16_bits=True)  # stays memory-mapped: a lookup touches only its rows
    return Weights(embed=embed, layers=layers, final_norm=f32(FINAL_NORM), lm_head=lm_head)


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
        self._inv_freq = cfg.inv_freq()  # [d/2] fp32
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, max_context, cfg.head_dim)
        self._k = np.zeros(shape, np.float32)  # [L, nkv, ctx, d]; np.zeros maps pages lazily
        self._v = np.zeros(shape, np.float32)
        self._logits_dtype = np.float32 if fp32_logits else np.uint16  # bf16 rows as bit patterns
        self._logits = np.zeros((1, cfg.vocab_size), self._logits_dtype)  # [rows, V], grown on demand
        self._decode_logits = np.zeros((1, cfg.vocab_size), self._logits_dtype)  # [1, V]
        self._hidden = np.zeros((1, cfg.hidden_size), np.float32)  # [1, H]

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

    def verify(self, tokens: Sequence[int]) -> int:
        """k draft tokens at the next k positions in one forward; rows [k, vocab] in the logits buffer."""
        ids = self._check_tokens(tokens)
        self._write_rows(self._forward(ids))
        return len(ids)

    # -- the forward ---------------------------------------------------------------------------------------
    def _forward(self, ids: np.ndarray) -> np.ndarray:
        """Run ids [T] at positions length..length+T-1, append their K/V, return the post-final-norm
        hidden states [T, H]. The hidden state of the last position is kept for hidden_after_norm()."""
        cfg = self.cfg
        t, start = len(ids), self.length
        x = self.w.embed_rows(ids)  # [T, H]
        angles = np.arange(start, start + t, dtype=np.float32)[:, None] * self._inv_freq[None, :]
        cos, sin = np.cos(angles), np.sin(angles)  # [T, d/2]
        for li, lw in enumerate(self.w.layers):
            x = x + self._attention(li, lw, rms_norm(x, lw.input_norm, cfg.rms_norm_eps), cos, sin)
            x = x + self._mlp(lw, rms_norm(x, lw.post_norm, cfg.rms_norm_eps))
        self.length = start + t
        h = rms_norm(x, self.w.final_norm, cfg.rms_norm_eps)
        self._hidden[0] = h[-1]
        return h

    def _attention(self, li: int, lw: LayerWeights, x: np.ndarray, cos: np.ndarray, sin: np.ndarray):
        cfg = self.cfg
        t, d, nkv, rep = x.shape[0], cfg.head_dim, cfg.num_key_value_heads, cfg.n_rep
        qkv = x @ lw.wqkv.T  # [T, q + 2 kv]
        if lw.bqkv is not None:
            qkv += lw.bqkv
        q = qkv[:, :cfg.q_size].reshape(t, cfg.num_attention_heads, d)  # (T, nh, d)
        k = qkv[:, cfg.q_size:cfg.q_size + cfg.kv_size].reshape(t, nkv, d)  # (T, nkv, d)
        v = qkv[:, cfg.q_size + cfg.kv_size:].reshape(t, nkv, d)  # (T, nkv, d)
        if lw.q_norm is not None:
            q = rms_norm(q, lw.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        start = self.length
        end = start + t
        self._k[li, :, start:end] = k.transpose(1, 0, 2)  # (nkv, T, d)
        self._v[li, :, start:end] = v.transpose(1, 0, 2)
        keys, values = self._k[li, :, :end], self._v[li, :, :end]  # (nkv, L, d)

        # Query head h reads KV head h // rep: group the rep query heads of each KV head together.
        qg = q.reshape(t, nkv, rep, d).transpose(1, 2, 0, 3).reshape(nkv, rep * t, d)  # (nkv, rep*T, d)
        scores = (qg @ keys.transpose(0, 2, 1)) * np.float32(d ** -0.5)  # (nkv, rep*T, L)
        if t > 1:  # query i (position start+i) sees keys 0..start+i
            future = np.arange(end)[None, :] > (start + np.arange(t))[:, None]  # (T, L)
            scores = scores.reshape(nkv, rep, t, end)
            scores[:, :, future] = -np.inf
            scores = scores.reshape(nkv, rep * t, end)
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        out = (p @ values).reshape(nkv, rep, t, d).transpose(2, 0, 1, 3).reshape(t, cfg.q_size)  # (T, nh*d)
        out = out @ lw.wo.T  # [T, H]
        if lw.bo is not None:
            out += lw.bo
        return out

    def _mlp(self, lw: LayerWeights, x: np.ndarray) -> np.ndarray:
        gu = x @ lw.w_gate_up.T  # [T, 2I]
        i = gu.shape[1] // 2
        return (silu(gu[:, :i]) * gu[:, i:]) @ lw.w_down.T  # [T, H]

    def _lm_head(self, h: np.ndarray) -> np.ndarray:
        return h @ self.w.lm_head.T  # [rows, V]

    # -- buffers -------------------------------------------------------------------------------------------
    def _write_rows(self, h: np.ndarray) -> None:
        """lm_head over the post-norm rows h [n, H]; the logits buffer holds exactly these n rows."""
        logits = self._lm_head(h)
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


def load_numpy_engine(cfg: ModelConfig, ckpt: Checkpoint, max_context: int, fp32_logits: bool = False,
                      progress=None) -> NumpyEngine:
    check_context(cfg, max_context)  # refuse before converting gigabytes of weights
    return NumpyEngine(cfg, load_weights(cfg, ckpt, progress), max_context, fp32_logits)
