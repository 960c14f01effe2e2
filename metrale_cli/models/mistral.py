"""Mistral (`MistralForCausalLM`): the Llama block with an attention window (`sliding_window`) on every
layer (MistralForCausalLM ignores `layer_types`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import llama, windows
from .model_config import Family

if TYPE_CHECKING:
    from .model_config import ConfigReader


def parse(r: ConfigReader) -> dict[str, Any]:
    llama.refuse_non_swiglu(r)
    return dict(attention_bias=False, o_proj_bias=False, qk_norm=False, **windows.all_sliding(r))


FAMILY = Family("mistral", "MistralForCausalLM", parse, llama.define, "Mistral (sliding_window)")
