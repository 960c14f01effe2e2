"""Turning results into Rich tables, plain text or JSON. This is the only module that prints.

Formats (`--format`, default: rich when stdout is a terminal, plain otherwise):
    rich   tables, colour for accepted/rejected drafts, bars for top-k probabilities, timings at the end;
           everything fits the console's width (80 columns included): a row of a table is one line
           (a top-k candidate is a row of its own; token texts are cut with an ellipsis rather than
           wrapped), and only prose (inspect's values, bench's targets) wraps at spaces
    plain  deterministic text: fixed column widths, no colour, nothing that depends on the terminal width;
           decode prints one line per step as it is produced, then "stopped: eos|steps|interrupted
           after N tokens"
    json   one JSON object per command (indented, UTF-8)

plain and json are snapshot-stable: timings appear only with --timings, and numbers have fixed formats:
logits, probabilities, margins and rates 4 decimals (%.4f; in JSON the same value as a number),
max_abs_diff_vs_sequential %.3e (4 significant digits), hidden-state statistics 6 significant digits
(%.6g), milliseconds 3 decimals, tokens/s 1 decimal. A NaN or infinite number is `null` in JSON.

Token text (plain and rich) is escaped so that whitespace and control characters are visible:
    space -> ␣ (U+2423);  newline, tab, carriage return -> \\n \\t \\r;  backslash -> \\\\;
    a literal ␣ -> \\u2423;  other control, format and separator characters -> \\uXXXX (\\UXXXXXXXX above
    U+FFFF);  every other printable character is kept as it is.
A token that is not valid UTF-8 on its own (a byte-level or byte-fallback piece of a multi-byte
character) shows the bytes that are no character as <0xF0><0x9F> (tokenizer.py), in every format.
In JSON, "text" fields hold the raw token text (JSON string escapes only), or null without a tokenizer.

The generated text of decode ("text") is decoded by the tokenizer from the produced ids together
(decoding.continuation_text), never joined from the token texts, so a character split over byte
tokens comes out whole. plain prints it on one line as a JSON string, `text: "..."` (quote_text: JSON's
escapes, and every other invisible character as \\uXXXX); rich prints it after the prompt, keeping
newlines, and on a terminal streams it while decoding; JSON holds it raw.

JSON keys (decode, verify and forward objects start with "command", "model" (the --model path as given,
or "default"), "device" ("cpu"|"cuda") and "logits_dtype" ("bf16"|"fp32"); "hidden" appears only with
--hidden or --dump-hidden, "timings" only with --timings; positions are 0-based):

decode   {"prompt": text|null, "prompt_tokens": [ids],
          "steps": [{"position", "token", "text", "logit", "top_k": [{"token", "text", "logit", "prob"}]}],
          "text": the generated text (null without a tokenizer), "stopped_at_eos": bool,
          "interrupted": bool (Ctrl-C stopped decoding: the report holds the tokens produced so far),
          "speculative": {"k", "draft_source", "draft_model", "drafted", "accepted", "acceptance_rate",
                          "mean_accepted_per_pass", "verify_passes", "acceptance_by_position": [rates]}
                         (only with --draft ngram or --draft-model)}
verify   {"prompt", "prompt_tokens", "k", "draft_source", "draft_model",
          "rows": [{"position", "draft", "draft_text", "target", "target_text", "accepted", "status",
                    "margin"}],
          "accepted", "next_token", "next_text", "max_abs_diff_vs_sequential",
          "max_abs_diff_ulps_vs_sequential", "rows_identical_vs_sequential" (the last three null unless
          --draft self)}
         A row's "status" is "accepted", "rejected" or "unchecked": acceptance stops at the first
         rejection, so the rows after it are not checked, whatever their draft and target (their target
         is the argmax of a row that follows the rejected draft). "accepted" is true, false, or null for
         an unchecked row. plain shows yes / no / unchecked, rich a green check, a red cross, a dim dot.
         max_abs_diff_ulps_vs_sequential: max_abs_diff_vs_sequential in steps (ulps) of the logits dtype
         at the logit where it occurs (one bf16 step is 0.0625 for logits from 8 to 16);
         rows_identical_vs_sequential: how many of the k verify rows equal their decode rows bit for bit.
forward  {"prompt", "prompt_tokens", "rows": [{"position", "input", "argmax", "text", "logit"}]}
inspect  {"command", "model", "architecture", "model_type", "layers", "heads", "kv_heads",
          "head_dim", "hidden", "intermediate", "vocab", "max_position_embeddings", "sliding_window",
          "parameters", "dtype", "dtypes": {dtype: tensors}, "shards", "files", "bytes", "tied_embeddings",
          "rope": {"theta", "type", "scaling", "rotary_fraction"}, "sliding_layers": [layer indices],
          "sliding_rope": {as rope} | null (when the sliding layers' rope differs), "attn_logit_softcapping",
          "final_logit_softcapping", "attention_scale", "norm", "post_norms", "activation", "embed_scale",
          "tokenizer", "bos_token_id", "eos_token_ids", "valid", "problems"}
"hidden"  {"size", "norm", "mean", "std", "min", "max", "first": [8 values], "sha256"}
          (the post-final-norm hidden state of the last row the command produced, the last row of
          --dump-hidden: for decode, plain or speculative, the row that chose the last token; sha256 of
          its fp32 bytes)
"timings" {"load_s", "prefill_ms", "per_token_ms_median", "tokens_per_s"} for decode (tokens/s of the
          decode steps after the prefill). Speculative decode has "per_pass_ms_median" (per verify pass)
          instead of "per_token_ms_median", and adds "speculative_tokens_per_s", "plain_tokens_per_s",
          "speedup", "plain_tokens_match": decode-phase tokens/s (tokens after the first, over the time
          after the prefill) of speculative and of plain greedy decoding run in the same process on the
          same engine, and whether both produced the same tokens;
          {"load_s", "prefill_ms", "verify_ms"} for verify; {"load_s", "prefill_ms", "tokens_per_s"} for forward.

bench    {"preset", "device", "context", "params", "streamed_bytes", "kv_bytes",
          "figures": [{"name", "value", "unit", "target", "ratio", "met"}], "notes": [text],
          "paths": [{"path", "decode_ms", "floor_ratio", "bandwidth_fraction", "verify_ms": {k: ms},
                     "verify_ratio": {k: verify / that path's decode}, "logits_max_abs_diff" (vs the first path;
                     null for it), "argmax_matches", "fallbacks": {op: why unfused}}] (empty without --path;
          with it, "figures" are the first path's)

compare (logits)  {"command": "compare", "kind": "logits", "a"/"b": {"path", "source", "dtype", "shape"},
          "rows", "vocab", "overall": {"max_abs_diff", "max_abs_a", "rel_err", "nmse", "cosine", "rel_diff"}
          (null when no row is finite on both sides), "top1": {"agree", "rows", "rate"}, "top5_overlap",
          "top10_overlap", "softmax": {"kl_mean", "kl_max", "kl_percentiles": {"99.9", "99", "95", "90", "50",
          "10", "5", "1", "0.1"}, "kl_min", "dp_mean", "dp_max", "dp_percentiles": {"99.9", "99", "95", "90",
          "75", "50", "25", "10", "5", "1", "0.1"}, "dp_min", "dp_rms", "same_top_p_pct"},
          "argmax_mismatches": [{"row", "position", "a_token", "a_logit", "b_logit_at_a_token", "b_token",
          "a_logit_at_b_token", "b_logit", "margin_a"}], "first_argmax_mismatch": row|null,
          "nonfinite_rows": [rows], "tolerances": {"max_kl", "max_rel_err", "min_top1"} (null: not given),
          "first_exceeding": {"row", "position", "reasons": [text]}|null, "exceeding_rows",
          "passed": bool|null (null: no tolerance given), "failures": [text],
          "row_stats": [{"row", "position", "finite", "max_abs_diff", "max_abs_a", "rel_err", "nmse", "cosine",
          "rel_diff", "argmax_a", "argmax_b", "top5_overlap", "top10_overlap", "kl", "dp"}] (only with --rows)}
compare (layers)  {"command": "compare", "kind": "layers", "a"/"b": {"path", "source", "tensors"}, "rows",
          "positions": [ints]|null, "tensors": [{"name", "shape", "max_abs_diff", "max_abs_a", "rel_err", "nmse",
          "cosine", "rel_diff", "worst_row", "worst_position", "nonfinite_mismatch", "diverged"}] (forward order),
          "only_in_a", "only_in_b", "rtol", "rtol_is_check", "first_divergence": {"name", "rel_err",
          "before_max_rel_err"}|null, "summary": the first-divergence line, "passed": bool|null, "failures"}
          Error statistics, KL and Δp are %.3e (4 significant digits), cosine %.8f, overlaps and rates %.4f,
          same_top_p_pct %.3f; positions are null for inputs that do not record them.
score     {"command", "model", "device", "logits_dtype", "prompt": text|null (null with --text-file),
          "text_file": path|null, "prompt_tokens": [ids], "chunk", "stride",
          "windows": [{"start", "end", "first_scored"}],
          "scored": [{"position", "token", "text", "logprob", "prob", "rank",
                      "top_k": [{"token", "text", "logit", "prob"}]}],
          "scored_tokens", "total_logprob", "mean_nll", "perplexity" (%.6g: six significant digits, what fp32
          logits support across BLAS builds; natural log),
          "timings": {"load_s", "prefill_ms", "tokens_per_s"} (only with --timings)}
"""

