"""How engines quantize a matmul's input before multiplying it with quantized weights (`--activation-quant
emulate`): each function maps fp32 x [..., K] to the fp32 values of its quantized form, x' = q * s. The formats
(fp8.py, compressed_tensors.py, modelopt.py) say which one their checkpoints' schemes use and with which scale.

Dynamic scales follow the kernels' and compressed-tensors' `forward_quantize` definitions: s = amax / (the
type's range / 2) per group (448 for e4m3, 127.5 for int8, 6 for e2m1), an all-zero group staying zero;
NVFP4 rounds each group's scale to e4m3 under a global scale that divides it.
"""

from __future__ import annotations

import numpy as np

from . import E4M3_MAX, e4m3, e4m3_as_fp32

NVFP4_GROUP = 16
FP4_BOUNDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)  # between the e2m1 magnitudes
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def e4m3_groups(x: np.ndarray, group: int, ue8m0: bool = False) -> np.ndarray:
    """FP8 dynamic (DeepSeek's act_quant, transformers' FineGrainedFP8, compressed-tensors' token / group
    strategies): per row and `group` consecutive columns (the last group partial; the row's width: per token),
    s = amax / 448 (ue8m0: rounded up to a power of two), x' = e4m3(x / s) * s."""
    x = np.asarray(x, np.float32)
    k = x.shape[-1]
    g = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -k % group)]).reshape(*x.shape[:-1], -1, group)
    s = np.abs(g).max(-1, keepdims=True) / np.float32(E4M3_MAX)
    if ue8m0:
        s = np.exp2(np.ceil(np.log2(np.maximum(s, np.finfo(np.float32).tiny)))).astype(np.float32)
    safe = np.where(s > 0, s, np.float32(1))
    return (e4m3_static(g, safe)).reshape(*x.shape[:-1], -1)[..., :k]


def e4m3_static(x: np.ndarray, s) -> np.ndarray:
    """FP8 with a given scale (a checkpoint's static activation scale): x' = e4m3(clip(x / s, -448, 448)) * s."""
    return e4m3_as_fp32(np.clip(np.asarray(x, np.float32) / s, -E4M3_MAX, E4M3_MAX).astype(e4m3())) * s


def int8_per_token(x: np.ndarray) -> np.ndarray:
    """int8 dynamic symmetric per token: s = amax / 127.5, x' = round_half_even(clip(x / s, -128, 127)) * s."""
    x = np.asarray(x, np.float32)
    s = np.abs(x).max(-1, keepdims=True) / np.float32(127.5)
    return int8_static(x, np.where(s > 0, s, np.float32(1)))


def int8_static(x: np.ndarray, s) -> np.ndarray:
    """int8 with a given scale: x' = round_half_even(clip(x / s, -128, 127)) * s."""
    return np.round(np.clip(np.asarray(x, np.float32) / s, -128, 127)) * s


def round_fp4(v: np.ndarray) -> np.ndarray:
    """The nearest e2m1 value, ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
    3.5 -> 4, 5 -> 4, as compressed-tensors' cast_to_fp4); |v| <= 6 here."""
    a = np.abs(v)
    i = np.searchsorted(FP4_BOUNDS, a, side="left")  # a == a bound: the lower value ...
    up = np.isin(a, FP4_BOUNDS[[1, 3, 5]])  # ... except where the even code is the upper one
    return np.copysign(FP4_VALUES[i + up], v)


def nvfp4(x: np.ndarray, global_scale) -> np.ndarray:
    """NVFP4 (W4A4) per 16 columns under `global_scale` (compressed-tensors' input_global_scale; ModelOpt's
    1 / input_scale): s = e4m3(clip(global * amax / 6, +-448)) (0 -> 0.125), then s / global; x' =
    e2m1(clip(x / s, -6, 6)) * s. The width must be a multiple of 16, as the kernels require."""
    x = np.asarray(x, np.float32)
    if x.shape[-1] % NVFP4_GROUP:
        raise ValueError(f"NVFP4 activations of width {x.shape[-1]} are not groups of {NVFP4_GROUP}")
    g = x.reshape(*x.shape[:-1], -1, NVFP4_GROUP)
    s = e4m3_as_fp32(np.clip(global_scale * (np.abs(g).max(-1, keepdims=True) / np.float32(6)),
                             -E4M3_MAX, E4M3_MAX).astype(e4m3()))
    s = np.where(s == 0, np.float32(0.125), s) / global_scale
    return (round_fp4(np.clip(g / s, -6, 6)) * s).reshape(x.shape)
