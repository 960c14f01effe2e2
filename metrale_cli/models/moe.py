"""Mixture-of-experts pieces the sparse families share (qwen2_moe, qwen3_moe, mixtral).

A sparse family is its dense family's attention (llama.define builds it) with a `MoeSpec` (models/spec.py)
in place of the dense MLP on the layers `MoeConfig.sparse_layers` names. Its checkpoint stores one tensor
per expert (`mlp.experts.{e}.gate_proj.weight`, mixtral `block_sparse_moe.experts.{e}.w1.weight`); the
definition declares them as stacked `Param`s, so the loader builds [E, 2I, H] and [E, H, I] weights and
no engine knows the layout. This is also what transformers 5.x `save_pretrained` writes: its in-memory
fused `experts.gate_up_proj` is split back into per-expert tensors on save (`save_original_format=True`,
the default); a checkpoint saved with `save_original_format=False` is refused by the checkpoint check
(its fused tensor names are unexpected).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .model_config import MoeConfig
from .spec import ModelDefinition, MoeSpec, Param

if TYPE_CHECKING:
    from .model_config import ConfigReader, ModelConfig

# Routing options of other MoE families (DeepSeek, GLM, Ernie, ...) and the values that leave the routing
# as softmax -> top-k. A config that sets one to anything else means a router metrale does not implement
# (sigmoid scoring, group-limited top-k, a scaling of the weights, a router bias): refused, never ignored.
OTHER_ROUTING: dict[str, tuple[Any, ...]] = {
    "scoring_func": ("softmax",),
    "topk_method": ("greedy",),
    "n_group": (1,),
    "topk_group": (1,),
    "routed_scaling_factor": (1, 1.0),
    "n_shared_experts": (0,),
    "first_k_dense_replace": (0,),
    "moe_layer_freq": (1,),
    "router_bias": (False,),
    "moe_router_bias": (False,),
    "use_expert_bias": (False,),
}


def refuse_other_routing(r: ConfigReader) -> None:
    for key, neutral in OTHER_ROUTING.items():
        value = r.raw.get(key)
        if value is not None and value not in neutral:
            r.refuse(key, value, "a routing option of another MoE family; only softmax top-k routing is implemented")


def positive(r: ConfigReader, key: str, default: int) -> int:
    """An optional positive integer field (transformers' default when absent)."""
    value = r.optional(key, int, default)
    if value <= 0:
        r.refuse(key, value, "must be a positive integer")
    return value


def moe_config(r: ConfigReader, *, num_experts: int, top_k: int, expert_size: int, norm_topk_prob: bool,
               sparse_layers: tuple[int, ...], shared_expert_size: int | None = None) -> MoeConfig | None:
    """The sparse block, or None when no layer is sparse (transformers then runs the dense model)."""
    if not sparse_layers:
        return None
    if top_k > num_experts:
        r.refuse("num_experts_per_tok", top_k, f"more than the {num_experts} experts")
    spec = MoeSpec(num_experts, top_k, expert_size, norm_topk_prob, "silu", shared_expert_size)
    return MoeConfig(spec, sparse_layers)


def qwen_sparse_layers(r: ConfigReader) -> tuple[int, ...]:
    """Qwen MoE layer placement: layer i is sparse when (i + 1) % decoder_sparse_step == 0 and i is not in
    mlp_only_layers (transformers' Qwen2Moe/Qwen3MoeDecoderLayer)."""
    layers = r.positive_int("num_hidden_layers")
    step = positive(r, "decoder_sparse_step", 1)
    dense = r.optional("mlp_only_layers", list, [])
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        r.refuse("mlp_only_layers", dense, "must be a list of layer indices")
    return tuple(i for i in range(layers) if (i + 1) % step == 0 and i not in dense)


def define_sparse(cfg: ModelConfig, base: ModelDefinition, block: str, names: tuple[str, str, str],
                  shared: str = "shared_expert.", prefix: str = "model.") -> ModelDefinition:
    """`base` (the dense definition) with the sparse block on cfg.moe.sparse_layers. `block` is the
    checkpoint module of the sparse MLP (`mlp`, mixtral `block_sparse_moe`), `names` the (gate, up, down)
    projection names of one expert, `shared` the shared expert's module (DeepSeek's `shared_experts.`),
    `prefix` where the decoder's layers live."""
    if cfg.moe is None:
        return base
    layers = list(base.layers)
    for i in cfg.moe.sparse_layers:
        dense = tuple(p for p in layers[i].params if p.key not in ("gate_up", "down"))
        layers[i] = replace(layers[i], mlp=cfg.moe.spec,
                            params=dense + sparse_params(cfg.hidden_size, cfg.moe.spec, f"{prefix}layers.{i}.{block}.",
                                                         names, shared))
    return replace(base, layers=tuple(layers))


def sparse_params(h: int, spec: MoeSpec, p: str, names: tuple[str, str, str],
                  shared: str = "shared_expert.") -> tuple[Param, ...]:
    """The router (with a gated shared expert's gate row appended) and its choice correction, the stacked
    experts and the shared expert."""
    e, inter = spec.num_experts, spec.intermediate_size
    gate, up, down = names
    router = [(p + "gate.weight", (e, h))]
    if spec.shared_expert_size and spec.shared_expert_gated:
        router.append((p + "shared_expert_gate.weight", (1, h)))
    params = [
        Param.of("router", *router),
        Param.stacked("experts_gate_up", [[(f"{p}experts.{j}.{gate}.weight", (inter, h)),
                                           (f"{p}experts.{j}.{up}.weight", (inter, h))] for j in range(e)]),
        Param.stacked("experts_down", [[(f"{p}experts.{j}.{down}.weight", (h, inter))] for j in range(e)]),
    ]
    if spec.router.kind == "sigmoid_biased_grouped":
        params.append(Param.of("router_correction", (p + "gate.e_score_correction_bias", (e,))))
    if spec.shared_expert_size:
        s, q = spec.shared_expert_size, p + shared
        params += [Param.of("shared_gate_up", (q + "gate_proj.weight", (s, h)), (q + "up_proj.weight", (s, h))),
                   Param.of("shared_down", (q + "down_proj.weight", (h, s)))]
    return tuple(params)
