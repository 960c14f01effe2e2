"""RoPE parameter dicts (a 5.x `rope_parameters` entry or a 4.x `rope_scaling`) read into a `Rope`.

config.py reads the flat default/llama3 layout every Llama-like family uses; the families with more
(Gemma 3: one dict per layer type, `linear` scaling; Phi-3: `longrope`, partial rotary) read theirs here.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .spec import LongRope, Rope, RopeScaling

if TYPE_CHECKING:
    from .model_config import ConfigReader


def rope_type(params: dict[str, Any]) -> str:
    return params.get("rope_type", params.get("type", "default"))


def read_rope(r: ConfigReader, key: str, params: dict[str, Any], theta: float, head_dim: int,
              supported: tuple[str, ...], rotary_dim: int | None = None,
              longrope: LongRope | None = None) -> Rope:
    """A Rope from one parameter dict (`key` names it in errors); `longrope` is built by the caller."""
    kind = rope_type(params)
    if kind not in supported:
        r.refuse(f"{key}.rope_type", kind, f"supported: {', '.join(supported)}")
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ConfigError(f"{r.source}: {key}.rope_theta must be a positive number, got {json.dumps(theta)}")
    if kind == "linear":
        return Rope(float(theta), head_dim, rotary_dim=rotary_dim, linear_factor=_number(r, key, params, "factor"))
    if kind == "llama3":
        scaling = RopeScaling(_number(r, key, params, "factor"), _number(r, key, params, "low_freq_factor"),
                              _number(r, key, params, "high_freq_factor"),
                              int(_number(r, key, params, "original_max_position_embeddings")))
        if scaling.high_freq_factor == scaling.low_freq_factor:
            r.refuse(f"{key}.high_freq_factor", scaling.high_freq_factor, "must differ from low_freq_factor")
        return Rope(float(theta), head_dim, scaling, rotary_dim=rotary_dim)
    return Rope(float(theta), head_dim, rotary_dim=rotary_dim, longrope=longrope if kind == "longrope" else None)


def read_longrope(r: ConfigReader, key: str, params: dict[str, Any], rotary_dim: int, original_max: int,
                  max_position_embeddings: int) -> LongRope:
    """longrope as transformers 5 computes it (_compute_longrope_parameters): factor defaults to
    max_position_embeddings / original_max_position_embeddings, attention_factor to
    sqrt(1 + ln(factor) / ln(original)) (1 when factor <= 1)."""
    factors = []
    for name in ("short_factor", "long_factor"):
        value = params.get(name)
        if not isinstance(value, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                  for x in value):
            raise ConfigError(f"{r.source}: {key}.{name} must be a list of numbers")
        if len(value) != rotary_dim // 2:
            r.refuse(f"{key}.{name}", f"{len(value)} values", f"must have rotary dims / 2 = {rotary_dim // 2}")
        factors.append(tuple(float(x) for x in value))
    if original_max <= 0:
        r.refuse("original_max_position_embeddings", original_max, "must be positive")
    factor = params.get("factor")
    factor = max_position_embeddings / original_max if factor is None else _number(r, key, params, "factor")
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max))
    else:
        attention = _number(r, key, params, "attention_factor")
    return LongRope(factors[0], factors[1], original_max, float(attention))


def _number(r: ConfigReader, key: str, params: dict[str, Any], name: str) -> float:
    if name not in params:
        raise ConfigError(f"{r.source}: {key} of type {rope_type(params)} is missing '{name}'")
    value = params[name]
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"{r.source}: {key}.{name} must be a number, got {json.dumps(value)}")
    return float(value)
