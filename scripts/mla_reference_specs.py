"""The latent-attention and DeepSeek-routing fixtures of make_reference_fixtures.py: DeepSeek-V3 (q_lora on
and off, both rope_interleave settings, YaRN with and without truncation), DeepSeek-V2 (group-limited
softmax routing, YaRN), GLM-4.5 (GQA with q/k/v bias and q/k norm, partial rotary, grouped sigmoid
routing), GLM-4.7-Flash (DeepSeek-V3's blocks, dense / sparse per layer from mlp_layer_types) and DeepSeek-V3.2
(V3 with the sparse attention indexer, index_topk below the prompt's length so that it chooses). Every sparse layer has several groups with topk_group < n_group and, for sigmoid routing, a
nonzero e_score_correction_bias large enough to change the choice; first_k_dense_replace >= 1.

Kept apart from the main script (which imports it) so each stays short; the model classes and config
classes are looked up by name in transformers.
"""

from __future__ import annotations

import numpy as np
import torch

TYPES = ("deepseek_v3", "deepseek_v2", "glm4_moe", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa")
MLA_TYPES = ("deepseek_v3", "deepseek_v2", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa")
DSA_TYPES = ("deepseek_v32", "glm_moe_dsa")  # with the sparse attention indexer
CORRECTION_STD = 0.15  # e_score_correction_bias ~ N(0, 0.15): of the order of the sigmoid scores' spread

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 0.9, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
MLA = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=12, moe_intermediate_size=24)


def mla_model_specs():
    """(name, seed, model class name, config class name, config kwargs over the script's BASE, save options)."""
    return [
        # q_lora, interleaved rope, YaRN (attention factor on cos/sin, mscale_all_dim in the softmax scale),
        # top-4 of 16 experts in the best 2 of 4 groups, renormalised, x2.5, 2 shared experts, layer 0 dense
        ("deepseek_v3", 1401, "DeepseekV3ForCausalLM", "DeepseekV3Config",
         dict(MLA, q_lora_rank=48, rope_interleave=True, rope_parameters=dict(YARN), n_routed_experts=16,
              num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
              n_shared_experts=2, first_k_dense_replace=1, tie_word_embeddings=False), {}),
        # q_proj (no q_lora), rotate_half rope, YaRN with truncate false, top-2 of 8 in the best 1 of 2 groups,
        # not renormalised, layers 0 and 1 dense
        ("deepseek_v3_noq", 1402, "DeepseekV3ForCausalLM", "DeepseekV3Config",
         dict(MLA, q_lora_rank=None, rope_interleave=False,
              rope_parameters={**YARN, "factor": 8.0, "truncate": False, "mscale": 1.0, "mscale_all_dim": 1.0},
              n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, norm_topk_prob=False,
              routed_scaling_factor=1.5, n_shared_experts=1, first_k_dense_replace=2, tie_word_embeddings=False), {}),
        # DeepSeek-V2-Lite's layout: q_proj, group_limited_greedy softmax routing (top-3 of 8, best 2 of 4 groups)
        ("deepseek_v2", 1403, "DeepseekV2ForCausalLM", "DeepseekV2Config",
         dict(MLA, q_lora_rank=None, rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
              n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, topk_method="group_limited_greedy",
              routed_scaling_factor=1.5, n_shared_experts=2, first_k_dense_replace=1, tie_word_embeddings=False), {}),
        # GQA with q/k/v bias and q/k norm, head_dim 32 with half of it rotating, top-4 of 16 in the best 2 of 4
        ("glm4_moe", 1404, "Glm4MoeForCausalLM", "Glm4MoeConfig",
         dict(num_hidden_layers=3, head_dim=32, attention_bias=True, use_qk_norm=True,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
              n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True,
              routed_scaling_factor=2.5, n_shared_experts=1, moe_intermediate_size=24, first_k_dense_replace=1,
              tie_word_embeddings=False), {}),
        # GLM-4.7-Flash: q_lora, interleaved rope, layer 1 dense between two sparse ones (mlp_layer_types, not
        # first_k_dense_replace), top-3 of 12 in the best 2 of 3 groups, renormalised, x1.8, v_head_dim > nope
        ("glm4_moe_lite", 1405, "Glm4MoeLiteForCausalLM", "Glm4MoeLiteConfig",
         dict(MLA, q_lora_rank=40, v_head_dim=20, rope_interleave=True,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6}, n_routed_experts=12, num_experts_per_tok=3,
              n_group=3, topk_group=2, norm_topk_prob=True, routed_scaling_factor=1.8, n_shared_experts=1,
              mlp_layer_types=["sparse", "dense", "sparse"], tie_word_embeddings=False), {}),
        # DeepSeek-V3.2: V3 with the indexer (8 heads of 16 dims, the top 5 positions: the 12-token prompt's later
        # rows attend to 5 of their positions), YaRN, top-4 of 16 in the best 2 of 4 groups, layer 0 dense
        ("deepseek_v32", 1406, "DeepseekV32ForCausalLM", "DeepseekV32Config",
         dict(MLA, q_lora_rank=48, rope_parameters=dict(YARN), index_topk=5, index_head_dim=16, index_n_heads=8,
              n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True,
              routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=1, tie_word_embeddings=False), {}),
        # GLM-5: V3.2's blocks, the indexer's rope interleaved, layers 1 and 3 sharing the choice of 0 and 2 (4
        # layers, pattern FSFS), v_head_dim > qk_nope_head_dim, top-3 of 12 in the best 2 of 3 groups
        ("glm_moe_dsa", 1407, "GlmMoeDsaForCausalLM", "GlmMoeDsaConfig",
         dict(MLA, num_hidden_layers=4, q_lora_rank=40, v_head_dim=20, rope_parameters={"rope_type": "default",
              "rope_theta": 1e6}, index_topk=5, index_head_dim=16, index_n_heads=8, index_topk_pattern="FSFS",
              n_routed_experts=12, num_experts_per_tok=3, n_group=3, topk_group=2, norm_topk_prob=True,
              routed_scaling_factor=1.8, n_shared_experts=1, first_k_dense_replace=1, tie_word_embeddings=False), {}),
    ]


