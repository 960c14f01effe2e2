"""forward's report: the argmax token and its logit for the last row or every row."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from .common import (TEXT_COLUMN, Meta, dump_json, f4, note_column, note_json, num, plain_head, plain_note, rich_head,
                     short_note, token_cell, write)
from .tails import base_timings, json_tail, plain_hidden, plain_timings, rich_hidden, rich_timings
from .text import escape_text

if TYPE_CHECKING:
    from ..decoding.results import ForwardResult


def forward_json(meta: Meta, r: ForwardResult) -> dict[str, Any]:
    doc = meta.pass_json_head(r.prompt_tokens)
    mtp = _mtp_agreement(r)
    doc.update({
        "rows": [{"position": row.position, "input": r.prompt_tokens[row.position], "argmax": row.argmax,
                  "text": row.text, "logit": num(row.logit), "argmax_note": note_json(row.note),
                  **({"model_argmax": row.model_argmax} if mtp else {})} for row in r.rows],
        **({"mtp_agreement": {"agree": mtp[0], "rows": mtp[1]}} if mtp else {}),
    })
    json_tail(doc, meta, r.hidden, lambda: forward_timings_json(r))
    return doc


def _mtp_agreement(r: ForwardResult) -> tuple[int, int] | None:
    """forward --mtp: at how many of the rows the MTP layer's argmax is the model's own (the first drafts a greedy
    verify pass would accept along this prompt), of how many; None for the model's own rows."""
    if not r.rows or r.rows[0].model_argmax is None:
        return None
    return sum(row.argmax == row.model_argmax for row in r.rows), len(r.rows)


def _agreement_line(agree: tuple[int, int]) -> str:
    return f"mtp_agreement: {agree[0]}/{agree[1]} rows (the first drafts a greedy verify would accept)"


def forward_timings_json(r: ForwardResult) -> dict[str, Any]:
    return base_timings(r.timings)


def render_forward(console: Console, meta: Meta, r: ForwardResult) -> None:
    if meta.fmt == "json":
        dump_json(console, forward_json(meta, r))
        return
    mtp = _mtp_agreement(r)
    if meta.fmt == "plain":
        plain_head(console, meta, r.prompt_tokens)
        write(console, "")
        write(console, f"{'position':>8}  {'input':>8}  {'argmax':>8}  {'logit':>10}" + (f"  {'model':>8}" if mtp else "")
              + ("  text" if meta.has_tokenizer else ""))
        for row in r.rows:
            line = f"{row.position:>8}  {r.prompt_tokens[row.position]:>8}  {row.argmax:>8}  {f4(row.logit):>10}"
            line += f"  {row.model_argmax:>8}" if mtp else ""
            write(console, line + (f"  {escape_text(row.text)}" if meta.has_tokenizer else "") + plain_note(row.note))
        if mtp:
            write(console, "")
            write(console, _agreement_line(mtp))
        plain_hidden(console, r.hidden)
        if meta.timings:
            plain_timings(console, forward_timings_json(r))
        return
    rich_head(console, meta, r.prompt_tokens)
    t = Table(title=f"forward: {len(r.rows)} of {len(r.prompt_tokens)} rows", title_justify="left")
    for name in ("pos", "input", "argmax"):
        t.add_column(name, justify="right", no_wrap=True)
    if meta.has_tokenizer:
        t.add_column("text", **TEXT_COLUMN)
    t.add_column("logit", justify="right", no_wrap=True)
    if mtp:
        t.add_column("model", justify="right", no_wrap=True)
    notes = note_column(t, r.rows)
    for row in r.rows:
        cells: list[Any] = [str(row.position), str(r.prompt_tokens[row.position]), str(row.argmax)]
        if meta.has_tokenizer:
            cells.append(token_cell(row.text, "cyan"))
        cells.append(f4(row.logit))
        if mtp:
            cells.append(str(row.model_argmax))
        t.add_row(*cells, *([short_note(row.note)] if notes else []))
    console.print(t)
    if mtp:
        console.print(_agreement_line(mtp))
    rich_hidden(console, r.hidden)
    if meta.timings:
        rich_timings(console, forward_timings_json(r))
