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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from ..models.spec import MoeSpec
from .mixers import mixer_kind

if TYPE_CHECKING:
    from ..models.spec import LayerSpec, ModelDefinition, Norm
    from ..models.weights import Weights

X = Any  # a backend's activation array, [rows, width] fp32
NormArg = "tuple[Any, Norm]"  # (norm weight, norm kind)

# An observer of tapped values: tap(name, rows [T, width]) with the backend's array.
Tap = Callable[[str, Any], None]


class Ops(Protocol):
    """What a backend implements for one pass of T rows at positions start..start+T-1."""

    def embed(self, table: Any, scale: float | None = None) -> X: ...  # [T, H] fp32 rows (times scale)
    def linear(self, x: X, w: Any, bias: Any = None, *, out: str, norm: Any = None, residual: X | None = None,
               tap: str | None = None, reduce: bool = False) -> X:
        """y = norm(x) @ w.T + bias; with `residual`, residual += y and residual is returned. `out` names
        the activation buffer y lives in (backends with preallocated buffers use it); `tap` names y.
        `reduce` marks a row-parallel projection (o, down): a tensor-parallel rank holds only some of w's
        input columns, so its y is a partial sum that is all-reduced (bias added once) before the
        residual add or the norm that follows; an unsharded engine ignores it."""
        ...
    def mixer(self, layer: int) -> Any:
        """The backend's ops of layer `layer`'s mixer kind for this pass (engine/mixers.py; for attention
        the AttentionOps of engine/attention.py)."""
        ...
    def gated_mlp(self, x: X, w_gate_up: Any, *, norm: Any, activation: str) -> X: ...  # act(g) * u [T, I]
    def norm(self, x: X, weight: Any, norm: Norm, *, out: str, residual: X | None = None,
             tap: str | None = None) -> X:
        """RMSNorm of x; with `residual`, residual += it and residual is returned (`tap` names the norm)."""
    def route(self, x: X, w_router: Any, spec: MoeSpec, *, norm: Any, bias: Any = None,
              correction: Any = None) -> Route:
        """The router of a sparse layer on norm(x), by spec.router's kind (models/spec.RouterSpec), in fp32;
        w_router [E (+1 shared gate row), H], `bias` [E] its bias, `correction` [E] the choice correction."""
        ...
    def experts(self, x: X, route: Route, w_gate_up: Any, w_down: Any, spec: MoeSpec, *, norm: Any,
                shared: tuple[Any, Any] | None, tap: str, bias: tuple[Any, Any] | None = None) -> X:
        """x + y, y = sum over the route's experts of weight * down_e(glu(gate_up_e(h))), h = norm(x),
        with the experts' (gate_up, down) biases when `bias`,
        plus sigmoid(route.shared_gate) * the shared expert (shared = its gate_up, down) when given;
        `tap` names y. A tensor-parallel rank holds only spec.held's experts and some columns of the
        shared expert: its y is a partial sum (the route's other experts skipped), all-reduced before
        the residual add, as `linear(reduce=True)` does."""
        ...
    def tap(self, name: str, x: X) -> None: ...


@dataclass
class Route:
    """The router's choice for T rows, in a backend's arrays."""

    logits: Any  # [T, E] router logits
    top_k_index: Any  # [T, k] chosen experts, by decreasing probability (ties: the lowest index first)
    top_k_weights: Any  # [T, k] their weights
    shared_gate: Any = None  # [T, 1] sigmoid(shared_expert_gate(h)) when the block has a shared expert


def decoder_forward(ops: Ops, definition: ModelDefinition, w: Weights) -> X:
    """Embed, run every block, apply the final norm; returns the post-final-norm rows [T, H]."""
    x = ops.embed(w.embed, scale=definition.embed_scale)
    ops.tap("model.embed_tokens", x)
    for i, (layer, lw) in enumerate(zip(definition.layers, w.layers)):
        p = f"model.layers.{i}"
        x = mixer_kind(layer.mixer.kind).forward(ops, i, layer, lw, x)
        if isinstance(layer.mlp, MoeSpec):
            x = sparse_mlp(ops, layer, lw, x, i)
        else:
            act = ops.gated_mlp(x, lw["gate_up"], norm=(lw["mlp_norm"], layer.norm), activation=layer.mlp.activation)
            x = sublayer_out(ops, act, lw["down"], None, lw.get("mlp_out_norm"), layer.norm, x,
                             f"{p}.mlp", f"{p}.post_feedforward_layernorm")
        ops.tap(p, x)
    h = ops.norm(x, w.final_norm, definition.norm, out="h")
    ops.tap("model.norm", h)
    return h


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


def sublayer_out(ops: Ops, y_in: X, w: Any, bias: Any, out_norm: Any, norm: Norm, x: X, tap: str,
                 norm_tap: str) -> X:
    """A sublayer's output projection (o, down, a mixer's out_proj) added to the residual x: straight into
    it (the projection's epilogue), or in a sandwich block (out_norm given) through that norm first, which
    needs the projection on its own."""
    if out_norm is None:
        return ops.linear(y_in, w, bias, out="x", residual=x, tap=tap, reduce=True)
    y = ops.linear(y_in, w, bias, out="h", tap=tap, reduce=True)
    return ops.norm(y, out_norm, norm, out="x", residual=x, tap=norm_tap)


def tap_names(definition: ModelDefinition) -> list[str]:
    """Every tap point in forward order (what a layer dump can hold)."""
    names = ["model.embed_tokens"]
    for i, layer in enumerate(definition.layers):
        p, keys = f"model.layers.{i}", layer.keys()
        names += mixer_kind(layer.mixer.kind).tap_names(p, layer)
        if isinstance(layer.mlp, MoeSpec):
            names += [f"{p}.mlp.gate{s}" for s in ("", ".top_k_index", ".top_k_weights")]
        names.append(f"{p}.mlp")
        names += [f"{p}.post_feedforward_layernorm"] if "mlp_out_norm" in keys else []
        names.append(p)
    return names + ["model.norm"]
