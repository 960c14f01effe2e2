"""What every report shares: the format choice, number formats, the header, JSON output, table cells,
and the lines on stderr (notes, errors, the load progress bar)."""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ..errors import UsageError
from .text import escape_text

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


def counted(n: int, noun: str) -> str:
    """"1 row", "2 rows": a count with its noun in the right number."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def f4(x: float) -> str:
    return f"{x:.4f}"


def num(x: float | None, fmt: str = ".4f") -> float | None:
    """A float for JSON: the same rounding as the plain text, None for NaN/Inf."""
    if x is None or not math.isfinite(x):
        return None
    return float(format(x, fmt))


@dataclass
class Meta:
    command: str
    model: str  # the path as given, or "default"
    device: str
    logits_dtype: str
    fmt: str
    compute: str = "fp32"  # the engine's precision (the CUDA engine: bf16)
    prompt: str | None = None  # prompt text, when the tokens came from --prompt
    has_tokenizer: bool = False
    top_k: int = 0
    timings: bool = False
    draft_model: str | None = None

    def json_head(self) -> dict[str, Any]:
        return {"command": self.command, "model": self.model, "device": self.device, "compute": self.compute,
                "logits_dtype": self.logits_dtype}

    def pass_json_head(self, prompt_tokens: list[int]) -> dict[str, Any]:
        """The keys decode, verify and forward objects start with: json_head, the prompt and its tokens."""
        return {**self.json_head(), "prompt": self.prompt, "prompt_tokens": list(prompt_tokens)}


def note_json(note: Any) -> dict[str, Any] | None:
    """A row's "argmax_note" (decoding.results.ArgmaxNote): null, or {"tied": [ids], "fp32_argmax": id|null}."""
    return None if note is None else {"tied": list(note.tied), "fp32_argmax": note.fp32_argmax}


def note_text(note: Any) -> str:
    """An ArgmaxNote in words, the same in plain and rich: "bf16 tie 17=42, lowest wins; fp32 argmax 42"."""
    if note is None:
        return ""
    parts = [f"bf16 tie {'='.join(map(str, note.tied))}, lowest wins"] if note.tied else []
    if note.fp32_argmax is not None:
        parts.append(f"fp32 argmax {note.fp32_argmax}")
    return "; ".join(parts)


def short_note(note: Any) -> str:
    """An ArgmaxNote for a rich table's cell: "tie 17=42, fp32 42" (NOTE_CAPTION says what it means)."""
    if note is None:
        return ""
    parts = [f"tie {'='.join(map(str, note.tied))}"] if note.tied else []
    return ", ".join(parts + ([f"fp32 {note.fp32_argmax}"] if note.fp32_argmax is not None else []))


NOTE_CAPTION = ("bf16: tie = the row's maximum at several ids (the lowest wins); fp32 = the argmax of the fp32 "
                "logits before rounding")


def note_column(table: Table, rows: list[Any]) -> bool:
    """A rich table gets a "bf16" column, and the caption saying what it holds, when a row has a note."""
    if not any(getattr(r, "note", None) is not None for r in rows):
        return False
    table.add_column("bf16", style="yellow", no_wrap=True)
    table.caption, table.caption_justify = NOTE_CAPTION, "left"
    return True


def plain_note(note: Any) -> str:
    """What a plain row line ends with when its bf16 argmax carries a note: "  [bf16 tie ...]"."""
    return f"  [{note_text(note)}]" if note is not None else ""


def write(console: Console, line: str = "") -> None:
    console.out(line, highlight=False)


def dump_json(console: Console, doc: dict[str, Any]) -> None:
    write(console, json_text(doc))


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


# A long prompt's echo before the result (rich and plain; JSON keeps it whole): its first and last ids,
# and its text's first and last characters, saying how many were left out.
ECHO_IDS = (24, 8)
ECHO_CHARS = (300, 100)


def echo_ids(ids: list[int]) -> str:
    """"1 2 3 (3)", or for a long prompt its first and last ids: "0 1 ... 23 \u2026 2472 ... 2479 (2480; 2448
    not shown)"."""
    head, tail = ECHO_IDS
    if len(ids) <= head + tail:
        return f"{' '.join(map(str, ids))} ({len(ids)})"
    shown = " ".join(map(str, ids[:head])) + " \u2026 " + " ".join(map(str, ids[-tail:]))
    return f"{shown} ({len(ids)}; {len(ids) - head - tail} not shown)"


def echo_text(text: str, show: Callable[[str], str] = escape_text) -> str:
    """`show(text)`, or for a long text its first and last characters and how many are left out."""
    head, tail = ECHO_CHARS
    if len(text) <= head + tail:
        return show(text)
    return f"{show(text[:head])} \u2026 ({len(text) - head - tail} characters not shown) \u2026 {show(text[-tail:])}"


def plain_head(console: Console, meta: Meta, prompt_tokens: list[int]) -> None:
    write(console, f"metrale {meta.command}")
    write(console, f"model: {meta.model}")
    if meta.draft_model is not None:
        write(console, f"draft_model: {meta.draft_model}")
    write(console, f"device: {meta.device}")
    write(console, f"compute: {meta.compute}")
    write(console, f"logits_dtype: {meta.logits_dtype}")
    if meta.prompt is not None:
        write(console, f"prompt: {echo_text(meta.prompt)}")
    write(console, f"prompt_tokens: {echo_ids(prompt_tokens)}")


def rich_head(console: Console, meta: Meta, prompt_tokens: list[int]) -> None:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("model", Text(meta.model))
    if meta.draft_model is not None:
        grid.add_row("draft model", Text(meta.draft_model))
    grid.add_row("device", f"{meta.device}, {meta.compute} compute, logits {meta.logits_dtype}")
    if meta.prompt is not None:
        grid.add_row("prompt", Text(echo_text(meta.prompt)))
    grid.add_row("prompt tokens", Text(echo_ids(prompt_tokens)))
    console.print(grid)


# A token text column: at most this wide, and the first to narrow when a table must fit the console; its
# cells (token_cell) stay on one line, cut with an ellipsis, so a row is always one line.
TEXT_COLUMN: dict[str, Any] = {"max_width": 24, "min_width": 4}


def token_cell(text: str | None, style: str = "") -> Text:
    return Text(escape_text(text), style=style, no_wrap=True, overflow="ellipsis")


def prob_bar(p: float, width: int = 20) -> str:
    full = max(0, min(width, round(p * width)))
    return "\u2588" * full + "\u00b7" * (width - full)


def note(err_console: Console, message: str) -> None:
    """A progress note on stderr (dim on a terminal)."""
    err_console.print(f"[dim]{escape(message)}[/dim]" if isatty(err_console) else message, highlight=False)


def error_line(err_console: Console, line: str) -> None:
    """The one line a failure prints on stderr."""
    write(err_console, line)


def help_text(console: Console, text: str) -> None:
    """Text printed verbatim (usage help, the version, a traceback under METRALE_DEBUG=1)."""
    write(console, text)


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
