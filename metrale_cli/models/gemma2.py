"""Gemma 2 (`Gemma2ForCausalLM`): the sandwich block, scaled embeddings and softcapped scores and logits.

Per layer, every norm an RMSNorm with scale (1 + w) computed in fp32:
    x += post_attention_layernorm(o_proj(attention(input_layernorm(x))))
    x += post_feedforward_layernorm(down_proj(gelu_tanh(gate_proj(n(x))) * up_proj(n(x))))
with n = pre_feedforward_layernorm. The embedding rows are multiplied by sqrt(hidden_size); the scores by
query_pre_attn_scalar ** -0.5 and then softcapped, tanh(s / attn_logit_softcapping) * attn_logit_softcapping,
before the causal / window mask; the logits likewise by final_logit_softcapping. Sliding layers (even
ones by default, `layer_types` when given) attend to the last `sliding_window` positions. Tied embeddings
by default. gemma3.py reuses this block (no softcap, q/k norms, a rope per layer type).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import windows
from .model_config import Family
from .spec import AttentionSpec, LayerSpec, MlpSpec, ModelDefinition, Norm, Param, Rope

if TYPE_CHECKING:
    from .model_config import ConfigReader, ModelConfig

# transformers' Gemma2Config defaults, for the fields a config.json leaves out (explicit nulls stay null).
DEFAULTS: dict[str, Any] = {
    "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
}


@dataclass(frozen=True)
class GemmaOptions:
    """The Gemma 2 / 3 fields beyond the generic ModelConfig ones."""

    query_pre_attn_scalar: float  # scores scale = query_pre_attn_scalar ** -0.5
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    qk_norm: bool = False  # gemma3: per-head (1 + w) RMSNorm on q and k
    prefix: str = "model."  # where the decoder's tensors live (gemma3 multimodal: language_model.model.)
    lm_head_name: str = "lm_head.weight"
    ignored_prefixes: tuple[str, ...] = ()  # a multimodal checkpoint's vision tower and projector
    # gemma3: the rope of each layer type; None = the config's rope_theta / rope_scaling for every layer
    full_rope: Rope | None = None
    sliding_rope: Rope | None = None


def prepare(r: ConfigReader) -> dict[str, Any]:
    return {**DEFAULTS, **r.raw}


def parse(r: ConfigReader) -> dict[str, Any]:
    refuse_common(r)
    bias = r.optional("attention_bias", bool, False)
    options = GemmaOptions(
        query_pre_attn_scalar=positive_number(r, "query_pre_attn_scalar"),
        attn_logit_softcapping=optional_positive(r, "attn_logit_softcapping"),
        final_logit_softcapping=optional_positive(r, "final_logit_softcapping"),
    )
    return dict(attention_bias=bias, o_proj_bias=bias, qk_norm=False, sliding_window=windows.read_window(r),
                layer_types=windows.read_layer_types(r, lambda i: windows.SLIDING if i % 2 == 0 else windows.FULL),
                options=options)


def refuse_common(r: ConfigReader) -> None:
    """What Gemma 2 and 3 configs may ask for that is not implemented."""
    act = r.optional("hidden_activation", str, "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        r.refuse("hidden_activation", act, "only gelu_pytorch_tanh is supported")
    if r.optional("use_bidirectional_attention", bool, False):
        r.refuse("use_bidirectional_attention", True, "only causal attention is supported")


def positive_number(r: ConfigReader, key: str) -> float:
    value = r.required(key, (int, float))
    if value <= 0:
        r.refuse(key, value, "must be positive")
    return float(value)


def optional_positive(r: ConfigReader, key: str) -> float | None:
    value = r.optional(key, (int, float), None)
    if value is not None and value <= 0:
        r.refuse(key, value, "must be positive (or null for none)")
    return None if value is None else float(value)


def define(cfg: ModelConfig) -> ModelDefinition:
    o: GemmaOptions = cfg.options
    h, v, p = cfg.hidden_size, cfg.vocab_size, o.prefix
    norm = Norm(cfg.rms_norm_eps, offset=1.0)
    mlp = MlpSpec(cfg.intermediate_size, "gelu_tanh")
    default_rope = Rope(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling)
    layers = []
    for i in range(cfg.num_hidden_layers):
        window = cfg.window_of(i)
        kind = cfg.layer_types[i] if cfg.layer_types else windows.FULL  # the rope goes by the layer type
        rope = (o.sliding_rope if kind == windows.SLIDING else o.full_rope) or default_rope
        attention = AttentionSpec(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, rope,
                                  scale=o.query_pre_attn_scalar ** -0.5, qk_norm=o.qk_norm, window=window,
                                  softcap=o.attn_logit_softcapping)
        layers.append(LayerSpec(attention, mlp, norm, layer_params(cfg, i, attention, p)))
    return ModelDefinition(
        family=cfg.model_type,
        layers=tuple(layers),
        embed=Param.of("embed", (p + "embed_tokens.weight", (v, h))),
        final_norm=Param.of("final_norm", (p + "norm.weight", (h,))),
        lm_head=None if cfg.tie_word_embeddings else Param.of("lm_head", (o.lm_head_name, (v, h))),
        norm=norm,
        ignored=("rotary_emb.inv_freq",) + ((o.lm_head_name,) if cfg.tie_word_embeddings else ()),
        ignored_prefixes=o.ignored_prefixes,
        # transformers: torch.tensor(hidden ** 0.5) (fp32), cast to the weights' dtype, times the rows.
        embed_scale=_fp32(math.sqrt(h)),
        final_logit_softcap=o.final_logit_softcapping,
    )


def _fp32(x: float) -> float:
    """x rounded to the nearest fp32 value (numpy is not imported where configs are read)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def layer_params(cfg: ModelConfig, i: int, a: AttentionSpec, prefix: str) -> tuple[Param, ...]:
    h, inter = cfg.hidden_size, cfg.intermediate_size
    p = f"{prefix}layers.{i}."
    s = p + "self_attn."
    q, kv, d = a.q_size, a.kv_size, a.head_dim
    params = [
        Param.of("input_norm", (p + "input_layernorm.weight", (h,))),
        Param.of("qkv", (s + "q_proj.weight", (q, h)), (s + "k_proj.weight", (kv, h)), (s + "v_proj.weight", (kv, h))),
        Param.of("o", (s + "o_proj.weight", (h, q))),
        Param.of("attn_out_norm", (p + "post_attention_layernorm.weight", (h,))),
        Param.of("mlp_norm", (p + "pre_feedforward_layernorm.weight", (h,))),
        Param.of("gate_up", (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h))),
        Param.of("down", (p + "mlp.down_proj.weight", (h, inter))),
        Param.of("mlp_out_norm", (p + "post_feedforward_layernorm.weight", (h,))),
    ]
    if cfg.attention_bias:
        params.append(Param.of("qkv_bias", (s + "q_proj.bias", (q,)), (s + "k_proj.bias", (kv,)),
                               (s + "v_proj.bias", (kv,))))
        params.append(Param.of("o_bias", (s + "o_proj.bias", (h,))))
    if a.qk_norm:
        params.append(Param.of("q_norm", (s + "q_norm.weight", (d,))))
        params.append(Param.of("k_norm", (s + "k_norm.weight", (d,))))
    return tuple(params)


FAMILY = Family("gemma2", "Gemma2ForCausalLM", parse, define,
                "Gemma 2 (sandwich norms, softcapping, alternating sliding windows)", prepare=prepare)
