"""FP8 (e4m3) weights with block or per-tensor scales: `quantization_config.quant_method == "fp8"`.

As DeepSeek-V3/R1, Kimi-K2, Qwen3-*-FP8, GLM-4.5-FP8 and Mistral ship them (transformers' FineGrainedFP8):
  - `weight` F8_E4M3 [out, in];
  - `weight_scale_inv` [ceil(out / bn), ceil(in / bk)] for `weight_block_size: [bn, bk]` (usually
    [128, 128]; F32 in DeepSeek, BF16 in Qwen3 and Mistral; F8_E8M0 where `scale_fmt` is ue8m0 and the
    scales are stored as exponents), one scale per block, the edge blocks partial; a single scale [] or [1]
    without `weight_block_size`;
  - with `activation_scheme: static`, an `activation_scale` [] beside each weight (the activations' fixed
    e4m3 scale; `--activation-quant emulate` reads it).
The weight's value is `float(weight) * scale` of its block, exact in fp32 (an e4m3 value has a 3-bit
mantissa, a scale at most 8 bits of bf16 or 24 of fp32).

Which weights: every Linear weight ([out, in]) of the decoder except those `modules_to_not_convert` names
(transformers' matching: a dotted prefix, a regex up to a module boundary, or a suffix); the embedding, the
lm_head and the routers stay in the checkpoint's dense dtype (quantized.linear_weight).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..formats import QuantMethod, WeightFormat, register_format, register_quant_method, weight_format
from ..spec import Tensor
from . import activations, e4m3_as_fp32, linear_weight, refuse, scale_as_fp32, skipped_by

SCALE_DTYPES = ("F32", "BF16", "F8_E8M0")


def block_format(block_n: int, block_k: int, *, static: bool = False, ue8m0: bool = False) -> str:
    """The registered format name of FP8 weights with [block_n, block_k] scale blocks (registered on first use).
    `static`: an activation_scale beside each weight; `ue8m0`: dynamic activation scales rounded up to a power
    of two (scale_fmt ue8m0, DeepSeek-V3.1's)."""
    name = f"fp8_block{block_n}x{block_k}" + ("_static" if static else "") + ("_ue8m0" if ue8m0 else "")
    try:
        weight_format(name)
    except KeyError:
        def companions(t: Tensor) -> tuple[Tensor, ...]:
            grid = (-(-t.shape[0] // block_n), -(-t.shape[1] // block_k))
            return (Tensor(t.name + "_scale_inv", grid),) + _activation_scale(t, static)

        register_format(WeightFormat(
            name, companions=companions, dtypes=(("F8_E4M3",), SCALE_DTYPES) + ((("F32", "BF16"),) if static else ()),
            dequantize=lambda w, scale, *_: dequantize_block(w, scale, block_n, block_k),
            input_quant=_static_input if static else lambda x, *_: activations.e4m3_groups(x, block_k, ue8m0),
            input_quant_doc=("e4m3 with the checkpoint's static activation_scale" if static else
                             f"e4m3, dynamic scale per token and {block_k} columns" + (", power of two" if ue8m0 else "")),
            kind="fp8_block", params={"block": (block_n, block_k), "static": static, "ue8m0": ue8m0}, row_slices=True))
    return name


def tensor_format(*, static: bool = False) -> str:
    """The registered format name of FP8 weights with one scale per tensor."""
    name = "fp8_tensor" + ("_static" if static else "")
    try:
        weight_format(name)
    except KeyError:
        register_format(WeightFormat(
            name, companions=lambda t: (Tensor(t.name + "_scale_inv", ()),) + _activation_scale(t, static),
            dtypes=(("F8_E4M3",), SCALE_DTYPES) + ((("F32", "BF16"),) if static else ()),
            dequantize=lambda w, scale, *_: e4m3_as_fp32(w) * scale_as_fp32(scale).reshape(()),
            input_quant=_static_input if static else lambda x, *_: activations.e4m3_groups(x, x.shape[-1]),
            input_quant_doc="e4m3 with the checkpoint's static activation_scale" if static else
            "e4m3, dynamic scale per token",
            kind="fp8_tensor", params={"static": static}, row_slices=True))
    return name


def _static_input(x: np.ndarray, _scale, activation_scale) -> np.ndarray:
    """The checkpoint's static activation_scale s: x' = e4m3(clip(x / s, -448, 448)) * s."""
    return activations.e4m3_static(x, scale_as_fp32(activation_scale).reshape(()))


def _activation_scale(t: Tensor, static: bool) -> tuple[Tensor, ...]:
    return (Tensor(t.name.removesuffix("weight") + "activation_scale", ()),) if static else ()


def dequantize_block(w: np.ndarray, scale: np.ndarray, block_n: int, block_k: int) -> np.ndarray:
    """fp32 [out, in] = e4m3 weight times the scale of its [block_n, block_k] block (partial at the edges)."""
    out = e4m3_as_fp32(w)
    rows, cols = out.shape
    s = scale_as_fp32(scale)
    s = np.repeat(np.repeat(s, block_n, axis=0)[:rows], block_k, axis=1)[:, :cols]
    out *= s
    return out


def _format_of(qc: dict[str, Any], p) -> str | None:
    if not linear_weight(p) or skipped_by(qc.get("modules_to_not_convert"), p):
        return None
    static = qc.get("activation_scheme", "dynamic") == "static"
    block = qc.get("weight_block_size")
    if block is None:
        return tensor_format(static=static)
    return block_format(int(block[0]), int(block[1]), static=static, ue8m0=qc.get("scale_fmt") == "ue8m0")


def _check(qc: dict[str, Any]) -> None:
    block = qc.get("weight_block_size")
    if block is not None and (not isinstance(block, list) or len(block) != 2
                              or not all(isinstance(b, int) and b > 0 for b in block)):
        refuse("weight_block_size", block, "must be two positive integers [block_out, block_in]")
    if qc.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
        refuse("activation_scheme", qc.get("activation_scheme"), "is not dynamic or static")
    if qc.get("scale_fmt", "float") not in ("float", "ue8m0", None):
        refuse("scale_fmt", qc.get("scale_fmt"), "is not float or ue8m0")
    if qc.get("expert_dtype", "fp8") != "fp8":
        refuse("expert_dtype", qc.get("expert_dtype"), "is not implemented (fp8 experts only)")
    if qc.get("fmt", "e4m3") not in ("e4m3", None):
        refuse("fmt", qc.get("fmt"), "is not implemented (e4m3 weights only)")
    if qc.get("modules_to_convert"):
        refuse("modules_to_convert", qc.get("modules_to_convert"), "is not implemented")


register_quant_method(QuantMethod("fp8", _format_of, check=_check))
