"""bench's report: each figure, its target and its ratio; the rows paths side by side."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .common import dump_json, write


def render_bench(console: Console, fmt: str, result: Any) -> None:
    """The bench table: each figure, its target and its ratio to that target's reference."""
    if fmt == "json":
        dump_json(console, result.to_json())
        return
    head = (f"{result.preset} on {result.device}: {result.params / 1e9:.3f}B params, context {result.context}, "
            f"{result.streamed_bytes / 1e9:.2f} GB weights + {result.kv_bytes / 1e9:.3f} GB KV read per step")

    def verdict(f) -> str:
        return "" if f.met is None else ("met" if f.met else "MISSED")

    if fmt == "plain":  # a field a figure does not have (no target, no ratio, no verdict) is left out
        write(console, "metrale bench")
        write(console, head)
        for f in result.figures:
            fields = [f"{f.name}: {f.value:.4g} {f.unit}"]
            fields += [f"target: {f.target}"] if f.target else []
            fields += [f"ratio: {f.ratio:.3f}"] if f.ratio is not None else []
            fields += [verdict(f)] if f.met is not None else []
            write(console, " | ".join(fields))
        if result.paths:
            write(console, "rows paths side by side (same run; verify: x that path's decode step):")
            names = [p.path for p in result.paths]
            for name, cells in _path_cells(result):
                write(console, f"{name}: " + " | ".join(f"{n} {c}" for n, c in zip(names, cells)))
        for n in result.notes:
            write(console, f"note: {n}")
        return
    t = Table(title=head, title_justify="left")
    for col in ("figure", "value", "unit", "target", "ratio", ""):  # names and targets wrap at spaces
        t.add_column(col, justify="right" if col in ("value", "ratio") else "left",
                     no_wrap=col not in ("figure", "target"))
    for f in result.figures:
        style = "green" if f.met else ("red" if f.met is False else "")
        t.add_row(f.name, f"{f.value:.4g}", f.unit, f.target, "" if f.ratio is None else f"{f.ratio:.3f}",
                  Text(verdict(f), style=style))
    console.print(t)
    if result.paths:
        console.print(_paths_table(result))
    for n in result.notes:
        console.print(f"note: {n}")


def _path_cells(result: Any) -> list[tuple[str, list[str]]]:
    """(metric, one cell per path) rows of the side-by-side table of bench --path."""
    ps = result.paths
    first = ps[0].path
    ks = list(dict.fromkeys(k for p in ps for k in p.verify_ms))
    out = [("decode step", [f"{p.decode_ms:.3f} ms" for p in ps]),
           ("x floor", [f"{p.floor_ratio:.3f}" for p in ps]),
           ("of read bandwidth", [f"{100 * p.bandwidth_fraction:.1f}%" for p in ps])]
    for k in ks:
        out.append((f"verify k={k}", [f"{p.verify_ms[k]:.3f} ms ({p.verify_ratio[k]:.3f} x)" if k in p.verify_ms
                                      else "" for p in ps]))
    out.append((f"logits vs {first}", ["" if p.logits_max_abs_diff is None else
                                        f"max |diff| {p.logits_max_abs_diff:.3e}, argmax "
                                        f"{'same' if p.argmax_matches else 'DIFFERS'}" for p in ps]))
    if any(p.fallbacks for p in ps):
        out.append(("unfused", [", ".join(f"{op}: {why}" for op, why in p.fallbacks.items()) for p in ps]))
    return out


def _paths_table(result: Any) -> Table:
    t = Table(title="rows paths side by side (same run; verify: x that path's decode step)", title_justify="left")
    t.add_column("figure", no_wrap=True)
    for p in result.paths:
        t.add_column(p.path, justify="right")
    for name, cells in _path_cells(result):
        t.add_row(name, *cells)
    return t