from __future__ import annotations

import contextlib
import json
import math
import unicodedata
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .errors import UsageError

if TYPE_CHECKING:  # decoding (and numpy) is imported by the commands that compute, not by `--help`
    from rich.progress import Progress

    from .decoding.results import (DecodeResult, DecodeStep, ForwardResult, HiddenSummary, SpecDecodeResult,
                                   Timings, VerifyResult)
    from .decoding.rows import TextStream

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


def display_text(s: str) -> str:
    """Generated text for reading (rich): newlines, tabs and spaces kept; other control, format and
    separator characters as \\uXXXX (carriage return as \\r), so a model's output cannot move the
    cursor or colour the terminal."""
    out = []
    for ch in s:
        if ch in "\n\t " or ch == "\ufffd" or unicodedata.category(ch) not in _INVISIBLE:
            out.append(ch)
        elif ch == "\r":
            out.append("\\r")
        else:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}")
    return "".join(out)


def quote_text(s: str) -> str:
    """Generated text on one line (plain): a JSON string (json.loads gives the text back) that escapes
    every invisible character as \\uXXXX besides JSON's own \\n \\t \\r \\" \\\\; spaces stay spaces."""
    out = []
    for ch in json.dumps(s, ensure_ascii=False):
        if ch == " " or unicodedata.category(ch) not in _INVISIBLE:
            out.append(ch)
        elif ord(ch) <= 0xFFFF:
            out.append(f"\\u{ord(ch):04x}")
        else:  # JSON spells a character above U+FFFF as its UTF-16 surrogate pair
            high, low = divmod(ord(ch) - 0x10000, 0x400)
            out.append(f"\\u{0xD800 + high:04x}\\u{0xDC00 + low:04x}")
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
                _rich_head(self.console, self.meta, prompt_tokens)
                self.console.print(Text("text", style="bold"))
                if self.meta.prompt is not None:
                    self.console.out(display_text(self.meta.prompt), style="dim", highlight=False, end="")
            else:
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

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
        if self._stream is not None:
            self._stream_out(self._stream.push(step.token))
        if self.meta.fmt != "plain":
            return
        line = f"{step.position:>8}  {step.token:>8}  {f4(step.logit):>10}"
        _write(self.console, line + (f"  {escape_text(step.text)}" if self.meta.has_tokenizer else ""))
        for rank, t in enumerate(step.top_k, 1):
            sub = f"{'top' + str(rank):>8}  {t.token:>8}  {f4(t.logit):>10}  p={f4(t.prob)}"
            _write(self.console, sub + (f"  {escape_text(t.text)}" if self.meta.has_tokenizer else ""))

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
            _dump_json(self.console, decode_json(self.meta, result, plain_match))
        elif self.meta.fmt == "plain":
            self._plain_tail(result, plain_match)
        else:
            self._rich(result, plain_match)

    def _plain_tail(self, result: DecodeResult, plain_match: bool | None) -> None:
        c = self.console
        _write(c, "")
        _write(c, f"stopped: {_stop_reason(result)} after {len(result.steps)} tokens")
        if result.text is not None:
            _write(c, f"text: {quote_text(result.text)}")
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
        if not self._streamed:  # else the head and the text were printed while decoding
            _rich_head(c, meta, result.prompt_tokens)
            if result.text is not None:
                _rich_text(c, meta, result.text)
        c.print(_rich_steps(c, meta, result))
        spec = _spec_json(result, meta)
        if spec is not None:
            c.print(_rich_spec(spec))
        _rich_hidden(c, result.hidden)
        if meta.timings:
            _rich_timings(c, decode_timings_json(result, plain_match))


