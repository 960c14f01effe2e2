"""Qwen3.5 (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`, and the language model of the multimodal
`Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration` checkpoints, run on text alone):
Qwen3-Next's hybrid block (qwen3_next.py) with these differences that change the reading:

- the linear layers' input projections are four plain tensors, `in_proj_qkv` [q | k | v], `in_proj_z`,
  `in_proj_b`, `in_proj_a`, not Qwen3-Next's head-grouped `in_proj_qkvz` / `in_proj_ba`;
- qwen3_5 is dense: every layer a SwiGLU of `intermediate_size`;
- qwen3_5_moe makes every layer sparse (no `decoder_sparse_step` / `mlp_only_layers`) and always
  renormalises the top-k weights (its router has no `norm_topk_prob`), with Qwen3-Next's gated shared expert;
- the rope is multimodal (`mrope_section`): on a text-only prompt its three position rows are equal, which
  rotates exactly as the plain partial rope does;
- the multimodal checkpoints keep the decoder under `model.language_model.` (the head at `lm_head`) and the
  vision tower under `model.visual.` (never read); their `text_config` is the model's config.
Everything else (gated full attention, (1 + w) norms, RMSNormGated, the gated delta rule) is Qwen3-Next's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import moe, qwen3_next
from .model_config import Family

if TYPE_CHECKING:
    from .model_config import ConfigReader

# transformers' Qwen3_5TextConfig / Qwen3_5MoeTextConfig defaults over Qwen3-Next's
DENSE_DEFAULTS = {**qwen3_next.DEFAULTS, "num_key_value_heads": 4}
MOE_DEFAULTS = {**qwen3_next.DEFAULTS, "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                "shared_expert_intermediate_size": 512}
OUTER_FIELDS = ("dtype", "torch_dtype", "tie_word_embeddings", "eos_token_id", "bos_token_id")
MULTIMODAL_PREFIX = "model.language_model."


def _prepare(defaults: dict[str, Any], multimodal: bool):
    def prepare(r: ConfigReader) -> dict[str, Any]:
        if not multimodal:
            fields = {**defaults, **r.raw}
        else:
            text = r.required("text_config", dict)
            fields = {**defaults, **text, **{k: r.raw[k] for k in OUTER_FIELDS if k in r.raw},
                      "model_type": r.raw["model_type"]}
        if "num_experts" in defaults:  # no dense layer: intermediate_size is only reported
            fields.setdefault("intermediate_size", fields["moe_intermediate_size"])
        return fields
    return prepare


def _parse_dense(multimodal: bool):
    def parse(r: ConfigReader) -> dict[str, Any]:
        return qwen3_next.parse_hybrid(r, grouped=False, prefix=MULTIMODAL_PREFIX if multimodal else "model.")
    return parse


def _parse_moe(multimodal: bool):
    def parse(r: ConfigReader) -> dict[str, Any]:
        fields = qwen3_next.parse_hybrid(r, grouped=False, prefix=MULTIMODAL_PREFIX if multimodal else "model.")
        moe.refuse_other_routing(r)
        if r.raw.get("norm_topk_prob") is False:
            r.refuse("norm_topk_prob", False, "Qwen3.5-MoE always renormalises the top-k weights")
        for key in ("mlp_only_layers", "decoder_sparse_step"):
            if r.raw.get(key) not in (None, [], 1):
                r.refuse(key, r.raw[key], "Qwen3.5-MoE makes every layer sparse (transformers ignores it)")
        experts = moe.positive(r, "num_experts", 256)
        layers = tuple(range(r.positive_int("num_hidden_layers")))
        return dict(fields, moe=moe.moe_config(
            r, num_experts=experts, top_k=moe.positive(r, "num_experts_per_tok", 8),
            expert_size=moe.positive(r, "moe_intermediate_size", 512), norm_topk_prob=True, sparse_layers=layers,
            shared_expert_size=moe.positive(r, "shared_expert_intermediate_size", 512)))
    return parse


TEXT_FAMILY = Family("qwen3_5_text", "Qwen3_5ForCausalLM", _parse_dense(False), qwen3_next.define,
                     "Qwen3.5 dense (Qwen3-Next's hybrid block, flat linear-attention projections)",
                     prepare=_prepare(DENSE_DEFAULTS, False))
MULTIMODAL_FAMILY = Family("qwen3_5", "Qwen3_5ForConditionalGeneration", _parse_dense(True), qwen3_next.define,
                           "Qwen3.5 dense, the text part of the multimodal checkpoint",
                           prepare=_prepare(DENSE_DEFAULTS, True))
MOE_TEXT_FAMILY = Family("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", _parse_moe(False), qwen3_next.define,
                         "Qwen3.5-MoE (every layer sparse, renormalised top-k, gated shared expert)",
                         prepare=_prepare(MOE_DEFAULTS, False))
MOE_MULTIMODAL_FAMILY = Family("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", _parse_moe(True),
                               qwen3_next.define, "Qwen3.5-MoE, the text part of the multimodal checkpoint",
                               prepare=_prepare(MOE_DEFAULTS, True))
FAMILIES = (TEXT_FAMILY, MULTIMODAL_FAMILY, MOE_TEXT_FAMILY, MOE_MULTIMODAL_FAMILY)
