"""The engine protocol: the passes every backend implements, behind the ModelLogits interface."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

from ..logits import ModelLogits

if TYPE_CHECKING:
    from ..config import ModelConfig
    from .ops import Tap


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
    # While set, every pass hands the block loop's tapped values (host fp32 arrays [rows, width]) to it:
    # the same computation as without it (the GPU runs the same launches eagerly instead of replaying a
    # graph), so an observer sees the numbers the passes produce.
    tap: Tap | None

    def prefill(self, tokens: Sequence[int], all_logits: bool = False) -> int: ...
    def decode(self, token: int) -> None: ...
    def verify(self, tokens: Sequence[int]) -> int: ...
    def trim(self, length: int) -> None: ...
    def reset(self) -> None: ...
    def synchronize(self) -> None: ...
