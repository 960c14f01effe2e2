"""Mixtral (`MixtralForCausalLM`): Mistral attention with every MLP sparse.

Per token: softmax over `num_local_experts` router logits (`block_sparse_moe.gate`) in fp32, the
`num_experts_per_tok` largest, always renormalised to sum 1; expert e is w2(silu(w1 x) * w3 x)
(w1 = gate, w3 = up, w2 = down) of `intermediate_size`. `sliding_window` is read as mistral reads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import llama, mistral, moe
from .model_config import Family

if TYPE_CHECKING:
    from .model_config import ConfigReader, ModelConfig
    from .spec import ModelDefinition


def parse(r: ConfigReader) -> dict[str, Any]:
    fields = mistral.parse(r)
    moe.refuse_other_routing(r)
    # MixtralConfig's rope_theta default is 1e6, not the 1e4 metrale assumes for an absent field: a config
    # that leaves it out would run with the wrong frequencies, so it is refused.
    params = r.raw.get("rope_parameters")
    if r.raw.get("rope_theta") is None and not (isinstance(params, dict) and params.get("rope_theta") is not None):
        r.refuse("rope_theta", None, "mixtral configs must give rope_theta (transformers' default there is 1e6)")
    layers = r.positive_int("num_hidden_layers")
    return dict(fields, moe=moe.moe_config(
        r, num_experts=moe.positive(r, "num_local_experts", 8), top_k=moe.positive(r, "num_experts_per_tok", 2),
        expert_size=r.positive_int("intermediate_size"), norm_topk_prob=True, sparse_layers=tuple(range(layers))))


def define(cfg: ModelConfig) -> ModelDefinition:
    return moe.define_sparse(cfg, llama.define(cfg), "block_sparse_moe", ("w1", "w3", "w2"))


FAMILY = Family("mixtral", "MixtralForCausalLM", parse, define,
                "Mixtral (top-2 of 8 experts, renormalised; sliding_window as mistral)")
