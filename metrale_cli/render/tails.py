"""The sections after a pass report's table: the hidden-state summary and the timings."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Callable

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .common import Meta, num, write

if TYPE_CHECKING:
    from ..decoding.results import HiddenSummary, Timings


def base_timings(t: Timings) -> dict[str, Any]:
    return {"load_s": num(t.load_s, ".3f"), "prefill_ms": num(1000 * t.prefill_s, ".3f")}


def prefill_timings_json(t: Timings, tokens: int) -> dict[str, Any]:
    """The timings of a command that runs one prefill: load, prefill, and the `tokens` it ran per second."""
    out = base_timings(t)
    out["tokens_per_s"] = num(tokens / t.prefill_s, ".1f") if t.prefill_s > 0 else None
    return out


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
    "load_s": ("load", "s"), "prefill_ms": ("prefill", "ms"), "per_token_ms_median": ("per token (median)", "ms"),
    "tokens_per_s": ("tokens/s", ""), "verify_ms": ("verify pass", "ms"),
    "per_pass_ms_median": ("per verify pass (median)", "ms"),
    "speculative_tokens_per_s": ("speculative tokens/s", ""), "plain_tokens_per_s": ("plain greedy tokens/s", ""),
    "speedup": ("speedup", "x"), "plain_tokens_match": ("same tokens as plain greedy", ""),
}


def plain_timings(c: Console, timings: dict[str, Any]) -> None:
    for key, value in timings.items():
        shown = "n/a" if value is None else json.dumps(value) if isinstance(value, bool) else value
        write(c, f"timings.{key}: {shown}")


def rich_timings(c: Console, timings: dict[str, Any]) -> None:
    t = Table(title="timings", title_justify="left", show_header=False)
    t.add_column("")
    t.add_column("", justify="right")
    for key, value in timings.items():
        label, unit = _TIMING_LABELS.get(key, (key, ""))
        shown = "n/a" if value is None else ("yes" if value else "no") if isinstance(value, bool) else f"{value} {unit}"
        t.add_row(label, shown.strip())
    c.print(t)
