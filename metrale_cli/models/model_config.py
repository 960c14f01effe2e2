"""The model blueprint (a Hugging Face `config.json` as one frozen dataclass), the typed reader family modules
parse their fields with, and what a family is. config.py reads config.json into a ModelConfig; a family
module (models/<family>.py) builds a `Family` whose `parse` receives a ConfigReader and whose `define`
receives the ModelConfig. Adding an architecture is one such module and one line in `models/__init__.py`'s
registry; docs/ADDING_AN_ARCHITECTURE.md walks through it.

Field names keep the Hugging Face names, so there is no translation layer to get wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable

from ..errors import ConfigError
from . import formats
from .spec import ModelDefinition, MoeSpec, Rope, RopeScaling

if TYPE_CHECKING:  # numpy is imported where RoPE needs it: the CLI reads configs long before any math
    import numpy as np


@dataclass(frozen=True)
class MoeConfig:
    """The sparse block of a config and where it applies (ModelConfig.moe)."""

    spec: MoeSpec
    sparse_layers: tuple[int, ...]  # layers running `spec`; the others run the dense MLP (intermediate_size)


@dataclass(frozen=True)
class Family:
    model_type: str  # the config.json `model_type` it reads
    hf_class: str  # transformers' causal-LM class (the reference the tests compare with)
    # parse(reader) -> the family's ModelConfig fields (attention_bias, qk_norm, ...); refuses what the
    # family does not implement with the field named.
    parse: Callable[[ConfigReader], dict[str, Any]]
    # define(cfg) -> the blocks and tensors the engines run
    define: Callable[[ModelConfig], ModelDefinition]
    summary: str = ""  # one line for --help, inspect and the README
    # prepare(reader) -> the dict the generic fields are read from, when it is not config.json itself: the
    # family's transformers defaults under the fields a config.json leaves out (Gemma's hub configs omit
    # many), or a multimodal checkpoint's `text_config`. None: config.json as it is.
    prepare: Callable[[ConfigReader], dict[str, Any]] | None = None


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # a key of models.FAMILIES (`family` is its Family)
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
    family: Family | None = field(default=None, compare=False, repr=False)  # models.FAMILIES[model_type]

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
        check_positive(self, key, value)
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


def check_positive(r: ConfigReader, key: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"{r.source}: field '{key}' must be positive, got {value}")
