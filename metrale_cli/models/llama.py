"""Llama (`LlamaForCausalLM`): the pre-norm decoder block every family here starts from.

Per layer: x += o_proj(attention(rope(q_proj(n1(x))), rope(k_proj(n1(x))), v_proj(n1(x))))
           x += down_proj(silu(gate_proj(n2(x))) * up_proj(n2(x)))
with n1 = input_layernorm and n2 = post_attention_layernorm (despite its name, the norm *before* the MLP),
both RMSNorm. Llama 3.1/3.2 `llama3` rope scaling, tied embeddings and `attention_bias` (on q/k/v and o)
are read from the config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .model_config import Family
from .spec import AttentionSpec, LayerSpec, MlpSpec, ModelDefinition, Norm, Param, Rope

if TYPE_CHECKING:
    from .model_config import ConfigReader, ModelConfig

# Buffers some exporters save that carry no weights: tolerated, never read.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def parse(r: ConfigReader) -> dict[str, Any]:
    refuse_non_swiglu(r)
    bias = r.optional("attention_bias", bool, False)
    return dict(attention_bias=bias, o_proj_bias=bias, qk_norm=False, sliding_window=None, layer_types=())


def refuse_non_swiglu(r: ConfigReader) -> None:
    act = r.optional("hidden_act", str, "silu")
    if act != "silu":
        r.refuse("hidden_act", act, "only silu (SwiGLU) is supported")
    if r.optional("mlp_bias", bool, False):
        r.refuse("mlp_bias", True, "MLP biases are not supported")


def define(cfg: ModelConfig) -> ModelDefinition:
    """The Llama block for every layer; the q/k/v bias, o bias and q/k norm follow the config's flags."""
    h, v = cfg.hidden_size, cfg.vocab_size
    rope = Rope(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling)
    mlp = MlpSpec(cfg.intermediate_size, "silu")
    norm = Norm(cfg.rms_norm_eps)
    layers = []
    for i in range(cfg.num_hidden_layers):
        attention = AttentionSpec(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, rope,
                                  scale=cfg.head_dim ** -0.5, qk_norm=cfg.qk_norm, window=cfg.window_of(i))
        layers.append(LayerSpec(attention, mlp, norm, layer_params(cfg, i, attention)))
    return ModelDefinition(
        family=cfg.model_type,
        layers=tuple(layers),
        embed=Param.of("embed", ("model.embed_tokens.weight", (v, h))),
        final_norm=Param.of("final_norm", ("model.norm.weight", (h,))),
        lm_head=None if cfg.tie_word_embeddings else Param.of("lm_head", ("lm_head.weight", (v, h))),
        norm=norm,
        # Some exporters keep the tied head; it is ignored because it must equal the embedding.
        ignored=IGNORED_SUFFIXES + (("lm_head.weight",) if cfg.tie_word_embeddings else ()),
    )


def layer_params(cfg: ModelConfig, i: int, a: AttentionSpec) -> tuple[Param, ...]:
    h, inter = cfg.hidden_size, cfg.intermediate_size
    p, s = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
    q, kv, d = a.q_size, a.kv_size, a.head_dim
    params = [
        Param.of("input_norm", (p + "input_layernorm.weight", (h,))),
        Param.of("qkv", (s + "q_proj.weight", (q, h)), (s + "k_proj.weight", (kv, h)), (s + "v_proj.weight", (kv, h))),
        Param.of("o", (s + "o_proj.weight", (h, q))),
        Param.of("mlp_norm", (p + "post_attention_layernorm.weight", (h,))),
        Param.of("gate_up", (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h))),
        Param.of("down", (p + "mlp.down_proj.weight", (h, inter))),
    ]
    if cfg.attention_bias:
        params.append(Param.of("qkv_bias", (s + "q_proj.bias", (q,)), (s + "k_proj.bias", (kv,)),
                               (s + "v_proj.bias", (kv,))))
    if cfg.o_proj_bias:
        params.append(Param.of("o_bias", (s + "o_proj.bias", (h,))))
    if cfg.qk_norm:
        params.append(Param.of("q_norm", (s + "q_norm.weight", (d,))))
        params.append(Param.of("k_norm", (s + "k_norm.weight", (d,))))
    return tuple(params)


FAMILY = Family("llama", "LlamaForCausalLM", parse, define,
                "Llama 1-3.x (llama3 rope scaling, tied embeddings, attention bias)")
