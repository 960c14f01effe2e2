"""Forward, greedy decode, verify and speculative decoding, as small named steps over an engine.

Everything here reads results through the ModelLogits interface (argmax on the device, rows copied to
the host as bytes) and returns plain dataclasses; rendering lives in render.py. Positions are 0-based
indices into the sequence (prompt then generated tokens).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .errors import InputError, NonFiniteLogitsError
from .logits import BF16, DevicePtr

# -- results ---------------------------------------------------------------------------------------------


@dataclass
class TopK:
    token: int
    text: str | None
    logit: float
    prob: float


@dataclass
class HiddenSummary:
    size: int
    norm: float
    mean: float
    std: float
    min: float
    max: float
    first: list[float]
    sha256: str  # of the fp32 little-endian bytes
    values: np.ndarray = field(repr=False)


@dataclass
class Rows:
    """Every logits row a command produced, in order, exactly as copy_logits_to_host gave them."""

    dtype: str  # "bf16" | "fp32"
    vocab: int
    data: list[bytes] = field(default_factory=list)

    def append(self, raw: bytes) -> None:
        self.data.append(raw)

    def array(self) -> np.ndarray:
        """[rows, vocab] as float32 or as uint16 bf16 bit patterns."""
        dt = np.float32 if self.dtype == "fp32" else np.uint16
        if not self.data:
            return np.zeros((0, self.vocab), dt)
        return np.frombuffer(b"".join(self.data), dtype=dt).reshape(len(self.data), self.vocab)


@dataclass
class HiddenRows:
    """The post-final-norm hidden state behind every logits row a command produced, in the same order
    (row i is the hidden state the logits row i was computed from), as fp32 [hidden] vectors."""

    size: int
    data: list[np.ndarray] = field(default_factory=list)

    def extend(self, rows: np.ndarray) -> None:
        self.data.extend(np.asarray(r, dtype=np.float32) for r in rows)

    def array(self) -> np.ndarray:
        """[rows, hidden] float32."""
        return np.stack(self.data) if self.data else np.zeros((0, self.size), np.float32)

    def summary(self) -> HiddenSummary | None:
        """The --hidden summary: the last row."""
        return summarize_hidden(self.data[-1]) if self.data else None


@dataclass
class Timings:
    load_s: float = 0.0
    prefill_s: float = 0.0
    prompt_tokens: int = 0
    step_s: list[float] = field(default_factory=list)  # one per decode step / verify pass
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def per_token_ms(self) -> float | None:
        return 1000 * float(np.median(self.step_s)) if self.step_s else None


@dataclass
class DecodeStep:
    position: int  # position of the produced token
    token: int
    text: str | None
    logit: float
    top_k: list[TopK]


@dataclass
class DecodeResult:
    prompt_tokens: list[int]
    steps: list[DecodeStep]
    stopped_at_eos: bool
    rows: Rows | None
    hidden: HiddenSummary | None
    timings: Timings
    text: str | None = None  # the continuation, decoded from the produced ids together (continuation_text)
    hidden_rows: HiddenRows | None = None  # with want_hidden: one per logits row, in the same order
    interrupted: bool = False  # should_stop() asked to stop before the steps or an EOS were reached


@dataclass
class VerifyRow:
    position: int  # position of the draft token
    draft: int
    target: int  # the target model's greedy token at this position
    accepted: bool | None  # None: not checked, acceptance stopped at an earlier rejection
    margin: float  # top-1 minus top-2 logit of the row that decided this position
    draft_text: str | None = None
    target_text: str | None = None

    @property
    def status(self) -> str:
        """accepted | rejected | unchecked (after the first rejection, whatever draft and target are)."""
        return "unchecked" if self.accepted is None else ("accepted" if self.accepted else "rejected")


@dataclass
class VerifyResult:
    k: int
    draft_source: str
    prompt_tokens: list[int]
    rows: list[VerifyRow]
    accepted: int
    next_token: int
    next_text: str | None
    max_abs_diff_vs_sequential: float | None  # only for --draft self
    logit_rows: Rows | None
    hidden: HiddenSummary | None
    timings: Timings
    # --draft self: max_abs_diff_vs_sequential in steps (ulps) of the logits dtype at the logit where it
    # occurs, and how many of the k verify rows are bit-identical to their sequential decode rows
    max_abs_diff_ulps_vs_sequential: int | None = None
    rows_identical_vs_sequential: int | None = None
    hidden_rows: HiddenRows | None = None  # with want_hidden: one per logits row, in the same order


@dataclass
class ForwardRow:
    position: int
    argmax: int
    text: str | None
    logit: float


@dataclass
class ForwardResult:
    prompt_tokens: list[int]
    rows: list[ForwardRow]
    logit_rows: Rows | None
    hidden: HiddenSummary | None
    timings: Timings
    hidden_rows: HiddenRows | None = None  # with want_hidden: one per reported row, in the same order


@dataclass
class SpecStats:
    k: int
    draft_source: str
    verify_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)  # per draft position 0..k-1
    accepted_at: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_per_pass(self) -> float:
        return self.accepted / self.verify_passes if self.verify_passes else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]


@dataclass
class SpecDecodeResult(DecodeResult):
    stats: SpecStats | None = None
    plain_tokens_per_s: float | None = None  # plain greedy decoding in the same run (--timings)
    spec_tokens_per_s: float | None = None


# -- reading rows through ModelLogits ---------------------------------------------------------------------


class Reader:
    """Reads rows of one engine through ModelLogits; knows token texts for reporting."""

    def __init__(self, engine, token_text: Callable[[int], str] | None = None) -> None:
        self.engine = engine
        self.vocab = engine.vocab_size()
        self.token_text = token_text

    def text(self, token: int) -> str | None:
        return self.token_text(token) if self.token_text is not None else None

    def raw(self, ptr: DevicePtr) -> bytes:
        buf = bytearray(self.engine.row_nbytes(ptr))
        self.engine.copy_logits_to_host(ptr, buf)
        return bytes(buf)

    def values(self, raw: bytes, ptr: DevicePtr) -> np.ndarray:
        dt = np.float32 if self.engine.logits_ptr_is_fp32(ptr) else BF16
        return np.frombuffer(raw, dtype=dt).astype(np.float32)

    def argmax(self, ptr: DevicePtr, position: int) -> int:
        try:
            return self.engine.argmax_on_device(ptr)
        except NonFiniteLogitsError:
            raise NonFiniteLogitsError(
                f"the logits row for position {position} holds NaN or Inf", position=position
            ) from None

    def argmax_batch(self, ptr: DevicePtr, n: int, first_position: int) -> list[int]:
        try:
            return self.engine.argmax_batch(ptr, n)
        except NonFiniteLogitsError as e:
            pos = first_position + (e.row or 0)
            raise NonFiniteLogitsError(
                f"the logits row for position {pos} holds NaN or Inf", position=pos
            ) from None

    def top_k(self, values: np.ndarray, k: int) -> list[TopK]:
        if k <= 0:
            return []
        k = min(k, values.size)
        idx = np.argpartition(-values, k - 1)[:k]
        idx = idx[np.lexsort((idx, -values[idx]))]  # by logit, ties to the lower id
        shifted = values - values.max()
        probs = np.exp(shifted) / np.exp(shifted).sum()
        return [TopK(int(i), self.text(int(i)), float(values[i]), float(probs[i])) for i in idx]


def margin(values: np.ndarray) -> float:
    """Top-1 minus top-2 logit: how far the row's greedy choice is from a tie."""
    if values.size < 2:
        return float("inf")
    top2 = np.partition(values, -2)[-2:]
    return float(top2[1] - top2[0])


