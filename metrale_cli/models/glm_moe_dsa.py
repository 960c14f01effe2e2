"""GLM-5 (`GlmMoeDsaForCausalLM`, model_type glm_moe_dsa): DeepSeek-V3.2's blocks (models/deepseek.py: latent
attention with DeepSeek sparse attention's indexer, grouped sigmoid routing, ungated shared experts) under GLM's
defaults (q_lora_rank 2048, qk_nope_head_dim 192, v_head_dim 256, 32 indexer heads), with two differences that
transformers' GLM-MoE-DSA makes: the indexer rotates its rope dims in interleaved pairs, and a layer whose
`indexer_types` entry is "shared" has no indexer: it attends to the positions the nearest earlier "full" layer
chose. The types come from `indexer_types`, else `index_topk_pattern` ("F" / "S" per layer, a string or a list),
else `index_topk_freq` / `index_skip_topk_offset` (layer i full when max(i - offset + 1, 0) % freq == 0), as
GlmMoeDsaConfig derives them. The multi-token-prediction layers (`num_nextn_predict_layers`) are not run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import deepseek
from .model_config import Family

if TYPE_CHECKING:
    from .model_config import ConfigReader

MOE = deepseek.MoeDefaults(experts=256, top_k=8, size=2048, shared=1, first_dense=3, n_group=1, topk_group=1,
                           norm_topk_prob=True, scaling=2.5)
MLA = deepseek.MlaDefaults(q_lora=2048, kv_lora=512, nope=192, rope=64, v=256)


def parse(r: ConfigReader) -> dict[str, Any]:
    types = indexer_types(r)
    if types[0] != "full":
        r.refuse("indexer_types", types, "layer 0 has no earlier indexer to share")
    shared = tuple(i for i, t in enumerate(types) if t == "shared")
    return deepseek.parse_dsa(r, MOE, MLA, index_heads=32, interleave=True, shared=shared)


def indexer_types(r: ConfigReader) -> list[str]:
    """Per layer "full" (its own indexer) or "shared", as GlmMoeDsaConfig derives them."""
    n = r.positive_int("num_hidden_layers")
    types = r.optional("indexer_types", list, None)
    if types is None and r.raw.get("index_topk_pattern") is not None:
        pattern = r.raw["index_topk_pattern"]
        letters = {"F": "full", "S": "shared"}
        if isinstance(pattern, str) and set(pattern) <= set(letters):
            types = [letters[c] for c in pattern]
        elif isinstance(pattern, list):
            types = pattern
        else:
            r.refuse("index_topk_pattern", pattern, "needs F or S per layer")
    if types is None:
        freq = max(r.optional("index_topk_freq", int, 1), 1)
        offset = r.optional("index_skip_topk_offset", int, 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    key = "indexer_types" if "indexer_types" in r.raw else "index_topk_pattern"
    if len(types) != n or any(t not in ("full", "shared") for t in types):
        r.refuse(key, types, f"needs full or shared for each of the {n} layers")
    return types


FAMILY = Family("glm_moe_dsa", "GlmMoeDsaForCausalLM", parse, deepseek.define,
                "GLM-5 (DeepSeek-V3.2's sparse attention with an interleaved-rope indexer shared across layers; NumPy "
                "engine only)")
