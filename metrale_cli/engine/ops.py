"""What a backend implements for one pass of the block loop (`Ops`), the router's result (`Route`), and the one
step every sublayer ends with (`sublayer_out`: its output projection added to the residual stream). engine/loop.py
runs the blocks over these; each mixer kind's forward (engine/mixers.py) uses them too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from ..models.spec import MoeSpec, Norm

X = Any  # a backend's activation array, [rows, width] fp32
NormArg = "tuple[Any, Norm]"  # (norm weight, norm kind)

# An observer of tapped values: tap(name, rows [T, width]) with the backend's array.
Tap = Callable[[str, Any], None]


class Ops(Protocol):
    """What a backend implements for one pass of T rows at positions start..start+T-1.

    `fine_taps`: the pass also taps the values inside a block that other engines dump (the normed inputs, q/k/v
    after the projection and after rope, the attention output before o_proj, the MLP's gate/up and the input of
    down_proj; `--taps fine`), computed beside the block's own path; False on a backend that does not."""

    fine_taps: bool = False

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
    def join(self, a: X, b: X, *, out: str) -> X:
        """[T, A + B]: a's columns, then b's (a multi-token-prediction layer's input, engine/mtp.py; a backend
        that does not run MTP layers need not implement it)."""
        ...


@dataclass
class Route:
    """The router's choice for T rows, in a backend's arrays."""

    logits: Any  # [T, E] router logits
    top_k_index: Any  # [T, k] chosen experts, by decreasing probability (ties: the lowest index first)
    top_k_weights: Any  # [T, k] their weights
    shared_gate: Any = None  # [T, 1] sigmoid(shared_expert_gate(h)) when the block has a shared expert


def sublayer_out(ops: Ops, y_in: X, w: Any, bias: Any, out_norm: Any, norm: Norm, x: X, tap: str,
                 norm_tap: str) -> X:
    """A sublayer's output projection (o, down, a mixer's out_proj) added to the residual x: straight into
    it (the projection's epilogue), or in a sandwich block (out_norm given) through that norm first, which
    needs the projection on its own."""
    if out_norm is None:
        return ops.linear(y_in, w, bias, out="x", residual=x, tap=tap, reduce=True)
    y = ops.linear(y_in, w, bias, out="h", tap=tap, reduce=True)
    return ops.norm(y, out_norm, norm, out="x", residual=x, tap=norm_tap)
