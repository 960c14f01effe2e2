"""Qwen2 (`Qwen2ForCausalLM`): the Llama block with a bias on q/k/v (never on o_proj)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import llama
from .family import Family

if TYPE_CHECKING:
    from ..config import ConfigReader


def parse(r: ConfigReader) -> dict[str, Any]:
    llama.refuse_non_swiglu(r)
    return dict(attention_bias=True, o_proj_bias=False, qk_norm=False, sliding_window=sliding_window(r))


def sliding_window(r: ConfigReader) -> int | None:
    """Qwen configs carry a `sliding_window` that applies only when `use_sliding_window` is true."""
    window = r.optional("sliding_window", int, None)
    return window if r.optional("use_sliding_window", bool, False) else None


FAMILY = Family("qwen2", "Qwen2ForCausalLM", parse, llama.define, "Qwen2 / Qwen2.5 (q/k/v bias)")
