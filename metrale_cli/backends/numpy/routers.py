"""The router kinds of models/spec.RouterSpec on the NumPy engine: one function each, in fp32, the
reference. Each takes the router logits [T, E] (fp32, bias added) and returns the chosen experts [T, k]
(by decreasing choice score, ties to the lowest index) and their weights [T, k] before MoeSpec's
renormalisation (applied by `moe.route` for every kind)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from .ops import sigmoid, softmax

if TYPE_CHECKING:
    from ...models.spec import MoeSpec


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices [T, k] of the k largest values per row, largest first, equal values by increasing index."""
    return np.argsort(-scores, axis=-1, kind="stable")[:, :k]


def softmax_topk(logits: np.ndarray, spec: MoeSpec, correction: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    probs = softmax(logits)
    index = top_k(probs, spec.top_k)
    return index, np.take_along_axis(probs, index, axis=-1)


def topk_softmax(logits: np.ndarray, spec: MoeSpec, correction: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    index = top_k(logits, spec.top_k)
    return index, softmax(np.take_along_axis(logits, index, axis=-1))


def softmax_group_limited(logits: np.ndarray, spec: MoeSpec,
                          correction: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    r, (t, e) = spec.router, logits.shape
    probs = softmax(logits)
    best = probs.reshape(t, r.n_group, e // r.n_group).max(axis=-1)  # [T, n_group]
    keep = np.zeros((t, r.n_group), bool)
    np.put_along_axis(keep, top_k(best, r.topk_group), True, axis=-1)
    masked = np.where(np.repeat(keep, e // r.n_group, axis=-1), probs, np.float32(0))  # as transformers: 0, not -inf
    index = top_k(masked, spec.top_k)
    return index, np.take_along_axis(masked, index, axis=-1)


def sigmoid_biased_grouped(logits: np.ndarray, spec: MoeSpec,
                           correction: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    r, (t, e) = spec.router, logits.shape
    scores = sigmoid(logits)
    choice = scores if correction is None else scores + correction  # the correction steers the choice only
    if r.n_group > 1:
        grouped = choice.reshape(t, r.n_group, e // r.n_group)
        best_two = -np.sort(-grouped, axis=-1)[..., :2].sum(axis=-1)  # [T, n_group]
        groups = top_k(best_two, r.topk_group)
        keep = np.zeros((t, r.n_group), bool)
        np.put_along_axis(keep, groups, True, axis=-1)
        choice = np.where(np.repeat(keep, e // r.n_group, axis=-1), choice, np.float32(-np.inf))
    index = top_k(choice, spec.top_k)
    return index, np.take_along_axis(scores, index, axis=-1)


ROUTERS: dict[str, Callable[[np.ndarray, MoeSpec, np.ndarray | None], tuple[np.ndarray, np.ndarray]]] = {
    "softmax_topk": softmax_topk, "topk_softmax": topk_softmax, "softmax_group_limited": softmax_group_limited,
    "sigmoid_biased_grouped": sigmoid_biased_grouped}