# A token text column: at most this wide, and the first to narrow when a table must fit the console; its
# cells (_token_cell) stay on one line, cut with an ellipsis, so a row is always one line.
_TEXT_COLUMN: dict[str, Any] = {"max_width": 24, "min_width": 4}


def _token_cell(text: str | None, style: str = "") -> Text:
    return Text(escape_text(text), style=style, no_wrap=True, overflow="ellipsis")


def _rich_text(c: Console, meta: Meta, text: str) -> None:
    """The generated text, after the prompt (dim) when the prompt came as text."""
    shown = Text()
    if meta.prompt is not None:
        shown.append(display_text(meta.prompt), style="dim")
    shown.append(display_text(text), style="cyan")
    c.print(Text("text", style="bold"))
    c.print(shown)


def _stop_reason(result: DecodeResult) -> str:
    return "interrupted" if result.interrupted else "eos" if result.stopped_at_eos else "steps"


_RICH_STOP = {"interrupted": " (interrupted by Ctrl-C)", "eos": " (stopped at EOS)"}


def _bar(p: float, width: int = 20) -> str:
    full = max(0, min(width, round(p * width)))
    return "\u2588" * full + "\u00b7" * (width - full)


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
        t.add_column("text", **_TEXT_COLUMN)
    t.add_column("logit", justify="right", no_wrap=True)
    bar = 20 if c.width >= 100 else 10  # 80 columns leave room for a 10-character bar
    if meta.top_k:
        t.add_column("p", justify="right", no_wrap=True)
        t.add_column("", no_wrap=True)
    for n, s in enumerate(result.steps):
        if not meta.top_k:
            t.add_row(*_step_cells(meta, str(s.position), s.token, s.text, s.logit, "cyan"))
            continue
        for rank, cand in enumerate(s.top_k):
            chosen = cand.token == s.token
            cells = _step_cells(meta, str(s.position) if rank == 0 else "", cand.token, cand.text, cand.logit,
                                "cyan" if chosen else "")
            cells += [f4(cand.prob), Text(_bar(cand.prob, bar), style="green" if chosen else "blue")]
            t.add_row(*cells, style=None if chosen else "dim",
                      end_section=rank == len(s.top_k) - 1 and n < len(result.steps) - 1)
    return t


def _step_cells(meta: Meta, position: str, token: int, text: str | None, logit: float, style: str) -> list[Any]:
    cells: list[Any] = [position, str(token)]
    if meta.has_tokenizer:
        cells.append(_token_cell(text, style))
    return cells + [f4(logit)]


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
    from .decoding.results import SpecDecodeResult

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
        "text": result.text,
        "stopped_at_eos": result.stopped_at_eos,
        "interrupted": result.interrupted,
    })
    spec = _spec_json(result, meta)
    if spec is not None:
        doc["speculative"] = spec
    _json_tail(doc, meta, result.hidden, lambda: decode_timings_json(result, plain_match))
    return doc


def decode_timings_json(result: DecodeResult, plain_match: bool | None = None) -> dict[str, Any]:
    from .decoding.results import SpecDecodeResult

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
                  "status": row.status, "margin": num(row.margin)} for row in r.rows],
        "accepted": r.accepted,
        "next_token": r.next_token,
        "next_text": r.next_text,
        "max_abs_diff_vs_sequential": num(r.max_abs_diff_vs_sequential, ".3e"),
        "max_abs_diff_ulps_vs_sequential": r.max_abs_diff_ulps_vs_sequential,
        "rows_identical_vs_sequential": r.rows_identical_vs_sequential,
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
    _write(c, f"{'position':>8}  {'draft':>8}  {'target':>8}  {'accepted':>9}  {'margin':>10}"
           + ("  draft_text | target_text" if text else ""))
    shown = {"accepted": "yes", "rejected": "no", "unchecked": "unchecked"}
    for row in r.rows:
        line = (f"{row.position:>8}  {row.draft:>8}  {row.target:>8}  {shown[row.status]:>9}  "
                f"{f4(row.margin):>10}")
        if text:
            line += f"  {escape_text(row.draft_text)} | {escape_text(row.target_text)}"
        _write(c, line)
    _write(c, "")
    _write(c, f"accepted: {r.accepted}/{r.k}")
    _write(c, f"next_token: {r.next_token}" + (f"  {escape_text(r.next_text)}" if text else ""))
    diff = r.max_abs_diff_vs_sequential
    _write(c, f"max_abs_diff_vs_sequential: {'n/a' if diff is None else format(diff, '.3e')}")
    ulps, same = r.max_abs_diff_ulps_vs_sequential, r.rows_identical_vs_sequential
    _write(c, f"max_abs_diff_ulps_vs_sequential: {'n/a' if ulps is None else ulps}")
    _write(c, f"rows_identical_vs_sequential: {'n/a' if same is None else f'{same}/{r.k}'}")
    _plain_hidden(c, r.hidden)
    if meta.timings:
        _plain_timings(c, verify_timings_json(r))


