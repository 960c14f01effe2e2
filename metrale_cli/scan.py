"""`metrale inspect --scan`: count the NaN and Inf values of every floating-point tensor of a checkpoint.

Every byte of tensor data is read, in chunks of at most CHUNK_BYTES, so memory stays bounded whatever
the size of a tensor; each tensor's pages are released once it is counted. Values are classified by
their bit patterns (IEEE-style types: exponent all ones, Inf when the mantissa is zero, NaN otherwise),
so BF16 and the FP8 types need no ml_dtypes and no conversion. Integer and packed sub-byte types (F4,
F6: no NaN or Inf encodings) are skipped; a C64 tensor is counted per float32 component.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

CHUNK_BYTES = 16 << 20

# dtype -> (unsigned storage type, exponent mask, mantissa mask): types that encode both Inf and NaN.
_IEEE: dict[str, tuple[str, int, int]] = {
    "F16": ("<u2", 0x7C00, 0x03FF),
    "BF16": ("<u2", 0x7F80, 0x007F),
    "F32": ("<u4", 0x7F80_0000, 0x007F_FFFF),
    "C64": ("<u4", 0x7F80_0000, 0x007F_FFFF),
    "F64": ("<u8", 0x7FF0_0000_0000_0000, 0x000F_FFFF_FFFF_FFFF),
    "F8_E5M2": ("u1", 0x7C, 0x03),
}
# FP8 types without Inf: (mask, NaN pattern under it).
_NAN_ONLY: dict[str, tuple[int, int]] = {
    "F8_E4M3": (0x7F, 0x7F),  # e4m3fn: S.1111.111 is NaN
    "F8_E4M3FNUZ": (0xFF, 0x80),  # "negative zero" is the only NaN
    "F8_E5M2FNUZ": (0xFF, 0x80),
    "F8_E8M0": (0xFF, 0xFF),
}


@dataclass
class NonFiniteTensor:
    name: str
    dtype: str
    nan: int
    inf: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "nan": self.nan, "inf": self.inf}


def count_nonfinite(raw, dtype: str, chunk_bytes: int = CHUNK_BYTES) -> tuple[int, int]:
    """(NaN count, Inf count) of tensor bytes `raw` (a uint8 array) stored as safetensors `dtype`."""
    import numpy as np

    if dtype in _IEEE:
        storage, exp_mask, mant_mask = _IEEE[dtype]
    elif dtype in _NAN_ONLY:
        storage, (mask, pattern) = "u1", _NAN_ONLY[dtype]
    else:
        return 0, 0
    udt = np.dtype(storage)
    step = max(udt.itemsize, chunk_bytes // udt.itemsize * udt.itemsize)  # whole elements per chunk
    nan = inf = 0
    for start in range(0, raw.size, step):
        u = raw[start:start + step].view(udt)
        if dtype in _NAN_ONLY:
            nan += int(np.count_nonzero((u & mask) == pattern))
            continue
        special = (u & udt.type(exp_mask)) == udt.type(exp_mask)
        mantissa_zero = (u & udt.type(mant_mask)) == 0
        inf += int(np.count_nonzero(special & mantissa_zero))
        nan += int(np.count_nonzero(special & ~mantissa_zero))
    return nan, inf


def scan_nonfinite(ckpt, progress: Callable[[int, int], None] | None = None) -> list[NonFiniteTensor]:
    """The tensors of `ckpt` (a Checkpoint) holding NaN or Inf, in storage order. `progress(done, total)`
    is called with tensor bytes as they are read."""
    found, done, total = [], 0, ckpt.total_bytes
    for name in ckpt.tensor_names():
        info = ckpt.info(name)
        nan, inf = count_nonfinite(ckpt.raw(name), info.dtype)
        ckpt.release(name)
        if nan or inf:
            found.append(NonFiniteTensor(name, info.dtype, nan, inf))
        done += info.nbytes
        if progress is not None:
            progress(done, total)
    return found
