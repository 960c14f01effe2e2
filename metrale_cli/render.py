"""Turning results into Rich tables, plain text or JSON. This is the only module that prints.

Formats (`--format`, default: rich when stdout is a terminal, plain otherwise):
    rich   tables, colour for accepted/rejected drafts, bars for top-k probabilities, timings at the end
    plain  deterministic text: fixed column widths, no colour, nothing that depends on the terminal width;
           decode prints one line per step as it is produced
    json   one JSON object per command (indented, UTF-8)

plain and json are snapshot-stable: timings appear only with --timings, and numbers have fixed formats:
logits, probabilities, margins and rates 4 decimals (%.4f; in JSON the same value as a number),
max_abs_diff_vs_sequential %.3e (4 significant digits), hidden-state statistics 6 significant digits
(%.6g), milliseconds 3 decimals, tokens/s 1 decimal. A NaN or infinite number is `null` in JSON.

Token text (plain and rich) is escaped so that whitespace and control characters are visible:
    space -> ␣ (U+2423);  newline, tab, carriage return -> \\n \\t \\r;  backslash -> \\\\;
    a literal ␣ -> \\u2423;  other control, format and separator characters -> \\uXXXX (\\UXXXXXXXX above
    U+FFFF);  U+FFFD (a byte-level piece of a multi-byte character) and every other printable character
    are kept as they are.
In JSON, "text" fields hold the raw token text (JSON string escapes only), or null without a tokenizer.

JSON keys (decode, verify and forward objects start with "command", "model" (the --model path as given,
or "default"), "device" ("cpu"|"cuda") and "logits_dtype" ("bf16"|"fp32"); "hidden" appears only with
--hidden or --dump-hidden, "timings" only with --timings; positions are 0-based):

decode   {"prompt": text|null, "prompt_tokens": [ids],
          "steps": [{"position", "token", "text", "logit", "top_k": [{"token", "text", "logit", "prob"}]}],
          "stopped_at_eos": bool,
          "speculative": {"k", "draft_source", "draft_model", "drafted", "accepted", "acceptance_rate",
                          "mean_accepted_per_pass", "verify_passes", "acceptance_by_position": [rates]}
                         (only with --draft ngram or --draft-model)}
verify   {"prompt", "prompt_tokens", "k", "draft_source", "draft_model",
          "rows": [{"position", "draft", "draft_text", "target", "target_text", "accepted", "margin"}],
          "accepted", "next_token", "next_text", "max_abs_diff_vs_sequential" (null unless --draft self)}
forward  {"prompt", "prompt_tokens", "rows": [{"position", "input", "argmax", "text", "logit"}]}
inspect  {"command", "model", "architecture", "model_type", "layers", "heads", "kv_heads",
          "head_dim", "hidden", "intermediate", "vocab", "max_position_embeddings", "sliding_window",
          "parameters", "dtype", "dtypes": {dtype: tensors}, "shards", "files", "bytes", "tied_embeddings",
          "rope": {"theta", "type", "scaling"}, "tokenizer", "bos_token_id", "eos_token_ids", "valid",
          "problems"}
"hidden"  {"size", "norm", "mean", "std", "min", "max", "first": [8 values], "sha256"}
          (the post-final-norm hidden state of the last position run; sha256 of its fp32 bytes)
"timings" {"load_s", "prefill_ms", "per_token_ms_median", "tokens_per_s"} for decode (tokens/s of the
          decode steps after the prefill). Speculative decode has "per_pass_ms_median" (per verify pass)
          instead of "per_token_ms_median", and adds "speculative_tokens_per_s", "plain_tokens_per_s",
          "speedup", "plain_tokens_match": decode-phase tokens/s (tokens after the first, over the time
          after the prefill) of speculative and of plain greedy decoding run in the same process on the
          same engine, and whether both produced the same tokens;
          {"load_s", "prefill_ms", "verify_ms"} for verify; {"load_s", "prefill_ms", "tokens_per_s"} for forward.
"""

from __future__ import annotations

