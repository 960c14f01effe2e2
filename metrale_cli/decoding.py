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
from .logits import DevicePtr, bf16_bits_to_fp32

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


@dataclass
class VerifyRow:
    position: int  # position of the draft token
    draft: int
    target: int  # the target model's greedy token at this position
    accepted: bool
    margin: float  # top-1 minus top-2 logit of the row that decided this position
    draft_text: str | None = None
    target_text: str | None = None


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


@dataclass
class Evidence:
    """What a pass produced up to its first non-finite logits row, kept for the dumps: the rows (the
    failing ones included), the hidden state, and the ids the engine ran."""

    rows: Rows | None  # None when no logits dump was asked for
    hidden: HiddenSummary | None
    tokens: list[int]  # every input id the engine ran, from position 0
    first_position: int  # rows[i] is the output at input position first_position + i

    @property
    def positions(self) -> list[int]:
        return list(range(self.first_position, self.first_position + (len(self.rows.data) if self.rows else 0)))


class NonFiniteRun(NonFiniteLogitsError):
    """A pass's NonFiniteLogitsError with the evidence it produced: the CLI writes the dumps, then fails."""

    def __init__(self, err: NonFiniteLogitsError, evidence: Evidence) -> None:
        super().__init__(str(err), row=err.row, position=err.position)
        self.evidence = evidence


def describe_nonfinite(engine, tokens: Sequence[int]) -> str | None:
    """Where the non-finite values of the pass over `tokens` first appeared (the first layer, attention
    or MLP, or the embedding row), in words for the error message; None when the engine cannot tell.

    The hook for the engines' own diagnosis: until they provide one, this says nothing."""
    return None


# -- reading rows through ModelLogits ---------------------------------------------------------------------


class Reader:
    """Reads rows of one engine through ModelLogits; knows token texts for reporting."""

    def __init__(self, engine, token_text: Callable[[int], str] | None = None) -> None:
        self.engine = engine
        self.vocab = engine.vocab_size()
        self.token_text = token_text
        self.failed: list[bytes] = []  # the raw rows of the argmax call that found NaN/Inf

    def text(self, token: int) -> str | None:
        return self.token_text(token) if self.token_text is not None else None

    def raw(self, ptr: DevicePtr) -> bytes:
        buf = bytearray(self.engine.row_nbytes(ptr))
        self.engine.copy_logits_to_host(ptr, buf)
        return bytes(buf)

    def values(self, raw: bytes, ptr: DevicePtr) -> np.ndarray:
        if self.engine.logits_ptr_is_fp32(ptr):
            return np.frombuffer(raw, dtype=np.float32).copy()
        return bf16_bits_to_fp32(np.frombuffer(raw, dtype=np.uint16))

    def argmax(self, ptr: DevicePtr, position: int) -> int:
        """`position`: the input position whose output the row is (as the dumps number rows), for the
        message when the row holds NaN/Inf."""
        try:
            return self.engine.argmax_on_device(ptr)
        except NonFiniteLogitsError:
            self.failed = [self.raw(ptr)]
            raise NonFiniteLogitsError(
                f"the logits row for position {position} holds NaN or Inf", position=position
            ) from None

    def argmax_batch(self, ptr: DevicePtr, n: int, first_position: int) -> list[int]:
        try:
            return self.engine.argmax_batch(ptr, n)
        except NonFiniteLogitsError as e:
            self.failed = [self.raw(ptr.row_ptr(i)) for i in range(n)]
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


def _evidence(err: NonFiniteLogitsError, engine, rows: Rows | None, failed: list[bytes], tokens: Sequence[int],
              first_position: int, want_hidden: bool) -> NonFiniteRun:
    """The error to raise once a pass met a non-finite row: the rows so far plus the `failed` ones."""
    if rows is not None:
        rows.data.extend(failed)
    hidden = summarize_hidden(engine.copy_hidden_to_host()) if want_hidden else None
    return NonFiniteRun(err, Evidence(rows, hidden, list(tokens), first_position))


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
    rows = _rows_for(engine, buf, rd) if keep_rows else None
    try:
        ids = rd.argmax_batch(buf, n, first_pos)
    except NonFiniteLogitsError as e:
        raise _evidence(e, engine, rows, rd.failed, prompt, first_pos, want_hidden) from None
    out = []
    for i in range(n):
        ptr = buf.row_ptr(i)
        raw = rd.raw(ptr)
        if rows is not None:
            rows.append(raw)
        vals = rd.values(raw, ptr)
        out.append(ForwardRow(first_pos + i, ids[i], rd.text(ids[i]), float(vals[ids[i]])))
    hidden = summarize_hidden(engine.copy_hidden_to_host()) if want_hidden else None
    return ForwardResult(list(prompt), out, rows, hidden, timings)


