"""The decoder's order of operations, written once for every family and every backend.

`decoder_forward` runs the rows of one pass (a prompt chunk, a decode step or a verify pass) through the
blocks a `ModelDefinition` describes, against a small set of ops (`Ops`) that each backend implements:
the NumPy engine plainly, the CUDA rows path with its fused kernels under graph capture, the CUDA
prefill path with cuBLAS and flash attention. Fusion is a backend's business inside its ops: `linear`
takes the norm that precedes it and the residual it adds into, and a backend may run them in one kernel.

Taps: at every point named after a Hugging Face module (`model.embed_tokens`, `model.layers.{i}.self_attn`
= the attention output after o_proj, before the residual add, `model.layers.{i}.mlp`, `model.layers.{i}`
= the residual stream after the layer, `model.norm`) the loop hands the value to `ops.tap`. A sparse layer
(mixture of experts) adds its router's: `model.layers.{i}.mlp.gate` = the router logits [T, E] (fp32, the
shared expert's gate excluded), `model.layers.{i}.mlp.gate.top_k_index` = the chosen experts [T, k] (int,
by decreasing probability, ties to the lowest index) and `model.layers.{i}.mlp.gate.top_k_weights` = their
weights [T, k] (after renormalisation when norm_topk_prob); `model.layers.{i}.mlp` is the whole sparse
block's output (routed experts plus shared expert) before the residual add. In sandwich blocks also
`model.layers.{i}.post_attention_layernorm` / `post_feedforward_layernorm`, the normed sublayer outputs
before their residual add. A backend
with no observer makes that free; one with an observer computes the tapped value beside the fused path,
never instead of it, so the numbers the observer sees are the ones the pass computes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..models.spec import MoeSpec
from .mixers import mixer_kind
from .ops import Ops, Route, Tap, X, sublayer_out

__all__ = ["Ops", "Route", "Tap", "X", "decoder_block", "decoder_forward", "sparse_mlp", "sublayer_out", "tap_names"]

if TYPE_CHECKING:
    from ..models.spec import LayerSpec, ModelDefinition
    from ..models.weights import Weights


def decoder_forward(ops: Ops, definition: ModelDefinition, w: Weights) -> X:
    """Embed, run every block, apply the final norm; returns the post-final-norm rows [T, H]."""
    x = ops.embed(w.embed, scale=definition.embed_scale)
    ops.tap("model.embed_tokens", x)
    for i, (layer, lw) in enumerate(zip(definition.layers, w.layers)):
        x = decoder_block(ops, i, layer, lw, x)
    h = ops.norm(x, w.final_norm, definition.norm, out="h")
    ops.tap("model.norm", h)
    return h


def decoder_block(ops: Ops, i: int, layer: LayerSpec, lw: dict[str, Any], x: X) -> X:
    """Block i: its mixer, then its MLP (dense or sparse), each added into the residual stream x."""
    p = f"model.layers.{i}"
    x = mixer_kind(layer.mixer.kind).forward(ops, i, layer, lw, x)
    if isinstance(layer.mlp, MoeSpec):
        x = sparse_mlp(ops, layer, lw, x, i)
    else:
        if getattr(ops, "fine_taps", False):
            fine_mlp_taps(ops, layer, lw, x, p)
        act = ops.gated_mlp(x, lw["gate_up"], norm=(lw["mlp_norm"], layer.norm), activation=layer.mlp.activation)
        if getattr(ops, "fine_taps", False):
            ops.tap(f"{p}.mlp.down_proj.input", act)
        x = sublayer_out(ops, act, lw["down"], None, lw.get("mlp_out_norm"), layer.norm, x,
                         f"{p}.mlp", f"{p}.post_feedforward_layernorm")
    ops.tap(p, x)
    return x


def fine_taps_mlp_norm(layer: LayerSpec, p: str) -> str:
    """The tap name of a dense MLP's input norm: its checkpoint module (post_attention_layernorm in Llama,
    pre_feedforward_layernorm in Gemma's sandwich blocks)."""
    param = next(q for q in layer.params if q.key == "mlp_norm")
    return param.parts[0].name.removesuffix(".weight")


def fine_mlp_taps(ops: Ops, layer: LayerSpec, lw: dict[str, Any], x: X, p: str) -> None:
    """--taps fine of a dense MLP, computed beside its fused path: the normed input, gate and up (before the
    activation)."""
    ops.tap(fine_taps_mlp_norm(layer, p), ops.norm(x, lw["mlp_norm"], layer.norm, out="h"))
    gu = ops.linear(x, lw["gate_up"], out="gate_up", norm=(lw["mlp_norm"], layer.norm))
    half = gu.shape[1] // 2
    ops.tap(f"{p}.mlp.gate_proj", gu[:, :half])
    ops.tap(f"{p}.mlp.up_proj", gu[:, half:])


def sparse_mlp(ops: Ops, layer: LayerSpec, lw: dict[str, Any], x: X, i: int) -> X:
    """A mixture-of-experts MLP (layer.mlp a MoeSpec): route, then the chosen experts added into x."""
    spec, norm, p = layer.mlp, (lw["mlp_norm"], layer.norm), f"model.layers.{i}.mlp"
    route = ops.route(x, lw["router"], spec, norm=norm, bias=lw.get("router_bias"),
                      correction=lw.get("router_correction"))
    ops.tap(f"{p}.gate", route.logits)
    ops.tap(f"{p}.gate.top_k_index", route.top_k_index)
    ops.tap(f"{p}.gate.top_k_weights", route.top_k_weights)
    shared = (lw["shared_gate_up"], lw["shared_down"]) if spec.shared_expert_size else None
    bias = (lw["experts_gate_up_bias"], lw["experts_down_bias"]) if spec.expert_bias else None
    return ops.experts(x, route, lw["experts_gate_up"], lw["experts_down"], spec, norm=norm, shared=shared, tap=p,
                       bias=bias)


def tap_names(definition: ModelDefinition, fine: bool = False) -> list[str]:
    """Every tap point in forward order (what a layer dump can hold); with `fine`, the --taps fine ones too."""
    names = ["model.embed_tokens"]
    for i, layer in enumerate(definition.layers):
        p, keys = f"model.layers.{i}", layer.keys()
        kind = mixer_kind(layer.mixer.kind)
        names += kind.tap_names(p, layer, fine) if fine and layer.mixer.kind == "attention" else kind.tap_names(p, layer)
        if isinstance(layer.mlp, MoeSpec):
            names += [f"{p}.mlp.gate{s}" for s in ("", ".top_k_index", ".top_k_weights")]
        elif fine:
            names += [fine_taps_mlp_norm(layer, p), f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj", f"{p}.mlp.down_proj.input"]
        names.append(f"{p}.mlp")
        names += [f"{p}.post_feedforward_layernorm"] if "mlp_out_norm" in keys else []
        names.append(p)
    return names + ["model.norm"]