import contextlib
import json
import math
import unicodedata
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from rich.console import Console, Group
from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeRemainingColumn)
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .decoding import (DecodeResult, DecodeStep, ForwardResult, HiddenSummary, SpecDecodeResult, Timings,
                       VerifyResult)
from .errors import UsageError

FORMATS = ("rich", "plain", "json")
PROGRESS_MIN_BYTES = 200_000_000  # checkpoints smaller than this load too fast to need a bar


def isatty(console: Console) -> bool:
    try:
        return bool(console.file.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def choose_format(value: str | None, console: Console) -> str:
    if value is None:
        return "rich" if isatty(console) else "plain"
    if value not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, got {value!r}")
    return value


# -- numbers and text -------------------------------------------------------------------------------------------

_VISIBLE_ESCAPES = {" ": "\u2423", "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r", "\u2423": "\\u2423"}
_INVISIBLE = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"}


def escape_text(s: str | None) -> str:
    """Token text with whitespace and control characters made visible (see the module docstring)."""
    if s is None:
        return ""
    out = []
    for ch in s:
        if ch in _VISIBLE_ESCAPES:
            out.append(_VISIBLE_ESCAPES[ch])
        elif ch != "\ufffd" and unicodedata.category(ch) in _INVISIBLE:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}")
        else:
            out.append(ch)
    return "".join(out)


def f4(x: float) -> str:
    return f"{x:.4f}"


def num(x: float | None, fmt: str = ".4f") -> float | None:
    """A float for JSON: the same rounding as the plain text, None for NaN/Inf."""
    if x is None or not math.isfinite(x):
        return None
    return float(format(x, fmt))


# -- what every report names ---------------------------------------------------------------------------------


@dataclass
class Meta:
    command: str
    model: str  # the path as given, or "default"
    device: str
    logits_dtype: str
    fmt: str
    prompt: str | None = None  # prompt text, when the tokens came from --prompt
    has_tokenizer: bool = False
    top_k: int = 0
    timings: bool = False
    draft_model: str | None = None

    def json_head(self) -> dict[str, Any]:
        return {"command": self.command, "model": self.model, "device": self.device,
                "logits_dtype": self.logits_dtype}


def _write(console: Console, line: str = "") -> None:
    console.out(line, highlight=False)


def _dump_json(console: Console, doc: dict[str, Any]) -> None:
    _write(console, json_text(doc))


