"""Reading logits rows through the ModelLogits interface (argmax on the device, rows copied to the host as
bytes), the token texts, and the pieces every pass shares: the rows and hidden rows it keeps, and the
evidence it leaves when a row holds NaN or Inf.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..errors import NonFiniteLogitsError
from ..logits import DevicePtr, bf16_bits_to_fp32
from .results import ArgmaxNote, DecodeStep, Evidence, HiddenRows, NonFiniteRun, Rows, TopK


def describe_nonfinite(engine, tokens: Sequence[int]) -> str | None:
    """Where the non-finite values of the pass over `tokens` first appeared (the embedding rows, a layer's
    attention or MLP, the final norm), in words for the error message; None when the engine cannot tap
    its passes. Reruns `tokens` as one prefill from position 0 with every tap on (the cache is reset)."""
    if not hasattr(engine, "tap") or len(tokens) > engine.max_context:
        return None
    from ..engine.observe import describe_nonfinite as where

    return where(engine, tokens)


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

    def note(self, ptr: DevicePtr, values: np.ndarray, token: int) -> ArgmaxNote | None:
        """For a bf16 row whose argmax is `token`: the ids tied at its maximum, and the engine's fp32 argmax
        of the row where it differs (read before the engine's next pass); None when neither applies."""
        if self.engine.logits_ptr_is_fp32(ptr):
            return None
        tied = np.flatnonzero(values == values[token])
        fp32_argmax = getattr(self.engine, "fp32_argmax", None)
        other = fp32_argmax(ptr) if fp32_argmax is not None else None
        other = other if other is not None and other not in (token, -1) else None
        if len(tied) < 2 and other is None:
            return None
        return ArgmaxNote([int(i) for i in tied] if len(tied) > 1 else [], other)

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


def hidden_rows_for(engine, want: bool) -> HiddenRows | None:
    return HiddenRows(int(engine.cfg.hidden_size)) if want else None


def take_hidden(engine, hidden: HiddenRows | None, n: int | None = None) -> None:
    """Append the first n (default: all) hidden rows of the engine's last pass."""
    if hidden is not None:
        rows = engine.copy_hidden_rows_to_host()
        hidden.extend(rows if n is None else rows[:n])


def nonfinite_run(err: NonFiniteLogitsError, engine, rows: Rows | None, hidden: HiddenRows | None,
                  failed: list[bytes], tokens: Sequence[int], first_position: int,
                  failed_hidden: HiddenRows | None = None) -> NonFiniteRun:
    """The error to raise once a pass met a non-finite row: the rows so far plus the `failed` ones, and the
    hidden rows behind them (the failing pass's last rows, or `failed_hidden` when several passes made
    the failed rows)."""
    if rows is not None:
        rows.data.extend(failed)
    if hidden is not None:
        if failed_hidden is not None:
            hidden.data.extend(failed_hidden.data)
        elif failed:
            hidden.extend(engine.copy_hidden_rows_to_host()[-len(failed):])
    return NonFiniteRun(err, Evidence(rows, hidden, list(tokens), first_position))


def joined_text(detokenize: Callable[[list[int]], str] | None, prompt: Sequence[int],
                steps: list[DecodeStep]) -> str | None:
    """The continuation_text of the produced steps; None without a tokenizer."""
    return continuation_text(detokenize, prompt, [s.token for s in steps]) if detokenize is not None else None


def rows_for(engine, ptr: DevicePtr, rd: Reader) -> Rows:
    return Rows("fp32" if engine.logits_ptr_is_fp32(ptr) else "bf16", rd.vocab)