_VERIFY_MARKS = {"accepted": ("\u2713", "green"), "rejected": ("\u2717", "red"), "unchecked": ("\u00b7", "dim")}


def _rich_verify(c: Console, meta: Meta, r: VerifyResult) -> None:
    _rich_head(c, meta, r.prompt_tokens)
    t = Table(title=f"verify: k={r.k}, drafts from {r.draft_source}", title_justify="left")
    for name, justify in (("pos", "right"), ("draft", "right"), ("target", "right"), ("", "center"),
                          ("margin", "right")):
        t.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    if meta.has_tokenizer:
        t.add_column("draft text", **_TEXT_COLUMN)
        t.add_column("target text", **_TEXT_COLUMN)
    for row in r.rows:
        mark, style = _VERIFY_MARKS[row.status]
        cells: list[Any] = [str(row.position), str(row.draft), str(row.target),
                            Text(mark, style=f"bold {style}"), f4(row.margin)]
        if meta.has_tokenizer:
            cells += [_token_cell(row.draft_text), _token_cell(row.target_text)]
        t.add_row(*cells, style=style)
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
        t.add_column(name, justify="right", no_wrap=True)
    if meta.has_tokenizer:
        t.add_column("text", **_TEXT_COLUMN)
    t.add_column("logit", justify="right", no_wrap=True)
    for row in r.rows:
        cells: list[Any] = [str(row.position), str(r.prompt_tokens[row.position]), str(row.argmax)]
        if meta.has_tokenizer:
            cells.append(_token_cell(row.text, "cyan"))
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
        bad = key == "problems" or key.startswith("  ")  # the problems and each tensor with NaN/Inf
        style = "red" if bad else ("green" if key == "valid" and value == "yes" else None)
        t.add_row(key, Text(str(value), style=style or ""))
    console.print(t)


def _layer_pattern(sliding: list[int] | None, n: int | None) -> str | None:
    """"none", "all", or how many slide and the shortest repeating pattern ("4 of 6: S S F repeated");
    None when unknown (a config.json metrale cannot run)."""
    if sliding is None or n is None:
        return None
    if not sliding:
        return "none"
    if len(sliding) == n:
        return "all"
    kinds = ["S" if i in set(sliding) else "F" for i in range(n)]
    period = next(p for p in range(1, n + 1) if all(kinds[i] == kinds[i % p] for i in range(n)))
    if period <= n // 2:
        return f"{len(sliding)} of {n}: {' '.join(kinds[:period])} repeated"
    return f"{len(sliding)} of {n}: " + ", ".join(map(str, sliding))


def _inspect_rows(info: dict[str, Any]) -> list[tuple[str, str]]:
    """Every key of the JSON but "command", as text; "n/a" where a value is unknown (a config.json
    metrale cannot run is described from its raw fields)."""
    def shown(v: Any) -> str:
        if v is None:
            return "n/a"
        if isinstance(v, bool):
            return "yes" if v else "no"
        return f"{v:g}" if isinstance(v, float) else str(v)

    def rope_text(rope: dict[str, Any]) -> str:
        text = f"theta {shown(rope['theta'])}, {shown(rope['type'])}"
        if rope["scaling"]:
            text += " (" + ", ".join(f"{k} {shown(v)}" for k, v in rope["scaling"].items()) + ")"
        fraction = rope.get("rotary_fraction")
        return text + (f", rotary fraction {shown(fraction)}" if fraction not in (None, 1) else "")

    rope_s = rope_text(info["rope"])
    rows = [
        ("model", info["model"]), ("architecture", info["architecture"]), ("model_type", info["model_type"]),
        ("layers", info["layers"]), ("heads", info["heads"]), ("kv_heads", info["kv_heads"]),
        ("head_dim", info["head_dim"]), ("hidden", info["hidden"]), ("intermediate", info["intermediate"]),
        ("vocab", info["vocab"]), ("max_position_embeddings", info["max_position_embeddings"]),
        ("sliding_window", info["sliding_window"] if info["sliding_window"] is not None else "none"),
        ("parameters", f"{info['parameters']:,}" if info["parameters"] is not None else None),
        ("dtype", info["dtype"]),
        ("dtypes", ", ".join(f"{k} x{v}" for k, v in info["dtypes"].items()) or None),
        ("shards", info["shards"]), ("files", " ".join(info["files"]) or None),
        ("bytes", f"{info['bytes']:,}" if info["bytes"] is not None else None),
        ("tied_embeddings", info["tied_embeddings"]), ("rope", rope_s),
        ("sliding_layers", _layer_pattern(info["sliding_layers"], info["layers"])),
        ("sliding_rope", rope_text(info["sliding_rope"]) if info["sliding_rope"] else
         "as rope" if info["sliding_layers"] else "none" if info["sliding_layers"] is not None else None),
        ("attn_logit_softcapping", info["attn_logit_softcapping"] or "none"),
        ("final_logit_softcapping", info["final_logit_softcapping"] or "none"),
        ("attention_scale", f"{info['attention_scale']:.6g}" if info["attention_scale"] is not None else None),
        ("norm", info["norm"]), ("post_norms", info["post_norms"]), ("activation", info["activation"]),
        ("embed_scale", info["embed_scale"] or ("none" if info["norm"] is not None else None)),
        ("tokenizer", info["tokenizer"]), ("bos_token_id", info["bos_token_id"]),
        ("eos_token_ids", " ".join(map(str, info["eos_token_ids"])) or "none"),
        ("experts", _experts_text(info["experts"], info["layers"]) if info.get("experts") else "none"),
        ("valid", info["valid"]),
    ]
    if info["problems"]:
        rows.append(("problems", info["problems"]))
    rows.extend(_nonfinite_rows(info))
    return [(k, shown(v)) for k, v in rows]


