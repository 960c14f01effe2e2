"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3 attention (per-head q/k RMSNorm) with sparse MLP layers.

A sparse layer's MLP: softmax over `num_experts` router logits in fp32, the `num_experts_per_tok` largest,
renormalised when `norm_topk_prob`, each chosen expert a SwiGLU of `moe_intermediate_size`. Layers listed
in `mlp_only_layers`, or not on the `decoder_sparse_step` grid, keep the dense MLP of `intermediate_size`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import llama, moe, qwen3
from .model_config import Family

if TYPE_CHECKING:
    from .model_config import ConfigReader, ModelConfig
    from .spec import ModelDefinition

EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def parse(r: ConfigReader) -> dict[str, Any]:
    fields = qwen3.parse(r)
    moe.refuse_other_routing(r)
    return dict(fields, moe=qwen_moe_config(r, experts_default=128, top_k_default=8, size_default=768))


def qwen_moe_config(r: ConfigReader, *, experts_default: int, top_k_default: int, size_default: int,
                    shared_expert_size: int | None = None) -> moe.MoeConfig | None:
    """The Qwen MoE fields, with transformers' defaults when absent. transformers 5.x writes the expert
    count of qwen3_moe as `num_local_experts` (an attribute alias), Hub configs as `num_experts`."""
    key = "num_local_experts" if r.raw.get("num_experts") is None and "num_local_experts" in r.raw else "num_experts"
    experts = r.optional(key, int, experts_default)
    if experts < 0:
        r.refuse(key, experts, "must not be negative")
    sparse = moe.qwen_sparse_layers(r) if experts > 0 else ()  # 0 experts: every layer dense
    return moe.moe_config(r, num_experts=experts, top_k=moe.positive(r, "num_experts_per_tok", top_k_default),
                          expert_size=moe.positive(r, "moe_intermediate_size", size_default),
                          norm_topk_prob=r.optional("norm_topk_prob", bool, False), sparse_layers=sparse,
                          shared_expert_size=shared_expert_size)


def define(cfg: ModelConfig) -> ModelDefinition:
    return moe.define_sparse(cfg, llama.define(cfg), "mlp", EXPERT_NAMES)


FAMILY = Family("qwen3_moe", "Qwen3MoeForCausalLM", parse, define,
                "Qwen3-MoE (softmax top-k experts, norm_topk_prob, dense mlp_only_layers)")
