"""compare --reference's report: the run against transformers, then compare's logits and layers reports."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .common import dump_json, write
from .compare import compare_json, plain_layers, plain_logits_compare, rich_layers, rich_logits_compare


def reference_check_json(r: Any) -> dict[str, Any]:
    """compare --reference's JSON: the run, then compare's logits (with row_stats) and layers objects."""
    t, p = r.tolerances, r.precision
    return {"command": "compare", "kind": "reference", "reference": r.reference,
            "reference_version": r.reference_version, "model": r.model, "device": p.device, "compute": p.compute,
            "logits_dtype": p.logits, "reference_device": p.reference_device, "reference_dtype": p.reference,
            "prompt_tokens": list(r.prompt_tokens), "steps": r.steps,
            "positions": list(r.positions), "reference_tokens": list(r.reference_tokens),
            "metrale_tokens": list(r.metrale_tokens), "tokens_identical": r.tokens_identical,
            "first_token_mismatch": r.first_token_mismatch, "layers_selected": r.selected_layers,
            "tolerances": {"max_kl": t.max_kl, "max_rel_err": t.max_rel_err, "min_top1": t.min_top1,
                           "rtol": t.rtol},
            "logits": compare_json(r.logits), "layers": None if r.layers is None else compare_json(r.layers),
            "passed": r.passed, "failures": list(r.failures)}


def _reference_lines(r: Any) -> list[tuple[str, str]]:
    mismatch, p = r.first_token_mismatch, r.precision
    n = len(r.prompt_tokens)
    return [("reference", f"{r.reference} {r.reference_version}: {p.reference} weights, compute and logits, "
                          f"on {p.reference_device}"),
            ("metrale", f"{p.compute} weights and compute, {p.logits} logits, on {p.device}"), ("model", r.model),
            ("prompt_tokens", f"{' '.join(map(str, r.prompt_tokens))} ({n})"),
            ("steps", f"{r.steps} (rows compared: positions {r.positions[0]}..{r.positions[-1]}, every prompt row "
                      "and step row, teacher-forced)"),
            ("reference_tokens", " ".join(map(str, r.reference_tokens))),
            ("metrale_tokens", " ".join(map(str, r.metrale_tokens))),
            ("tokens_identical", "yes" if r.tokens_identical else f"no (first differs at step {mismatch})")]


def render_reference_check(console: Console, fmt: str, r: Any) -> None:
    """The report of `metrale compare --reference`: the run, compare's logits report with every row (the
    argmax of both sides per row), the layers report with --layers, and the verdict."""
    if fmt == "json":
        dump_json(console, reference_check_json(r))
        return
    verdict = "passed" if r.passed else "FAILED: " + "; ".join(r.failures)
    if fmt == "plain":
        write(console, "metrale compare --reference")
        for key, value in _reference_lines(r):
            write(console, f"{key}: {value}")
        write(console, "")
        plain_logits_compare(console, r.logits)
        if r.layers is not None:
            write(console, "")
            plain_layers(console, r.layers)
        write(console, "")
        write(console, f"reference_check: {verdict}")
        return
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for key, value in _reference_lines(r):
        grid.add_row(key, Text(value, style="" if key != "tokens_identical" else
                               ("green" if r.tokens_identical else "red")))
    console.print(grid)
    rich_logits_compare(console, r.logits)
    if r.layers is not None:
        rich_layers(console, r.layers)
    console.print(Text(f"reference check: {verdict}", style="bold green" if r.passed else "bold red"))