def summarize_hidden(values: np.ndarray, first: int = 8) -> HiddenSummary:
    v = np.ascontiguousarray(values, dtype="<f4")
    return HiddenSummary(
        size=int(v.size), norm=float(np.linalg.norm(v.astype(np.float64))), mean=float(v.mean()),
        std=float(v.std()), min=float(v.min()), max=float(v.max()),
        first=[float(x) for x in v[:first]], sha256=hashlib.sha256(v.tobytes()).hexdigest(), values=v,
    )


def continuation_text(detokenize: Callable[[list[int]], str], prompt: Sequence[int],
                      generated: Sequence[int]) -> str:
    """The generated text as the tokenizer decodes the ids together (a character split over byte tokens
    comes out whole): decode(prompt + generated) minus decode(prompt), so a sentencepiece word's leading
    space is kept; decode(generated) when the first does not start with the second."""
    head = detokenize(list(prompt))
    full = detokenize(list(prompt) + list(generated))
    return full[len(head):] if full.startswith(head) else detokenize(list(generated))


class TextStream:
    """Incremental detokenization for showing tokens as they are decoded: push(token) returns the text
    that became final (nothing while a multi-byte character is still incomplete). Each push decodes only
    a few tokens (a window ending at the last emitted text), so a long generation stays linear."""

    WINDOW = 6  # tokens of prompt context for the first push (a decoder may treat the first piece apart)
    HOLD = 4  # tokens held back at most while they end in an incomplete character (a UTF-8 char is <= 4 bytes)

    def __init__(self, detokenize: Callable[[list[int]], str], prompt: Sequence[int]) -> None:
        self._detok = detokenize
        self._ids = list(prompt)
        self._read = len(self._ids)  # ids before this are shown
        self._prefix = max(0, self._read - self.WINDOW)

    def push(self, token: int) -> str:
        self._ids.append(token)
        head = self._detok(self._ids[self._prefix:self._read])
        full = self._detok(self._ids[self._prefix:])
        held = len(self._ids) - self._read
        if held < self.HOLD and (len(full) <= len(head) or full.endswith("\ufffd")):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(head):]

    def flush(self) -> str:
        """What is left when the stream ends (an incomplete character, as the decoder shows it)."""
        head = self._detok(self._ids[self._prefix:self._read])
        full = self._detok(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return full[len(head):]


def _hidden_rows_for(engine, want: bool) -> HiddenRows | None:
    return HiddenRows(int(engine.cfg.hidden_size)) if want else None


def _take_hidden(engine, hidden: HiddenRows | None, n: int | None = None) -> None:
    """Append the first n (default: all) hidden rows of the engine's last pass."""
    if hidden is not None:
        rows = engine.copy_hidden_rows_to_host()
        hidden.extend(rows if n is None else rows[:n])


def _sync(engine) -> None:
    sync = getattr(engine, "synchronize", None)
    if sync is not None:
        sync()


# -- forward -------------------------------------------------------------------------------------------------


def run_forward(engine, prompt: Sequence[int], *, all_rows: bool, token_text=None, keep_rows: bool = False,
                want_hidden: bool = False) -> ForwardResult:
    rd = Reader(engine, token_text)
    timings = Timings(prompt_tokens=len(prompt))
    engine.reset()
    t0 = time.perf_counter()
    n = engine.prefill(prompt, all_logits=all_rows)
    _sync(engine)
    timings.prefill_s = time.perf_counter() - t0
    buf = engine.logits_buffer_ptr()
    first_pos = len(prompt) - n
    ids = rd.argmax_batch(buf, n, first_pos)
    rows = _rows_for(engine, buf, rd) if keep_rows else None
    out = []
    for i in range(n):
        ptr = buf.row_ptr(i)
        raw = rd.raw(ptr)
        if rows is not None:
            rows.append(raw)
        vals = rd.values(raw, ptr)
        out.append(ForwardRow(first_pos + i, ids[i], rd.text(ids[i]), float(vals[ids[i]])))
    hidden_rows = _hidden_rows_for(engine, want_hidden)
    _take_hidden(engine, hidden_rows)
    return ForwardResult(list(prompt), out, rows, hidden_rows.summary() if hidden_rows else None, timings,
                         hidden_rows)


# -- greedy decode ---------------------------------------------------------------------------------------------


def prefill_next(engine, rd: Reader, prompt: Sequence[int], timings: Timings, rows: Rows | None,
                 hidden: HiddenRows | None = None):
    """Prefill the prompt; return (next token, its row values) from the prompt's last row."""
    engine.reset()
    t0 = time.perf_counter()
    engine.prefill(prompt, all_logits=False)
    _sync(engine)
    timings.prefill_s = time.perf_counter() - t0
    ptr = engine.logits_buffer_ptr().row_ptr(0)
    token = rd.argmax(ptr, len(prompt) - 1)
    raw = rd.raw(ptr)
    if rows is not None:
        rows.append(raw)
    _take_hidden(engine, hidden)
    return token, rd.values(raw, ptr)


def run_decode(engine, prompt: Sequence[int], steps: int, *, top_k: int = 0, eos_ids: Sequence[int] = (),
               ignore_eos: bool = False, token_text=None, keep_rows: bool = False,
               want_hidden: bool = False, on_step: Callable[[DecodeStep], None] | None = None,
               detokenize: Callable[[list[int]], str] | None = None,
               should_stop: Callable[[], bool] | None = None) -> DecodeResult:
    """Prefill, then greedy steps: each produced token is fed back by one decode step.

    Step i reports the token produced at position len(prompt) + i, read from the row that chose it.
    should_stop() is asked before each decode step; True ends decoding there (result.interrupted), with
    every token produced so far reported (Ctrl-C in the CLI).
    """
    rd = Reader(engine, token_text)
    timings = Timings(prompt_tokens=len(prompt))
    rows = _rows_for(engine, engine.logits_buffer_ptr(), rd) if keep_rows else None
    hidden = _hidden_rows_for(engine, want_hidden)
    token, values = prefill_next(engine, rd, prompt, timings, rows, hidden)
    out: list[DecodeStep] = []
    eos = set(eos_ids)
    stopped = interrupted = False
    for i in range(steps):
        step = DecodeStep(len(prompt) + i, token, rd.text(token), float(values[token]), rd.top_k(values, top_k))
        out.append(step)
        if on_step is not None:
            on_step(step)
        if token in eos and not ignore_eos:
            stopped = True
            break
        if i == steps - 1:
            break
        if should_stop is not None and should_stop():
            interrupted = True
            break
        t0 = time.perf_counter()
        engine.decode(token)
        ptr = engine.decode_logits_ptr()
        token = rd.argmax(ptr, len(prompt) + i + 1)
        timings.step_s.append(time.perf_counter() - t0)
        raw = rd.raw(ptr)
        if rows is not None:
            rows.append(raw)
        _take_hidden(engine, hidden)
        values = rd.values(raw, ptr)
    return DecodeResult(list(prompt), out, stopped, rows, hidden.summary() if hidden else None, timings,
                        _text(detokenize, prompt, out), hidden, interrupted)


def _text(detokenize: Callable[[list[int]], str] | None, prompt: Sequence[int],
          steps: list[DecodeStep]) -> str | None:
    return continuation_text(detokenize, prompt, [s.token for s in steps]) if detokenize is not None else None


def _rows_for(engine, ptr: DevicePtr, rd: Reader) -> Rows:
    return Rows("fp32" if engine.logits_ptr_is_fp32(ptr) else "bf16", rd.vocab)


# -- verify ------------------------------------------------------------------------------------------------------


def draft_greedy(engine, rd: Reader, first: int, k: int, first_position: int,
                 keep_rows: bool = False) -> tuple[list[int], list[bytes]]:
    """k tokens by sequential greedy decode steps starting from `first` (already chosen); with keep_rows
    also the raw decode rows, row i being the one computed after feeding draft i. The cache grows by k."""
    drafts, raws = [first], []
    for i in range(k):
        engine.decode(drafts[-1])
        ptr = engine.decode_logits_ptr()
        if keep_rows:
            raws.append(rd.raw(ptr))
        if i < k - 1:
            drafts.append(rd.argmax(ptr, first_position + i + 1))
    return drafts, raws


def run_verify(engine, prompt: Sequence[int], k: int, *, draft: str | Sequence[int] = "self",
               draft_engine=None, token_text=None, keep_rows: bool = False,
               want_hidden: bool = False) -> VerifyResult:
    """Prefill, then one verify pass over k drafts d[0..k-1] at positions len(prompt)..len(prompt)+k-1.

    d[0] is checked against the argmax of the prompt's last row, d[i] against verify row i-1; acceptance
    stops at the first mismatch. With draft="self" the same model drafts by k sequential decode steps,
    and every verify row is compared with the matching decode row.
    """
    if k <= 0:
        raise InputError(f"--k must be at least 1, got {k}")
    rd = Reader(engine, token_text)
    timings = Timings(prompt_tokens=len(prompt))
    n = len(prompt)
    logit_rows = _rows_for(engine, engine.logits_buffer_ptr(), rd) if keep_rows else None
    hidden = _hidden_rows_for(engine, want_hidden)
    first, first_values = prefill_next(engine, rd, prompt, timings, logit_rows, hidden)
    seq_raws: list[bytes] | None = None
    if draft == "self":
        source = "self"
        drafts, seq_raws = draft_greedy(engine, rd, first, k, n, keep_rows=True)
        engine.trim(n)
    elif draft == "model":
        source = "model"
        drafts = draft_from_model(draft_engine, prompt, k)
    else:
        source = "ids"
        drafts = [int(t) for t in draft]
        if len(drafts) != k:
            raise InputError(f"--draft gives {len(drafts)} ids but --k is {k}")
    t0 = time.perf_counter()
    engine.verify(drafts)
    buf = engine.logits_buffer_ptr()
    targets_after = rd.argmax_batch(buf, k, n)
    timings.step_s.append(time.perf_counter() - t0)

    raws = [rd.raw(buf.row_ptr(i)) for i in range(k)]
    _take_hidden(engine, hidden)
    if logit_rows is not None:
        for raw in raws:
            logit_rows.append(raw)
    values = [first_values] + [rd.values(raw, buf.row_ptr(0)) for raw in raws]
    targets = [first] + targets_after  # targets[i]: greedy token at position n + i
    rows, accepted, mismatch_seen = [], 0, False
    for i, d in enumerate(drafts):
        ok: bool | None = None if mismatch_seen else d == targets[i]
        mismatch_seen = mismatch_seen or not ok
        accepted += bool(ok)
        rows.append(VerifyRow(n + i, d, targets[i], ok, margin(values[i]), rd.text(d), rd.text(targets[i])))
    next_token = targets[accepted]
    engine.trim(n + accepted)
    diff = ulps = identical = None
    if seq_raws is not None:
        diff, ulps, identical = compare_rows(rd, buf.row_ptr(0), raws, seq_raws)
    return VerifyResult(k, source, list(prompt), rows, accepted, next_token, rd.text(next_token), diff,
                        logit_rows, hidden.summary() if hidden else None, timings, ulps, identical, hidden)


def compare_rows(rd: Reader, ptr: DevicePtr, rows: list[bytes], others: list[bytes]) -> tuple[float, int, int]:
    """Row by row: the largest |difference|, that difference in ulps of the logits dtype (the largest ulp
    distance among the elements where the largest |difference| occurs: a logit near zero has tiny ulps,
    so the largest ulp distance over all elements would flag rounding noise), and how many rows are
    bit-identical."""
    fp32 = rd.engine.logits_ptr_is_fp32(ptr)
    diff, ulps = 0.0, 0
    for a, b in zip(rows, others):
        d = np.abs(rd.values(a, ptr) - rd.values(b, ptr))
        worst = float(d.max())
        if worst > diff or (worst == diff and worst > 0):
            u = int(ulp_distance(a, b, fp32)[d == worst].max())
            ulps = u if worst > diff else max(ulps, u)
            diff = worst
    return diff, ulps, sum(a == b for a, b in zip(rows, others))


def ulp_distance(a: bytes, b: bytes, fp32: bool) -> np.ndarray:
    """Per element of two raw logits rows (bf16 or fp32 bytes), how many steps of that dtype apart they
    are: the distance of their bit patterns on the line of ordered floats (+0 and -0 are one value)."""
    dt, sign = ("<u4", 1 << 31) if fp32 else ("<u2", 1 << 15)

    def ordered(raw: bytes) -> np.ndarray:
        bits = np.frombuffer(raw, dtype=dt).astype(np.int64)
        magnitude = bits & (sign - 1)
        return np.where(bits & sign, -magnitude, magnitude)

    return np.abs(ordered(a) - ordered(b))


def draft_from_model(draft_engine, prompt: Sequence[int], k: int) -> list[int]:
    """k drafts from a draft model: its greedy token after the prompt, then what its drafter proposes
    after that (k - 1 decode steps; no step is run whose output is not used)."""
    drafter = ModelDrafter(draft_engine)
    first, _ = prefill_next(draft_engine, drafter.rd, prompt, Timings(), None)
    return [first] + drafter.propose(list(prompt) + [first], k - 1)


# -- speculative decoding ------------------------------------------------------------------------------------------


class ModelDrafter:
    """Drafts with a smaller model that keeps its own KV cache in step with the committed tokens."""

    name = "model"

    def __init__(self, engine) -> None:
        self.engine = engine
        self.rd = Reader(engine)

    def start(self, prompt: Sequence[int]) -> None:
        self.engine.reset()

    def propose(self, committed: list[int], k: int) -> list[int]:
        if k <= 0:  # no room left in the cache: the verify pass runs the current token alone
            return []
        e = self.engine
        # Catch up on committed tokens the draft has not run (all but the last, which decode feeds).
        behind = committed[e.length:-1]
        if behind:
            e.prefill(behind, all_logits=False)
        drafts, _ = draft_greedy(e, self.rd, committed[-1], k, len(committed) - 1)
        # draft_greedy fed committed[-1] and drafts[0..k-2]; the proposals are what came out of those.
        out = drafts[1:]
        e_ptr = e.decode_logits_ptr()
        out.append(self.rd.argmax(e_ptr, len(committed) + k - 1))
        return out

    def accept(self, committed_len_before: int, accepted: int) -> None:
        # Valid prefix: the committed tokens plus the accepted drafts the draft model has run.
        self.engine.trim(min(self.engine.length, committed_len_before + accepted))


class NgramDrafter:
    """Prompt lookup: the longest earlier n-gram matching the context's end proposes what followed it."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3) -> None:
        self.max_ngram = max_ngram

    def start(self, prompt: Sequence[int]) -> None:
        pass

    def propose(self, committed: list[int], k: int) -> list[int]:
        seq = np.asarray(committed, dtype=np.int64)
        for n in range(min(self.max_ngram, len(seq) - 1), 0, -1):
            tail = seq[-n:]
            # windows[i] = seq[i:i+n] for every start that leaves at least one token after it
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent earlier match
                return [int(t) for t in seq[start:start + k]]
        return []

    def accept(self, committed_len_before: int, accepted: int) -> None:
        pass


def speculative_decode(engine, drafter, prompt: Sequence[int], steps: int, k: int, *, eos_ids=(),
                       ignore_eos: bool = False, token_text=None, top_k: int = 0,
                       keep_rows: bool = False, want_hidden: bool = False,
                       on_step: Callable[[DecodeStep], None] | None = None,
                       detokenize: Callable[[list[int]], str] | None = None,
                       should_stop: Callable[[], bool] | None = None) -> SpecDecodeResult:
    """Greedy speculative decoding: its tokens equal plain greedy decoding of `engine`.

    Loop: the current token `cur` is known but not yet run by the target. The drafter proposes up to k
    tokens after it; one verify pass runs [cur, d1..dm]; row j predicts the token after d_j (row 0: after
    cur). The longest prefix with d_{j+1} == argmax(row j) is kept, then the correction or bonus token
    argmax(row a) becomes the next `cur`; the target cache is trimmed to the accepted prefix.
    should_stop() is asked before each verify pass (as in run_decode).
    """
    if k <= 0:
        raise InputError(f"--k must be at least 1, got {k}")
    rd = Reader(engine, token_text)
    timings = Timings(prompt_tokens=len(prompt))
    rows = _rows_for(engine, engine.logits_buffer_ptr(), rd) if keep_rows else None
    hidden = _hidden_rows_for(engine, want_hidden)
    stats = SpecStats(k, drafter.name, drafted_at=[0] * k, accepted_at=[0] * k)
    cur, values = prefill_next(engine, rd, prompt, timings, rows, hidden)
    drafter.start(prompt)
    committed = list(prompt) + [cur]
    out: list[DecodeStep] = []
    eos = set(eos_ids)

    def emit(token: int, vals: np.ndarray) -> bool:
        """Record one produced token; True when decoding must stop."""
        step = DecodeStep(len(prompt) + len(out), token, rd.text(token), float(vals[token]), rd.top_k(vals, top_k))
        out.append(step)
        if on_step is not None:
            on_step(step)
        return len(out) >= steps or (token in eos and not ignore_eos)

    stopped = emit(cur, values)
    interrupted = False
    while not stopped:
        if should_stop is not None and should_stop():
            interrupted = True
            break
        t0 = time.perf_counter()
        base = len(committed)  # target cache holds committed[:-1]
        room = engine.max_context - engine.length - 1
        drafts = drafter.propose(committed, min(k, max(room, 0)))[:max(room, 0)]
        engine.verify([cur] + drafts)
        buf = engine.logits_buffer_ptr()
        m = len(drafts)
        targets = rd.argmax_batch(buf, m + 1, base - 1)
        accepted = 0
        while accepted < m and drafts[accepted] == targets[accepted]:
            accepted += 1
        stats.verify_passes += 1
        stats.drafted += m
        stats.accepted += accepted
        for i in range(m):
            stats.drafted_at[i] += 1
            stats.accepted_at[i] += i < accepted
        engine.trim(base + accepted)
        drafter.accept(base, accepted)
        timings.step_s.append(time.perf_counter() - t0)
        pass_hidden = engine.copy_hidden_rows_to_host() if hidden is not None else None
        for j in range(accepted + 1):  # accepted drafts, then the correction/bonus token
            raw = rd.raw(buf.row_ptr(j))
            if rows is not None:
                rows.append(raw)
            if hidden is not None:
                hidden.extend(pass_hidden[j:j + 1])
            token = drafts[j] if j < accepted else targets[accepted]
            committed.append(token)
            if emit(token, rd.values(raw, buf.row_ptr(j))):
                stopped = True
                break
        cur = committed[-1]
    stopped_at_eos = bool(out) and out[-1].token in eos and not ignore_eos
    return SpecDecodeResult(list(prompt), out, stopped_at_eos, rows, hidden.summary() if hidden else None, timings,
                            _text(detokenize, prompt, out), hidden, interrupted, stats=stats)
