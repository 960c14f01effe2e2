"""One forward pass, and greedy decoding: prefill the prompt, then one decode step per produced token."""

from __future__ import annotations

import time
from typing import Callable, Sequence

from ..errors import InputError, NonFiniteLogitsError
from .results import DecodeResult, DecodeStep, ForwardResult, ForwardRow, HiddenRows, Rows, Timings
from .rows import Reader, hidden_rows_for, joined_text, nonfinite_run, rows_for, take_hidden

# -- forward -------------------------------------------------------------------------------------------------


def run_forward(engine, prompt: Sequence[int], *, all_rows: bool, token_text=None, keep_rows: bool = False,
                want_hidden: bool = False, mtp=None) -> ForwardResult:
    """One pass over the prompt; the last row or every row. With `mtp` (an engine with run(tokens, previous):
    backends/numpy/mtp.py) the rows are the multi-token-prediction layer's instead, after the model's pass: row p
    is the layer on token p with the model's hidden row at p - 1 (positions 1.., the token after p predicted)."""
    if mtp is not None and len(prompt) < 2:
        raise InputError("the multi-token-prediction layer's first row is the prompt's second token: give 2 or "
                         "more tokens")
    timings = Timings(prompt_tokens=len(prompt))
    engine.reset()
    t0 = time.perf_counter()
    n = engine.prefill(prompt, all_logits=all_rows or mtp is not None)
    model_argmax = None
    if mtp is not None:
        model_argmax = Reader(engine).argmax_batch(engine.logits_buffer_ptr(), n, 0)  # every position's
        mtp.reset()
        n = mtp.run(prompt[1:], engine.copy_hidden_rows_to_host()[:-1], all_logits=all_rows)
        engine = mtp
    engine.synchronize()
    timings.prefill_s = time.perf_counter() - t0
    rd = Reader(engine, token_text)
    buf = engine.logits_buffer_ptr()
    first_pos = len(prompt) - n
    rows = rows_for(engine, buf, rd) if keep_rows else None
    hidden_rows = hidden_rows_for(engine, want_hidden)
    try:
        ids = rd.argmax_batch(buf, n, first_pos)
    except NonFiniteLogitsError as e:
        raise nonfinite_run(e, engine, rows, hidden_rows, rd.failed, prompt, first_pos) from None
    out = []
    for i in range(n):
        ptr = buf.row_ptr(i)
        raw = rd.raw(ptr)
        if rows is not None:
            rows.append(raw)
        vals = rd.values(raw, ptr)
        out.append(ForwardRow(first_pos + i, ids[i], rd.text(ids[i]), float(vals[ids[i]]), rd.note(ptr, vals, ids[i]),
                              None if model_argmax is None else int(model_argmax[first_pos + i])))
    take_hidden(engine, hidden_rows)
    return ForwardResult(list(prompt), out, rows, hidden_rows.summary() if hidden_rows else None, timings,
                         hidden_rows)


# -- greedy decode ---------------------------------------------------------------------------------------------


def prefill_next(engine, rd: Reader, prompt: Sequence[int], timings: Timings, rows: Rows | None,
                 hidden: HiddenRows | None = None, all_rows: bool = False):
    """Prefill the prompt; return (next token, its row values, the row's ArgmaxNote) from the prompt's last
    row. `all_rows`: the pass keeps every position's rows (a drafter reads the hidden ones); the reports still
    take the last row's."""
    engine.reset()
    t0 = time.perf_counter()
    n = engine.prefill(prompt, all_logits=all_rows)
    engine.synchronize()
    timings.prefill_s = time.perf_counter() - t0
    ptr = engine.logits_buffer_ptr().row_ptr(n - 1)
    token = rd.argmax(ptr, len(prompt) - 1)
    raw = rd.raw(ptr)
    if rows is not None:
        rows.append(raw)
    if hidden is not None:
        hidden.extend(engine.copy_hidden_rows_to_host()[n - 1:n])
    values = rd.values(raw, ptr)
    return token, values, rd.note(ptr, values, token)


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
    rows = rows_for(engine, engine.logits_buffer_ptr(), rd) if keep_rows else None
    hidden = hidden_rows_for(engine, want_hidden)
    out: list[DecodeStep] = []
    try:
        stopped, interrupted = _greedy_steps(engine, rd, prompt, steps, top_k, set(eos_ids), ignore_eos, timings,
                                             rows, hidden, out, on_step, should_stop)
    except NonFiniteLogitsError as e:  # every produced token was fed back: the engine ran prompt + out
        ran = list(prompt) + [s.token for s in out]
        raise nonfinite_run(e, engine, rows, hidden, rd.failed, ran, len(prompt) - 1) from None
    return DecodeResult(list(prompt), out, stopped, rows, hidden.summary() if hidden else None, timings,
                        joined_text(detokenize, prompt, out), hidden, interrupted)


def _greedy_steps(engine, rd: Reader, prompt: Sequence[int], steps: int, top_k: int, eos: set[int],
                  ignore_eos: bool, timings: Timings, rows: Rows | None, hidden: HiddenRows | None,
                  out: list[DecodeStep], on_step: Callable[[DecodeStep], None] | None,
                  should_stop: Callable[[], bool] | None) -> tuple[bool, bool]:
    """run_decode's loop: appends each produced step to `out`; (stopped at EOS, interrupted)."""
    token, values, note = prefill_next(engine, rd, prompt, timings, rows, hidden)
    stopped = interrupted = False
    for i in range(steps):
        step = DecodeStep(len(prompt) + i, token, rd.text(token), float(values[token]), rd.top_k(values, top_k),
                          note)
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
        token = rd.argmax(ptr, len(prompt) + i)  # the row of the token fed at len(prompt) + i
        timings.step_s.append(time.perf_counter() - t0)
        raw = rd.raw(ptr)
        if rows is not None:
            rows.append(raw)
        take_hidden(engine, hidden)
        values = rd.values(raw, ptr)
        note = rd.note(ptr, values, token)
    return stopped, interrupted


def draft_greedy(engine, rd: Reader, drafts: list[int], k: int, first_position: int,
                 raws: list[bytes] | None = None, hidden: HiddenRows | None = None) -> None:
    """Extend `drafts` ([first], already chosen) to k tokens by sequential greedy decode steps; with
    `raws` (`hidden`) also append the raw decode rows (their hidden rows), row i being the one computed
    after feeding draft i. The lists are the caller's, so a non-finite row leaves them holding what was
    fed and computed. The cache grows by k."""
    for i in range(k):
        engine.decode(drafts[-1])
        ptr = engine.decode_logits_ptr()
        if raws is not None:
            raws.append(rd.raw(ptr))
        take_hidden(engine, hidden)
        if i < k - 1:
            drafts.append(rd.argmax(ptr, first_position + i))