# -- greedy decode ---------------------------------------------------------------------------------------------


def prefill_next(engine, rd: Reader, prompt: Sequence[int], timings: Timings, rows: Rows | None):
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
    return token, rd.values(raw, ptr)


def run_decode(engine, prompt: Sequence[int], steps: int, *, top_k: int = 0, eos_ids: Sequence[int] = (),
               ignore_eos: bool = False, token_text=None, keep_rows: bool = False,
               want_hidden: bool = False, on_step: Callable[[DecodeStep], None] | None = None) -> DecodeResult:
    """Prefill, then greedy steps: each produced token is fed back by one decode step.

    Step i reports the token produced at position len(prompt) + i, read from the row that chose it.
    """
    rd = Reader(engine, token_text)
    timings = Timings(prompt_tokens=len(prompt))
    rows = _rows_for(engine, engine.logits_buffer_ptr(), rd) if keep_rows else None
    out: list[DecodeStep] = []
    try:
        stopped = _greedy_steps(engine, rd, prompt, steps, top_k, set(eos_ids), ignore_eos, timings, rows, out,
                                on_step)
    except NonFiniteLogitsError as e:  # every produced token was fed back: the engine ran prompt + out
        ran = list(prompt) + [s.token for s in out]
        raise _evidence(e, engine, rows, rd.failed, ran, len(prompt) - 1, want_hidden) from None
    hidden = summarize_hidden(engine.copy_hidden_to_host()) if want_hidden else None
    return DecodeResult(list(prompt), out, stopped, rows, hidden, timings)


def _greedy_steps(engine, rd: Reader, prompt: Sequence[int], steps: int, top_k: int, eos: set[int],
                  ignore_eos: bool, timings: Timings, rows: Rows | None, out: list[DecodeStep],
                  on_step: Callable[[DecodeStep], None] | None) -> bool:
    """run_decode's loop: appends each produced step to `out`; True when it stopped at an EOS token."""
    token, values = prefill_next(engine, rd, prompt, timings, rows)
    stopped = False
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
        t0 = time.perf_counter()
        engine.decode(token)
        ptr = engine.decode_logits_ptr()
        token = rd.argmax(ptr, len(prompt) + i)  # the row of the token fed at len(prompt) + i
        timings.step_s.append(time.perf_counter() - t0)
        raw = rd.raw(ptr)
        if rows is not None:
            rows.append(raw)
        values = rd.values(raw, ptr)
    return stopped


def _rows_for(engine, ptr: DevicePtr, rd: Reader) -> Rows:
    return Rows("fp32" if engine.logits_ptr_is_fp32(ptr) else "bf16", rd.vocab)


# -- verify ------------------------------------------------------------------------------------------------------


