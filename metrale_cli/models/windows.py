"""Which layers attend through a sliding window, read as transformers 5 reads each family's config.

A sliding layer's query at position p attends to the keys in (p - sliding_window, p]; a full layer to
all of [0, p]. Every family ends with `layer_types` (one "full_attention" / "sliding_attention" per
layer) and one `sliding_window` for the sliding ones:

    mistral, phi3   every layer slides when sliding_window is set (their models ignore layer_types)
    qwen2, qwen3    sliding_window applies only with use_sliding_window, and then to the layers that
                    layer_types marks sliding (default: layer i >= max_window_layers)
    gemma2          layer_types, default: even layers sliding, odd ones full
    gemma3          layer_types, default: sliding unless (i + 1) % sliding_window_pattern == 0 (5 : 1)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .model_config import ConfigReader

FULL, SLIDING = "full_attention", "sliding_attention"


def read_window(r: ConfigReader) -> int | None:
    window = r.optional("sliding_window", int, None)
    if window is not None and window <= 0:
        r.refuse("sliding_window", window, "must be a positive number of positions")
    return window


def read_layer_types(r: ConfigReader, default: Callable[[int], str]) -> tuple[str, ...]:
    """`layer_types` from the config when present (checked), else default(i) for every layer."""
    n = r.positive_int("num_hidden_layers")
    given = r.optional("layer_types", list, None)
    if given is None:
        return tuple(default(i) for i in range(n))
    bad = [t for t in given if t not in (FULL, SLIDING)]
    if bad:
        r.refuse("layer_types", bad[0], f"supported layer types: {FULL}, {SLIDING}")
    if len(given) != n:
        r.refuse("layer_types", f"{len(given)} entries", f"num_hidden_layers is {n}")
    return tuple(given)


def all_sliding(r: ConfigReader) -> dict:
    """mistral / phi3: one window for every layer when sliding_window is set."""
    window = read_window(r)
    n = r.positive_int("num_hidden_layers")
    return dict(sliding_window=window, layer_types=(SLIDING,) * n if window is not None else ())


def qwen_windows(r: ConfigReader) -> dict:
    """qwen2 / qwen3: `sliding_window` counts only with `use_sliding_window`, on the layers layer_types
    marks sliding (by default those from max_window_layers on)."""
    window = read_window(r) if r.optional("use_sliding_window", bool, False) else None
    if window is None:
        return dict(sliding_window=None, layer_types=())
    first = r.optional("max_window_layers", int, 28)
    return dict(sliding_window=window, layer_types=read_layer_types(r, lambda i: SLIDING if i >= first else FULL))
