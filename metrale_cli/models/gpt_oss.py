"""gpt-oss (`GptOssForCausalLM`): grouped-query attention with q/k/v/o biases and attention sinks (one learned
logit per head joining every softmax), sliding-window (`sliding_window`, 128) and full layers alternating
(`layer_types`; default: even layers sliding), YaRN rope (factor 32, untruncated, with its attention factor on
cos/sin), and a sparse MLP on every layer: router logits with a bias, the `num_experts_per_tok` largest, their
softmax (router kind topk_softmax); each expert's gate/up with a bias, gpt-oss's clamped SwiGLU
(`swiglu_limit`, `swiglu_alpha`: min(g, L) * sigmoid(alpha min(g, L)) * (clip(u, -L, L) + 1)), its down
projection with a bias.

The checkpoint stores the experts fused, gate and up interleaved along the output (gate 0, up 0, gate 1, ...):
as MXFP4 (quant_method mxfp4, models/quantized/mxfp4.py: `*_blocks` / `*_scales` [E, out, ...]) in the shipped
checkpoints, or dense [E, in, out] (`gate_up_proj` [E, H, 2I], `down_proj` [E, I, H]) in bf16 exports; the
definition says so (Param.interleaved / transposed) and the loader reorders them to the engine's layout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from . import llama
from .model_config import Family, MoeConfig
from .rope_params import read_rope
from .spec import MoeSpec, Param, Rope, RouterSpec, Tensor
from .windows import FULL, SLIDING, read_layer_types, read_window

if TYPE_CHECKING:
    from .model_config import ConfigReader, ModelConfig
    from .spec import ModelDefinition

DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


@dataclass(frozen=True)
class GptOssOptions:
    rope: Rope


def parse(r: ConfigReader) -> dict[str, Any]:
    if r.optional("hidden_act", str, "silu") != "silu":  # the experts use swiglu_limit / alpha; hidden_act is unread
        r.refuse("hidden_act", r.raw["hidden_act"], "gpt-oss's experts use their clamped SwiGLU")
    if r.optional("attention_bias", bool, True) is not True:
        r.refuse("attention_bias", False, "gpt-oss checkpoints have q/k/v/o biases")
    experts = r.positive_int("num_local_experts") if "num_local_experts" in r.raw else 128
    top_k = r.optional("num_experts_per_tok", int, 4)
    if not 0 < top_k <= experts:
        r.refuse("num_experts_per_tok", top_k, f"must be in 1..{experts}")
    layers = r.positive_int("num_hidden_layers")
    spec = MoeSpec(experts, top_k, r.positive_int("intermediate_size"), norm_topk_prob=False,
                   activation="swiglu_oai", router=RouterSpec("topk_softmax", bias=True), expert_bias=True,
                   swiglu_limit=float(r.optional("swiglu_limit", (int, float), 7.0)),
                   swiglu_alpha=float(r.optional("swiglu_alpha", (int, float), 1.702)))
    window = read_window(r) if "sliding_window" in r.raw else 128
    types = read_layer_types(r, lambda i: SLIDING if (i + 1) % 2 else FULL)
    params = dict(r.optional("rope_parameters", dict, None) or r.optional("rope_scaling", dict, None) or DEFAULT_ROPE)
    theta = params.get("rope_theta", r.optional("rope_theta", (int, float), 150000.0))
    hidden, heads = r.positive_int("hidden_size"), r.positive_int("num_attention_heads")
    head_dim = r.optional("head_dim", int, None) or hidden // heads
    rope = read_rope(r, "rope_parameters", params, theta, head_dim, ("default", "yarn"))
    return dict(attention_bias=True, o_proj_bias=True, qk_norm=False, sliding_window=window,
                layer_types=types if window is not None else (), rope_theta=rope.theta, rope_scaling=None,
                moe=MoeConfig(spec, tuple(range(layers))), options=GptOssOptions(rope))


def define(cfg: ModelConfig) -> ModelDefinition:
    base = llama.define(cfg)
    spec, h = cfg.moe.spec, cfg.hidden_size
    e, inter, heads = spec.num_experts, spec.intermediate_size, cfg.num_attention_heads
    layers = []
    for i, layer in enumerate(base.layers):
        p = f"model.layers.{i}."
        x = p + "mlp.experts."
        attention = replace(layer.mixer, rope=cfg.options.rope, sinks=True)
        params = tuple(q for q in layer.params if q.key not in ("gate_up", "down")) + (
            Param.of("sinks", (p + "self_attn.sinks", (heads,))),
            Param.of("router", (p + "mlp.router.weight", (e, h))),
            Param.of("router_bias", (p + "mlp.router.bias", (e,))),
            Param("experts_gate_up", (Tensor(x + "gate_up_proj", (e, 2 * inter, h)),), interleaved=True, transposed=True),
            Param("experts_gate_up_bias", (Tensor(x + "gate_up_proj_bias", (e, 2 * inter)),), interleaved=True),
            Param("experts_down", (Tensor(x + "down_proj", (e, h, inter)),), transposed=True),
            Param.of("experts_down_bias", (x + "down_proj_bias", (e, h))),
        )
        layers.append(replace(layer, mixer=attention, mlp=spec, params=params))
    return replace(base, layers=tuple(layers))


FAMILY = Family("gpt_oss", "GptOssForCausalLM", parse, define,
                "gpt-oss (attention sinks, alternating sliding layers, YaRN, top-4 experts with biases, MXFP4)")
