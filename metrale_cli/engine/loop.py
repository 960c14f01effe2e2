"""The decoder's order of operations, written once for every family and every backend.

`decoder_forward` runs the rows of one pass (a prompt chunk, a decode step or a verify pass) through the
blocks a `ModelDefinition` describes, against a small set of ops (`Ops`) that each backend implements:
the NumPy engine plainly, the CUDA rows path with its fused kernels under graph capture, the CUDA
prefill path with cuBLAS and flash attention. Fusion is a backend's business inside its ops: `linear`
takes the norm that precedes it and the residual it adds into, and a backend may run them in one kernel.

Taps: at every point named after a Hugging Face module (`model.embed_tokens`, `model.layers.{i}.self_attn`
= the attention output after o_proj, before the residual add, `model.layers.{i}.mlp`, `model.layers.{i}`
= the residual stream after the layer, `model.norm`) the loop hands the value to `ops.tap`. A backend
with no observer makes that free; one with an observer computes the tapped value beside the fused path,
never instead of it, so the numbers the observer sees are the ones the pass computes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from ..models.spec import AttentionSpec, ModelDefinition, Norm
    from ..models.weights import Weights

X = Any  # a backend's activation array, [rows, width] fp32
NormArg = "tuple[Any, Norm]"  # (norm weight, norm kind)

# An observer of tapped values: tap(name, rows [T, width]) with the backend's array.
Tap = Callable[[str, Any], None]


class Ops(Protocol):
    """What a backend implements for one pass of T rows at positions start..start+T-1."""

    def embed(self, table: Any) -> X: ...  # [T, H] fp32 rows of the embedding table
    def linear(self, x: X, w: Any, bias: Any = None, *, out: str, norm: Any = None, residual: X | None = None,
               tap: str | None = None) -> X:
        """y = norm(x) @ w.T + bias; with `residual`, residual += y and residual is returned. `out` names
        the activation buffer y lives in (backends with preallocated buffers use it); `tap` names y."""
        ...
    def rope_kv_append(self, qkv: X, layer: int, spec: AttentionSpec, q_norm: Any, k_norm: Any,
                       norm: Norm) -> X: ...  # rotated q [T, heads, d]; k/v appended to the cache
    def attention(self, q: X, layer: int, spec: AttentionSpec) -> X: ...  # [T, heads * d]
    def gated_mlp(self, x: X, w_gate_up: Any, *, norm: Any, activation: str) -> X: ...  # act(g) * u [T, I]
    def norm(self, x: X, weight: Any, norm: Norm, *, out: str) -> X: ...
    def tap(self, name: str, x: X) -> None: ...


def decoder_forward(ops: Ops, definition: ModelDefinition, w: Weights) -> X:
    """Embed, run every block, apply the final norm; returns the post-final-norm rows [T, H]."""
    x = ops.embed(w.embed)
    ops.tap("model.embed_tokens", x)
    for i, (layer, lw) in enumerate(zip(definition.layers, w.layers)):
        a = layer.attention
        qkv = ops.linear(x, lw["qkv"], lw.get("qkv_bias"), out="qkv", norm=(lw["input_norm"], layer.norm))
        q = ops.rope_kv_append(qkv, i, a, lw.get("q_norm"), lw.get("k_norm"), layer.norm)
        attn = ops.attention(q, i, a)
        x = ops.linear(attn, lw["o"], lw.get("o_bias"), out="x", residual=x, tap=f"model.layers.{i}.self_attn")
        act = ops.gated_mlp(x, lw["gate_up"], norm=(lw["mlp_norm"], layer.norm), activation=layer.mlp.activation)
        x = ops.linear(act, lw["down"], out="x", residual=x, tap=f"model.layers.{i}.mlp")
        ops.tap(f"model.layers.{i}", x)
    h = ops.norm(x, w.final_norm, definition.norm, out="h")
    ops.tap("model.norm", h)
    return h


def tap_names(definition: ModelDefinition) -> list[str]:
    """Every tap point in forward order (what a layer dump can hold)."""
    names = ["model.embed_tokens"]
    for i in range(len(definition.layers)):
        names += [f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp", f"model.layers.{i}"]
    return names + ["model.norm"]
