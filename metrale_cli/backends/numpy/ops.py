"""The NumPy engine's elementwise math, in fp32 as transformers computes it: shared by the engine's
generic ops and by each mixer kind's and router kind's module."""

from __future__ import annotations

import numpy as np

from ...logits import bf16_bits_to_fp32


def as_fp32(a: np.ndarray) -> np.ndarray:
    """A weight as fp32. BF16 tensors are read as their uint16 bit patterns (no ml_dtypes import; no
    runnable checkpoint dtype is stored as U16, so uint16 here always means bf16)."""
    return bf16_bits_to_fp32(a) if a.dtype == np.uint16 else np.array(a, dtype=np.float32)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, offset: float = 0.0) -> np.ndarray:
    """HF RMSNorm over the last axis: (offset + weight) * x / sqrt(mean(x^2) + eps), in fp32."""
    var = np.mean(np.square(x), axis=-1, keepdims=True)
    scale = weight if not offset else np.float32(offset) + weight  # Gemma: 1 + w, in fp32
    return scale * (x / np.sqrt(var + np.float32(eps)))


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate x [T, heads, d] by HF's rotate_half convention; cos/sin are [T, r/2] for the first r dims
    (partial rotary: the dims past r pass through unrotated)."""
    r = 2 * cos.shape[-1]
    half = r // 2
    x1, x2 = x[..., :half], x[..., half:r]
    c, s = cos[:, None, :], sin[:, None, :]  # (T, 1, r/2): broadcast over heads
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., r:]], axis=-1)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """torch's gelu(approximate="tanh") (HF gelu_pytorch_tanh): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    inner = np.float32(np.sqrt(2.0 / np.pi)) * (x + np.float32(0.044715) * x * x * x)
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(inner))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis in fp32 (max subtracted first, as torch does)."""
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """tanh(x / cap) * cap (Gemma 2's attention and final-logit softcapping), in fp32."""
    c = np.float32(cap)
    return np.tanh(x / c) * c


ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}


def glu(kind: str, limit: float | None = None, alpha: float = 1.702):
    """The gated linear unit `kind` (models/spec.GLU_KINDS) as a function of the gate/up product
    gu = [gate | up] [T, 2I] -> [T, I]."""
    if kind == "swiglu_oai":  # gpt-oss: clamped, sigmoid(alpha g), (up + 1)
        lim, a = np.float32(limit), np.float32(alpha)

        def oai(gu: np.ndarray) -> np.ndarray:
            i = gu.shape[1] // 2
            g, u = np.minimum(gu[:, :i], lim), np.clip(gu[:, i:], -lim, lim)
            return g * sigmoid(a * g) * (u + np.float32(1.0))

        return oai
    act = ACTIVATIONS[kind]

    def gated(gu: np.ndarray) -> np.ndarray:
        i = gu.shape[1] // 2
        return act(gu[:, :i]) * gu[:, i:]

    return gated
