"""One verify pass: K draft tokens checked against the target's greedy tokens in a single forward."""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from ..errors import InputError, NonFiniteLogitsError
from ..logits import DevicePtr
from .decode import draft_greedy, prefill_next
from .results import Timings, VerifyResult, VerifyRow
from .rows import Reader, hidden_rows_for, margin, nonfinite_run, rows_for, take_hidden
from .speculative import ModelDrafter, MtpDrafter


def run_verify(engine, prompt: Sequence[int], k: int, *, draft: str | Sequence[int] = "self",
               draft_engine=None, token_text=None, keep_rows: bool = False,
               want_hidden: bool = False) -> VerifyResult:
    """Prefill, then one verify pass over k drafts d[0..k-1] at positions len(prompt)..len(prompt)+k-1.

    d[0] is checked against the argmax of the prompt's last row, d[i] against verify row i-1; acceptance
    stops at the first mismatch. With draft="self" the same model drafts by k sequential decode steps,
    and every verify row is compared with the matching decode row. draft="model": `draft_engine` (a smaller
    model) drafts; draft="mtp": d[0] is the target's own token, d[1..] the drafts of `draft_engine`, the
    checkpoint's multi-token-prediction layer (decoding/speculative.MtpDrafter).
    """
    if k <= 0:
        raise InputError(f"--k must be at least 1, got {k}")
    rd = Reader(engine, token_text)
    timings = Timings(prompt_tokens=len(prompt))
    n = len(prompt)
    logit_rows = rows_for(engine, engine.logits_buffer_ptr(), rd) if keep_rows else None
    hidden = hidden_rows_for(engine, want_hidden)
    drafts: list[int] = []
    seq_raws: list[bytes] | None = None
    seq_hidden = hidden_rows_for(engine, want_hidden)  # the self-draft decode steps' hidden rows
    verifying = False
    try:
        first, first_values, first_note = prefill_next(engine, rd, prompt, timings, logit_rows, hidden,
                                                       all_rows=draft == "mtp")
        if draft == "self":
            source, drafts, seq_raws = "self", [first], []
            draft_greedy(engine, rd, drafts, k, n, seq_raws, seq_hidden)
            engine.trim(n)
        elif draft == "model":
            source = "model"
            drafts = draft_from_model(draft_engine, prompt, k)
        elif draft == "mtp":
            source, mtp = "mtp", MtpDrafter(draft_engine, engine)
            mtp.start(prompt)
            drafts = [first] + (mtp.propose(list(prompt) + [first], k - 1) if k > 1 else [])
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
        if seq_raws and not verifying:
            raise nonfinite_run(e, engine, logit_rows, hidden, seq_raws, list(prompt) + drafts, n - 1,
                                seq_hidden) from None
        raise nonfinite_run(e, engine, logit_rows, hidden, rd.failed, list(prompt) + drafts, n - 1) from None
    timings.step_s.append(time.perf_counter() - t0)

    raws = [rd.raw(buf.row_ptr(i)) for i in range(k)]
    take_hidden(engine, hidden)
    if logit_rows is not None:
        for raw in raws:
            logit_rows.append(raw)
    values = [first_values] + [rd.values(raw, buf.row_ptr(0)) for raw in raws]
    targets = [first] + targets_after  # targets[i]: greedy token at position n + i
    notes = [first_note] + [rd.note(buf.row_ptr(i), values[i + 1], targets[i + 1]) for i in range(k)]
    rows, accepted, mismatch_seen = [], 0, False
    for i, d in enumerate(drafts):
        ok: bool | None = None if mismatch_seen else d == targets[i]
        mismatch_seen = mismatch_seen or not ok
        accepted += bool(ok)
        rows.append(VerifyRow(n + i, d, targets[i], ok, margin(values[i]), rd.text(d), rd.text(targets[i]),
                              notes[i]))
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
    first, _, _ = prefill_next(draft_engine, drafter.rd, prompt, Timings(), None)
    return [first] + drafter.propose(list(prompt) + [first], k - 1)
