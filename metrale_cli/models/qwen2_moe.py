"""Qwen2-MoE (`Qwen2MoeForCausalLM`, Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention (q/k/v bias) with sparse
MLP layers that add a shared expert, scaled per token by sigmoid(shared_expert_gate(x)), to the routed ones.

Routing as qwen3_moe (softmax in fp32, top-k, renormalised when `norm_topk_prob`, default false); the
shared expert is a SwiGLU of `shared_expert_intermediate_size`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import llama, moe, windows
from .model_config import Family
from .qwen3_moe import EXPERT_NAMES, qwen_moe_config

if TYPE_CHECKING:
    from .model_config import ConfigReader, ModelConfig
    from .spec import ModelDefinition


def parse(r: ConfigReader) -> dict[str, Any]:
    llama.refuse_non_swiglu(r)
    moe.refuse_other_routing(r)
    bias = r.optional("qkv_bias", bool, True)  # a transformers 5 field; earlier configs always had the bias
    shared = moe.positive(r, "shared_expert_intermediate_size", 5632)
    return dict(attention_bias=bias, o_proj_bias=False, qk_norm=False, **windows.qwen_windows(r),
                moe=qwen_moe_config(r, experts_default=60, top_k_default=4, size_default=1408,
                                    shared_expert_size=shared))


def define(cfg: ModelConfig) -> ModelDefinition:
    return moe.define_sparse(cfg, llama.define(cfg), "mlp", EXPERT_NAMES)


FAMILY = Family("qwen2_moe", "Qwen2MoeForCausalLM", parse, define,
                "Qwen2-MoE / Qwen1.5-MoE (top-k experts plus a sigmoid-gated shared expert)")
