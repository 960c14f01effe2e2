"""RoPE parameter dicts (a 5.x `rope_parameters` entry or a 4.x `rope_scaling`) read into a `Rope`.

config.py reads the flat default/llama3 layout every Llama-like family uses; the families with more
(Gemma 3: one dict per layer type, `linear` scaling; Phi-3: `longrope`, partial rotary; DeepSeek / gpt-oss:
`yarn`) read theirs here.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .spec import LongRope, Rope, RopeScaling, Yarn, yarn_mscale

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
    if kind == "yarn":
        return Rope(float(theta), head_dim, rotary_dim=rotary_dim, yarn=read_yarn(r, key, params))
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


def read_yarn(r: ConfigReader, key: str, params: dict[str, Any]) -> Yarn:
    """YaRN as transformers 5 reads it (standardize_rope_params, then _compute_yarn_parameters): a top-level
    original_max_position_embeddings wins over the dict's, which defaults to max_position_embeddings;
    `factor` must be given, null meaning max_position_embeddings / original; attention_factor, when not
    given, is mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set (non-zero), else
    mscale(factor); beta_fast / beta_slow default (also when 0) to 32 / 1; truncate defaults to true."""
    max_pos = r.optional("max_position_embeddings", int, 2048)
    top = r.raw.get("original_max_position_embeddings")
    original = top if top is not None else params.get("original_max_position_embeddings", max_pos)
    if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        r.refuse(f"{key}.original_max_position_embeddings", original, "must be a positive integer")
    if "factor" not in params:
        raise ConfigError(f"{r.source}: {key} of type yarn is missing 'factor'")
    factor = max_pos / original if params["factor"] is None else _number(r, key, params, "factor")
    if factor <= 0:
        r.refuse(f"{key}.factor", factor, "must be positive")
    mscale = _optional_number(r, key, params, "mscale")
    mscale_all_dim = _optional_number(r, key, params, "mscale_all_dim")
    attention = _optional_number(r, key, params, "attention_factor")
    if attention is None:
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                     else yarn_mscale(factor))
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"{r.source}: {key}.truncate must be true or false, got {json.dumps(truncate)}")
    beta_fast = _optional_number(r, key, params, "beta_fast") or 32.0
    beta_slow = _optional_number(r, key, params, "beta_slow") or 1.0
    return Yarn(float(factor), original, float(attention), float(beta_fast), float(beta_slow), truncate,
                mscale_all_dim or None)


def _optional_number(r: ConfigReader, key: str, params: dict[str, Any], name: str) -> float | None:
    return None if params.get(name) is None else _number(r, key, params, name)


def _number(r: ConfigReader, key: str, params: dict[str, Any], name: str) -> float:
    if name not in params:
        raise ConfigError(f"{r.source}: {key} of type {rope_type(params)} is missing '{name}'")
    value = params[name]
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"{r.source}: {key}.{name} must be a number, got {json.dumps(value)}")
    return float(value)
