"""The built-in weight formats and quant methods (models/formats.py is their registry and says what a format
is): one module per `quantization_config.quant_method`. formats.py imports this package the first time a
format or a quant method is looked up, so a checkpoint without a quantization_config never loads them.

Shared here: which params a quant method may quantize (`linear_weight`), transformers' matching of
`modules_to_not_convert` / `ignore` lists (`skipped_by`), and reading stored scales and e4m3 values as fp32.
activations.py holds how engines quantize a matmul's input (`--activation-quant emulate`), for every format.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np

from ..formats import QuantConfigError

if TYPE_CHECKING:
    from ..spec import Param

# Keys of the Linear weights a quantized checkpoint never quantizes: the embedding and lm_head (kept dense
# for accuracy, as every quantizer does by default), the routers (not Linear modules in transformers) and
# DeepSeek-V3.2's indexer weights_proj (transformers' _keep_in_fp32_modules, which its quantizers skip), and a
# multi-token-prediction layer's eh_proj (models/mtp.py: engines load it as a plain, unquantized Linear, so the
# checkpoints that ship one quantized keep it dense; its block's projections are quantized like the decoder's).
DENSE_KEYS = frozenset({"embed", "lm_head", "router", "idx_w", "mtp_eh_proj"})


def linear_weight(p: Param) -> bool:
    """Whether p is a decoder Linear weight ([out, in] parts) that a quant method may store quantized."""
    return p.key not in DENSE_KEYS and all(len(t.shape) == 2 and t.name.endswith(".weight") for t in p.parts)


def module_of(tensor_name: str) -> str:
    return tensor_name.removesuffix(".weight")


def matches(patterns: list[str] | None, module: str) -> bool:
    """transformers' rule for a module named in a skip list: a dotted prefix ("model.layers.1" matches
    "model.layers.1.mlp", not "model.layers.11"), a regex up to a module boundary ("model.layers.*.mlp.gate"),
    or a suffix ("lm_head"). compressed-tensors' "re:" prefix marks a regex matched the same way."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    for key in patterns or ():
        key = key.removeprefix("re:")
        if module.endswith(key):
            return True
        try:
            if re.match(rf"(?:{key}){boundary}", module):
                return True
        except re.error as e:
            raise QuantConfigError("modules_to_not_convert", key, f"is not a valid pattern ({e})") from None
    return False


def skipped_by(patterns: list[str] | None, p: Param) -> bool:
    """Whether the skip list names p's modules: all of them (p stays dense) or none (p is quantized); a fused
    param whose parts are split between the two (q_proj skipped, k_proj not) is refused."""
    hits = [matches(patterns, module_of(t.name)) for t in p.parts]
    if any(hits) and not all(hits):
        named = [module_of(t.name) for t, hit in zip(p.parts, hits) if hit]
        raise QuantConfigError("modules_to_not_convert", named,
                               f"skips part of {p.key} ({', '.join(module_of(t.name) for t in p.parts)}), "
                               "which metrale multiplies as one weight")
    return bool(hits) and hits[0]


def refuse(field: str, value: Any, why: str) -> None:
    raise QuantConfigError(field, value, why)


def scale_as_fp32(s: np.ndarray) -> np.ndarray:
    """A stored scale as fp32: F32 as is, BF16 (read as its uint16 bits) widened, F8_E8M0 as 2^(e - 127)."""
    s = np.asarray(s)
    if s.dtype == np.uint16:
        return (s.astype(np.uint32) << 16).view(np.float32)
    return s.astype(np.float32)


E4M3_MAX = 448.0


def e4m3_as_fp32(w: np.ndarray) -> np.ndarray:
    """An F8_E4M3 array (ml_dtypes float8_e4m3fn, or its raw bytes as uint8) as fp32, exactly."""
    return np.asarray(w).view(e4m3()).astype(np.float32)


def e4m3():
    """The e4m3 numpy dtype (ml_dtypes', imported where first used: the CPU path of a bf16 model never needs it)."""
    import ml_dtypes

    return ml_dtypes.float8_e4m3fn


from . import fp8, mxfp4  # noqa: E402  (registers their formats; they need the helpers above)
from . import compressed_tensors, modelopt  # noqa: E402  (after fp8 and mxfp4, whose helpers they use)

__all__ = ["compressed_tensors", "fp8", "modelopt", "mxfp4", "E4M3_MAX", "e4m3", "e4m3_as_fp32", "linear_weight", "matches",
           "refuse", "scale_as_fp32", "skipped_by"]
