"""How many KV positions a layer keeps: all of the context, or a ring buffer for a sliding layer.

A sliding layer (window W) never reads a key older than W - 1 positions before its query, so it keeps
only the most recent `ring_slots` positions, position p in slot p % slots. The ring must also hold
   - every position a pass writes before its queries read the window: a pass of up to `rows` tokens
     needs W - 1 + rows slots, and
   - what a trim rolls back: positions written beyond the new length overwrote the slots of older ones,
     so a trim may drop at most slots - W + 1 positions (`ring_rollback`), which is >= rows.
Both engines size their rings with these functions (the CUDA kernels with `granule` a multiple of their
key tile, so a tile never wraps around the ring).
"""

from __future__ import annotations


def ring_slots(window: int | None, max_context: int, rows: int, granule: int = 1) -> int:
    """Slots a layer keeps: max_context for a full layer or when the ring would not be smaller."""
    if window is None:
        return max_context
    need = window - 1 + rows
    need = -(-need // granule) * granule
    return min(need, max_context)


def ring_rollback(window: int | None, slots: int, max_context: int) -> int | None:
    """The most positions a trim may drop on this layer (None: no limit, the layer keeps everything)."""
    if window is None or slots >= max_context:
        return None
    return slots - window + 1
