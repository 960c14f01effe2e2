"""Reading a Hugging Face `config.json` into the model blueprint (models/model_config.ModelConfig).

Field names keep the Hugging Face names, so there is no translation layer to get wrong. Both the
transformers 4.x layout (`torch_dtype`, top-level `rope_theta`, `rope_scaling`) and the 5.x layout
(`dtype`, `rope_parameters`) are read. Anything that would change the numbers and that metrale does not
implement is refused with a ConfigError naming the field and its value.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import CheckpointError, ConfigError
from .models import FAMILIES, formats
from .models.model_config import ConfigReader, ModelConfig, check_positive
from .models.spec import RopeScaling

__all__ = ["ConfigReader", "ModelConfig", "load_config", "parse_config"]

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
SUPPORTED_DTYPES = ("bfloat16", "float16", "float32")
SUPPORTED_ROPE_TYPES = ("default", "llama3")


# --------------------------------------------------------------------------------------------------
# Parsing


def load_config(path: str | Path) -> ModelConfig:
    """Read `config.json` (a file, or the directory holding it)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"{p}: config.json not found")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read ({e.strerror})") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a JSON object, got {type(raw).__name__}")
    return parse_config(raw, source=str(p))


def parse_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    r = ConfigReader(raw, source)
    model_type = r.required("model_type", str)
    if model_type not in FAMILIES:
        r.refuse("model_type", model_type, f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    family = FAMILIES[model_type]
    if family.prepare is not None:  # defaults under the given fields, or a nested text_config
        r = ConfigReader(family.prepare(r), source)
    family_fields = family.parse(r)  # refuses what the family does not implement

    hidden = r.positive_int("hidden_size")
    heads = r.positive_int("num_attention_heads")
    kv_heads = r.optional("num_key_value_heads", int, heads)
    if kv_heads is None:  # some configs write null for "same as heads"
        kv_heads = heads
    check_positive(r, "num_key_value_heads", kv_heads)
    # a family may set it (latent attention: qk_rope_head_dim, as transformers' DeepSeek configs do)
    head_dim = family_fields.pop("head_dim", None) or r.optional("head_dim", int, None)
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(
                f"{source}: hidden_size {hidden} is not divisible by num_attention_heads {heads} "
                "(and no head_dim is given)"
            )
        head_dim = hidden // heads
    check_positive(r, "head_dim", head_dim)
    if head_dim % 2:
        r.refuse("head_dim", head_dim, "RoPE needs an even head_dim")
    if heads % kv_heads:
        raise ConfigError(
            f"{source}: num_attention_heads {heads} is not divisible by num_key_value_heads {kv_heads}"
        )

    if "rope_theta" not in family_fields:  # families with per-layer or other rope types read their own
        family_fields["rope_theta"], family_fields["rope_scaling"] = _parse_rope(r)
    cfg = ModelConfig(
        model_type=model_type,
        vocab_size=r.positive_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=r.positive_int("intermediate_size"),
        num_hidden_layers=r.positive_int("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(r.optional("rms_norm_eps", (int, float), 1e-6)),
        max_position_embeddings=r.optional("max_position_embeddings", int, 2048),
        tie_word_embeddings=r.optional("tie_word_embeddings", bool, False),
        dtype=_parse_dtype(r),
        bos_token_id=_token_id(r, "bos_token_id"),
        eos_token_ids=_eos_ids(r),
        quantization=_quantization(r),
        family=family,
        **family_fields,
    )
    if cfg.quantization is not None:
        try:  # which param is in which format: a skip list that splits a fused weight is refused here
            cfg.definition
        except formats.QuantConfigError as e:
            raise CheckpointError(f"{source}: {e}") from None
    return cfg


def _quantization(r: ConfigReader) -> dict[str, Any] | None:
    """quantization_config, when its quant_method is one metrale reads (formats.py); refused otherwise."""
    qc = r.optional("quantization_config", dict, None)
    if qc is None:
        return None
    method = qc.get("quant_method")
    if formats.quant_method(method) is None:
        known = ", ".join(formats.known_quant_methods()) or "none yet"
        raise CheckpointError(f"{r.source}: quantization_config.quant_method {method!r} is a weight format metrale "
                              f"does not read (supported: {known})")
    try:
        formats.quant_method(method).check(qc)
    except formats.QuantConfigError as e:
        raise CheckpointError(f"{r.source}: {e}") from None
    return qc


def _parse_rope(r: ConfigReader) -> tuple[float, RopeScaling | None]:
    # 5.x: rope_parameters holds rope_type, rope_theta and the scaling keys; 4.x: top-level rope_theta
    # and an optional rope_scaling dict.
    params = r.optional("rope_parameters", dict, None)
    key = "rope_parameters"
    if params is None:
        params = r.optional("rope_scaling", dict, None)
        key = "rope_scaling"
    theta = r.optional("rope_theta", (int, float), None)
    if params is not None and params.get("rope_theta") is not None:
        theta = params["rope_theta"]
    if theta is None:
        theta = 10000.0
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ConfigError(f"{r.source}: rope_theta must be a positive number, got {json.dumps(theta)}")
    if params is None:
        return float(theta), None
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        r.refuse(f"{key}.rope_type", rope_type, f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return float(theta), None
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ConfigError(f"{r.source}: {key} of type llama3 is missing '{e.args[0]}'") from None
    except (TypeError, ValueError):
        raise ConfigError(f"{r.source}: {key} of type llama3 has a non-numeric value") from None
    if scaling.high_freq_factor == scaling.low_freq_factor:
        r.refuse(f"{key}.high_freq_factor", scaling.high_freq_factor, "must differ from low_freq_factor")
    return float(theta), scaling


def _parse_dtype(r: ConfigReader) -> str:
    dtype = r.optional("dtype", str, None) or r.optional("torch_dtype", str, None) or "float32"
    if dtype not in SUPPORTED_DTYPES:
        key = "dtype" if "dtype" in r.raw else "torch_dtype"
        r.refuse(key, dtype, f"supported: {', '.join(SUPPORTED_DTYPES)}")
    return dtype


def _token_id(r: ConfigReader, key: str) -> int | None:
    value = r.raw.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _eos_ids(r: ConfigReader) -> tuple[int, ...]:
    value = r.raw.get("eos_token_id")
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()
