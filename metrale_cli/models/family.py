"""A family: how one Hugging Face `model_type` is read from config.json and what model it defines.

Adding an architecture is one module that builds a `Family` (see llama.py, qwen3.py) and one line in
`models/__init__.py`'s registry; docs/ADDING_AN_ARCHITECTURE.md walks through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from .model_config import ConfigReader, ModelConfig
    from .spec import ModelDefinition


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
