"""Teacher-forced scoring (`metrale score`): the log-probability and rank the model gives every actual
next token of a text, its top-k alternatives, the total log-likelihood and the perplexity.

Token j (j >= 1) is scored by the logits row of position j - 1: log p(t_j | t_<j) = row[t_j] - logsumexp(row),
in float64 from the rows read through ModelLogits (fp32 logits by default: bf16 rows would round every
log-probability). The first token is never scored (nothing precedes it), exactly as transformers'
`model(ids, labels=ids).loss`, whose exp is the perplexity of a text that fits one window:
perplexity = exp(-(Σ_j log p(t_j | t_<j)) / (n - 1)).

Texts longer than the window are scored in windows of `chunk` tokens starting every `stride` tokens
(default stride = chunk - 1). Each window is a fresh forward pass (empty KV cache) over tokens
[start, start + chunk) and scores only the tokens no earlier window scored; the first token of a window
is context only. So every token after the first is scored exactly once, and a token scored by window
w > 0 is conditioned on the tokens of its window before it: at least chunk - stride of them, more
further in (with the default stride, the first token a window scores sees one token of context). This is
transformers' strided-perplexity recipe (max_length = chunk, stride) without the token it drops at each
window start; stride = chunk / 2 gives every scored token at least chunk / 2 tokens of context, like
llama-perplexity's scoring of the second half of each chunk (which discards the first halves instead of
overlapping windows, and starts each chunk with BOS; here no token is inserted).

rank: 1 + the number of tokens whose logit is strictly higher than the actual token's (1 = argmax; ties
share the better rank). top-k alternatives are the k largest logits, ties to the lower id.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .compare import top_k_ids
from .decoding.results import Timings, TopK
from .decoding.rows import Reader
from .errors import InputError, UsageError
from .config import ModelConfig
from .inputs import limit_of


@dataclass
class ScoredToken:
    position: int  # the scored token's position (the row of position - 1 predicted it)
    token: int
    text: str | None
    logprob: float  # natural log
    rank: int
    top_k: list[TopK]
    window: int  # index of the window that scored it

    @property
    def prob(self) -> float:
        return math.exp(self.logprob)


@dataclass
class Window:
    start: int  # first token of the window (context only)
    end: int  # one past the last token
    first_scored: int  # positions first_scored .. end - 1 are scored here

    @property
    def scored(self) -> int:
        return self.end - self.first_scored


@dataclass
class ScoreResult:
    tokens: list[int]
    chunk: int
    stride: int
    windows: list[Window]
    scored: list[ScoredToken]
    timings: Timings = field(default_factory=Timings)

    @property
    def total_logprob(self) -> float:
        return math.fsum(s.logprob for s in self.scored)

    @property
    def mean_nll(self) -> float:
        return -self.total_logprob / len(self.scored)

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)


# -- planning (no weights needed) ---------------------------------------------------------------------------


def plan_windows(n: int, chunk: int, stride: int) -> list[Window]:
    """Windows [start, end) over n tokens and the positions each one scores (see the module docstring)."""
    if n < 2:
        raise InputError(f"score needs at least 2 tokens (the first is context only), got {n}")
    if chunk < 2:
        raise UsageError(f"--chunk must be at least 2 tokens, got {chunk}")
    if not 1 <= stride <= chunk - 1:
        raise UsageError(f"--stride must be between 1 and --chunk - 1 = {chunk - 1}, got {stride} "
                         "(a larger stride would leave tokens unscored)")
    windows = [Window(0, min(chunk, n), 1)]
    while windows[-1].end < n:
        start = windows[-1].start + stride
        windows.append(Window(start, min(start + chunk, n), windows[-1].end))
    return windows


def choose_chunk(cfg: ModelConfig, label: str, n: int, chunk: int | None, stride: int | None,
                 max_context: int | None) -> tuple[int, int, int]:
    """(chunk, stride, KV cache positions): the window is at most the model's context and --max-context;
    by default it is the whole text when the text fits."""
    limit = cfg.max_context
    if max_context is not None:
        if max_context > limit:
            raise InputError(f"--max-context {max_context} exceeds {label}'s {limit_of(cfg)}")
        limit = max_context
    if chunk is None:
        chunk = max(2, min(n, limit))
    elif chunk > limit:
        what = f"--max-context {max_context}" if max_context is not None else f"{label}'s {limit_of(cfg)}"
        raise InputError(f"--chunk {chunk} exceeds {what}")
    stride = chunk - 1 if stride is None else stride
    plan_windows(n, chunk, stride)  # the checks, before any weight is loaded
    return chunk, stride, max_context if max_context is not None else min(chunk, n)


def read_text_file(value: str, read_stdin: Callable[[], str]) -> str:
    """--text-file F: the text to score ('-' reads stdin), as UTF-8."""
    if value == "-":
        return read_stdin()
    p = Path(value)
    if p.is_dir():
        raise UsageError(f"--text-file {value}: is a directory")
    try:
        return p.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise UsageError(f"--text-file {value}: no such file") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"--text-file {value}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise UsageError(f"--text-file {value}: cannot read: {e.strerror or e}") from None


# -- scoring ---------------------------------------------------------------------------------------------------


def run_score(engine, tokens: Sequence[int], *, chunk: int, stride: int, top_k: int = 0,
              token_text=None) -> ScoreResult:
    """Score every token after the first, window by window, from the engine's logits rows."""
    if top_k < 0:
        raise UsageError(f"--top-k must be 0 or more, got {top_k}")
    ids = [int(t) for t in tokens]
    windows = plan_windows(len(ids), chunk, stride)
    rd = Reader(engine, token_text)
    timings = Timings(prompt_tokens=len(ids))
    scored: list[ScoredToken] = []
    for w, win in enumerate(windows):
        engine.reset()
        t0 = time.perf_counter()
        n_rows = engine.prefill(ids[win.start:win.end], all_logits=True)
        engine.synchronize()
        timings.step_s.append(time.perf_counter() - t0)
        buf = engine.logits_buffer_ptr()
        rd.argmax_batch(buf, n_rows, win.start)  # a row holding NaN/Inf fails here, naming its position
        for pos in range(win.first_scored, win.end):
            ptr = buf.row_ptr(pos - 1 - win.start)
            scored.append(score_row(rd.values(rd.raw(ptr), ptr), pos, ids[pos], w, top_k, rd.text))
    timings.prefill_s = sum(timings.step_s)
    return ScoreResult(ids, chunk, stride, windows, scored, timings)


def score_row(values: np.ndarray, position: int, token: int, window: int, top_k: int,
              text: Callable[[int], str | None]) -> ScoredToken:
    """The actual token's log-probability and rank in one logits row, and the row's top-k, in float64."""
    x = np.asarray(values, dtype=np.float64)
    m = float(x.max())
    log_z = m + math.log(float(np.exp(x - m).sum()))
    alts = [TopK(int(i), text(int(i)), float(values[i]), math.exp(float(x[i]) - log_z))
            for i in (top_k_ids(x, top_k) if top_k > 0 else [])]
    rank = 1 + int((x > x[token]).sum())
    return ScoredToken(position, token, text(token), float(x[token]) - log_z, rank, alts, window)
