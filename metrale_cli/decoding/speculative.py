"""Greedy speculative decoding: a drafter (a smaller model, or prompt lookup) proposes tokens, one verify
pass of the target keeps the longest prefix it agrees with; the tokens are those of plain greedy decoding."""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from ..errors import InputError, MetraleError, NonFiniteLogitsError
from .decode import draft_greedy, prefill_next, run_decode
from .results import DecodeResult, DecodeStep, NonFiniteRun, SpecDecodeResult, SpecStats, Timings
from .rows import Reader, hidden_rows_for, joined_text, nonfinite_run, rows_for


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


class MtpDrafter:
    """Drafts with the target's multi-token-prediction layer (models/mtp.py, an engine with run(tokens,
    previous)): the layer takes each committed token with the target's hidden row (after its final norm) at the
    position before, so it is fed the target's rows as verify passes accept them; the first draft comes from
    the target's rows, each further one from the layer's own last row (its cache rows of those drafts are dropped
    at accept(), to be fed again with the target's)."""

    name = "mtp"
    needs_all_rows = True  # start() reads the target's hidden row of every prompt position

    def __init__(self, mtp, target) -> None:
        self.mtp, self.target = mtp, target
        self.rd = Reader(mtp)
        self._pending = np.zeros((0, int(mtp.cfg.hidden_size)), np.float32)  # target rows not yet fed
        self._fed = 0  # the MTP cache's rows fed from the target (positions 1.._fed)

    def start(self, prompt: Sequence[int]) -> None:
        self.mtp.reset()
        self._fed = 0
        self._pending = self.target.copy_hidden_rows_to_host()
        if len(self._pending) != len(prompt):
            raise MetraleError(f"the MTP draft needs the prompt's {len(prompt)} hidden rows, got {len(self._pending)}")

    def propose(self, committed: list[int], k: int) -> list[int]:
        fresh = committed[self._fed + 1:]  # each with the target row of the position before it
        self.mtp.run(fresh, self._pending[:len(fresh)])
        self._fed, self._pending = self._fed + len(fresh), self._pending[len(fresh):]
        if k <= 0:  # no room left in the cache: the verify pass runs the current token alone
            return []
        drafts = [self.rd.argmax(self.mtp.logits_buffer_ptr().row_ptr(0), len(committed))]
        while len(drafts) < k:  # the layer again, on its last draft and its own last row
            self.mtp.run(drafts[-1:], self.mtp.copy_hidden_rows_to_host()[-1:])
            drafts.append(self.rd.argmax(self.mtp.logits_buffer_ptr().row_ptr(0), len(committed) + len(drafts)))
        return drafts

    def accept(self, committed_len_before: int, accepted: int) -> None:
        self.mtp.trim(self._fed)
        # the verify pass's rows 0..accepted: the current token and the accepted drafts, now committed
        self._pending = self.target.copy_hidden_rows_to_host()[:accepted + 1]


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
    rows = rows_for(engine, engine.logits_buffer_ptr(), rd) if keep_rows else None
    hidden = hidden_rows_for(engine, want_hidden)
    stats = SpecStats(k, drafter.name, drafted_at=[0] * k, accepted_at=[0] * k)

    def evidence(e: NonFiniteLogitsError, ran: Sequence[int], failed: list[bytes]) -> NonFiniteRun:
        return nonfinite_run(e, engine, rows, hidden, failed, ran, len(prompt) - 1)

    try:
        cur, values, note = prefill_next(engine, rd, prompt, timings, rows, hidden,
                                         all_rows=getattr(drafter, "needs_all_rows", False))
    except NonFiniteLogitsError as e:
        raise evidence(e, prompt, rd.failed) from None
    drafter.start(prompt)
    committed = list(prompt) + [cur]
    out: list[DecodeStep] = []
    eos = set(eos_ids)

    def emit(token: int, vals: np.ndarray, note) -> bool:
        """Record one produced token; True when decoding must stop."""
        step = DecodeStep(len(prompt) + len(out), token, rd.text(token), float(vals[token]), rd.top_k(vals, top_k),
                          note)
        out.append(step)
        if on_step is not None:
            on_step(step)
        return len(out) >= steps or (token in eos and not ignore_eos)

    stopped = emit(cur, values, note)
    interrupted = False
    while not stopped:
        if should_stop is not None and should_stop():
            interrupted = True
            break
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
        pass_hidden = engine.copy_hidden_rows_to_host() if hidden is not None else None
        for j in range(accepted + 1):  # accepted drafts, then the correction/bonus token
            raw = rd.raw(buf.row_ptr(j))
            if rows is not None:
                rows.append(raw)
            if hidden is not None:
                hidden.extend(pass_hidden[j:j + 1])
            token = drafts[j] if j < accepted else targets[accepted]
            committed.append(token)
            vals = rd.values(raw, buf.row_ptr(j))
            if emit(token, vals, rd.note(buf.row_ptr(j), vals, token)):
                stopped = True
                break
        cur = committed[-1]
    stopped_at_eos = bool(out) and out[-1].token in eos and not ignore_eos
    return SpecDecodeResult(list(prompt), out, stopped_at_eos, rows, hidden.summary() if hidden else None, timings,
                            joined_text(detokenize, prompt, out), hidden, interrupted, stats=stats)


def time_against_plain(engine, result: SpecDecodeResult, prompt: Sequence[int], steps: int, *, eos_ids=(),
                       ignore_eos: bool = False, should_stop: Callable[[], bool] | None = None) -> bool | None:
    """decode --timings of a speculative run: plain greedy decoding of the same prompt on the same engine,
    for the tokens/s comparison. Sets result.spec_tokens_per_s and result.plain_tokens_per_s, and returns
    whether both produced the same tokens. Both rates count the tokens after the first (which the
    identical prefill produces) over the decode-phase time. Ctrl-C during the comparison (should_stop)
    marks the result interrupted and returns None: the speculative tokens stand, without it."""
    plain = run_decode(engine, prompt, steps, eos_ids=eos_ids, ignore_eos=ignore_eos, should_stop=should_stop)
    if plain.interrupted:
        result.interrupted = True
        return None
    result.spec_tokens_per_s = decode_rate(result)
    result.plain_tokens_per_s = decode_rate(plain)
    return [s.token for s in plain.steps] == [s.token for s in result.steps]


def decode_rate(result: DecodeResult) -> float | None:
    """Tokens per second of the decode phase: the tokens after the first over the time after the prefill."""
    seconds = sum(result.timings.step_s)
    return (len(result.steps) - 1) / seconds if seconds > 0 and len(result.steps) > 1 else None
