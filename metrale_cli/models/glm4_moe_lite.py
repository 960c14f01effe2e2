"""GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`, model_type glm4_moe_lite): DeepSeek-V3's latent attention and sparse
block (models/deepseek.py: grouped sigmoid routing with e_score_correction_bias, ungated shared experts) under GLM's
defaults (q_lora_rank 768, qk_nope_head_dim 192, v_head_dim 256, 64 experts top-4, routed_scaling_factor 1.8).

Which layers are sparse comes from `mlp_layer_types` ("dense" / "sparse" per layer; absent: layer 0 dense, the
rest sparse), as transformers reads it: Glm4MoeLiteConfig has no first_k_dense_replace, so a config whose
first_k_dense_replace says otherwise than the layer types is refused rather than read one way or the other. The
multi-token-prediction layers (`num_nextn_predict_layers`) are not run; their tensors are ignored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import deepseek
from .model_config import Family

if TYPE_CHECKING:
    from .model_config import ConfigReader

MOE = deepseek.MoeDefaults(experts=64, top_k=4, size=1536, shared=1, first_dense=1, n_group=1, topk_group=1,
                           norm_topk_prob=True, scaling=1.8)
MLA = deepseek.MlaDefaults(q_lora=768, kv_lora=512, nope=192, rope=64, v=256)


def parse(r: ConfigReader) -> dict[str, Any]:
    deepseek.accept_sigmoid_routing(r)
    moe_cfg = deepseek.sigmoid_grouped_moe(r, MOE, deepseek.sparse_layers(r, MOE.first_dense, reads_first_k=False))
    return deepseek.parse_mla(r, r.optional("rope_interleave", bool, True), moe_cfg, MLA)


FAMILY = Family("glm4_moe_lite", "Glm4MoeLiteForCausalLM", parse, deepseek.define,
                "GLM-4.7-Flash (DeepSeek-V3's latent attention and grouped sigmoid routing, per-layer dense / sparse)")
