"""What every engine shares besides the logits interface: the cache length, trim and input checks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from .config import ModelConfig
from .errors import InputError
from .logits import LogitsBuffers

if TYPE_CHECKING:
    from .engine.ops import Tap


def check_context(cfg: ModelConfig, max_context: int) -> None:
    if max_context > cfg.max_context:
        raise InputError(
            f"a context of {max_context} exceeds the model's limit of {cfg.max_context} positions"
        )


class EngineBase(LogitsBuffers):
    """Passes start at `length`, the number of positions held in the KV cache."""

    cfg: ModelConfig
    max_context: int
    length: int = 0
    tap: Tap | None = None  # engine/protocols.py: an observer of every pass's tapped values
    states: dict = {}  # per mixer kind, its state of the engine's layers (engine/mixers.py): reset and trimmed here

    def reset(self) -> None:
        self.length = 0
        for state in self.states.values():
            state.reset()

    def trim(self, length: int) -> None:
        """Keep the first `length` positions of the cache (drop rejected drafts)."""
        if not 0 <= length <= self.length:
            raise InputError(f"cannot trim a cache of {self.length} positions to {length}")
        for state in self.states.values():  # e.g. a ring cannot give back positions it has overwritten
            state.trim(length)
        self.length = length

    def synchronize(self) -> None:
        """Wait for queued device work (nothing to wait for on the CPU)."""

    def _check_tokens(self, tokens: Sequence[int]) -> np.ndarray:
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise InputError("no tokens to run")
        bad = ids[(ids < 0) | (ids >= self.cfg.vocab_size)]
        if bad.size:
            raise InputError(f"token id {int(bad[0])} is outside the vocabulary [0, {self.cfg.vocab_size})")
        if self.length + ids.size > self.max_context:
            raise InputError(
                f"{self.length} cached + {ids.size} new positions exceed the KV cache of "
                f"{self.max_context} positions"
            )
        return ids
