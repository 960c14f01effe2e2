"""Phi-3 / Phi-4-mini (`Phi3ForCausalLM`): the Llama block with pre-fused projections and richer rope.

The checkpoint stores q/k/v as one `self_attn.qkv_proj` [q + 2 kv, H] and gate/up as one
`mlp.gate_up_proj` [2I, H] (gate first): each is a one-part Param, the engines' fused layout already.
RoPE may be partial (`partial_rotary_factor`, Phi-4-mini 0.75: only the first int(head_dim * f) dims of
each head rotate) and `longrope` scaled (`short_factor` / `long_factor`, `original_max_position_embeddings`
and the attention factor on cos/sin; see spec.LongRope for when the long factors apply). Every layer
attends through `sliding_window` when it is set. Tied embeddings when configured (Phi-4-mini).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import llama, windows
from .model_config import Family
from .rope_params import read_longrope, read_rope, rope_type
from .spec import AttentionSpec, LayerSpec, MlpSpec, ModelDefinition, Norm, Param, Rope

if TYPE_CHECKING:
    from .model_config import ConfigReader, ModelConfig

ORIGINAL_MAX_DEFAULT = 4096  # Phi3Config.original_max_position_embeddings


@dataclass(frozen=True)
class Phi3Options:
    rope: Rope  # the rope of every layer (partial rotary / longrope included)


def parse(r: ConfigReader) -> dict[str, Any]:
    llama.refuse_non_swiglu(r)
    rope = _rope(r)
    return dict(attention_bias=False, o_proj_bias=False, qk_norm=False, **windows.all_sliding(r),
                options=Phi3Options(rope), rope_theta=rope.theta, rope_scaling=None)


def _rope(r: ConfigReader) -> Rope:
    """As Phi3Config reads it: `rope_scaling` (4.x) before `rope_parameters` (5.x); rope_theta and
    partial_rotary_factor inside it or at the top level; the top-level original_max_position_embeddings
    (default 4096) wins over the dict's; the early "su" / "yarn" names mean longrope."""
    key = "rope_scaling" if r.optional("rope_scaling", dict, None) else "rope_parameters"
    params = dict(r.optional(key, dict, None) or {})
    theta = params.get("rope_theta", r.optional("rope_theta", (int, float), 10000.0))
    partial = params.get("partial_rotary_factor", r.optional("partial_rotary_factor", (int, float), 1.0))
    if not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        r.refuse("partial_rotary_factor", partial, "must be in (0, 1]")
    hidden, heads = r.positive_int("hidden_size"), r.positive_int("num_attention_heads")
    head_dim = r.optional("head_dim", int, None) or hidden // heads
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or rotary_dim <= 0:
        r.refuse("partial_rotary_factor", partial,
                 f"gives {rotary_dim} rotary dims of head_dim {head_dim}: must be even")
    if rope_type(params) in ("su", "yarn"):
        params["rope_type"] = "longrope"
    longrope = None
    if rope_type(params) == "longrope":
        original = r.optional("original_max_position_embeddings", int, ORIGINAL_MAX_DEFAULT)
        longrope = read_longrope(r, key, params, rotary_dim, original,
                                 r.optional("max_position_embeddings", int, 4096))
    return read_rope(r, key, params, theta, head_dim, ("default", "longrope"),
                     rotary_dim=rotary_dim if rotary_dim != head_dim else None, longrope=longrope)


def define(cfg: ModelConfig) -> ModelDefinition:
    h, v, inter = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    rope = cfg.options.rope
    mlp, norm = MlpSpec(inter, "silu"), Norm(cfg.rms_norm_eps)
    layers = []
    for i in range(cfg.num_hidden_layers):
        a = AttentionSpec(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, rope,
                          scale=cfg.head_dim ** -0.5, window=cfg.window_of(i))
        p = f"model.layers.{i}."
        params = (
            Param.of("input_norm", (p + "input_layernorm.weight", (h,))),
            Param.of("qkv", (p + "self_attn.qkv_proj.weight", (a.q_size + 2 * a.kv_size, h))),
            Param.of("o", (p + "self_attn.o_proj.weight", (h, a.q_size))),
            Param.of("mlp_norm", (p + "post_attention_layernorm.weight", (h,))),
            Param.of("gate_up", (p + "mlp.gate_up_proj.weight", (2 * inter, h))),
            Param.of("down", (p + "mlp.down_proj.weight", (h, inter))),
        )
        layers.append(LayerSpec(a, mlp, norm, params))
    return ModelDefinition(
        family=cfg.model_type,
        layers=tuple(layers),
        embed=Param.of("embed", ("model.embed_tokens.weight", (v, h))),
        final_norm=Param.of("final_norm", ("model.norm.weight", (h,))),
        lm_head=None if cfg.tie_word_embeddings else Param.of("lm_head", ("lm_head.weight", (v, h))),
        norm=norm,
        ignored=llama.IGNORED_SUFFIXES + (("lm_head.weight",) if cfg.tie_word_embeddings else ()),
    )


FAMILY = Family("phi3", "Phi3ForCausalLM", parse, define,
                "Phi-3 / Phi-4-mini (fused qkv and gate_up, partial rotary, longrope)")
