"""Mistral (`MistralForCausalLM`): the Llama block with an attention window (`sliding_window`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import llama
from .family import Family

if TYPE_CHECKING:
    from ..config import ConfigReader


def parse(r: ConfigReader) -> dict[str, Any]:
    llama.refuse_non_swiglu(r)
    return dict(attention_bias=False, o_proj_bias=False, qk_norm=False,
                sliding_window=r.optional("sliding_window", int, None))


FAMILY = Family("mistral", "MistralForCausalLM", parse, llama.define, "Mistral (sliding_window)")
