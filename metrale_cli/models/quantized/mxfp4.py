"""MXFP4 (OCP microscaling FP4) experts: `quantization_config.quant_method == "mxfp4"`, as gpt-oss ships them.

For a stacked expert weight `<name>` of logical shape [E, N, K] (N outputs, K inputs, K a multiple of 32):
  - `<name>_blocks` U8 [E, N, K / 32, 16]: two e2m1 (FP4) values a byte, the low nibble first (k even);
  - `<name>_scales` U8 [E, N, K / 32]: one E8M0 scale per 32 values, 2^(byte - 127).
e2m1 values are {0, 0.5, 1, 1.5, 2, 3, 4, 6} with a sign bit; weight = value * 2^(scale - 127), exact in fp32
(an fp32 holds every such product, subnormal ones included).

Which weights: the stacked experts (experts_gate_up, experts_down) outside `modules_to_not_convert`; gpt-oss
keeps attention, router, embedding and lm_head in bf16.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..formats import QuantMethod, WeightFormat, register_format, register_quant_method
from ..spec import Tensor
from . import refuse, skipped_by

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCK = 32  # values per scale
EXPERT_KEYS = frozenset({"experts_gate_up", "experts_down"})


def _packed(t: Tensor) -> Tensor:
    *lead, k = t.shape
    return Tensor(t.name + "_blocks", (*lead, k // BLOCK, BLOCK // 2))


def _scales(t: Tensor) -> tuple[Tensor, ...]:
    *lead, k = t.shape
    return (Tensor(t.name + "_scales", (*lead, k // BLOCK)),)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """fp32 [..., K] from blocks U8 [..., K / 32, 16] and E8M0 scales U8 [..., K / 32]."""
    b = np.asarray(blocks, np.uint8)
    values = np.empty(b.shape[:-1] + (BLOCK,), np.float32)
    values[..., 0::2] = E2M1[b & 0x0F]
    values[..., 1::2] = E2M1[b >> 4]
    values = np.ldexp(values, np.asarray(scales, np.int32)[..., None] - 127)
    return values.reshape(*b.shape[:-2], -1)


E2M1_RMS = float(np.sqrt(np.mean(E2M1 ** 2)))  # of a random code: 2.93


def draw(rng, i: int, shape: tuple[int, ...], logical: tuple[int, ...]) -> np.ndarray:
    """Random blocks (any byte is two valid codes) and E8M0 scales near fan_in^-0.5 / E2M1_RMS (within a factor
    of two either way), so the weights are about N(0, 1 / fan_in) in size."""
    fan_in = logical[-1]
    if i == 0:
        return rng.integers(0, 256, shape, dtype=np.uint8)
    exponent = 127 + round(float(np.log2(fan_in ** -0.5 / E2M1_RMS)))
    return (exponent + rng.integers(-1, 2, shape)).astype(np.uint8)


MXFP4 = register_format(WeightFormat("mxfp4", companions=_scales, dtypes=(("U8",), ("U8",)), dequantize=dequantize,
                                     stored=_packed, row_slices=True, draw=draw))


def _format_of(qc: dict[str, Any], p) -> str | None:
    if p.key not in EXPERT_KEYS or skipped_by(qc.get("modules_to_not_convert"), p):
        return None
    if any(t.shape[-1] % BLOCK for t in p.parts):
        refuse("quant_method", "mxfp4", f"needs {p.key}'s input width ({p.parts[0].shape[-1]}) to be a multiple of 32")
    return "mxfp4"


register_quant_method(QuantMethod("mxfp4", _format_of))