def draft_greedy(engine, rd: Reader, drafts: list[int], k: int, first_position: int,
                 raws: list[bytes] | None = None) -> None:
    """Extend `drafts` ([first], already chosen) to k tokens by sequential greedy decode steps; with
    `raws` also append the raw decode rows, row i being the one computed after feeding draft i. Both
    lists are the caller's, so a non-finite row leaves them holding what was fed and computed. The
    cache grows by k."""
    for i in range(k):
        engine.decode(drafts[-1])
        ptr = engine.decode_logits_ptr()
        if raws is not None:
            raws.append(rd.raw(ptr))
        if i < k - 1:
            drafts.append(rd.argmax(ptr, first_position + i))


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
    drafts: list[int] = []
    seq_raws: list[bytes] | None = None
    verifying = False
    try:
        first, first_values = prefill_next(engine, rd, prompt, timings, logit_rows)
        if draft == "self":
            source, drafts, seq_raws = "self", [first], []
            draft_greedy(engine, rd, drafts, k, n, seq_raws)
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
        verifying = True
        engine.verify(drafts)
        buf = engine.logits_buffer_ptr()
        targets_after = rd.argmax_batch(buf, k, n)
    except NonFiniteLogitsError as e:
        # After the prompt's last row come the failing verify rows, or, when self-drafting met the
        # non-finite row, the sequential decode rows up to it (the positions the verify rows would have).
        failed = seq_raws if seq_raws and not verifying else rd.failed
        raise _evidence(e, engine, logit_rows, failed, list(prompt) + drafts, n - 1, want_hidden) from None
    timings.step_s.append(time.perf_counter() - t0)

    raws = [rd.raw(buf.row_ptr(i)) for i in range(k)]
    if logit_rows is not None:
        for raw in raws:
            logit_rows.append(raw)
    values = [first_values] + [rd.values(raw, buf.row_ptr(0)) for raw in raws]
    targets = [first] + targets_after  # targets[i]: greedy token at position n + i
    rows, accepted, mismatch_seen = [], 0, False
    for i, d in enumerate(drafts):
        ok = (not mismatch_seen) and d == targets[i]
        mismatch_seen = mismatch_seen or not ok
        accepted += ok
        rows.append(VerifyRow(n + i, d, targets[i], ok, margin(values[i]), rd.text(d), rd.text(targets[i])))
    next_token = targets[accepted]
    engine.trim(n + accepted)
    diff = None
    if seq_raws is not None:
        ptr = buf.row_ptr(0)
        diff = max(float(np.max(np.abs(rd.values(a, ptr) - rd.values(b, ptr)))) for a, b in zip(raws, seq_raws))
    hidden = summarize_hidden(engine.copy_hidden_to_host()) if want_hidden else None
    return VerifyResult(k, source, list(prompt), rows, accepted, next_token, rd.text(next_token), diff,
                        logit_rows, hidden, timings)


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
        drafts = [committed[-1]]
        draft_greedy(e, self.rd, drafts, k, len(committed) - 1)
        # draft_greedy fed committed[-1] and drafts[1..k-1]; the proposals are what came out of those.
        out = drafts[1:]
        e_ptr = e.decode_logits_ptr()
        out.append(self.rd.argmax(e_ptr, len(committed) + k - 2))  # the row of drafts[k - 1]
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
                       on_step: Callable[[DecodeStep], None] | None = None) -> SpecDecodeResult:
    """Greedy speculative decoding: its tokens equal plain greedy decoding of `engine`.

    Loop: the current token `cur` is known but not yet run by the target. The drafter proposes up to k
    tokens after it; one verify pass runs [cur, d1..dm]; row j predicts the token after d_j (row 0: after
    cur). The longest prefix with d_{j+1} == argmax(row j) is kept, then the correction or bonus token
    argmax(row a) becomes the next `cur`; the target cache is trimmed to the accepted prefix.
    """
    if k <= 0:
        raise InputError(f"--k must be at least 1, got {k}")
    rd = Reader(engine, token_text)
    timings = Timings(prompt_tokens=len(prompt))
    rows = _rows_for(engine, engine.logits_buffer_ptr(), rd) if keep_rows else None
    stats = SpecStats(k, drafter.name, drafted_at=[0] * k, accepted_at=[0] * k)

    def evidence(e: NonFiniteLogitsError, ran: Sequence[int], failed: list[bytes]) -> NonFiniteRun:
        return _evidence(e, engine, rows, failed, ran, len(prompt) - 1, want_hidden)

    try:
        cur, values = prefill_next(engine, rd, prompt, timings, rows)
    except NonFiniteLogitsError as e:
        raise evidence(e, prompt, rd.failed) from None
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
    while not stopped:
        t0 = time.perf_counter()
        base = len(committed)  # target cache holds committed[:-1]
        room = engine.max_context - engine.length - 1
        try:  # a draft model's own rows can be non-finite: the target's rows so far are the evidence
            drafts = drafter.propose(committed, min(k, max(room, 0)))[:max(room, 0)]
        except NonFiniteLogitsError as e:
            raise evidence(e, committed[:-1], []) from None
        engine.verify([cur] + drafts)
        buf = engine.logits_buffer_ptr()
        m = len(drafts)
        try:
            targets = rd.argmax_batch(buf, m + 1, base - 1)
        except NonFiniteLogitsError as e:
            raise evidence(e, committed + drafts, rd.failed) from None
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
        for j in range(accepted + 1):  # accepted drafts, then the correction/bonus token
            raw = rd.raw(buf.row_ptr(j))
            if rows is not None:
                rows.append(raw)
            token = drafts[j] if j < accepted else targets[accepted]
            committed.append(token)
            if emit(token, rd.values(raw, buf.row_ptr(j))):
                stopped = True
                break
        cur = committed[-1]
    stopped_at_eos = bool(out) and out[-1].token in eos and not ignore_eos
    hidden = summarize_hidden(engine.copy_hidden_to_host()) if want_hidden else None
    return SpecDecodeResult(list(prompt), out, stopped_at_eos, rows, hidden, timings, stats=stats)
