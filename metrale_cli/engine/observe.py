"""What the block loop's taps are used for: finding where non-finite values start, and recording layers.

`engine.tap` (engine/protocols.py) is an observer every pass hands its tapped values to. `LayerRecorder`
records them during a command's own passes (what --dump-layers writes); `first_nonfinite` re-runs tokens
from an empty cache with an observer that stops at the first NaN/Inf.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from .protocols import Engine


@dataclass(frozen=True)
class NonFinite:
    name: str  # the tap: model.embed_tokens, model.layers.{i}.self_attn / .mlp, model.layers.{i}, model.norm
    row: int  # the first row (of the tokens run) holding NaN/Inf there
    nan: int  # NaN count in that tensor
    inf: int  # Inf count

    def describe(self, tokens: Sequence[int]) -> str:
        where = _module_words(self.name)
        token = f"token {tokens[self.row]} " if 0 <= self.row < len(tokens) else ""
        return (f"first non-finite values in {self.name} ({where}), {token}at position {self.row}: "
                f"{self.nan} NaN, {self.inf} Inf")


def first_nonfinite(engine: Engine, tokens: Sequence[int]) -> NonFinite | None:
    """The first tapped tensor, in forward order, holding NaN or Inf when `tokens` run from position 0.
    None when every tapped tensor is finite (then the non-finite values come from lm_head)."""
    found: list[NonFinite] = []

    def tap(name: str, x: np.ndarray) -> None:
        if found:
            return
        bad = ~np.isfinite(x)
        if bad.any():
            rows = bad.reshape(bad.shape[0], -1).any(axis=1)
            found.append(NonFinite(name, int(np.argmax(rows)), int(np.isnan(x).sum()), int(np.isinf(x).sum())))

    engine.reset()
    with tapping(engine, tap):
        engine.prefill(list(tokens))
    return found[0] if found else None


def describe_nonfinite(engine: Engine, tokens: Sequence[int]) -> str:
    """One sentence naming where non-finite values first appear for `tokens` (prompt + generated)."""
    hit = first_nonfinite(engine, tokens)
    if hit is None:
        return "every layer's output and the final norm are finite: lm_head (or the logits conversion) made them"
    return hit.describe(tokens)


@contextlib.contextmanager
def tapping(engine: Engine, tap: Callable[[str, np.ndarray], None]) -> Iterator[None]:
    """Every pass inside the block hands its tapped values to `tap`."""
    previous = engine.tap
    engine.tap = tap
    try:
        yield
    finally:
        engine.tap = previous


@dataclass
class LayerRecorder:
    """Records the tapped values `keep` selects over every pass of a command, in the order they ran.

    Each pass's rows are appended at the positions it ran at (read from the engine as the pass starts:
    the embedding is its first tap), so after a trimmed draft the positions say which rows were redone."""

    engine: Engine
    keep: Callable[[str], bool]
    layers: list[int] = field(default_factory=list)  # the layer indices `keep` selects (for the dump's metadata)
    rows: dict[str, list[np.ndarray]] = field(default_factory=dict)
    positions: list[int] = field(default_factory=list)

    def __call__(self, name: str, x: np.ndarray) -> None:
        if name == "model.embed_tokens":  # an MTP layer's cache starts at position 1 (NumpyEngine.position_offset)
            first = self.engine.length + getattr(self.engine, "position_offset", 0)
            self.positions.extend(range(first, first + x.shape[0]))
        if self.keep(name):
            self.rows.setdefault(name, []).append(np.array(x, dtype=np.float32).reshape(x.shape[0], -1))

    def tensors(self) -> dict[str, np.ndarray]:
        """name -> fp32 [rows, width], every pass's rows in order."""
        return {name: np.concatenate(parts, axis=0) for name, parts in self.rows.items()}

    def at(self, positions: Sequence[int]) -> tuple[dict[str, np.ndarray], list[int]]:
        """The rows at `positions`, in that order (the rows a command's other dumps hold): a position run
        more than once (a self-drafted row the verify pass redid) gives its last run; one never run is
        left out. Returns the tensors and the positions they hold."""
        last = {p: i for i, p in enumerate(self.positions)}
        idx = [last[p] for p in positions if p in last]
        return {name: t[idx] for name, t in self.tensors().items()}, [self.positions[i] for i in idx]


def capture(engine: Engine, tokens: Sequence[int], keep: Callable[[str], bool]) -> dict[str, np.ndarray]:
    """The tapped tensors `keep` selects when `tokens` run as one prefill from position 0."""
    recorder = LayerRecorder(engine, keep)
    engine.reset()
    with tapping(engine, recorder):
        engine.prefill(list(tokens))
    return recorder.tensors()


def _module_words(name: str) -> str:
    parts = name.split(".")
    if name == "model.embed_tokens":
        return "the embedding rows"
    if name == "model.norm":
        return "the final norm"
    if len(parts) == 3:
        return f"the residual stream after layer {parts[2]}"
    if parts[3:5] == ["mlp", "gate"]:  # a sparse layer's router taps (engine/loop.py)
        return f"layer {parts[2]} router " + (parts[5].replace("_", " ") if len(parts) > 5 else "logits")
    what = {"self_attn": "attention output", "mlp": "MLP output"}.get(parts[3], parts[3])
    return f"layer {parts[2]} {what}"
