"""The sections after a pass report's table: the hidden-state summary and the timings."""

from __future__ import annotations

import json
import statistics
from typing import TYPE_CHECKING, Any, Callable

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .common import Meta, num, write

if TYPE_CHECKING:
    from ..decoding.results import HiddenSummary, Timings


def base_timings(t: Timings, tokens: int | None = None) -> dict[str, Any]:
    """load and prefill, and the prefill's rate over `tokens` (default: the prompt's)."""
    return {"load_s": num(t.load_s, ".3f"), "prefill_ms": num(1000 * t.prefill_s, ".3f"),
            **mean_rate("prefill_", t.prefill_s, t.prompt_tokens if tokens is None else tokens)}


def mean_rate(prefix: str, seconds: float, tokens: int) -> dict[str, Any]:
    """`tokens` over `seconds` on one basis, the mean: ms per token and its reciprocal, tokens per second."""
    ok = seconds > 0 and tokens > 0
    return {f"{prefix}per_token_ms_mean": num(1000 * seconds / tokens, ".3f") if ok else None,
            f"{prefix}tokens_per_s_mean": num(tokens / seconds, ".1f") if ok else None}


def median_ms(step_s: list[float]) -> float | None:
    """The median step in ms (3 decimals); None without steps."""
    return num(1000 * statistics.median(step_s), ".3f") if step_s else None


def median_rate(step_s: list[float]) -> dict[str, Any]:
    """Steps that produce one token each: the median step, and the rate of that median step."""
    median = statistics.median(step_s) if step_s else 0.0
    return {"per_token_ms_median": median_ms(step_s),
            "tokens_per_s_of_median": num(1 / median, ".1f") if median > 0 else None}


def json_tail(doc: dict[str, Any], meta: Meta, hidden: HiddenSummary | None,
              timings: Callable[[], dict[str, Any]]) -> None:
    if hidden is not None:
        doc["hidden"] = hidden_json(hidden)
    if meta.timings:
        doc["timings"] = timings()


def hidden_json(h: HiddenSummary) -> dict[str, Any]:
    return {"size": h.size, "norm": num(h.norm, ".6g"), "mean": num(h.mean, ".6g"), "std": num(h.std, ".6g"),
            "min": num(h.min, ".6g"), "max": num(h.max, ".6g"), "first": [num(x, ".6g") for x in h.first],
            "sha256": h.sha256}


def plain_hidden(c: Console, h: HiddenSummary | None) -> None:
    if h is None:
        return
    d = hidden_json(h)
    write(c, f"hidden: size {d['size']} norm {h.norm:.6g} mean {h.mean:.6g} std {h.std:.6g} "
             f"min {h.min:.6g} max {h.max:.6g}")
    write(c, "hidden_first: " + " ".join(f"{x:.6g}" for x in h.first))
    write(c, f"hidden_sha256: {h.sha256}")


def rich_hidden(c: Console, h: HiddenSummary | None) -> None:
    """Grids that fit 80 columns whatever the values (a %.6g value takes up to 12 characters): the
    statistics three to a line, the first values four to a line, then the sha256."""
    if h is None:
        return
    c.print(Text("hidden state after the final norm (last row)", style="italic"))
    stats = Table.grid(padding=(0, 2))
    for _ in range(3):
        stats.add_column(style="bold", no_wrap=True)
        stats.add_column(justify="right", no_wrap=True)
    stats.add_row("size", str(h.size), "norm", f"{h.norm:.6g}", "mean", f"{h.mean:.6g}")
    stats.add_row("std", f"{h.std:.6g}", "min", f"{h.min:.6g}", "max", f"{h.max:.6g}")
    c.print(stats)
    first = Table.grid(padding=(0, 1))
    first.add_column(style="bold", no_wrap=True)
    for _ in range(4):
        first.add_column(justify="right", no_wrap=True)
    for i in range(0, len(h.first), 4):
        values = [f"{x:.6g}" for x in h.first[i:i + 4]]
        first.add_row(f"first[{i}:{i + len(values)}]", *values, *[""] * (4 - len(values)))
    c.print(first)
    c.print(Text(f"sha256 {h.sha256}", style="dim", no_wrap=True, overflow="ellipsis"))


_TIMING_LABELS = {
    "load_s": ("load", "s"), "prefill_ms": ("prefill", "ms"), "verify_ms": ("verify pass", "ms"),
    "speedup": ("speedup", "x"), "plain_tokens_match": ("same tokens as plain greedy", ""),
}


def timing_label(key: str) -> tuple[str, str]:
    """A timings key as rich shows it, with its unit: prefill_tokens_per_s_mean -> ("prefill tokens/s
    (mean)", ""), per_token_ms_median -> ("per token (median)", "ms")."""
    if key in _TIMING_LABELS:
        return _TIMING_LABELS[key]
    basis = ""
    for suffix, shown in (("_of_median", "of the median"), ("_mean", "mean"), ("_median", "median")):
        if key.endswith(suffix):
            key, basis = key.removesuffix(suffix), f" ({shown})"
            break
    unit = "ms" if key.endswith("_ms") else ""
    words = key.removesuffix("_ms").replace("_per_s", "/s").replace("_", " ").replace("per pass", "per verify pass")
    return words + basis, unit


def plain_timings(c: Console, timings: dict[str, Any]) -> None:
    for key, value in timings.items():
        shown = "n/a" if value is None else json.dumps(value) if isinstance(value, bool) else value
        write(c, f"timings.{key}: {shown}")


def rich_timings(c: Console, timings: dict[str, Any]) -> None:
    t = Table(title="timings", title_justify="left", show_header=False)
    t.add_column("")
    t.add_column("", justify="right")
    for key, value in timings.items():
        label, unit = timing_label(key)
        shown = "n/a" if value is None else ("yes" if value else "no") if isinstance(value, bool) else f"{value} {unit}"
        t.add_row(label, shown.strip())
    c.print(t)
