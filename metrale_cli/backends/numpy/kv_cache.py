"""The NumPy engine's KV cache: one [kv_heads, slots, head_dim] pair per layer, a ring for sliding layers.

Full layers keep every position (slot = position). A sliding layer keeps `ring_slots` positions (slot =
position % slots, engine/kv_layout.py), so a long context costs it about its window, not the context.
`read` hands keys back in position order, so attention over a ring computes the same sums in the same
order as over a full cache.
"""

from __future__ import annotations

import numpy as np

from ...engine.kv_layout import ring_rollback, ring_slots
from ...errors import InputError
from ...models.spec import ModelDefinition


class KVCache:
    def __init__(self, definition: ModelDefinition, max_context: int, rows: int) -> None:
        """`rows`: the most positions one pass writes (the engine chunks longer passes)."""
        self.max_context = max_context
        self.slots = [ring_slots(layer.mixer.window, max_context, rows) for layer in definition.layers]
        self.rollback = [ring_rollback(layer.mixer.window, s, max_context)
                         for layer, s in zip(definition.layers, self.slots)]
        # np.zeros maps pages lazily: an unused tail of a full layer costs no memory
        self.k = [np.zeros((layer.mixer.num_kv_heads, s, layer.mixer.head_dim), np.float32)
                  for layer, s in zip(definition.layers, self.slots)]
        self.v = [np.zeros_like(k) for k in self.k]
        self.written = 0  # one past the highest position written since the last reset

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.k, self.v))

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """k, v [kv_heads, T, d] at positions start..start+T-1."""
        end = start + k.shape[1]
        self.written = max(self.written, end)
        slots = self._slots(layer, start, end)
        self.k[layer][:, slots] = k
        self.v[layer][:, slots] = v

    def read(self, layer: int, lo: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values [kv_heads, end - lo, d] of positions lo..end-1, in position order."""
        slots = self._slots(layer, lo, end)
        return self.k[layer][:, slots], self.v[layer][:, slots]

    def check_trim(self, length: int) -> None:
        """Refuse a trim to `length` that would need ring positions already overwritten."""
        dropped = self.written - length
        for layer, limit in enumerate(self.rollback):
            if limit is not None and dropped > limit:
                raise InputError(
                    f"cannot trim back {dropped} positions: sliding layer {layer} keeps a ring of "
                    f"{self.slots[layer]} positions, which allows dropping at most {limit}")

    def reset(self) -> None:
        self.written = 0

    def _slots(self, layer: int, lo: int, end: int) -> slice | np.ndarray:
        n = self.slots[layer]
        if end <= n:  # no wrap: a view, not a copy
            return slice(lo, end)
        return np.arange(lo, end) % n
