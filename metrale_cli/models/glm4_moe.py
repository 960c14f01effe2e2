"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (`Glm4MoeForCausalLM`): grouped-query attention with q/k/v bias
(`attention_bias`; o_proj has none), per-head q/k RMSNorm when `use_qk_norm`, partial rotary
(`partial_rotary_factor`, 0.5 by default: the first half of each head's dims rotate, rotate_half pairs), and
DeepSeek-V3's sparse block (models/deepseek.py: sigmoid_biased_grouped routing with e_score_correction_bias,
ungated shared experts, dense layers before `first_k_dense_replace`). The multi-token-prediction layers
(`num_nextn_predict_layers`) are not part of the forward; the first runs as a draft (models/mtp.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from . import deepseek, llama, moe
from .model_config import Family
from .rope_params import read_rope
from .spec import Rope

if TYPE_CHECKING:
    from .model_config import ConfigReader, ModelConfig
    from .spec import ModelDefinition

DEFAULTS = deepseek.MoeDefaults(experts=128, top_k=8, size=1408, shared=1, first_dense=1, n_group=1, topk_group=1,
                                norm_topk_prob=True, scaling=1.0)


@dataclass(frozen=True)
class Glm4MoeOptions:
    rope: Rope  # every layer's (partial rotary)
    nextn: int


def parse(r: ConfigReader) -> dict[str, Any]:
    llama.refuse_non_swiglu(r)
    deepseek.accept_sigmoid_routing(r)
    rope = _rope(r)
    return dict(attention_bias=r.optional("attention_bias", bool, False), o_proj_bias=False,
                qk_norm=r.optional("use_qk_norm", bool, False), sliding_window=None, layer_types=(),
                rope_theta=rope.theta, rope_scaling=None, moe=deepseek.sigmoid_grouped_moe(r, DEFAULTS),
                options=Glm4MoeOptions(rope, deepseek.nextn_layers(r)))


def _rope(r: ConfigReader) -> Rope:
    """rope_parameters (5.x) or rope_scaling + rope_theta (4.x); partial_rotary_factor inside or at the top
    level, 0.5 when absent (Glm4MoeConfig's default)."""
    key = "rope_scaling" if r.optional("rope_scaling", dict, None) else "rope_parameters"
    params = dict(r.optional(key, dict, None) or {})
    theta = params.get("rope_theta", r.optional("rope_theta", (int, float), 10000.0))
    partial = params.get("partial_rotary_factor", r.optional("partial_rotary_factor", (int, float), 0.5))
    if not isinstance(partial, (int, float)) or isinstance(partial, bool) or not 0 < partial <= 1:
        r.refuse("partial_rotary_factor", partial, "must be in (0, 1]")
    hidden, heads = r.positive_int("hidden_size"), r.positive_int("num_attention_heads")
    head_dim = r.optional("head_dim", int, None) or hidden // heads
    rotary = int(head_dim * partial)
    if rotary % 2 or rotary <= 0:
        r.refuse("partial_rotary_factor", partial, f"gives {rotary} rotary dims of head_dim {head_dim}: must be even")
    return read_rope(r, key, params, theta, head_dim, ("default", "yarn"),
                     rotary_dim=rotary if rotary != head_dim else None)


def define(cfg: ModelConfig) -> ModelDefinition:
    base = llama.define(cfg)
    o, n = cfg.options, cfg.num_hidden_layers
    layers = tuple(replace(layer, mixer=replace(layer.mixer, rope=o.rope)) for layer in base.layers)
    base = replace(base, layers=layers, ignored_prefixes=deepseek.nextn_prefixes(n, o.nextn),
                   notes=deepseek.nextn_notes(n, o.nextn))
    return moe.define_sparse(cfg, base, "mlp", deepseek.EXPERT_NAMES, shared="shared_experts.")


FAMILY = Family("glm4_moe", "Glm4MoeForCausalLM", parse, define,
                "GLM-4.5 / 4.6 (q/k/v bias, partial rotary, grouped sigmoid routing, shared experts)")
