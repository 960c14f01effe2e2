"""decode's report: the steps as they come (plain) or streamed text / a progress bar (rich), then the
whole result; speculative decoding's counts; decode's JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .common import (TEXT_COLUMN, Meta, counted, dump_json, echo_text, f4, isatty, note_column, note_json, num,
                     plain_head, plain_note, prob_bar, rich_head, short_note, token_cell, write)
from .tails import (base_timings, json_tail, mean_rate, median_ms, median_rate, plain_hidden, plain_timings,
                    rich_hidden, rich_timings)
from .text import display_text, escape_text, quote_text

if TYPE_CHECKING:  # decoding (and numpy) is imported by the commands that compute, not by `--help`
    from rich.progress import Progress

    from ..decoding.results import DecodeResult, DecodeStep
    from ..decoding.rows import TextStream


class DecodeReport:
    """decode output: `begin` before the first step, `step` per produced token, `finish` with the whole
    result. Plain prints a line per step as it is produced; rich on a terminal streams the generated text
    as it is decoded (`stream`, when there is a tokenizer) or shows a transient progress bar."""

    def __init__(self, console: Console, meta: Meta, stream: TextStream | None = None) -> None:
        self.console = console
        self.meta = meta
        self._live: Progress | None = None  # rich on a terminal without a tokenizer: a transient bar
        self._task: Any = None
        self._stream: TextStream | None = None  # rich on a terminal with a tokenizer: the text as it comes
        self._offered_stream = stream
        self._streamed = False  # the head and the text were printed while decoding

    def begin(self, prompt_tokens: list[int], steps: int) -> None:
        if self.meta.fmt == "rich" and isatty(self.console):
            if self._offered_stream is not None:
                self._stream, self._streamed = self._offered_stream, True
                rich_head(self.console, self.meta, prompt_tokens)
                self.console.print(Text("text", style="bold"))
                if self.meta.prompt is not None:
                    self.console.out(echo_text(self.meta.prompt, display_text), style="dim", highlight=False,
                                     end="")
            else:
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

                self._live = Progress(TextColumn("[bold]decoding[/]"), BarColumn(), MofNCompleteColumn(),
                                      console=self.console, transient=True)
                self._live.start()
                self._task = self._live.add_task("decode", total=steps)
        if self.meta.fmt != "plain":
            return
        plain_head(self.console, self.meta, prompt_tokens)
        write(self.console, "")
        text = "  text" if self.meta.has_tokenizer else ""
        write(self.console, f"{'position':>8}  {'token':>8}  {'logit':>10}{text}")

    def step(self, step: DecodeStep) -> None:
        if self._live is not None:
            self._live.advance(self._task)
        if self._stream is not None:
            self._stream_out(self._stream.push(step.token))
        if self.meta.fmt != "plain":
            return
        line = f"{step.position:>8}  {step.token:>8}  {f4(step.logit):>10}"
        write(self.console, line + (f"  {escape_text(step.text)}" if self.meta.has_tokenizer else "")
              + plain_note(step.note))
        for rank, t in enumerate(step.top_k, 1):
            sub = f"{'top' + str(rank):>8}  {t.token:>8}  {f4(t.logit):>10}  p={f4(t.prob)}"
            write(self.console, sub + (f"  {escape_text(t.text)}" if self.meta.has_tokenizer else ""))

    def _stream_out(self, text: str) -> None:
        if text:
            self.console.out(display_text(text), style="cyan", highlight=False, end="")
            self.console.file.flush()

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self._stream is not None:
            self._stream_out(self._stream.flush())
            self.console.out("")  # end the streamed line
            self._stream = None

    def finish(self, result: DecodeResult, plain_match: bool | None = None) -> None:
        self.close()
        if self.meta.fmt == "json":
            dump_json(self.console, decode_json(self.meta, result, plain_match))
        elif self.meta.fmt == "plain":
            self._plain_tail(result, plain_match)
        else:
            self._rich(result, plain_match)

    def _plain_tail(self, result: DecodeResult, plain_match: bool | None) -> None:
        c = self.console
        write(c, "")
        write(c, "stopped: " + _PLAIN_STOP[_stop_reason(result)].format(counted(len(result.steps), "token")))
        if result.text is not None:
            write(c, f"text: {quote_text(result.text)}")
        spec = _spec_json(result, self.meta)
        if spec is not None:
            for key, value in spec.items():
                if key == "draft_model":  # already in the header
                    continue
                if key == "acceptance_by_position":
                    value = " ".join(f4(v) for v in value)
                elif isinstance(value, float):
                    value = f4(value)
                write(c, f"{key}: {value}")
        plain_hidden(c, result.hidden)
        if self.meta.timings:
            plain_timings(c, decode_timings_json(result, plain_match))

    def _rich(self, result: DecodeResult, plain_match: bool | None) -> None:
        c, meta = self.console, self.meta
        if not self._streamed:  # else the head and the text were printed while decoding
            rich_head(c, meta, result.prompt_tokens)
            if result.text is not None:
                _rich_text(c, meta, result.text)
        c.print(_rich_steps(c, meta, result))
        spec = _spec_json(result, meta)
        if spec is not None:
            c.print(_rich_spec(spec))
        rich_hidden(c, result.hidden)
        if meta.timings:
            rich_timings(c, decode_timings_json(result, plain_match))


def _rich_text(c: Console, meta: Meta, text: str) -> None:
    """The generated text, after the prompt (dim) when the prompt came as text."""
    shown = Text()
    if meta.prompt is not None:
        shown.append(echo_text(meta.prompt, display_text), style="dim")
    shown.append(display_text(text), style="cyan")
    c.print(Text("text", style="bold"))
    c.print(shown)


def _stop_reason(result: DecodeResult) -> str:
    return "interrupted" if result.interrupted else "eos" if result.stopped_at_eos else "steps"


_PLAIN_STOP = {"interrupted": "interrupted after {}", "eos": "at EOS after {}", "steps": "after {} (--steps)"}
_RICH_STOP = {"interrupted": " (interrupted by Ctrl-C)", "eos": " (stopped at EOS)"}


def _rich_steps(c: Console, meta: Meta, result: DecodeResult) -> Table:
    """One row per step; with --top-k, one row per candidate (the step's own token first, its position
    on that row only) with its probability and a bar, so no candidate ever spans two lines."""
    title = f"decode: {len(result.steps)} tokens" + _RICH_STOP.get(_stop_reason(result), "")
    if meta.top_k:
        title += f", top-{meta.top_k} candidates each"
    t = Table(title=title, title_justify="left")
    t.add_column("pos", justify="right", no_wrap=True)
    t.add_column("token", justify="right", no_wrap=True)
    if meta.has_tokenizer:
        t.add_column("text", **TEXT_COLUMN)
    t.add_column("logit", justify="right", no_wrap=True)
    bar = 20 if c.width >= 100 else 10  # 80 columns leave room for a 10-character bar
    if meta.top_k:
        t.add_column("p", justify="right", no_wrap=True)
        t.add_column("", no_wrap=True)
    notes = note_column(t, result.steps)
    for n, s in enumerate(result.steps):
        if not meta.top_k:
            t.add_row(*_step_cells(meta, str(s.position), s.token, s.text, s.logit, "cyan"),
                      *([short_note(s.note)] if notes else []))
            continue
        for rank, cand in enumerate(s.top_k):
            chosen = cand.token == s.token
            cells = _step_cells(meta, str(s.position) if rank == 0 else "", cand.token, cand.text, cand.logit,
                                "cyan" if chosen else "")
            cells += [f4(cand.prob), Text(prob_bar(cand.prob, bar), style="green" if chosen else "blue")]
            cells += [short_note(s.note) if rank == 0 else ""] if notes else []
            t.add_row(*cells, style=None if chosen else "dim",
                      end_section=rank == len(s.top_k) - 1 and n < len(result.steps) - 1)
    return t


def _step_cells(meta: Meta, position: str, token: int, text: str | None, logit: float, style: str) -> list[Any]:
    cells: list[Any] = [position, str(token)]
    if meta.has_tokenizer:
        cells.append(token_cell(text, style))
    return cells + [f4(logit)]


def _rich_spec(spec: dict[str, Any]) -> Table:
    t = Table(title=f"speculative decoding ({spec['draft_source']}, k={spec['k']})", title_justify="left")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_column("")
    for key in ("verify_passes", "drafted", "accepted"):
        t.add_row(key.replace("_", " "), str(spec[key]), "")
    t.add_row("acceptance rate", f4(spec["acceptance_rate"]), Text(prob_bar(spec["acceptance_rate"]), style="green"))
    t.add_row("mean accepted per pass", f4(spec["mean_accepted_per_pass"]), "")
    for i, rate in enumerate(spec["acceptance_by_position"]):
        t.add_row(f"  accepted at draft {i + 1}", f4(rate), Text(prob_bar(rate), style="green"))
    return t


def _spec_json(result: DecodeResult, meta: Meta) -> dict[str, Any] | None:
    from ..decoding.results import SpecDecodeResult

    if not isinstance(result, SpecDecodeResult) or result.stats is None:
        return None
    s = result.stats
    return {
        "k": s.k, "draft_source": s.draft_source, "draft_model": meta.draft_model,
        "drafted": s.drafted, "accepted": s.accepted, "acceptance_rate": num(s.acceptance_rate),
        "mean_accepted_per_pass": num(s.mean_accepted_per_pass), "verify_passes": s.verify_passes,
        "acceptance_by_position": [num(r) for r in s.acceptance_by_position],
    }


def decode_json(meta: Meta, result: DecodeResult, plain_match: bool | None = None) -> dict[str, Any]:
    doc = meta.pass_json_head(result.prompt_tokens)
    doc.update({
        "steps": [
            {"position": s.position, "token": s.token, "text": s.text, "logit": num(s.logit),
             "argmax_note": note_json(s.note),
             "top_k": [{"token": t.token, "text": t.text, "logit": num(t.logit), "prob": num(t.prob)}
                       for t in s.top_k]}
            for s in result.steps
        ],
        "text": result.text,
        "stopped_at_eos": result.stopped_at_eos,
        "interrupted": result.interrupted,
    })
    spec = _spec_json(result, meta)
    if spec is not None:
        doc["speculative"] = spec
    json_tail(doc, meta, result.hidden, lambda: decode_timings_json(result, plain_match))
    return doc


def decode_timings_json(result: DecodeResult, plain_match: bool | None = None) -> dict[str, Any]:
    from ..decoding.results import SpecDecodeResult

    t = result.timings
    out = base_timings(t)
    spec = isinstance(result, SpecDecodeResult) and result.stats is not None
    if spec:  # a verify pass gives one or more tokens: passes and tokens each on their own basis
        out["per_pass_ms_mean"] = num(1000 * sum(t.step_s) / len(t.step_s), ".3f") if t.step_s else None
        out["per_pass_ms_median"] = median_ms(t.step_s)
    # the decode phase: the tokens after the first (which the prefill row gives) over the time after it
    out.update(mean_rate("", sum(t.step_s), len(result.steps) - 1))
    if not spec:  # each step gives one token
        out.update(median_rate(t.step_s))
    if isinstance(result, SpecDecodeResult) and result.spec_tokens_per_s is not None:
        plain = result.plain_tokens_per_s
        out["plain_per_token_ms_mean"] = num(1000 / plain, ".3f") if plain else None
        out["plain_tokens_per_s_mean"] = num(plain, ".1f")
        out["speedup"] = num(result.spec_tokens_per_s / plain if plain else None, ".3f")
        out["plain_tokens_match"] = plain_match
    return out
