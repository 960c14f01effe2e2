"""NVIDIA ModelOpt NVFP4 checkpoints: `quantization_config.quant_method == "modelopt"`, `quant_algo: NVFP4`.

As ModelOpt exports them (the fields may sit under a nested `quantization` dict, as in its hf_quant_config.json):
  - `weight` U8 [out, in / 2]: two e2m1 values a byte, the low nibble first (bit 3 the sign);
  - `weight_scale` F8_E4M3 [out, in / 16]: one scale per 16 values;
  - `weight_scale_2` F32 []: the tensor's second-level scale, which MULTIPLIES (the reciprocal of
    compressed-tensors' `weight_global_scale`);
  - `input_scale` F32 []: the activations' static scale (read by `--activation-quant emulate`).
The value is e2m1 * fp32(weight_scale * weight_scale_2): the per-16 scale first, in fp32, then the product, as a
kernel applies one scale per block. Modules named by `exclude_modules` (or `ignore`: exact names, dotted
prefixes or fnmatch patterns, as vLLM reads them) stay dense. Other `quant_algo`s, a `group_size` other than
16 and a `kv_cache_quant_algo` are refused by name.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

import numpy as np

from ..formats import QuantMethod, WeightFormat, register_format, register_quant_method
from ..spec import Tensor
from . import activations, e4m3, e4m3_as_fp32, linear_weight, module_of, refuse, scale_as_fp32
from .compressed_tensors import NVFP4_GROUP, nvfp4_values


def _fields(qc: dict[str, Any]) -> dict[str, Any]:
    nested = qc.get("quantization")
    return {**qc, **nested} if isinstance(nested, dict) else qc


def _excluded(patterns: list[str], module: str) -> bool:
    return any(module == p or module.startswith(p + ".") or fnmatchcase(module, p) for p in patterns)


def block_scales(scale: np.ndarray, scale_2: np.ndarray) -> np.ndarray:
    """fp32 [out, in / 16]: each block's scale, fp32(weight_scale) * weight_scale_2."""
    return e4m3_as_fp32(scale) * scale_as_fp32(scale_2).reshape(())


def dequantize(packed: np.ndarray, scale: np.ndarray, scale_2: np.ndarray, *_) -> np.ndarray:
    return nvfp4_values(packed) * np.repeat(block_scales(scale, scale_2), NVFP4_GROUP, axis=1)


def _companions(t: Tensor) -> tuple[Tensor, ...]:
    out, cols = t.shape
    base = t.name.removesuffix("weight")
    return (Tensor(t.name + "_scale", (out, cols // NVFP4_GROUP)), Tensor(t.name + "_scale_2", ()),
            Tensor(base + "input_scale", ()))


def input_quant(x: np.ndarray, *companions) -> np.ndarray:
    """The activations as an NVFP4 W4A4 kernel quantizes them: compressed-tensors' NVFP4 definition under the
    global scale 1 / input_scale (vLLM's ModelOpt path: `input_scale_inv`)."""
    return activations.nvfp4(x, np.float32(1) / scale_as_fp32(companions[-1]).reshape(()))


SCALE_2 = 2.0 ** -6  # a random weight's second-level scale: its e4m3 block scales then sit near 1


def draw(rng, i: int, shape: tuple[int, ...], logical: tuple[int, ...]) -> np.ndarray:
    """Random e2m1 pairs, positive e4m3 block scales and scalars such that the weights are about N(0, 1 / fan_in)
    in size; input_scale covers activations up to 8."""
    from .mxfp4 import E2M1_RMS

    fan_in = logical[-1]

    if i == 0:
        return rng.integers(0, 256, shape, dtype=np.uint8)
    if i == 1:
        block = fan_in ** -0.5 / E2M1_RMS / SCALE_2 * rng.uniform(0.8, 1.2, shape)
        return block.astype(np.float32).astype(e4m3())
    return np.full(shape, SCALE_2 if i == 2 else 8.0 / (448 * 6), np.float32)


NVFP4 = register_format(WeightFormat(
    "modelopt_nvfp4", companions=_companions, dtypes=(("U8",), ("F8_E4M3",), ("F32",), ("F32",)),
    dequantize=dequantize, stored=lambda t: Tensor(t.name, (t.shape[0], t.shape[1] // 2)), kind="modelopt_nvfp4",
    row_slices=True, draw=draw,
    input_quant=input_quant,
    input_quant_doc="NVFP4: e2m1 with an e4m3 scale per 16 columns under the global scale 1 / input_scale"))


def _format_of(qc: dict[str, Any], p) -> str | None:
    f = _fields(qc)
    skip = list(f.get("exclude_modules") or []) + list(f.get("ignore") or [])
    hits = [_excluded(skip, module_of(t.name)) for t in p.parts]
    if p.key == "lm_head" and not hits[0]:
        refuse("exclude_modules", skip, "does not name lm_head, which metrale reads dense only")
    if not linear_weight(p) or all(hits):
        return None
    if any(hits):
        refuse("exclude_modules", [module_of(t.name) for t, h in zip(p.parts, hits) if h],
               f"skips part of {p.key}, which metrale multiplies as one weight")
    if p.parts[0].shape[-1] % NVFP4_GROUP:
        refuse("group_size", NVFP4_GROUP, f"does not divide {p.key}'s input width ({p.parts[0].shape[-1]})")
    return NVFP4.name


def _check(qc: dict[str, Any]) -> None:
    f = _fields(qc)
    if f.get("quant_algo") != "NVFP4":
        refuse("quant_algo", f.get("quant_algo"), "is not implemented (NVFP4 only)")
    if f.get("group_size", NVFP4_GROUP) != NVFP4_GROUP:
        refuse("group_size", f.get("group_size"), "is not 16 (NVFP4's block)")
    if f.get("kv_cache_quant_algo") is not None:
        refuse("kv_cache_quant_algo", f.get("kv_cache_quant_algo"), "is not implemented (quantized KV cache)")
    for key in ("exclude_modules", "ignore"):
        if not isinstance(f.get(key) or [], list):
            refuse(key, f.get(key), "must be a list")


register_quant_method(QuantMethod("modelopt", _format_of, check=_check))