def json_text(value: Any, indent: str = "", in_list: bool = False) -> str:
    """Indented JSON, compact where it stays readable: a list of scalars on one line, and so is an object
    inside a list when it holds only scalars and lists of scalars (a step without top-k, a verify row)."""
    inner = indent + "  "
    if isinstance(value, dict) and value:
        if in_list and all(_flat(v) for v in value.values()):
            return json.dumps(value, ensure_ascii=False, allow_nan=False)
        items = [f"{inner}{json.dumps(k, ensure_ascii=False)}: {json_text(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        return "[\n" + ",\n".join(inner + json_text(v, inner, True) for v in value) + "\n" + indent + "]"
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def _flat(value: Any) -> bool:
    if isinstance(value, dict):
        return False
    return not isinstance(value, list) or not any(isinstance(v, (dict, list)) for v in value)


def _plain_head(console: Console, meta: Meta, prompt_tokens: list[int]) -> None:
    _write(console, f"metrale {meta.command}")
    _write(console, f"model: {meta.model}")
    if meta.draft_model is not None:
        _write(console, f"draft_model: {meta.draft_model}")
    _write(console, f"device: {meta.device}")
    _write(console, f"logits_dtype: {meta.logits_dtype}")
    if meta.prompt is not None:
        _write(console, f"prompt: {escape_text(meta.prompt)}")
    _write(console, f"prompt_tokens: {' '.join(map(str, prompt_tokens))} ({len(prompt_tokens)})")


def _rich_head(console: Console, meta: Meta, prompt_tokens: list[int]) -> None:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("model", Text(meta.model))
    if meta.draft_model is not None:
        grid.add_row("draft model", Text(meta.draft_model))
    grid.add_row("device", f"{meta.device}, logits {meta.logits_dtype}")
    if meta.prompt is not None:
        grid.add_row("prompt", Text(escape_text(meta.prompt)))
    grid.add_row("prompt tokens", Text(f"{' '.join(map(str, prompt_tokens))} ({len(prompt_tokens)})"))
    console.print(grid)


# -- decode --------------------------------------------------------------------------------------------------


class DecodeReport:
    """decode output: `begin` before the first step, `step` per produced token (plain streams them),
    `finish` with the whole result."""

    def __init__(self, console: Console, meta: Meta) -> None:
        self.console = console
        self.meta = meta
        self._live: Progress | None = None  # rich on a terminal: a transient bar while decoding
        self._task: Any = None

    def begin(self, prompt_tokens: list[int], steps: int) -> None:
        if self.meta.fmt == "rich" and isatty(self.console):
            self._live = Progress(TextColumn("[bold]decoding[/]"), BarColumn(), MofNCompleteColumn(),
                                  console=self.console, transient=True)
            self._live.start()
            self._task = self._live.add_task("decode", total=steps)
        if self.meta.fmt != "plain":
            return
        _plain_head(self.console, self.meta, prompt_tokens)
        _write(self.console, "")
        text = "  text" if self.meta.has_tokenizer else ""
        _write(self.console, f"{'position':>8}  {'token':>8}  {'logit':>10}{text}")

    def step(self, step: DecodeStep) -> None:
        if self._live is not None:
            self._live.advance(self._task)
        if self.meta.fmt != "plain":
            return
        line = f"{step.position:>8}  {step.token:>8}  {f4(step.logit):>10}"
        _write(self.console, line + (f"  {escape_text(step.text)}" if self.meta.has_tokenizer else ""))
        for rank, t in enumerate(step.top_k, 1):
            sub = f"{'top' + str(rank):>8}  {t.token:>8}  {f4(t.logit):>10}  p={f4(t.prob)}"
            _write(self.console, sub + (f"  {escape_text(t.text)}" if self.meta.has_tokenizer else ""))

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def finish(self, result: DecodeResult, plain_match: bool | None = None) -> None:
        self.close()
        if self.meta.fmt == "json":
            _dump_json(self.console, decode_json(self.meta, result, plain_match))
        elif self.meta.fmt == "plain":
            self._plain_tail(result, plain_match)
        else:
            self._rich(result, plain_match)

    def _plain_tail(self, result: DecodeResult, plain_match: bool | None) -> None:
        c = self.console
        _write(c, "")
        _write(c, f"stopped: {'eos' if result.stopped_at_eos else 'steps'} after {len(result.steps)} tokens")
        spec = _spec_json(result, self.meta)
        if spec is not None:
            for key, value in spec.items():
                if key == "draft_model":  # already in the header
                    continue
                if key == "acceptance_by_position":
                    value = " ".join(f4(v) for v in value)
                elif isinstance(value, float):
                    value = f4(value)
                _write(c, f"{key}: {value}")
        _plain_hidden(c, result.hidden)
        if self.meta.timings:
            _plain_timings(c, decode_timings_json(result, plain_match))

    def _rich(self, result: DecodeResult, plain_match: bool | None) -> None:
        c, meta = self.console, self.meta
        _rich_head(c, meta, result.prompt_tokens)
        table = Table(title=f"decode: {len(result.steps)} tokens"
                      + (" (stopped at EOS)" if result.stopped_at_eos else ""), title_justify="left")
        table.add_column("pos", justify="right")
        table.add_column("token", justify="right")
        if meta.has_tokenizer:
            table.add_column("text")
        table.add_column("logit", justify="right")
        if meta.top_k:
            table.add_column(f"top-{meta.top_k}: token, logit, p")
        for s in result.steps:
            row: list[Any] = [str(s.position), str(s.token)]
            if meta.has_tokenizer:
                row.append(Text(escape_text(s.text), style="cyan"))
            row.append(f4(s.logit))
            if meta.top_k:
                row.append(_rich_top_k(s, meta.has_tokenizer))
            table.add_row(*row)
        c.print(table)
        spec = _spec_json(result, meta)
        if spec is not None:
            c.print(_rich_spec(spec))
        _rich_hidden(c, result.hidden)
        if meta.timings:
            _rich_timings(c, decode_timings_json(result, plain_match))


def _bar(p: float, width: int = 20) -> str:
    full = max(0, min(width, round(p * width)))
    return "\u2588" * full + "\u00b7" * (width - full)


def _rich_top_k(step: DecodeStep, has_tokenizer: bool) -> Group:
    lines = []
    for t in step.top_k:
        line = Text(f"{t.token:>6} ")
        if has_tokenizer:
            line.append(f"{escape_text(t.text)[:16]:<16} ", style="cyan")
        line.append(f"{f4(t.logit):>9} {f4(t.prob)} ")
        line.append(_bar(t.prob), style="green" if t.token == step.token else "blue")
        lines.append(line)
    return Group(*lines)


def _rich_spec(spec: dict[str, Any]) -> Table:
    t = Table(title=f"speculative decoding ({spec['draft_source']}, k={spec['k']})", title_justify="left")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_column("")
    for key in ("verify_passes", "drafted", "accepted"):
        t.add_row(key.replace("_", " "), str(spec[key]), "")
    t.add_row("acceptance rate", f4(spec["acceptance_rate"]), Text(_bar(spec["acceptance_rate"]), style="green"))
    t.add_row("mean accepted per pass", f4(spec["mean_accepted_per_pass"]), "")
    for i, rate in enumerate(spec["acceptance_by_position"]):
        t.add_row(f"  accepted at draft {i + 1}", f4(rate), Text(_bar(rate), style="green"))
    return t


def _spec_json(result: DecodeResult, meta: Meta) -> dict[str, Any] | None:
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
    doc = meta.json_head()
    doc.update({
        "prompt": meta.prompt,
        "prompt_tokens": list(result.prompt_tokens),
        "steps": [
            {"position": s.position, "token": s.token, "text": s.text, "logit": num(s.logit),
             "top_k": [{"token": t.token, "text": t.text, "logit": num(t.logit), "prob": num(t.prob)}
                       for t in s.top_k]}
            for s in result.steps
        ],
        "stopped_at_eos": result.stopped_at_eos,
    })
    spec = _spec_json(result, meta)
    if spec is not None:
        doc["speculative"] = spec
    _json_tail(doc, meta, result.hidden, lambda: decode_timings_json(result, plain_match))
    return doc


def decode_timings_json(result: DecodeResult, plain_match: bool | None = None) -> dict[str, Any]:
    t = result.timings
    out = _base_timings(t)
    spec = isinstance(result, SpecDecodeResult) and result.stats is not None
    out["per_pass_ms_median" if spec else "per_token_ms_median"] = num(t.per_token_ms, ".3f")
    decoded = sum(t.step_s)
    produced = len(result.steps) - 1  # the first token comes from the prefill row
    out["tokens_per_s"] = num(produced / decoded, ".1f") if decoded > 0 and produced > 0 else None
    if isinstance(result, SpecDecodeResult) and result.spec_tokens_per_s is not None:
        out["speculative_tokens_per_s"] = num(result.spec_tokens_per_s, ".1f")
        out["plain_tokens_per_s"] = num(result.plain_tokens_per_s, ".1f")
        ratio = (result.spec_tokens_per_s / result.plain_tokens_per_s) if result.plain_tokens_per_s else None
        out["speedup"] = num(ratio, ".3f")
        out["plain_tokens_match"] = plain_match
    return out


def _base_timings(t: Timings) -> dict[str, Any]:
    return {"load_s": num(t.load_s, ".3f"), "prefill_ms": num(1000 * t.prefill_s, ".3f")}


def _json_tail(doc: dict[str, Any], meta: Meta, hidden: HiddenSummary | None,
               timings: Callable[[], dict[str, Any]]) -> None:
    if hidden is not None:
        doc["hidden"] = hidden_json(hidden)
    if meta.timings:
        doc["timings"] = timings()


# -- verify --------------------------------------------------------------------------------------------------


def verify_json(meta: Meta, r: VerifyResult) -> dict[str, Any]:
    doc = meta.json_head()
    doc.update({
        "prompt": meta.prompt,
        "prompt_tokens": list(r.prompt_tokens),
        "k": r.k,
        "draft_source": r.draft_source,
        "draft_model": meta.draft_model,
        "rows": [{"position": row.position, "draft": row.draft, "draft_text": row.draft_text,
                  "target": row.target, "target_text": row.target_text, "accepted": row.accepted,
                  "margin": num(row.margin)} for row in r.rows],
        "accepted": r.accepted,
        "next_token": r.next_token,
        "next_text": r.next_text,
        "max_abs_diff_vs_sequential": num(r.max_abs_diff_vs_sequential, ".3e"),
    })
    _json_tail(doc, meta, r.hidden, lambda: verify_timings_json(r))
    return doc


def verify_timings_json(r: VerifyResult) -> dict[str, Any]:
    out = _base_timings(r.timings)
    out["verify_ms"] = num(1000 * sum(r.timings.step_s), ".3f")
    return out


def render_verify(console: Console, meta: Meta, r: VerifyResult) -> None:
    if meta.fmt == "json":
        _dump_json(console, verify_json(meta, r))
    elif meta.fmt == "plain":
        _plain_verify(console, meta, r)
    else:
        _rich_verify(console, meta, r)


def _plain_verify(c: Console, meta: Meta, r: VerifyResult) -> None:
    _plain_head(c, meta, r.prompt_tokens)
    _write(c, f"k: {r.k}")
    _write(c, f"draft_source: {r.draft_source}")
    _write(c, "")
    text = meta.has_tokenizer
    _write(c, f"{'position':>8}  {'draft':>8}  {'target':>8}  {'accepted':>8}  {'margin':>10}"
           + ("  draft_text | target_text" if text else ""))
    for row in r.rows:
        line = (f"{row.position:>8}  {row.draft:>8}  {row.target:>8}  {'yes' if row.accepted else 'no':>8}  "
                f"{f4(row.margin):>10}")
        if text:
            line += f"  {escape_text(row.draft_text)} | {escape_text(row.target_text)}"
        _write(c, line)
    _write(c, "")
    _write(c, f"accepted: {r.accepted}/{r.k}")
    _write(c, f"next_token: {r.next_token}" + (f"  {escape_text(r.next_text)}" if text else ""))
    diff = r.max_abs_diff_vs_sequential
    _write(c, f"max_abs_diff_vs_sequential: {'n/a' if diff is None else format(diff, '.3e')}")
    _plain_hidden(c, r.hidden)
    if meta.timings:
        _plain_timings(c, verify_timings_json(r))


def _rich_verify(c: Console, meta: Meta, r: VerifyResult) -> None:
    _rich_head(c, meta, r.prompt_tokens)
    t = Table(title=f"verify: k={r.k}, drafts from {r.draft_source}", title_justify="left")
    for name, justify in (("pos", "right"), ("draft", "right"), ("target", "right"), ("", "center"),
                          ("margin", "right")):
        t.add_column(name, justify=justify)  # type: ignore[arg-type]
    if meta.has_tokenizer:
        t.add_column("draft text")
        t.add_column("target text")
    for row in r.rows:
        style = "green" if row.accepted else "red"
        cells: list[Any] = [str(row.position), str(row.draft), str(row.target),
                            Text("\u2713" if row.accepted else "\u2717", style=f"bold {style}"), f4(row.margin)]
        if meta.has_tokenizer:
            cells += [Text(escape_text(row.draft_text)), Text(escape_text(row.target_text))]
        t.add_row(*cells, style=style)
    c.print(t)
    summary = Text(f"accepted {r.accepted}/{r.k}", style="bold green" if r.accepted == r.k else "bold")
    summary.append(f"; next token {r.next_token}")
    if meta.has_tokenizer:
        summary.append(f" {escape_text(r.next_text)}", style="cyan")
    if r.max_abs_diff_vs_sequential is not None:
        summary.append(f"; max |verify - sequential decode| = {r.max_abs_diff_vs_sequential:.3e}")
    c.print(summary)
    _rich_hidden(c, r.hidden)
    if meta.timings:
        _rich_timings(c, verify_timings_json(r))


# -- forward -------------------------------------------------------------------------------------------------


def forward_json(meta: Meta, r: ForwardResult) -> dict[str, Any]:
    doc = meta.json_head()
    doc.update({
        "prompt": meta.prompt,
        "prompt_tokens": list(r.prompt_tokens),
        "rows": [{"position": row.position, "input": r.prompt_tokens[row.position], "argmax": row.argmax,
                  "text": row.text, "logit": num(row.logit)} for row in r.rows],
    })
    _json_tail(doc, meta, r.hidden, lambda: forward_timings_json(r))
    return doc


def forward_timings_json(r: ForwardResult) -> dict[str, Any]:
    out = _base_timings(r.timings)
    s = r.timings.prefill_s
    out["tokens_per_s"] = num(len(r.prompt_tokens) / s, ".1f") if s > 0 else None
    return out


def render_forward(console: Console, meta: Meta, r: ForwardResult) -> None:
    if meta.fmt == "json":
        _dump_json(console, forward_json(meta, r))
        return
    if meta.fmt == "plain":
        _plain_head(console, meta, r.prompt_tokens)
        _write(console, "")
        _write(console, f"{'position':>8}  {'input':>8}  {'argmax':>8}  {'logit':>10}"
               + ("  text" if meta.has_tokenizer else ""))
        for row in r.rows:
            line = f"{row.position:>8}  {r.prompt_tokens[row.position]:>8}  {row.argmax:>8}  {f4(row.logit):>10}"
            _write(console, line + (f"  {escape_text(row.text)}" if meta.has_tokenizer else ""))
        _plain_hidden(console, r.hidden)
        if meta.timings:
            _plain_timings(console, forward_timings_json(r))
        return
    _rich_head(console, meta, r.prompt_tokens)
    t = Table(title=f"forward: {len(r.rows)} of {len(r.prompt_tokens)} rows", title_justify="left")
    for name in ("pos", "input", "argmax"):
        t.add_column(name, justify="right")
    if meta.has_tokenizer:
        t.add_column("text")
    t.add_column("logit", justify="right")
    for row in r.rows:
        cells: list[Any] = [str(row.position), str(r.prompt_tokens[row.position]), str(row.argmax)]
        if meta.has_tokenizer:
            cells.append(Text(escape_text(row.text), style="cyan"))
        t.add_row(*cells, f4(row.logit))
    console.print(t)
    _rich_hidden(console, r.hidden)
    if meta.timings:
        _rich_timings(console, forward_timings_json(r))


# -- hidden state and timings -----------------------------------------------------------------------------------


def hidden_json(h: HiddenSummary) -> dict[str, Any]:
    return {"size": h.size, "norm": num(h.norm, ".6g"), "mean": num(h.mean, ".6g"), "std": num(h.std, ".6g"),
            "min": num(h.min, ".6g"), "max": num(h.max, ".6g"), "first": [num(x, ".6g") for x in h.first],
            "sha256": h.sha256}


def _plain_hidden(c: Console, h: HiddenSummary | None) -> None:
    if h is None:
        return
    d = hidden_json(h)
    _write(c, f"hidden: size {d['size']} norm {h.norm:.6g} mean {h.mean:.6g} std {h.std:.6g} "
              f"min {h.min:.6g} max {h.max:.6g}")
    _write(c, "hidden_first: " + " ".join(f"{x:.6g}" for x in h.first))
    _write(c, f"hidden_sha256: {h.sha256}")


def _rich_hidden(c: Console, h: HiddenSummary | None) -> None:
    if h is None:
        return
    t = Table(title="hidden state after the final norm (last position)", title_justify="left")
    for name in ("size", "norm", "mean", "std", "min", "max"):
        t.add_column(name, justify="right")
    t.add_row(str(h.size), *(f"{v:.6g}" for v in (h.norm, h.mean, h.std, h.min, h.max)))
    c.print(t)
    c.print(Text("first: " + " ".join(f"{x:.6g}" for x in h.first)))
    c.print(Text(f"sha256: {h.sha256}", style="dim"))


_TIMING_LABELS = {
    "load_s": ("load", "s"), "prefill_ms": ("prefill", "ms"), "per_token_ms_median": ("per token (median)", "ms"),
    "tokens_per_s": ("tokens/s", ""), "verify_ms": ("verify pass", "ms"),
    "per_pass_ms_median": ("per verify pass (median)", "ms"),
    "speculative_tokens_per_s": ("speculative tokens/s", ""), "plain_tokens_per_s": ("plain greedy tokens/s", ""),
    "speedup": ("speedup", "x"), "plain_tokens_match": ("same tokens as plain greedy", ""),
}


def _plain_timings(c: Console, timings: dict[str, Any]) -> None:
    for key, value in timings.items():
        shown = "n/a" if value is None else json.dumps(value) if isinstance(value, bool) else value
        _write(c, f"timings.{key}: {shown}")


def _rich_timings(c: Console, timings: dict[str, Any]) -> None:
    t = Table(title="timings", title_justify="left", show_header=False)
    t.add_column("")
    t.add_column("", justify="right")
    for key, value in timings.items():
        label, unit = _TIMING_LABELS.get(key, (key, ""))
        shown = "n/a" if value is None else ("yes" if value else "no") if isinstance(value, bool) else f"{value} {unit}"
        t.add_row(label, shown.strip())
    c.print(t)


# -- inspect ---------------------------------------------------------------------------------------------------


def render_inspect(console: Console, fmt: str, info: dict[str, Any]) -> None:
    if fmt == "json":
        _dump_json(console, info)
        return
    rows = _inspect_rows(info)
    if fmt == "plain":
        _write(console, "metrale inspect")
        for key, value in rows:
            _write(console, f"{key}: {value}")
        return
    t = Table(title=f"inspect: {info['model']}", title_justify="left", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    for key, value in rows:
        style = "red" if key == "problems" else ("green" if key == "valid" and value == "yes" else None)
        t.add_row(key, Text(str(value), style=style or ""))
    console.print(t)


def _inspect_rows(info: dict[str, Any]) -> list[tuple[str, str]]:
    def yn(b: bool) -> str:
        return "yes" if b else "no"

    rope = info["rope"]
    rope_s = f"theta {rope['theta']:g}, {rope['type']}"
    if rope["scaling"]:
        rope_s += " (" + ", ".join(f"{k} {v:g}" for k, v in rope["scaling"].items()) + ")"
    rows = [
        ("model", info["model"]), ("architecture", info["architecture"]), ("model_type", info["model_type"]),
        ("layers", info["layers"]), ("heads", info["heads"]), ("kv_heads", info["kv_heads"]),
        ("head_dim", info["head_dim"]), ("hidden", info["hidden"]), ("intermediate", info["intermediate"]),
        ("vocab", info["vocab"]), ("max_position_embeddings", info["max_position_embeddings"]),
        ("sliding_window", info["sliding_window"] if info["sliding_window"] is not None else "none"),
        ("parameters", f"{info['parameters']:,}"), ("dtype", info["dtype"]),
        ("dtypes", ", ".join(f"{k} x{v}" for k, v in info["dtypes"].items()) or "n/a"),
        ("shards", info["shards"]),
        ("bytes", f"{info['bytes']:,}" if info["bytes"] is not None else "n/a"),
        ("tied_embeddings", yn(info["tied_embeddings"])), ("rope", rope_s),
        ("tokenizer", yn(info["tokenizer"])),
        ("eos_token_ids", " ".join(map(str, info["eos_token_ids"])) or "none"),
        ("valid", yn(info["valid"])),
    ]
    if info.get("experts"):
        rows[rows.index(("valid", yn(info["valid"]))):0] = _expert_rows(info["experts"], info["layers"])
    if info["problems"]:
        rows.append(("problems", info["problems"]))
    return [(k, str(v)) for k, v in rows]


def _expert_rows(x: dict[str, Any], layers: int) -> list[tuple[str, str]]:
    """A mixture of experts: its experts, the routing rule and which layers are sparse."""
    routing = f"softmax over {x['count']} in fp32, top-{x['top_k']}, " + (
        "renormalised" if x["norm_topk_prob"] else "not renormalised")
    if x["shared_expert_intermediate"]:
        routing += f"; + shared expert (intermediate {x['shared_expert_intermediate']}, sigmoid gate)"
    sparse = x["sparse_layers"]
    dense = [i for i in range(layers) if i not in set(sparse)]
    where = f"all {layers}" if not dense else ", ".join(map(str, sparse)) + " (dense: " + ", ".join(map(str, dense)) + ")"
    return [("experts", f"{x['count']} per sparse layer, intermediate {x['intermediate']}"), ("routing", routing),
            ("sparse_layers", where), ("active_parameters", f"{x['active_parameters']:,} per token")]


# -- errors and progress ------------------------------------------------------------------------------------------


# -- bench -------------------------------------------------------------------------------------------------------


def render_bench(console: Console, fmt: str, result: Any) -> None:
    """The bench table: each figure, its target and its ratio to that target's reference."""
    if fmt == "json":
        _dump_json(console, result.to_json())
        return
    head = (f"{result.preset} on {result.device}: {result.params / 1e9:.3f}B params, context {result.context}, "
            f"{result.streamed_bytes / 1e9:.2f} GB weights + {result.kv_bytes / 1e9:.3f} GB KV read per step")

    def verdict(f) -> str:
        return "" if f.met is None else ("met" if f.met else "MISSED")

    if fmt == "plain":
        _write(console, "metrale bench")
        _write(console, head)
        for f in result.figures:
            ratio = "" if f.ratio is None else f"{f.ratio:.3f}"
            _write(console, f"{f.name}: {f.value:.4g} {f.unit} | target: {f.target} | ratio: {ratio} | {verdict(f)}")
        for n in result.notes:
            _write(console, f"note: {n}")
        return
    t = Table(title=head, title_justify="left")
    for col in ("figure", "value", "unit", "target", "ratio", ""):
        t.add_column(col, justify="right" if col in ("value", "ratio") else "left")
    for f in result.figures:
        style = "green" if f.met else ("red" if f.met is False else "")
        t.add_row(f.name, f"{f.value:.4g}", f.unit, f.target, "" if f.ratio is None else f"{f.ratio:.3f}",
                  Text(verdict(f), style=style))
    console.print(t)
    for n in result.notes:
        console.print(f"note: {n}")


def note(err_console: Console, message: str) -> None:
    """A progress note on stderr (dim on a terminal)."""
    err_console.print(f"[dim]{escape(message)}[/dim]" if isatty(err_console) else message, highlight=False)


def error_line(err_console: Console, line: str) -> None:
    """The one line a failure prints on stderr."""
    _write(err_console, line)


def help_text(console: Console, text: str) -> None:
    """Text printed verbatim (usage help, the version, a traceback under METRALE_DEBUG=1)."""
    _write(console, text)


@contextlib.contextmanager
def load_progress(err_console: Console, label: str,
                  min_bytes: int = PROGRESS_MIN_BYTES) -> Iterator[Callable[[int, int], None]]:
    """A progress(done, total) callback for open_model: a Rich bar on stderr, shown only when stderr is a
    terminal and the checkpoint holds more than `min_bytes`."""
    state: dict[str, Any] = {}

    def progress(done: int, total: int) -> None:
        if total < min_bytes or not isatty(err_console):
            return
        if "bar" not in state:
            bar = Progress(TextColumn("[bold]loading[/] {task.description}"), BarColumn(), DownloadColumn(),
                           TimeRemainingColumn(), console=err_console, transient=True)
            bar.start()
            state["bar"], state["task"] = bar, bar.add_task(label, total=total)
        state["bar"].update(state["task"], completed=done)

    try:
        yield progress
    finally:
        if "bar" in state:
            state["bar"].stop()
