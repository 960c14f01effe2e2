"""The mixture-of-experts ops of the NumPy engine (NumpyPass.route / .experts): the reference, in fp32.

Routing follows transformers' Qwen2Moe/Qwen3Moe/MixtralTopKRouter: softmax over all experts in fp32, the
top_k largest probabilities, divided by their sum when norm_topk_prob. Ties are broken towards the lowest
expert index (a stable sort), a deterministic rule the CUDA router kernel follows too; torch.topk on the
CPU does not promise it (for three equal values it returned indices 1, 4, 3), so a tie, which random
weights make measure-zero, is the one case where the choice may differ from transformers'.

The experts run once per expert over the tokens that chose it (tokens grouped by expert), in increasing
expert order, each output scaled by its routing weight and added into y, as transformers' eager experts
loop does.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ...engine.loop import Route
from ...models.spec import MoeSpec
from .ops import sigmoid, softmax


def top_k(probs: np.ndarray, k: int) -> np.ndarray:
    """Indices [T, k] of the k largest values per row, largest first, equal values by increasing index."""
    return np.argsort(-probs, axis=-1, kind="stable")[:, :k]


def route(h: np.ndarray, w_router: np.ndarray, spec: MoeSpec) -> Route:
    """The router on normed rows h [T, H]; w_router [E (+1), H], the extra row the shared expert's gate."""
    logits = h @ w_router.T  # [T, E (+1)]
    router_logits = logits[:, :spec.num_experts]
    probs = softmax(router_logits)
    index = top_k(probs, spec.top_k)
    weights = np.take_along_axis(probs, index, axis=-1)
    if spec.norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    shared_gate = sigmoid(logits[:, spec.num_experts:]) if spec.shared_expert_size else None
    return Route(router_logits, index, weights, shared_gate)


def experts(h: np.ndarray, r: Route, w_gate_up: np.ndarray, w_down: np.ndarray,
            act: Callable[[np.ndarray], np.ndarray], first: int = 0) -> np.ndarray:
    """y [T, H] = sum over each row's chosen experts of weight * down_e(act(gate_e(h)) * up_e(h)).
    w_gate_up [E, 2I, H], w_down [E, H, I]: experts first .. first + E - 1 (a tensor-parallel rank's;
    the route's choices of other experts are skipped, so y is that rank's partial sum)."""
    t, k = r.top_k_index.shape
    flat = r.top_k_index.reshape(-1)  # (token, slot) pairs, token-major
    order = np.argsort(flat, kind="stable")  # grouped by expert, tokens in order within a group
    bounds = np.searchsorted(flat[order], np.arange(first, first + w_gate_up.shape[0] + 1))
    y = np.zeros_like(h)
    for e in range(w_gate_up.shape[0]):
        pairs = order[bounds[e]:bounds[e + 1]]
        if len(pairs) == 0:
            continue
        tokens = pairs // k  # distinct: top-k indices of one row are distinct
        out = gated(h[tokens], w_gate_up[e], act) @ w_down[e].T
        y[tokens] += out * r.top_k_weights.reshape(-1)[pairs][:, None]
    return y


def gated(h: np.ndarray, w_gate_up: np.ndarray, act: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """act(h @ gate.T) * (h @ up.T) with w_gate_up = [gate; up] [2I, H]."""
    gu = h @ w_gate_up.T
    i = gu.shape[1] // 2
    return act(gu[:, :i]) * gu[:, i:]