def _nonfinite_rows(info: dict[str, Any]) -> list[tuple[str, str]]:
    """inspect's NaN/Inf lines: what --scan found, or that nothing was looked at without it."""
    if not info.get("scanned"):
        return [("nonfinite", "not scanned (--scan reads every tensor)")]
    found = info["nonfinite"] or []
    if not found:
        return [("nonfinite", "none")]
    rows = [("nonfinite", "1 tensor holds NaN or Inf" if len(found) == 1 else f"{len(found)} tensors hold NaN or Inf")]
    return rows + [(f"  {t['name']}", f"{t['dtype']}: {t['nan']:,} NaN, {t['inf']:,} Inf") for t in found]


def _experts_text(x: dict[str, Any], layers: int) -> str:
    """A mixture of experts in one line: the experts, the routing rule, the sparse layers, the active size."""
    routing = f"top-{x['top_k']} (softmax in fp32, " + ("renormalised)" if x["norm_topk_prob"] else "not renormalised)")
    if x["shared_expert_intermediate"]:
        routing += f" + a shared expert of intermediate {x['shared_expert_intermediate']} (sigmoid gate)"
    sparse = x["sparse_layers"]
    dense = [i for i in range(layers) if i not in set(sparse)]
    where = f"all {layers}" if not dense else ", ".join(map(str, sparse)) + " (dense: " + ", ".join(map(str, dense)) + ")"
    return (f"{x['count']} of intermediate {x['intermediate']}, {routing}; sparse layers {where}; "
            f"{x['active_parameters']:,} active parameters per token")


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

    if fmt == "plain":  # a field a figure does not have (no target, no ratio, no verdict) is left out
        _write(console, "metrale bench")
        _write(console, head)
        for f in result.figures:
            fields = [f"{f.name}: {f.value:.4g} {f.unit}"]
            fields += [f"target: {f.target}"] if f.target else []
            fields += [f"ratio: {f.ratio:.3f}"] if f.ratio is not None else []
            fields += [verdict(f)] if f.met is not None else []
            _write(console, " | ".join(fields))
        if result.paths:
            _write(console, "rows paths side by side (same run; verify: x that path's decode step):")
            names = [p.path for p in result.paths]
            for name, cells in _path_cells(result):
                _write(console, f"{name}: " + " | ".join(f"{n} {c}" for n, c in zip(names, cells)))
        for n in result.notes:
            _write(console, f"note: {n}")
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
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

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


# -- compare and score (issue 15) ----------------------------------------------------------------------------------


def _e3(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.3e}"


def _cos(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.8f}"


def _errors_json(e: Any) -> dict[str, Any] | None:
    if e is None:
        return None
    return {"max_abs_diff": num(e.max_abs_diff, ".3e"), "max_abs_a": num(e.max_abs_a, ".3e"),
            "rel_err": num(e.rel_err, ".3e"), "nmse": num(e.nmse, ".3e"), "cosine": num(e.cosine, ".8f"),
            "rel_diff": num(e.rel_diff, ".3e")}


def _side_json(s: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"path": s.path, "source": s.source}
    if s.tensors is None:
        doc.update({"dtype": s.dtype, "shape": s.shape})
    else:
        doc["tensors"] = s.tensors
    return doc


def _side_text(s: Any) -> str:
    what = f"{s.tensors} tensors" if s.tensors is not None else f"{s.dtype}, [{s.shape[0]}, {s.shape[1]}]"
    return f"{s.path} ({s.source}, {what})"


def _where(row: int, position: int | None) -> str:
    return f"row {row}" + (f" (position {position})" if position is not None else "")


def compare_json(r: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"command": "compare", "kind": r.kind, "a": _side_json(r.a), "b": _side_json(r.b),
                           "rows": r.rows}
    if r.kind == "layers":
        return _layers_json(doc, r)
    t = r.tolerances
    sm = r.softmax
    doc.update({
        "vocab": r.vocab, "overall": _errors_json(r.overall),
        "top1": {"agree": r.top1_agree, "rows": r.rows, "rate": num(r.top1_rate)},
        **{f"top{k}_overlap": num(v) for k, v in r.top_overlap.items()},
        "softmax": None if sm is None else {
            "kl_mean": num(sm.kl_mean, ".3e"), "kl_max": num(sm.kl_max, ".3e"),
            "kl_percentiles": {q: num(v, ".3e") for q, v in sm.kl_percentiles.items()},
            "kl_min": num(sm.kl_min, ".3e"), "dp_mean": num(sm.dp_mean, ".3e"), "dp_max": num(sm.dp_max, ".3e"),
            "dp_percentiles": {q: num(v, ".3e") for q, v in sm.dp_percentiles.items()},
            "dp_min": num(sm.dp_min, ".3e"), "dp_rms": num(sm.dp_rms, ".3e"),
            "same_top_p_pct": num(sm.same_top_p_pct, ".3f")},
        "argmax_mismatches": [_mismatch_json(m) for m in r.mismatches],
        "first_argmax_mismatch": None if r.first_argmax_mismatch is None else r.first_argmax_mismatch.row,
        "nonfinite_rows": list(r.nonfinite_rows),
        "tolerances": {"max_kl": t.max_kl, "max_rel_err": t.max_rel_err, "min_top1": t.min_top1},
        "first_exceeding": None if r.first_exceeding is None else {
            "row": r.first_exceeding.row, "position": r.first_exceeding.position,
            "reasons": list(r.first_exceeding.reasons)},
        "exceeding_rows": r.exceeding_rows, "passed": r.passed, "failures": list(r.failures),
    })
    if r.row_stats is not None:
        doc["row_stats"] = [_row_json(s) for s in r.row_stats]
    return doc