def draw_buffers_(model: torch.nn.Module, seed: int) -> None:
    """The routers' e_score_correction_bias (a buffer, not a parameter) ~ N(0, CORRECTION_STD)."""
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
            if name.endswith("e_score_correction_bias"):
                b.copy_(CORRECTION_STD * torch.randn(b.shape, generator=g, dtype=torch.float32))


def route_gap(model, layers: list[int], router_logits: list[torch.Tensor]) -> float:
    """The smallest margin of any routing decision (group choice and expert choice) over the tokens and
    sparse layers: a near tie there is a discontinuity fp32 rounding could cross."""
    c = model.config
    gap = float("inf")
    for i, logits in zip(layers, router_logits):
        gate = model.model.layers[i].mlp.gate
        logits = logits.double()
        e, k = logits.shape[-1], c.num_experts_per_tok
        if c.model_type == "deepseek_v2":
            scores = torch.softmax(logits, -1)
            if c.topk_method == "group_limited_greedy":
                group = scores.view(-1, c.n_group, e // c.n_group).max(-1).values
                gap = min(gap, _kth_gap(group, c.topk_group))
                scores = _mask_groups(scores, group, c.n_group, c.topk_group, 0.0)
        else:
            scores = torch.sigmoid(logits) + gate.e_score_correction_bias.double()
            group = scores.view(-1, c.n_group, e // c.n_group).topk(2, -1).values.sum(-1)
            gap = min(gap, _kth_gap(group, c.topk_group))
            scores = _mask_groups(scores, group, c.n_group, c.topk_group, -1e9)
        gap = min(gap, _kth_gap(scores, k))
    return gap


@torch.no_grad()
def indexer_scores(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each indexed layer's scores [T, T] on `ids` [1, T] (no cache), in float64, with -inf where a query may not
    look, recomputed from the inputs transformers' indexer receives (hooked) by its own definition."""
    found = []

    def hook(module, args, kwargs):
        found.append((module, args, kwargs))

    hooks = [layer.self_attn.indexer.register_forward_pre_hook(hook, with_kwargs=True)
             for layer in model.model.layers if getattr(layer.self_attn, "indexer", None) is not None]
    with torch.no_grad():
        model(ids, use_cache=False)
    for h in hooks:
        h.remove()
    out = []
    for ix, args, kwargs in found:
        hidden, q_resid, (cos, sin) = (a.double() if torch.is_tensor(a) else a for a in args[:3])
        cos, sin = cos.double(), sin.double()
        t, rope = hidden.shape[1], ix.qk_rope_head_dim
        q = (q_resid @ ix.wq_b.weight.double().T).view(1, t, ix.n_heads, ix.head_dim)
        k = torch.nn.functional.layer_norm((hidden @ ix.wk.weight.double().T), (ix.head_dim,),
                                           ix.k_norm.weight.double(), ix.k_norm.bias.double(), ix.k_norm.eps)

        def rot(x):  # rotate_half on the first rope dims (interleaved pairs first regrouped: GLM-5), cos / sin
            c, s = (v.view(1, t, *([1] * (x.dim() - 3)), rope) for v in (cos, sin))  # [1, T, rope] over tokens
            r = x[..., :rope]
            if model.config.model_type == "glm_moe_dsa":
                r = torch.cat([r[..., 0::2], r[..., 1::2]], -1)
            half = torch.cat([-r[..., rope // 2:], r[..., :rope // 2]], -1)
            return torch.cat([r * c + half * s, x[..., rope:]], -1)

        q, k = rot(q)[0], rot(k)[0]  # [T, H, D], [T, D]
        scores = torch.relu(torch.einsum("shd,td->hst", q, k) * ix.head_dim ** -0.5)
        w = (hidden[0] @ ix.weights_proj.weight.double().T) * ix.n_heads ** -0.5  # [T, H]
        total = torch.einsum("sh,hst->st", w, scores)
        out.append(total.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")))
    return out


def indexer_gap(model, ids: torch.Tensor) -> float:
    """The smallest margin, over the indexed layers and the query rows with more visible positions than index_topk,
    between the index_topk-th and the next score: where it is 0 (a tie) or tiny the choice is rounding's."""
    gap = float("inf")
    for total in indexer_scores(model, ids) if model.config.model_type in DSA_TYPES else []:
        k = model.config.index_topk
        rows = total[k:]  # row s sees s + 1 positions: only rows from k on choose
        if len(rows):
            gap = min(gap, _kth_gap(rows, k))
    return gap


def _kth_gap(values: torch.Tensor, k: int) -> float:
    if k >= values.shape[-1]:
        return float("inf")
    top = values.sort(-1, descending=True).values
    return float((top[:, k - 1] - top[:, k]).min())


def _mask_groups(scores, group, n_group, topk_group, fill):
    keep = torch.zeros_like(group, dtype=torch.bool).scatter_(1, group.topk(topk_group, -1).indices, True)
    keep = keep.repeat_interleave(scores.shape[-1] // n_group, -1)
    return scores.masked_fill(~keep, fill)


def mla_golden(model, ids: torch.Tensor) -> dict[str, np.ndarray]:
    """Each latent-attention layer's kv_a_layernorm output (the normed latent) on `ids` [1, T]."""
    if model.config.model_type not in MLA_TYPES:
        return {}
    out, picks = [], []
    hooks = [layer.self_attn.kv_a_layernorm.register_forward_hook(lambda m, a, o: out.append(o.detach().clone()))
             for layer in model.model.layers]
    hooks += [layer.self_attn.indexer.register_forward_hook(lambda m, a, o: picks.append(o.detach().clone()))
              for layer in model.model.layers if getattr(layer.self_attn, "indexer", None) is not None]
    with torch.no_grad():
        model(ids, use_cache=False)
    for h in hooks:
        h.remove()
    arrays = {"kv_a_layernorm": torch.stack([o[0] for o in out]).numpy().astype(np.float32)}
    if picks:  # DeepSeek-V3.2: the positions each query attends to, as transformers' indexer returns them, sorted;
        # a row s with fewer than index_topk positions gets later (masked) ones too: -1 there
        chosen = np.sort(torch.stack([p[0] for p in picks]).numpy().astype(np.int64), -1)
        rows = np.arange(chosen.shape[1])[None, :, None]
        chosen = np.where(chosen > rows, -1, chosen)
        ref = [np.sort(s.topk(chosen.shape[-1], -1).indices.numpy(), -1) for s in indexer_scores(model, ids)]
        assert all(np.array_equal(np.where(r > rows[0], -1, r), c) for r, c in zip(ref, chosen)), \
            "the float64 indexer scores choose otherwise than transformers' indexer"
        arrays["indexer_topk"] = chosen
    return arrays
