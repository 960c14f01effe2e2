"""Qwen2 (`Qwen2ForCausalLM`): the Llama block with a bias on q/k/v (never on o_proj)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import llama, windows
from .model_config import Family

if TYPE_CHECKING:
    from .model_config import ConfigReader


def parse(r: ConfigReader) -> dict[str, Any]:
    llama.refuse_non_swiglu(r)
    return dict(attention_bias=True, o_proj_bias=False, qk_norm=False, **windows.qwen_windows(r))


FAMILY = Family("qwen2", "Qwen2ForCausalLM", parse, llama.define, "Qwen2 / Qwen2.5 (q/k/v bias)")
