"""When a longrope model (Phi-3 / Phi-4-mini) runs its long factors, and what that means for the cache.

transformers picks the factor set once per forward call, from the highest position it runs: long when
that position + 1 > original_max_position_embeddings, else short, for every row of the call. Keys that an
earlier call cached keep the rotation they got, but generate() does not mix the two: Phi3ForCausalLM's
prepare_inputs_for_generation drops the cache at the first step that crosses the boundary and re-runs the
whole sequence with the long factors. The engines do the same in both directions: every call uses one set
for all its rows, and a cache computed with the other set is recomputed first from the cached tokens (once
per crossing, e.g. when decoding passes the boundary, or when a trim goes back below it). So every row
equals transformers' forward of its call over the cached prefix, and greedy decoding equals generate().
"""

from __future__ import annotations

from ..models.spec import ModelDefinition


def _ropes(definition: ModelDefinition) -> list:
    """The rope of every layer whose mixer rotates (a mixer kind without rope has none)."""
    return [rope for rope in (getattr(layer.mixer, "rope", None) for layer in definition.layers) if rope is not None]


def has_longrope(definition: ModelDefinition) -> bool:
    return any(rope.longrope is not None for rope in _ropes(definition))


def long_factors(definition: ModelDefinition, call_end: int) -> bool:
    """Whether a call whose last position is call_end - 1 runs the long factors."""
    return any(rope.uses_long(call_end) for rope in _ropes(definition))
