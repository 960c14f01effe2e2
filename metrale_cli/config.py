"""The model blueprint: a Hugging Face `config.json` read into one frozen dataclass.

Field names keep the Hugging Face names, so there is no translation layer to get wrong. Both the
transformers 4.x layout (`torch_dtype`, top-level `rope_theta`, `rope_scaling`) and the 5.x layout
(`dtype`, `rope_parameters`) are read. Anything that would change the numbers and that metrale does not
implement is refused with a ConfigError naming the field and its value.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from functools import cached_property
from typing import TYPE_CHECKING, Any

from . import formats
from .errors import CheckpointError, ConfigError
from .models import FAMILIES, Family
from .models.moe import MoeConfig
from .models.spec import ModelDefinition, Rope, RopeScaling

if TYPE_CHECKING:  # numpy is imported where RoPE needs it: the CLI reads configs long before any math
    import numpy as np

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
SUPPORTED_DTYPES = ("bfloat16", "float16", "float32")
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # a key of models.FAMILIES
    vocab_size: int  # rows of the embedding and of lm_head
    hidden_size: int  # residual stream width H
    intermediate_size: int  # SwiGLU width I
    num_hidden_layers: int
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # KV heads (grouped-query attention when fewer than query heads)
    head_dim: int  # explicit in qwen3/mistral configs, else hidden_size // num_attention_heads
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool  # lm_head shares the embedding table
    # Set by the family's parse (models/<family>.py), not read from a field of the same name everywhere:
    attention_bias: bool  # q/k/v projections carry a bias (qwen2 always; llama when attention_bias)
    o_proj_bias: bool  # o_proj carries a bias (llama/qwen3 attention_bias; never qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (qwen3)
    sliding_window: int | None  # the attention window of the layers layer_types marks sliding
    dtype: str  # the checkpoint's declared dtype: bfloat16 | float16 | float32
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    moe: MoeConfig | None = None  # the sparse MLP block and its layers (qwen2_moe, qwen3_moe, mixtral)
    # Per layer "full_attention" or "sliding_attention" (attends to the last sliding_window positions);
    # empty: every layer full. Set by the family's parse (models/windows.py reads the HF fields).
    layer_types: tuple[str, ...] = ()
    options: Any = None  # the family's own parsed fields, a frozen dataclass (e.g. gemma2.GemmaOptions)
    # config.json's quantization_config (formats.py: its quant_method sets each param's weight format)
    quantization: dict[str, Any] | None = field(default=None, hash=False)

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    @cached_property
    def definition(self) -> ModelDefinition:
        """The blocks and tensors the engines run (built once per config by the family module)."""
        return formats.apply(self.family.define(self), self.quantization)

    @property
    def n_rep(self) -> int:
        """Query heads per KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def max_context(self) -> int:
        """The longest context the model is defined for (sliding layers attend to their window of it)."""
        return self.max_position_embeddings

    def window_of(self, layer: int) -> int | None:
        """The attention window of a layer: sliding_window for a sliding layer, None for a full one."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies [head_dim/2] as fp32, with llama3 scaling applied when configured."""
        return Rope(self.rope_theta, self.head_dim, self.rope_scaling).inv_freq()

    def parameter_count(self) -> int:
        return self.definition.parameter_count()


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
    _check_positive(r, "num_key_value_heads", kv_heads)
    head_dim = r.optional("head_dim", int, None)
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(
                f"{source}: hidden_size {hidden} is not divisible by num_attention_heads {heads} "
                "(and no head_dim is given)"
            )
        head_dim = hidden // heads
    _check_positive(r, "head_dim", head_dim)
    if head_dim % 2:
        r.refuse("head_dim", head_dim, "RoPE needs an even head_dim")
    if heads % kv_heads:
        raise ConfigError(
            f"{source}: num_attention_heads {heads} is not divisible by num_key_value_heads {kv_heads}"
        )

    if "rope_theta" not in family_fields:  # families with per-layer or other rope types read their own
        family_fields["rope_theta"], family_fields["rope_scaling"] = _parse_rope(r)
    return ModelConfig(
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
        **family_fields,
    )


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
    return qc


class ConfigReader:
    """Typed access to config fields with one-line errors that name the field and value."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def required(self, key: str, types: type | tuple[type, ...]) -> Any:
        if key not in self.raw:
            raise ConfigError(f"{self.source}: missing required field '{key}'")
        return self._typed(key, self.raw[key], types)

    def optional(self, key: str, types: type | tuple[type, ...], default: Any) -> Any:
        value = self.raw.get(key, default)
        if value is None:
            return default
        return self._typed(key, value, types)

    def positive_int(self, key: str) -> int:
        value = self.required(key, int)
        _check_positive(self, key, value)
        return value

    def refuse(self, key: str, value: Any, why: str) -> None:
        raise ConfigError(f"{self.source}: unsupported {key} {json.dumps(value)}: {why}")

    def _typed(self, key: str, value: Any, types: type | tuple[type, ...]) -> Any:
        types_t = types if isinstance(types, tuple) else (types,)
        # bool is an int in Python; a config that writes `true` for a size is wrong.
        if isinstance(value, bool) and bool not in types_t:
            ok = False
        else:
            ok = isinstance(value, types_t)
        if not ok:
            names = "/".join(t.__name__ for t in types_t)
            raise ConfigError(f"{self.source}: field '{key}' must be {names}, got {json.dumps(value)}")
        return value


def _check_positive(r: ConfigReader, key: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"{r.source}: field '{key}' must be positive, got {value}")


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
