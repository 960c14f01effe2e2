"""Qwen3 (`Qwen3ForCausalLM`): the Llama block with a per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import llama, windows
from .model_config import Family

if TYPE_CHECKING:
    from .model_config import ConfigReader


def parse(r: ConfigReader) -> dict[str, Any]:
    llama.refuse_non_swiglu(r)
    bias = r.optional("attention_bias", bool, False)
    return dict(attention_bias=bias, o_proj_bias=bias, qk_norm=True, **windows.qwen_windows(r))


FAMILY = Family("qwen3", "Qwen3ForCausalLM", parse, llama.define, "Qwen3 dense (per-head q/k RMSNorm)")
