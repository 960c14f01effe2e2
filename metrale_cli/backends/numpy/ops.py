"""The NumPy engine's elementwise math, in fp32 as transformers computes it: shared by the engine's
generic ops and by each mixer kind's and router kind's module."""

from __future__ import annotations

import numpy as np

from ...logits import bf16_bits_to_fp32, fp32_to_bf16_bits


def keep(x: np.ndarray) -> np.ndarray:
    """fp32 compute: values are kept as computed."""
    return x


def round_bf16(x: np.ndarray) -> np.ndarray:
    """bf16 compute: an fp32 array rounded to the nearest bf16 (ties to even), kept as fp32 values."""
    return bf16_bits_to_fp32(fp32_to_bf16_bits(x))


# How the NumPy engine rounds its intermediate values (`NumpyEngine(compute=)`): "fp32" keeps them (the
# reference), "bf16" rounds each to bf16 where transformers' bf16 forward produces a bf16 tensor, so a bf16
# engine is compared with like (every op below takes the rounding as `r`).
ROUNDING = {"fp32": keep, "bf16": round_bf16}


def as_fp32(a: np.ndarray) -> np.ndarray:
    """A weight as fp32. BF16 tensors are read as their uint16 bit patterns (no ml_dtypes import; no
    runnable checkpoint dtype is stored as U16, so uint16 here always means bf16)."""
    return bf16_bits_to_fp32(a) if a.dtype == np.uint16 else np.array(a, dtype=np.float32)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, offset: float = 0.0, r=keep) -> np.ndarray:
    """HF RMSNorm over the last axis: (offset + weight) * x / sqrt(mean(x^2) + eps), in fp32. Under bf16
    rounding as transformers computes it: Llama's norm rounds x / rms before the weight multiplies it,
    Gemma's (1 + w) norm rounds only its fp32 result."""
    var = np.mean(np.square(x), axis=-1, keepdims=True)
    normed = x / np.sqrt(var + np.float32(eps))
    if offset:
        return r((np.float32(offset) + weight) * normed)  # Gemma: 1 + w, in fp32
    return r(weight * r(normed))


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float, r=keep) -> np.ndarray:
    """torch's LayerNorm over the last axis, (x - mean) / sqrt(var + eps) * weight + bias (biased var), in fp32."""
    centred = x - np.mean(x, axis=-1, keepdims=True)
    var = np.mean(np.square(centred), axis=-1, keepdims=True)
    return r(weight * (centred / np.sqrt(var + np.float32(eps))) + bias)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, r=keep) -> np.ndarray:
    """Rotate x [T, heads, d] by HF's rotate_half convention, x * cos + rotate_half(x) * sin; cos/sin are
    [T, n/2] for the first n dims (partial rotary: the dims past n pass through unrotated)."""
    n = 2 * cos.shape[-1]
    half = n // 2
    x1, x2 = x[..., :half], x[..., half:n]
    c, s = r(cos[:, None, :]), r(sin[:, None, :])  # (T, 1, n/2): broadcast over heads
    return np.concatenate([r(r(x1 * c) - r(x2 * s)), r(r(x2 * c) + r(x1 * s)), x[..., n:]], axis=-1)


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


def softcap(x: np.ndarray, cap: float, r=keep) -> np.ndarray:
    """tanh(x / cap) * cap (Gemma 2's attention and final-logit softcapping), in fp32."""
    c = np.float32(cap)
    return r(r(np.tanh(r(x / c))) * c)


ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}


def glu(kind: str, limit: float | None = None, alpha: float = 1.702, r=keep):
    """The gated linear unit `kind` (models/spec.GLU_KINDS) as a function of the gate/up product
    gu = [gate | up] [T, 2I] -> [T, I]."""
    if kind == "swiglu_oai":  # gpt-oss: clamped, sigmoid(alpha g), (up + 1)
        lim, a = np.float32(limit), np.float32(alpha)

        def oai(gu: np.ndarray) -> np.ndarray:
            i = gu.shape[1] // 2
            g, u = np.minimum(gu[:, :i], lim), np.clip(gu[:, i:], -lim, lim)
            return r(r(g * r(sigmoid(r(a * g)))) * r(u + np.float32(1.0)))

        return oai
    act = ACTIVATIONS[kind]

    def gated(gu: np.ndarray) -> np.ndarray:
        i = gu.shape[1] // 2
        return r(r(act(gu[:, :i])) * gu[:, i:])

    return gated


class InputQuantized:
    """A weight whose products quantize their input first, as the checkpoint's scheme says an engine does
    (`--activation-quant emulate`: models/formats.WeightFormat.input_quant). It wraps any weight the products
    take (an fp32 array, a stored weight); one expert of a stack (`w[e]`) keeps the quantization."""

    def __init__(self, w, input_quant) -> None:
        self.w, self.input_quant = w, input_quant

    @property
    def shape(self) -> tuple[int, ...]:
        return self.w.shape

    @property
    def dtype(self):
        return getattr(self.w, "dtype", np.dtype(np.float32))

    def matmul(self, x: np.ndarray) -> np.ndarray:
        from .stored import matmul

        return matmul(self.input_quant(x), self.w)

    def __getitem__(self, index) -> "InputQuantized":
        return InputQuantized(self.w[index], self.input_quant)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:  # the values, for algebra that reshapes a weight
        return np.asarray(self.w, dtype)
