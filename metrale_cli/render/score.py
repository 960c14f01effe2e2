"""score's report: the log-probability and rank of every scored token, then the totals."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .common import Meta, dump_json, f4, num, plain_head, rich_head, write
from .tails import base_timings, plain_timings, rich_timings
from .text import escape_text


def score_json(meta: Meta, r: Any, text_file: str | None = None) -> dict[str, Any]:
    doc = meta.json_head()
    doc.update({
        "prompt": meta.prompt, "text_file": text_file, "prompt_tokens": list(r.tokens),
        "chunk": r.chunk, "stride": r.stride,
        "windows": [{"start": w.start, "end": w.end, "first_scored": w.first_scored} for w in r.windows],
        "scored": [{"position": s.position, "token": s.token, "text": s.text, "logprob": num(s.logprob),
                    "prob": num(s.prob), "rank": s.rank,
                    "top_k": [{"token": t.token, "text": t.text, "logit": num(t.logit), "prob": num(t.prob)}
                              for t in s.top_k]} for s in r.scored],
        "scored_tokens": len(r.scored), "total_logprob": num(r.total_logprob, SCORE_FMT),
        "mean_nll": num(r.mean_nll, SCORE_FMT), "perplexity": num(r.perplexity, SCORE_FMT),
    })
    if meta.timings:
        doc["timings"] = score_timings_json(r)
    return doc


def score_timings_json(r: Any) -> dict[str, Any]:
    return base_timings(r.timings, sum(w.end - w.start for w in r.windows))  # every window's prefill


# The score aggregates: six significant digits. They sum fp32 log-probabilities, whose last bits move with
# the BLAS build (numpy 2.4.6's OpenBLAS 0.3.31 gave total_logprob -30.082317 where the snapshot's build gave
# -30.082318 at "%.6f"), so more digits would make plain and JSON depend on the machine.
SCORE_FMT = ".6g"


def _score_summary(r: Any) -> list[tuple[str, str]]:
    return [("scored_tokens", str(len(r.scored))), ("total_logprob", format(r.total_logprob, SCORE_FMT)),
            ("mean_nll", format(r.mean_nll, SCORE_FMT)), ("perplexity", format(r.perplexity, SCORE_FMT))]


def render_score(console: Console, meta: Meta, r: Any, text_file: str | None = None) -> None:
    """The report of `metrale score`: one line per scored token, then the totals."""
    if meta.fmt == "json":
        dump_json(console, score_json(meta, r, text_file))
        return
    tok = meta.has_tokenizer

    def alts(s: Any, sep: str = ", ") -> str:
        return sep.join(f"{t.token}{' ' + escape_text(t.text) if tok else ''} {f4(t.prob)}" for t in s.top_k)

    if meta.fmt == "plain":
        plain_head(console, meta, r.tokens)
        if text_file is not None:
            write(console, f"text_file: {text_file}")
        write(console, f"chunk: {r.chunk}, stride: {r.stride}, windows: {len(r.windows)}")
        write(console, "")
        write(console, f"{'position':>8}  {'token':>8}  {'logprob':>10}  {'prob':>8}  {'rank':>6}"
              + ("  text" if tok else "") + (f"  | top-{meta.top_k}" if meta.top_k else ""))
        for s in r.scored:
            line = f"{s.position:>8}  {s.token:>8}  {f4(s.logprob):>10}  {f4(s.prob):>8}  {s.rank:>6}"
            line += f"  {escape_text(s.text)}" if tok else ""
            write(console, line + (f"  | {alts(s)}" if s.top_k else ""))
        write(console, "")
        for key, value in _score_summary(r):
            write(console, f"{key}: {value}")
        if meta.timings:
            plain_timings(console, score_timings_json(r))
        return
    rich_head(console, meta, r.tokens)
    t = Table(title=f"score: {len(r.scored)} tokens, {len(r.windows)} window(s) of {r.chunk}, stride {r.stride}",
              title_justify="left")
    for name in ("pos", "token") + (("text",) if tok else ()) + ("logprob", "prob", "rank"):
        t.add_column(name, justify="left" if name == "text" else "right")
    if meta.top_k:
        t.add_column(f"top-{meta.top_k}")
    for s in r.scored:
        cells: list[Any] = [str(s.position), str(s.token)]
        if tok:
            cells.append(Text(escape_text(s.text), style="cyan"))
        cells += [f4(s.logprob), f4(s.prob), Text(str(s.rank), style="green" if s.rank == 1 else "")]
        if meta.top_k:
            cells.append(Text(alts(s, "\n")))
        t.add_row(*cells)
    console.print(t)
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(justify="right")
    for key, value in _score_summary(r):
        grid.add_row(key, value)
    console.print(grid)
    if meta.timings:
        rich_timings(console, score_timings_json(r))
