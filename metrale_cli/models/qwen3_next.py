"""Qwen3-Next (`Qwen3NextForCausalLM`): hybrid layers, three Gated DeltaNet (linear attention) layers to one
gated full-attention layer, and a sparse MLP with a sigmoid-gated shared expert. The Qwen3.5 families
(qwen3_5.py) reuse `define` with their own projection layout.

- `layer_types`: "linear_attention" / "full_attention" per layer (default: full every
  `full_attention_interval` = 4th layer). A linear layer is the "linear_attention" mixer kind
  (spec.LinearAttentionSpec, engine/linear_attention.py): in_proj_qkvz and in_proj_ba in their head-grouped
  order, a causal depthwise conv1d of `linear_conv_kernel_dim` with SiLU, l2-normalised q/k, beta =
  sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), the gated delta rule per value head, RMSNormGated
  (a plain w; norm * silu(z)) and out_proj.
- Full layers: `head_dim` from the config (256), partial rotary (`partial_rotary_factor`, default 0.25),
  (1 + w) q/k RMSNorm, and an output gate: q_proj is doubled (per head [q_h; gate_h]) and the attention
  output is multiplied by sigmoid(gate) before o_proj (AttentionSpec.output_gate).
- Every other RMSNorm is zero-centred, (1 + w) (Norm.offset 1).
- The MLP: qwen2_moe's rule (softmax top-k over `num_experts`, renormalised when `norm_topk_prob`, plus
  sigmoid(shared_expert_gate) * shared_expert), on the layers `decoder_sparse_step` / `mlp_only_layers`
  make sparse; the others a dense SwiGLU of `intermediate_size`.
The checkpoint's multi-token-prediction head (`mtp.*`) is never read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import llama, moe
from .model_config import Family
from .qwen3_moe import EXPERT_NAMES, qwen_moe_config
from .rope_params import read_rope
from .spec import AttentionSpec, LayerSpec, LinearAttentionSpec, MlpSpec, ModelDefinition, Norm, Param, Rope

if TYPE_CHECKING:
    from .model_config import ConfigReader, ModelConfig

LINEAR, FULL = "linear_attention", "full_attention"
# transformers' Qwen3NextConfig defaults (the sizes a config.json may leave out)
DEFAULTS: dict[str, Any] = {
    "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
}
# and of its sparse block (norm_topk_prob defaults to true here, unlike qwen2_moe / qwen3_moe)
MOE_DEFAULTS: dict[str, Any] = {"num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
                                "shared_expert_intermediate_size": 512, "norm_topk_prob": True}


@dataclass(frozen=True)
class HybridOptions:
    """The fields qwen3_next and qwen3_5 read beyond the generic ones."""

    rope: Rope  # of the full-attention layers (partial rotary)
    linear: LinearAttentionSpec  # of every linear-attention layer
    kinds: tuple[str, ...]  # LINEAR / FULL per layer
    prefix: str = "model."  # where the decoder's tensors live (model.language_model. in a multimodal checkpoint)


def prepare(r: ConfigReader) -> dict[str, Any]:
    return {**DEFAULTS, **MOE_DEFAULTS, **r.raw}


def parse(r: ConfigReader) -> dict[str, Any]:
    fields = parse_hybrid(r, grouped=True)
    moe.refuse_other_routing(r)
    shared = moe.positive(r, "shared_expert_intermediate_size", 512)
    return dict(fields, moe=qwen_moe_config(r, experts_default=512, top_k_default=10, size_default=512,
                                            shared_expert_size=shared))


def parse_hybrid(r: ConfigReader, *, grouped: bool, prefix: str = "model.") -> dict[str, Any]:
    """The fields every hybrid family shares: the layer kinds, the linear layers' sizes, the full layers' rope."""
    llama.refuse_non_swiglu(r)  # hidden_act is also the conv's activation
    if r.optional("attention_bias", bool, False):
        r.refuse("attention_bias", True, "attention biases of the gated full-attention layers are not implemented")
    n = r.positive_int("num_hidden_layers")
    kinds = r.optional("layer_types", list, None)
    if kinds is None:
        interval = r.optional("full_attention_interval", int, 4)
        if interval <= 0:
            r.refuse("full_attention_interval", interval, "must be positive")
        kinds = [LINEAR if (i + 1) % interval else FULL for i in range(n)]
    if len(kinds) != n or any(k not in (LINEAR, FULL) for k in kinds):
        r.refuse("layer_types", kinds, f"must list '{LINEAR}' or '{FULL}' for each of the {n} layers")
    hk, hv = r.positive_int("linear_num_key_heads"), r.positive_int("linear_num_value_heads")
    if hv % hk:
        r.refuse("linear_num_value_heads", hv, f"must be a multiple of linear_num_key_heads {hk}")
    linear = LinearAttentionSpec(hk, hv, r.positive_int("linear_key_head_dim"), r.positive_int("linear_value_head_dim"),
                                 r.positive_int("linear_conv_kernel_dim"),
                                 float(r.optional("rms_norm_eps", (int, float), 1e-6)), grouped=grouped)
    return dict(attention_bias=False, o_proj_bias=False, qk_norm=True, sliding_window=None, layer_types=(),
                rope_theta=_rope(r).theta, rope_scaling=None,
                options=HybridOptions(_rope(r), linear, tuple(kinds), prefix))


def _rope(r: ConfigReader) -> Rope:
    """rope_parameters (5.x) or rope_theta / rope_scaling / partial_rotary_factor at the top level (4.x);
    only the default rope type. Qwen3.5's multimodal rope sections (mrope_section) rotate a text-only
    prompt exactly as the plain rope does (its three position rows are equal), so they are accepted."""
    key = "rope_parameters" if r.optional("rope_parameters", dict, None) else "rope_scaling"
    params = dict(r.optional(key, dict, None) or {})
    theta = params.get("rope_theta", r.optional("rope_theta", (int, float), 10000.0))
    partial = params.get("partial_rotary_factor", r.optional("partial_rotary_factor", (int, float), 0.25))
    hidden, heads = r.positive_int("hidden_size"), r.positive_int("num_attention_heads")
    head_dim = r.optional("head_dim", int, None) or hidden // heads
    if not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        r.refuse("partial_rotary_factor", partial, "must be in (0, 1]")
    rotary = int(head_dim * partial)
    if rotary % 2 or rotary <= 0:
        r.refuse("partial_rotary_factor", partial, f"gives {rotary} rotary dims of head_dim {head_dim}: must be even")
    return read_rope(r, key, params, theta, head_dim, ("default",), rotary_dim=rotary if rotary != head_dim else None)


def define(cfg: ModelConfig) -> ModelDefinition:
    o = cfg.options
    h, v, p0 = cfg.hidden_size, cfg.vocab_size, o.prefix
    norm = Norm(cfg.rms_norm_eps, offset=1.0)
    mlp = MlpSpec(cfg.intermediate_size, "silu")
    layers = []
    for i, kind in enumerate(o.kinds):
        p = f"{p0}layers.{i}."
        common = (Param.of("input_norm", (p + "input_layernorm.weight", (h,))),
                  Param.of("mlp_norm", (p + "post_attention_layernorm.weight", (h,))),
                  Param.of("gate_up", (p + "mlp.gate_proj.weight", (cfg.intermediate_size, h)),
                           (p + "mlp.up_proj.weight", (cfg.intermediate_size, h))),
                  Param.of("down", (p + "mlp.down_proj.weight", (h, cfg.intermediate_size))))
        if kind == LINEAR:
            mixer, params = o.linear, linear_params(o.linear, p + "linear_attn.", h)
        else:
            mixer = AttentionSpec(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, o.rope,
                                  scale=cfg.head_dim ** -0.5, qk_norm=True, output_gate=True)
            params = gated_attention_params(mixer, p + "self_attn.", h)
        layers.append(LayerSpec(mixer, mlp, norm, common + params))
    base = ModelDefinition(
        family=cfg.model_type, layers=tuple(layers),
        embed=Param.of("embed", (p0 + "embed_tokens.weight", (v, h))),
        final_norm=Param.of("final_norm", (p0 + "norm.weight", (h,))),
        lm_head=None if cfg.tie_word_embeddings else Param.of("lm_head", ("lm_head.weight", (v, h))),
        norm=norm,
        ignored=llama.IGNORED_SUFFIXES + (("lm_head.weight",) if cfg.tie_word_embeddings else ()),
        ignored_prefixes=("mtp.", "model.visual."),
    )
    return moe.define_sparse(cfg, base, "mlp", EXPERT_NAMES, prefix=p0)


def linear_params(s: LinearAttentionSpec, p: str, h: int) -> tuple[Param, ...]:
    if s.grouped:
        proj = Param.of("lin_in", (p + "in_proj_qkvz.weight", (2 * s.k_dim + 2 * s.v_dim, h)),
                        (p + "in_proj_ba.weight", (2 * s.num_v_heads, h)))
    else:
        proj = Param.of("lin_in", (p + "in_proj_qkv.weight", (s.conv_dim, h)), (p + "in_proj_z.weight", (s.v_dim, h)),
                        (p + "in_proj_b.weight", (s.num_v_heads, h)), (p + "in_proj_a.weight", (s.num_v_heads, h)))
    return (proj,
            Param.of("conv", (p + "conv1d.weight", (s.conv_dim, 1, s.conv_kernel))),
            Param.of("dt_bias", (p + "dt_bias", (s.num_v_heads,))),
            Param.of("A_log", (p + "A_log", (s.num_v_heads,))),
            Param.of("lin_norm", (p + "norm.weight", (s.v_head_dim,))),
            Param.of("lin_out", (p + "out_proj.weight", (h, s.v_dim))))


def gated_attention_params(a: AttentionSpec, p: str, h: int) -> tuple[Param, ...]:
    return (Param.of("qkv", (p + "q_proj.weight", (a.q_proj_size, h)), (p + "k_proj.weight", (a.kv_size, h)),
                     (p + "v_proj.weight", (a.kv_size, h))),
            Param.of("o", (p + "o_proj.weight", (h, a.q_size))),
            Param.of("q_norm", (p + "q_norm.weight", (a.head_dim,))),
            Param.of("k_norm", (p + "k_norm.weight", (a.head_dim,))))


FAMILY = Family("qwen3_next", "Qwen3NextForCausalLM", parse, define,
                "Qwen3-Next (Gated DeltaNet linear attention + gated full attention, top-k experts with a "
                "gated shared expert)", prepare=prepare)
