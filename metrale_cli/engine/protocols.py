"""The engine protocol: the passes every backend implements, behind the ModelLogits interface."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

from ..logits import ModelLogits

if TYPE_CHECKING:
    from ..config import ModelConfig
    from .loop import Tap


class Engine(ModelLogits, Protocol):
    """Passes start at `length`, the number of positions held in the KV cache.

    prefill(tokens)   the prompt in one forward (chunked where a backend bounds scratch memory); the
                      logits buffer gets every row (all_logits) or the last; returns the rows written
    decode(token)     one token; its row goes to the decode buffer (decode_logits_ptr)
    verify(tokens)    k tokens in one forward; [k, vocab] rows go to the logits buffer
    trim(length)      keep the first `length` cached positions (rolls back rejected drafts)
    """

    cfg: ModelConfig
    device: str  # "cpu" | "cuda"
    max_context: int
    length: int

    def prefill(self, tokens: Sequence[int], all_logits: bool = False) -> int: ...
    def decode(self, token: int) -> None: ...
    def verify(self, tokens: Sequence[int]) -> int: ...
    def trim(self, length: int) -> None: ...
    def reset(self) -> None: ...
    def synchronize(self) -> None: ...
    def observe(self, tokens: Sequence[int], tap: Tap) -> None:
        """Run `tokens` as one pass from the current length with `tap` seeing every tapped value (eager,
        the same kernels as the fast path; the cache is advanced as by prefill)."""
        ...
