"""The mixture-of-experts ops of the NumPy engine (NumpyPass.route / .experts): the reference, in fp32.

Routing is the spec's router kind (routers.py), its weights renormalised when norm_topk_prob. Ties go to
the lowest expert index (a stable sort), a deterministic rule the CUDA router kernel follows too; torch.topk
on the CPU does not promise it (for three equal values it returned indices 1, 4, 3), so a tie, which random
weights make measure-zero, is the one case where the choice may differ from transformers'.

The experts run once per expert over the tokens that chose it (tokens grouped by expert), in increasing
expert order, each output scaled by its routing weight and added into y, as transformers' eager experts
loop does.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ...engine.ops import Route
from ...models.spec import MoeSpec
from .ops import keep, sigmoid
from .routers import ROUTERS
from .stored import matmul


def route(h: np.ndarray, w_router: np.ndarray, spec: MoeSpec, bias: np.ndarray | None = None,
          correction: np.ndarray | None = None, r=keep) -> Route:
    """The router on normed rows h [T, H]; w_router [E (+1), H], the extra row the shared expert's gate;
    `bias` [E] the router's bias, `correction` [E] the choice correction of sigmoid_biased_grouped. Under
    bf16 rounding (`r`) the logits are rounded, the routing computed in fp32 and its weights rounded."""
    logits = r(matmul(h, w_router) if bias is None else matmul(h, w_router) + np.concatenate(
        [bias, np.zeros(w_router.shape[0] - len(bias), np.float32)]))  # [T, E (+1)]
    router_logits = logits[:, :spec.num_experts]
    index, weights = ROUTERS[spec.router.kind](router_logits, spec, correction)
    if spec.norm_topk_prob:
        denominator = weights.sum(axis=-1, keepdims=True)
        weights = weights / (denominator + np.float32(1e-20) if spec.router.kind == "sigmoid_biased_grouped"
                             else denominator)
    if spec.router.routed_scaling_factor != 1.0:
        weights = weights * np.float32(spec.router.routed_scaling_factor)
    gated = spec.shared_expert_size and spec.shared_expert_gated
    shared_gate = r(sigmoid(logits[:, spec.num_experts:])) if gated else None
    return Route(router_logits, index, r(weights), shared_gate)


def experts(h: np.ndarray, route: Route, w_gate_up: np.ndarray, w_down: np.ndarray,
            glu: Callable[[np.ndarray], np.ndarray], first: int = 0,
            bias: tuple[np.ndarray, np.ndarray] | None = None, r=keep) -> np.ndarray:
    """y [T, H] = sum over each row's chosen experts of weight * down_e(glu(gate_up_e(h))).
    w_gate_up [E, 2I, H], w_down [E, H, I]: experts first .. first + E - 1 (a tensor-parallel rank's;
    the route's choices of other experts are skipped, so y is that rank's partial sum); `bias`: their
    gate_up [E, 2I] and down [E, H] biases."""
    t, k = route.top_k_index.shape
    flat = route.top_k_index.reshape(-1)  # (token, slot) pairs, token-major
    order = np.argsort(flat, kind="stable")  # grouped by expert, tokens in order within a group
    bounds = np.searchsorted(flat[order], np.arange(first, first + w_gate_up.shape[0] + 1))
    y = np.zeros_like(h)
    for e in range(w_gate_up.shape[0]):
        pairs = order[bounds[e]:bounds[e + 1]]
        if len(pairs) == 0:
            continue
        tokens = pairs // k  # distinct: top-k indices of one row are distinct
        b_gu, b_down = (None, None) if bias is None else (bias[0][e], bias[1][e])
        out = matmul(gated(h[tokens], w_gate_up[e], glu, b_gu, r), w_down[e])
        out = r(out if b_down is None else out + b_down)
        y[tokens] = r(y[tokens] + r(out * route.top_k_weights.reshape(-1)[pairs][:, None]))
    return y


def gated(h: np.ndarray, w_gate_up: np.ndarray, glu: Callable[[np.ndarray], np.ndarray],
          bias: np.ndarray | None = None, r=keep) -> np.ndarray:
    """glu(h @ [gate; up].T (+ bias)) [T, I] with w_gate_up = [gate; up] [2I, H] (ops.glu)."""
    gu = matmul(h, w_gate_up)
    return glu(r(gu if bias is None else gu + bias))
