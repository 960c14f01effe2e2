"""The logits interface: how every pass's output is read back, whatever engine produced it.

Method names and meanings follow the engine metrale is modelled on (`ModelLogits` in its Rust model engine):

    vocab_size()                       rows are this wide
    copy_logits_to_host(ptr, dst)      one row as bytes: vocab*2 for BF16, vocab*4 for FP32
    logits_ptr_is_fp32(ptr)            whether ptr's buffer holds FP32 rows
    logits_buffer_ptr()                the multi-row buffer (prefill rows, verify's [k, vocab] rows)
    argmax_on_device(ptr, stream)      first index of the maximum of one row, computed where the row lives
    argmax_batch(ptr, n, stream)       the same for n consecutive rows
    hidden_after_norm()                post-final-norm hidden state [hidden] of the last position of the last pass
    hidden_rows_ptr()                  (beyond the seed) the post-final-norm rows [n, hidden] of the last pass,
                                       one per logits row it wrote
    decode_logits_fp32()               whether single-token decode writes FP32 rows
    decode_logits_ptr()                the row single-token decode last wrote

A `DevicePtr` addresses rows of one of the engine's buffers without exposing the backend (a NumPy array
on the CPU, a CuPy array on the GPU) to callers: they can only pass it back to the engine, or step to
another row with `ptr.row_ptr(i)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import ml_dtypes
import numpy as np

from .errors import InputError, NonFiniteLogitsError

BF16 = np.dtype(ml_dtypes.bfloat16)


@dataclass(frozen=True)
class DevicePtr:
    """Rows [row, row + rows) of a 2-D engine buffer. The buffer itself is private to the engine."""

    _buffer: Any = field(repr=False, compare=False)  # numpy or cupy array [rows_total, width]
    row: int = 0
    rows: int = 1

    def row_ptr(self, i: int) -> DevicePtr:
        """Row i of this region (0 <= i < rows)."""
        if not 0 <= i < self.rows:
            raise IndexError(f"row {i} outside a region of {self.rows} rows")
        return DevicePtr(self._buffer, self.row + i, 1)

    def take(self, n: int) -> DevicePtr:
        """The first n rows of this region."""
        if not 0 <= n <= self.rows:
            raise IndexError(f"{n} rows asked of a region of {self.rows}")
        return DevicePtr(self._buffer, self.row, n)

    @property
    def width(self) -> int:
        return int(self._buffer.shape[1])


@runtime_checkable
class ModelLogits(Protocol):
    def vocab_size(self) -> int: ...
    def copy_logits_to_host(self, logits_ptr: DevicePtr, dst: Any) -> None: ...
    def logits_ptr_is_fp32(self, logits_ptr: DevicePtr) -> bool: ...
    def logits_buffer_ptr(self) -> DevicePtr: ...
    def argmax_on_device(self, logits_ptr: DevicePtr, stream: int = 0) -> int: ...
    def argmax_batch(self, logits_ptr: DevicePtr, n: int, stream: int = 0) -> list[int]: ...
    def hidden_after_norm(self) -> DevicePtr: ...
    def decode_logits_fp32(self) -> bool: ...
    def decode_logits_ptr(self) -> DevicePtr: ...


def fp32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even, bit-identical to `torch.Tensor.to(torch.bfloat16)`."""
    return np.asarray(x, dtype=np.float32).astype(BF16)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """The uint16 bit patterns of a bfloat16 array (what `.npy` dumps store)."""
    return np.ascontiguousarray(x, dtype=BF16).view(np.uint16)


def host_argmax(rows: np.ndarray) -> np.ndarray:
    """First index of each row's maximum; -1 for a row holding NaN or Inf (never a silent answer)."""
    x = np.asarray(rows, dtype=np.float32)
    idx = np.argmax(x, axis=-1).astype(np.int64)
    idx[~np.isfinite(x).all(axis=-1)] = -1
    return idx