def _mismatch_json(m: Any) -> dict[str, Any]:
    return {"row": m.row, "position": m.position, "a_token": m.a_token, "a_logit": num(m.a_logit),
            "b_logit_at_a_token": num(m.b_logit_at_a), "b_token": m.b_token,
            "a_logit_at_b_token": num(m.a_logit_at_b), "b_logit": num(m.b_logit), "margin_a": num(m.margin_a)}


def _row_json(s: Any) -> dict[str, Any]:
    return {"row": s.row, "position": s.position, "finite": s.finite, **(_errors_json(s.errors) or {}),
            "argmax_a": s.argmax_a, "argmax_b": s.argmax_b,
            **{f"top{k}_overlap": num(v) for k, v in s.top_overlap.items()},
            "kl": num(s.kl, ".3e"), "dp": num(s.dp, ".3e")}


def _layers_json(doc: dict[str, Any], r: Any) -> dict[str, Any]:
    first = r.first_divergence
    doc.update({
        "positions": r.positions,
        "tensors": [{"name": t.name, "shape": t.shape, **(_errors_json(t.errors) or {}), "worst_row": t.worst_row,
                     "worst_position": t.worst_position, "nonfinite_mismatch": t.nonfinite_mismatch,
                     "diverged": t.diverged} for t in r.tensors],
        "only_in_a": list(r.only_a), "only_in_b": list(r.only_b), "rtol": r.rtol, "rtol_is_check": r.rtol_is_check,
        "first_divergence": None if first is None else {
            "name": first.name, "rel_err": num(first.errors.rel_err, ".3e"),
            "before_max_rel_err": num(r.before_max_rel_err, ".3e")},
        "summary": r.divergence_line(), "passed": r.passed, "failures": list(r.failures),
    })
    return doc


def render_compare(console: Console, fmt: str, r: Any) -> None:
    """The report of `metrale compare` (logits or layer dumps); --rows adds the per-row table."""
    if fmt == "json":
        _dump_json(console, compare_json(r))
    elif r.kind == "layers":
        (_plain_layers if fmt == "plain" else _rich_layers)(console, r)
    else:
        (_plain_logits_compare if fmt == "plain" else _rich_logits_compare)(console, r)


def _check_text(r: Any, hint: str) -> str:
    if r.passed is None:
        return f"not run (a report; {hint} to check)"
    if r.kind == "layers":  # the divergence line just above says why
        return f"{'passed' if r.passed else 'FAILED'} (--rtol {r.rtol:g})"
    return "passed" if r.passed else "FAILED: " + "; ".join(r.failures)


_LOGITS_HINT = "give --max-kl, --max-rel-err or --min-top1"


def _softmax_lines(sm: Any) -> list[tuple[str, str]]:
    if sm is None:
        return []
    out = [("kl_mean", _e3(sm.kl_mean)), ("kl_max", _e3(sm.kl_max))]
    out += [(f"kl_p{q}", _e3(v)) for q, v in sm.kl_percentiles.items()]
    out += [("kl_min", _e3(sm.kl_min)), ("dp_mean", _e3(sm.dp_mean)), ("dp_max", _e3(sm.dp_max))]
    out += [(f"dp_p{q}", _e3(v)) for q, v in sm.dp_percentiles.items()]
    out += [("dp_min", _e3(sm.dp_min)), ("dp_rms", _e3(sm.dp_rms)), ("same_top_p", f"{sm.same_top_p_pct:.3f}%")]
    return out


def _logits_summary(r: Any) -> list[tuple[str, str]]:
    e = r.overall
    rows = [] if e is None else [("max_abs_diff", _e3(e.max_abs_diff)), ("max_abs_a", _e3(e.max_abs_a)),
                                 ("rel_err", _e3(e.rel_err)), ("nmse", _e3(e.nmse)), ("cosine", _cos(e.cosine)),
                                 ("rel_diff", _e3(e.rel_diff))]
    rows.append(("top1_agreement", f"{r.top1_agree}/{r.rows} ({r.top1_rate:.4f})"))
    rows += [(f"top{k}_overlap", "n/a" if not math.isfinite(v) else f4(v)) for k, v in r.top_overlap.items()]
    return rows + _softmax_lines(r.softmax)


def _mismatch_cells(m: Any) -> list[str]:
    return [str(m.row), "-" if m.position is None else str(m.position), str(m.a_token), f4(m.a_logit),
            f4(m.b_logit_at_a), str(m.b_token), f4(m.a_logit_at_b), f4(m.b_logit), f4(m.margin_a)]


_MISMATCH_HEAD = ["row", "position", "a_token", "a_logit", "b_at_a_token", "b_token", "a_at_b_token", "b_logit",
                  "margin_a"]
_ROW_HEAD = ["row", "position", "max_abs_diff", "rel_err", "nmse", "cosine", "kl", "dp", "argmax_a", "argmax_b",
             "top5", "top10"]


def _row_cells(s: Any) -> list[str]:
    e = s.errors
    return [str(s.row), "-" if s.position is None else str(s.position), _e3(e.max_abs_diff), _e3(e.rel_err),
            _e3(e.nmse), _cos(e.cosine), _e3(s.kl), _e3(s.dp), str(s.argmax_a), str(s.argmax_b),
            *("n/a" if not math.isfinite(s.top_overlap[k]) else f4(s.top_overlap[k]) for k in (5, 10))]


def _plain_table(c: Console, head: list[str], rows: list[list[str]], first_left: bool = False) -> None:
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        return "  ".join(cell.ljust(w) if first_left and i == 0 else cell.rjust(w)
                         for i, (cell, w) in enumerate(zip(cells, widths))).rstrip()

    _write(c, line(head))
    for row in rows:
        _write(c, line(row))


