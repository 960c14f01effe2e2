"""verify's report: one row per draft (accepted, rejected, unchecked), the verdict, the rows against
sequential decoding."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .common import (TEXT_COLUMN, Meta, dump_json, f4, note_column, note_json, num, plain_head, plain_note, rich_head,
                     short_note, token_cell, write)
from .tails import base_timings, json_tail, mean_rate, plain_hidden, plain_timings, rich_hidden, rich_timings
from .text import escape_text

if TYPE_CHECKING:
    from ..decoding.results import VerifyResult


def verify_json(meta: Meta, r: VerifyResult) -> dict[str, Any]:
    doc = meta.pass_json_head(r.prompt_tokens)
    doc.update({
        "k": r.k,
        "draft_source": r.draft_source,
        "draft_model": meta.draft_model,
        "rows": [{"position": row.position, "draft": row.draft, "draft_text": row.draft_text,
                  "target": row.target, "target_text": row.target_text, "accepted": row.accepted,
                  "status": row.status, "margin": num(row.margin), "argmax_note": note_json(row.note)}
                 for row in r.rows],
        "accepted": r.accepted,
        "next_token": r.next_token,
        "next_text": r.next_text,
        "max_abs_diff_vs_sequential": num(r.max_abs_diff_vs_sequential, ".3e"),
        "max_abs_diff_ulps_vs_sequential": r.max_abs_diff_ulps_vs_sequential,
        "rows_identical_vs_sequential": r.rows_identical_vs_sequential,
    })
    json_tail(doc, meta, r.hidden, lambda: verify_timings_json(r))
    return doc


def verify_timings_json(r: VerifyResult) -> dict[str, Any]:
    seconds = sum(r.timings.step_s)
    return {**base_timings(r.timings), "verify_ms": num(1000 * seconds, ".3f"), **mean_rate("verify_", seconds, r.k)}


def render_verify(console: Console, meta: Meta, r: VerifyResult) -> None:
    if meta.fmt == "json":
        dump_json(console, verify_json(meta, r))
    elif meta.fmt == "plain":
        _plain_verify(console, meta, r)
    else:
        _rich_verify(console, meta, r)


def _plain_verify(c: Console, meta: Meta, r: VerifyResult) -> None:
    plain_head(c, meta, r.prompt_tokens)
    write(c, f"k: {r.k}")
    write(c, f"draft_source: {r.draft_source}")
    write(c, "")
    text = meta.has_tokenizer
    write(c, f"{'position':>8}  {'draft':>8}  {'target':>8}  {'accepted':>9}  {'margin':>10}"
          + ("  draft_text | target_text" if text else ""))
    shown = {"accepted": "yes", "rejected": "no", "unchecked": "unchecked"}
    for row in r.rows:
        line = (f"{row.position:>8}  {row.draft:>8}  {row.target:>8}  {shown[row.status]:>9}  "
                f"{f4(row.margin):>10}")
        if text:
            line += f"  {escape_text(row.draft_text)} | {escape_text(row.target_text)}"
        write(c, line + plain_note(row.note))
    write(c, "")
    write(c, f"accepted: {r.accepted}/{r.k}")
    write(c, f"next_token: {r.next_token}" + (f"  {escape_text(r.next_text)}" if text else ""))
    diff = r.max_abs_diff_vs_sequential
    write(c, f"max_abs_diff_vs_sequential: {'n/a' if diff is None else format(diff, '.3e')}")
    ulps, same = r.max_abs_diff_ulps_vs_sequential, r.rows_identical_vs_sequential
    write(c, f"max_abs_diff_ulps_vs_sequential: {'n/a' if ulps is None else ulps}")
    write(c, f"rows_identical_vs_sequential: {'n/a' if same is None else f'{same}/{r.k}'}")
    plain_hidden(c, r.hidden)
    if meta.timings:
        plain_timings(c, verify_timings_json(r))


_VERIFY_MARKS = {"accepted": ("\u2713", "green"), "rejected": ("\u2717", "red"), "unchecked": ("\u00b7", "dim")}


def _rich_verify(c: Console, meta: Meta, r: VerifyResult) -> None:
    rich_head(c, meta, r.prompt_tokens)
    t = Table(title=f"verify: k={r.k}, drafts from {r.draft_source}", title_justify="left")
    for name, justify in (("pos", "right"), ("draft", "right"), ("target", "right"), ("", "center"),
                          ("margin", "right")):
        t.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    if meta.has_tokenizer:
        t.add_column("draft text", **TEXT_COLUMN)
        t.add_column("target text", **TEXT_COLUMN)
    notes = note_column(t, r.rows)
    for row in r.rows:
        mark, style = _VERIFY_MARKS[row.status]
        cells: list[Any] = [str(row.position), str(row.draft), str(row.target),
                            Text(mark, style=f"bold {style}"), f4(row.margin)]
        if meta.has_tokenizer:
            cells += [token_cell(row.draft_text), token_cell(row.target_text)]
        t.add_row(*cells, *([short_note(row.note)] if notes else []), style=style)
    c.print(t)
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    grid.add_row("accepted", Text(f"{r.accepted}/{r.k}", style="bold green" if r.accepted == r.k else "bold"))
    rejected = next((row for row in r.rows if row.status == "rejected"), None)
    if rejected is not None and rejected is not r.rows[-1]:
        grid.add_row("", Text(f"\u00b7 not checked: acceptance stopped at position {rejected.position}",
                              style="dim"))
    nxt = Text(str(r.next_token))
    if meta.has_tokenizer:
        nxt.append(f" {escape_text(r.next_text)}", style="cyan")
    grid.add_row("next token", nxt)
    if r.max_abs_diff_vs_sequential is not None:
        ulps = r.max_abs_diff_ulps_vs_sequential
        grid.add_row("vs sequential", f"max |verify - decode| {r.max_abs_diff_vs_sequential:.3e} = {ulps} "
                                      f"{meta.logits_dtype} ulp{'' if ulps == 1 else 's'}")
        grid.add_row("", f"{r.rows_identical_vs_sequential}/{r.k} rows bit-identical")
    c.print(grid)
    rich_hidden(c, r.hidden)
    if meta.timings:
        rich_timings(c, verify_timings_json(r))