class LogitsBuffers:
    """The ModelLogits methods shared by every engine.

    An engine sets `_logits` ([rows, vocab] buffer for prefill/verify, `_n_rows` of them valid), `_decode_logits` ([1, vocab]),
    `_hidden` ([1, hidden] fp32), `_hidden_rows` ([n, hidden] fp32: the post-final-norm rows of the last pass
    behind the logits rows it wrote) and `_fp32_logits`, and implements the two backend hooks:
    `_row_to_host(ptr) -> np.ndarray` (one row, in the buffer's dtype) and
    `_argmax_rows(ptr, n, stream) -> np.ndarray` (indices, -1 for a non-finite row).
    """

    _logits: Any
    _decode_logits: Any
    _hidden: Any
    _fp32_logits: bool
    _n_rows: int = 1  # rows of _logits written by the last prefill/verify pass
    _hidden_rows: Any = None  # [n, hidden] fp32 of the last pass; None before the first

    # -- seed interface -------------------------------------------------------------------------
    def vocab_size(self) -> int:
        return int(self._decode_logits.shape[1])

    def logits_ptr_is_fp32(self, logits_ptr: DevicePtr) -> bool:
        return logits_ptr._buffer.dtype == np.float32

    def logits_buffer_ptr(self) -> DevicePtr:
        """The rows the last prefill or verify pass wrote (the buffer may hold more capacity)."""
        return DevicePtr(self._logits, 0, self._n_rows)

    def decode_logits_fp32(self) -> bool:
        return self._fp32_logits

    def decode_logits_ptr(self) -> DevicePtr:
        return DevicePtr(self._decode_logits, 0, 1)

    def hidden_after_norm(self) -> DevicePtr:
        return DevicePtr(self._hidden, 0, 1)

    def hidden_rows_ptr(self) -> DevicePtr:
        """The post-final-norm hidden rows [n, hidden] of the last pass, one per logits row it wrote:
        prefill (every position with all_logits, else the last), verify (k rows), decode (1 row).
        Valid until the next pass."""
        rows = self._hidden if self._hidden_rows is None else self._hidden_rows
        return DevicePtr(rows, 0, int(rows.shape[0]))

    def copy_logits_to_host(self, logits_ptr: DevicePtr, dst: Any) -> None:
        """Copy the first row of `logits_ptr` into `dst` (a writable bytes-like or uint8 array)."""
        self._copy_row(logits_ptr, dst)

    def argmax_on_device(self, logits_ptr: DevicePtr, stream: int = 0) -> int:
        return self.argmax_batch(logits_ptr, 1, stream)[0]

    def argmax_batch(self, logits_ptr: DevicePtr, n: int, stream: int = 0) -> list[int]:
        if not 1 <= n <= logits_ptr.rows:
            raise InputError(f"argmax over {n} rows asked of a region of {logits_ptr.rows} rows")
        idx = self._argmax_rows(logits_ptr, n, stream)
        bad = np.flatnonzero(np.asarray(idx) < 0)
        if bad.size:
            row = int(bad[0])
            raise NonFiniteLogitsError(f"logits row {row} holds NaN or Inf", row=row)
        return [int(i) for i in idx]

    # -- extras beyond the seed ---------------------------------------------------------------------
    def copy_hidden_to_host(self) -> np.ndarray:
        """hidden_after_norm() as a host fp32 vector [hidden]."""
        return np.array(self._row_to_host(self.hidden_after_norm()), dtype=np.float32)

    def copy_hidden_rows_to_host(self) -> np.ndarray:
        """hidden_rows_ptr() as a host fp32 array [n, hidden]."""
        ptr = self.hidden_rows_ptr()
        return np.stack([np.asarray(self._row_to_host(ptr.row_ptr(i)), dtype=np.float32) for i in range(ptr.rows)])

    def row_nbytes(self, logits_ptr: DevicePtr) -> int:
        return self.vocab_size() * (4 if self.logits_ptr_is_fp32(logits_ptr) else 2)

    # -- shared implementation -----------------------------------------------------------------------
    def _copy_row(self, ptr: DevicePtr, dst: Any) -> None:
        want = self.row_nbytes(ptr)
        try:
            view = memoryview(dst).cast("B")
        except TypeError:
            raise InputError("copy_logits_to_host: dst must be a writable bytes-like buffer") from None
        if view.readonly:
            raise InputError("copy_logits_to_host: dst is read-only")
        if view.nbytes != want:
            raise InputError(
                f"copy_logits_to_host: dst is {view.nbytes} bytes, a row is {want} bytes "
                f"({self.vocab_size()} x {'fp32' if want // self.vocab_size() == 4 else 'bf16'})"
            )
        row = np.ascontiguousarray(self._row_to_host(ptr))
        np.frombuffer(view, dtype=np.uint8)[:] = row.view(np.uint8).reshape(-1)

    def _row_to_host(self, ptr: DevicePtr) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def _argmax_rows(self, ptr: DevicePtr, n: int, stream: int) -> np.ndarray:  # pragma: no cover
        raise NotImplementedError