def _plain_logits_compare(c: Console, r: Any) -> None:
    _write(c, "metrale compare")
    _write(c, f"a: {_side_text(r.a)}")
    _write(c, f"b: {_side_text(r.b)}")
    _write(c, f"kind: logits, rows: {r.rows}, vocab: {r.vocab}")
    _write(c, "")
    for key, value in _logits_summary(r):
        _write(c, f"{key}: {value}")
    _write(c, f"nonfinite_rows: {' '.join(map(str, r.nonfinite_rows)) or 'none'}")
    _write(c, "")
    _write(c, f"argmax_mismatches: {len(r.mismatches)}")
    if r.mismatches:
        _plain_table(c, _MISMATCH_HEAD, [_mismatch_cells(m) for m in r.mismatches])
    if r.row_stats is not None:
        _write(c, "")
        _plain_table(c, _ROW_HEAD, [_row_cells(s) for s in r.row_stats])
    _write(c, "")
    m = r.first_argmax_mismatch
    _write(c, f"first_argmax_mismatch: {'none' if m is None else _where(m.row, m.position)}")
    fe = r.first_exceeding
    shown = "none" if fe is None else f"{_where(fe.row, fe.position)}: {', '.join(fe.reasons)}"
    _write(c, f"first_exceeding: {shown}")
    _write(c, f"check: {_check_text(r, _LOGITS_HINT)}")


def _rich_logits_compare(c: Console, r: Any) -> None:
    c.print(Text(f"A (reference): {_side_text(r.a)}"))
    c.print(Text(f"B: {_side_text(r.b)}"))
    e = r.overall
    if e is not None:
        c.print(_rich_grid(f"logits: {r.rows} rows x {r.vocab}, over every value",
                           ["max|A-B|", "max|A|", "max|A-B|/max|A|", "NMSE", "cosine", "rel_diff"],
                           [[_e3(e.max_abs_diff), _e3(e.max_abs_a), _e3(e.rel_err), _e3(e.nmse), _cos(e.cosine),
                             _e3(e.rel_diff)]]))
    overlap = ["n/a" if not math.isfinite(v) else f4(v) for v in r.top_overlap.values()]
    c.print(_rich_grid("argmax", ["top-1 agree", *(f"top-{k} overlap" for k in r.top_overlap), "nonfinite rows"],
                       [[f"{r.top1_agree}/{r.rows} ({r.top1_rate:.4f})", *overlap,
                         " ".join(map(str, r.nonfinite_rows)) or "none"]]))
    sm = r.softmax
    if sm is not None:
        keys = ["mean", "max", *sm.kl_percentiles, "min"]
        kl = {"mean": sm.kl_mean, "max": sm.kl_max, **sm.kl_percentiles, "min": sm.kl_min}
        dp = {"mean": sm.dp_mean, "max": sm.dp_max, **sm.dp_percentiles, "min": sm.dp_min, "rms": sm.dp_rms}
        rows = [[k if k in ("mean", "max", "min", "rms") else f"{k}%", _e3(kl[k]) if k in kl else "",
                 _e3(dp[k]) if k in dp else ""] for k in keys[:2] + list(sm.dp_percentiles) + ["min", "rms"]]
        c.print(_rich_grid(f"softmax (same top p {sm.same_top_p_pct:.3f}%)", ["", "KL(P_A||P_B)", "Δp (A's top)"],
                           rows, first_left=True))
    if r.mismatches:
        head = ["row", "pos", "A top", "A logit", "B there", "B top", "A there", "B logit", "A margin"]
        c.print(_rich_grid(f"argmax differs in {len(r.mismatches)} rows", head,
                           [_mismatch_cells(m) for m in r.mismatches], compact=True))
    if r.row_stats is not None:
        head = ["row", "pos", "max|A-B|", "rel err", "KL", "Δp", "A top", "B top", "top5"]
        c.print(_rich_grid("per row", head, [[x for i, x in enumerate(_row_cells(s)) if i not in (4, 5, 11)]
                                             for s in r.row_stats], compact=True))
    fe = r.first_exceeding
    if fe is not None:
        c.print(Text(f"first row exceeding: {_where(fe.row, fe.position)}: {', '.join(fe.reasons)}", style="red"))
    _rich_check(c, r, _LOGITS_HINT)


def _rich_grid(title: str, head: list[str], rows: list[list[str]], first_left: bool = False,
               compact: bool = False) -> Table:
    # compact: no vertical rules, so a wide per-row table still fits an 80-column terminal
    t = (Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
               collapse_padding=True)
         if compact else Table(title=title, title_justify="left"))
    for i, h in enumerate(head):
        t.add_column(h, justify="left" if first_left and i == 0 else "right")
    for row in rows:
        t.add_row(*row)
    return t


def _rich_check(c: Console, r: Any, hint: str) -> None:
    style = "dim" if r.passed is None else ("bold green" if r.passed else "bold red")
    c.print(Text(f"check: {_check_text(r, hint)}", style=style))


_LAYER_HEAD = ["tensor", "shape", "max_abs_diff", "rel_err", "nmse", "cosine", "rel_diff", "worst_row"]


def _layer_cells(t: Any) -> list[str]:
    e = t.errors
    worst = str(t.worst_row) + (f" (pos {t.worst_position})" if t.worst_position is not None else "")
    return [t.name, "x".join(map(str, t.shape)), _e3(e.max_abs_diff), _e3(e.rel_err), _e3(e.nmse), _cos(e.cosine),
            _e3(e.rel_diff), worst]


_LAYERS_HINT = "give --rtol"


def _plain_layers(c: Console, r: Any) -> None:
    _write(c, "metrale compare")
    _write(c, f"a: {_side_text(r.a)}")
    _write(c, f"b: {_side_text(r.b)}")
    _write(c, f"kind: layers, rows: {r.rows}, tensors compared: {len(r.tensors)}")
    _write(c, f"positions: {' '.join(map(str, r.positions)) if r.positions is not None else 'n/a'}")
    _write(c, "")
    _plain_table(c, _LAYER_HEAD, [_layer_cells(t) for t in r.tensors], first_left=True)
    _write(c, "")
    _write(c, f"only_in_a: {' '.join(r.only_a) or 'none'}")
    _write(c, f"only_in_b: {' '.join(r.only_b) or 'none'}")
    _write(c, r.divergence_line())
    _write(c, f"check: {_check_text(r, _LAYERS_HINT)}")


def _rich_layers(c: Console, r: Any) -> None:
    c.print(Text(f"A (reference): {_side_text(r.a)}"))
    c.print(Text(f"B: {_side_text(r.b)}"))
    t = Table(title=f"layer dumps: {r.rows} rows, {len(r.tensors)} tensors in forward order", title_justify="left",
              box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    for i, h in enumerate(["tensor", "shape", "max|A-B|", "rel err", "cosine", "worst row"]):
        t.add_column(h, justify="left" if i == 0 else "right", no_wrap=i == 0)
    first = r.first_divergence
    seen = False
    for tc in r.tensors:
        seen = seen or tc is first
        style = "bold red" if tc is first else ("yellow" if seen and tc.diverged else "")
        cells = _layer_cells(tc)
        t.add_row(*cells[:4], cells[5], str(tc.worst_row), style=style)
    c.print(t)
    for label, names in (("only in A", r.only_a), ("only in B", r.only_b)):
        if names:
            c.print(Text(f"{label}: {' '.join(names)}", style="yellow"))
    c.print(Text(r.divergence_line(), style="bold red" if first is not None else "bold green"))
    _rich_check(c, r, _LAYERS_HINT)


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
    out = _base_timings(r.timings)
    s = r.timings.prefill_s
    out["tokens_per_s"] = num(len(r.scored) / s, ".1f") if s > 0 else None
    return out


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
        _dump_json(console, score_json(meta, r, text_file))
        return
    tok = meta.has_tokenizer

    def alts(s: Any, sep: str = ", ") -> str:
        return sep.join(f"{t.token}{' ' + escape_text(t.text) if tok else ''} {f4(t.prob)}" for t in s.top_k)

    if meta.fmt == "plain":
        _plain_head(console, meta, r.tokens)
        if text_file is not None:
            _write(console, f"text_file: {text_file}")
        _write(console, f"chunk: {r.chunk}, stride: {r.stride}, windows: {len(r.windows)}")
        _write(console, "")
        _write(console, f"{'position':>8}  {'token':>8}  {'logprob':>10}  {'prob':>8}  {'rank':>6}"
               + ("  text" if tok else "") + (f"  | top-{meta.top_k}" if meta.top_k else ""))
        for s in r.scored:
            line = f"{s.position:>8}  {s.token:>8}  {f4(s.logprob):>10}  {f4(s.prob):>8}  {s.rank:>6}"
            line += f"  {escape_text(s.text)}" if tok else ""
            _write(console, line + (f"  | {alts(s)}" if s.top_k else ""))
        _write(console, "")
        for key, value in _score_summary(r):
            _write(console, f"{key}: {value}")
        if meta.timings:
            _plain_timings(console, score_timings_json(r))
        return
    _rich_head(console, meta, r.tokens)
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
        _rich_timings(console, score_timings_json(r))


# -- compare --reference transformers -----------------------------------------------------------------------------


def reference_check_json(r: Any) -> dict[str, Any]:
    """compare --reference's JSON: the run, then compare's logits (with row_stats) and layers objects."""
    t = r.tolerances
    return {"command": "compare", "kind": "reference", "reference": r.reference,
            "reference_version": r.reference_version, "model": r.model, "device": r.device,
            "reference_device": "cpu", "dtype": r.dtype, "prompt_tokens": list(r.prompt_tokens), "steps": r.steps,
            "positions": list(r.positions), "reference_tokens": list(r.reference_tokens),
            "metrale_tokens": list(r.metrale_tokens), "tokens_identical": r.tokens_identical,
            "first_token_mismatch": r.first_token_mismatch, "layers_selected": r.selected_layers,
            "tolerances": {"max_kl": t.max_kl, "max_rel_err": t.max_rel_err, "min_top1": t.min_top1,
                           "rtol": t.rtol},
            "logits": compare_json(r.logits), "layers": None if r.layers is None else compare_json(r.layers),
            "passed": r.passed, "failures": list(r.failures)}


def _reference_lines(r: Any) -> list[tuple[str, str]]:
    mismatch = r.first_token_mismatch
    return [("reference", f"{r.reference} {r.reference_version} ({r.dtype}, cpu)"),
            ("metrale", f"{r.dtype}, {r.device}"), ("model", r.model),
            ("prompt_tokens", " ".join(map(str, r.prompt_tokens))),
            ("steps", f"{r.steps} (rows compared: positions {r.positions[0]}..{r.positions[-1]}, teacher-forced)"),
            ("reference_tokens", " ".join(map(str, r.reference_tokens))),
            ("metrale_tokens", " ".join(map(str, r.metrale_tokens))),
            ("tokens_identical", "yes" if r.tokens_identical else f"no (first differs at step {mismatch})")]


def render_reference_check(console: Console, fmt: str, r: Any) -> None:
    """The report of `metrale compare --reference`: the run, compare's logits report with every row (the
    argmax of both sides per row), the layers report with --layers, and the verdict."""
    if fmt == "json":
        _dump_json(console, reference_check_json(r))
        return
    verdict = "passed" if r.passed else "FAILED: " + "; ".join(r.failures)
    if fmt == "plain":
        _write(console, "metrale compare --reference")
        for key, value in _reference_lines(r):
            _write(console, f"{key}: {value}")
        _write(console, "")
        _plain_logits_compare(console, r.logits)
        if r.layers is not None:
            _write(console, "")
            _plain_layers(console, r.layers)
        _write(console, "")
        _write(console, f"reference_check: {verdict}")
        return
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for key, value in _reference_lines(r):
        grid.add_row(key, Text(value, style="" if key != "tokens_identical" else
                               ("green" if r.tokens_identical else "red")))
    console.print(grid)
    _rich_logits_compare(console, r.logits)
    if r.layers is not None:
        _rich_layers(console, r.layers)
    console.print(Text(f"reference check: {verdict}", style="bold green" if r.passed else "bold red"))
