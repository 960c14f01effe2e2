"""Weights as the checkpoint stores them, multiplied in fp32: the NumPy engine's projection weights.

A BF16 or F16 checkpoint's projections stay in their 2 bytes an element (`StoredWeight`, BF16 as its uint16
bit patterns, memory-mapped: a fused projection such as q | k | v is its parts side by side, `JoinedWeight`,
so loading copies nothing and the pages are the file's, which the OS may drop and read again); a product
widens a block of rows at a time to fp32 inside the projection (kernels.py), so only the stored bytes cross
memory and the products and sums are the fp32 ones of `x @ fp32(w).T`, in another order. Weights in a format
(FP8, MXFP4, NVFP4, int8, symmetric packed int4: `FormattedWeight`) keep their stored tensors and scales and are
dequantized a block of rows at a time by their format's own code (compiled kernels for FP8, MXFP4, NVFP4 and
packed int4 / int8: `COMPILED`). F32 weights stay plain fp32 arrays (NumPy's BLAS reads them as stored).

`matmul(x, w)`, `rows(table, ids)` and `dense(w)` take any of them, so the engine's ops and each mixer's
module never ask which one a weight is.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from . import kernels

# The engine weights multiplied as x @ w.T (or looked up by rows: the embedding): only these are kept as
# stored; every other weight (norms, biases, convolutions, gates' vectors) is read as fp32.
PROJECTIONS = frozenset({
    "qkv", "o", "gate_up", "down", "q", "q_a", "q_b", "kv_a", "kv_b", "lin_in", "lin_out", "router",
    "shared_gate_up", "shared_down", "experts_gate_up", "experts_down", "embed", "lm_head",
})
SMALL_M = 16  # up to this many rows: the fused kernel; more: blocks widened to fp32 for BLAS
BLOCK_BYTES = 1 << 21  # the fp32 block of weight rows one BLAS product reads (about L2-sized)


class StoredWeight:
    """A weight [..., N, K] kept as stored: `kind` "bf16" (`data` its uint16 bit patterns) or "f16"."""

    def __init__(self, data: np.ndarray, kind: str) -> None:
        if kind not in ("bf16", "f16"):
            raise ValueError(f"unknown stored kind {kind!r}")
        self.data, self.kind = data, kind
        self._plan: Plan | None = None

    @classmethod
    def of(cls, a: np.ndarray) -> StoredWeight | np.ndarray:
        """A stored array as the engine keeps it: uint16 (bf16 bits) and float16 wrapped, fp32 as it is. One
        of fewer than FUSED_MIN elements is widened to fp32 here, once: the kernels do not take it, and
        widening it inside every product made a small BF16 model (SmolLM2 135M) decode 2.4 x slower than its
        F32 copy, for 2 bytes an element saved on a model that small."""
        if a.dtype not in (np.uint16, np.float16):
            return a
        kind = "bf16" if a.dtype == np.uint16 else "f16"
        return widen(a, kind) if a.size < kernels.FUSED_MIN else cls(a, kind)

    # -- the array surface the loader, the sharding plan and the tests use ---------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    dtype = np.dtype(np.float32)  # the values it stands for

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index) -> StoredWeight:
        """Rows, columns or one expert of the weight, still stored (a view where NumPy gives one)."""
        return StoredWeight(self.data[index], self.kind)

    def reshape(self, *shape) -> StoredWeight:
        return StoredWeight(self.data.reshape(*shape), self.kind)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = widen(self.data, self.kind)
        return out if dtype is None else out.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"StoredWeight({self.kind}, shape={self.shape})"

    # -- the products -------------------------------------------------------------------------------
    def matmul(self, x: np.ndarray) -> np.ndarray:
        """x [M, K] fp32 @ self.T -> [M, N] fp32, the weight widened inside the product."""
        if self.data.ndim != 2:
            raise ValueError(f"matmul needs a 2-D weight, this one is {self.shape}")
        x = np.ascontiguousarray(x, dtype=np.float32)
        w = self.data
        n, k = w.shape
        if self.kind == "bf16" and len(x) <= SMALL_M and fused(w.size):
            if self._plan is None:
                self._plan = Plan([w])
            return self._plan.matmul(x)
        out = np.empty((len(x), n), np.float32)
        step = max(16, BLOCK_BYTES // (4 * k)) if len(x) <= SMALL_M else max(64, 4 * BLOCK_BYTES // (4 * k))
        buf = np.empty((min(step, n), k), np.float32)
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            block = widen(w[lo:hi], self.kind, buf[:hi - lo])
            out[:, lo:hi] = x @ block.T
        return out

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """The fp32 rows `ids` (an embedding lookup: only those rows are read)."""
        return widen(self.data[ids], self.kind)


def widen(a: np.ndarray, kind: str, out: np.ndarray | None = None) -> np.ndarray:
    """The exact fp32 values of stored `a` (bf16 bits or float16), into `out` when given."""
    if out is None:
        out = np.empty(a.shape, np.float32)
    if kind == "bf16":
        if a.ndim == 2 and fused(a.size):
            kernels.compiled().widen_bf16(np.ascontiguousarray(a), out)
        else:
            np.left_shift(a, 16, out=out.view(np.uint32), dtype=np.uint32)
    else:
        out[...] = a
    return out


def fused(size: int) -> bool:
    """Whether the compiled kernels take a weight of `size` elements: numba is there and the weight is large
    enough for them to matter."""
    return kernels.AVAILABLE and size >= kernels.FUSED_MIN


def matmul(x: np.ndarray, w: Any) -> np.ndarray:
    """x [M, K] @ w.T in fp32, for a stored weight (dense or formatted) or an fp32 array."""
    return x @ w.T if isinstance(w, np.ndarray) else w.matmul(x)


def rows(table: Any, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of an embedding table as fp32: a stored weight, a memory-mapped bf16 (uint16) array, or fp32."""
    if not isinstance(table, np.ndarray):
        return table.rows(ids)
    out = table[ids]
    return widen(out, "bf16") if out.dtype == np.uint16 else np.asarray(out, np.float32)


def dense(w: Any) -> np.ndarray:
    """The whole weight as fp32 (for algebra that reshapes it, such as latent attention's kv_b)."""
    return np.asarray(w, np.float32)


class FormattedWeight:
    """A weight stored in a registered format (models/formats.py: FP8 with its scales, MXFP4 blocks...), kept as
    stored: `tensors` are the format's stored tensor and companions as the checkpoint holds them, `shape` the
    logical [..., N, K]. A product dequantizes a block of rows at a time with the format's own exact
    dequantization (formats.py stays the one home of that arithmetic) and multiplies it while it is in cache."""

    dtype = np.dtype(np.float32)

    def __init__(self, fmt, tensors: tuple[np.ndarray, ...], shape: tuple[int, ...]) -> None:
        self.fmt, self.tensors, self.shape = fmt, tensors, tuple(shape)
        self.block_rows = int(fmt.params.get("block", (1, 1))[0])  # rows one scale row covers (1: per row)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def __len__(self) -> int:
        return self.shape[0]

    def _lead(self) -> int:
        return len(self.shape) - 2  # leading (expert) axes before [N, K]

    def __getitem__(self, index) -> FormattedWeight:
        """One expert of a stacked weight (an int), or the rows `order` of every expert (`[..., order, :]`, the
        loader's de-interleaving: a per-row format only), still stored."""
        if isinstance(index, (int, np.integer)) and self._lead():
            return FormattedWeight(self.fmt, tuple(t[index] if t.ndim > self._lead() else t for t in self.tensors),
                                   self.shape[1:])
        if isinstance(index, tuple) and len(index) == 3 and index[0] is Ellipsis and self.block_rows == 1:
            order, lead = np.asarray(index[1]), self._lead()
            return FormattedWeight(self.fmt, tuple(np.take(t, order, axis=lead) if t.ndim > lead else t
                                                   for t in self.tensors), self.shape)
        return np.asarray(self)[index]  # any other index: of the fp32 values (a simulation's slices)

    def reshape(self, *shape) -> FormattedWeight:
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if tuple(shape) != self.shape:
            raise ValueError(f"a {self.fmt.name} weight {self.shape} cannot be reshaped to {shape}")
        return self

    def rows_fp32(self, lo: int, hi: int) -> np.ndarray:
        """The exact fp32 values of rows lo..hi-1 (lo a multiple of block_rows) of a 2-D weight."""
        b = self.block_rows
        n = self.shape[0]
        parts = []
        for t in self.tensors:
            if t.ndim == 0 or t.shape in ((1,),):
                parts.append(t)  # one scale for the whole tensor
            elif t.shape[0] == n:
                parts.append(t[lo:hi])
            elif b > 1 and t.shape[0] == -(-n // b):  # one scale row per block_rows rows
                parts.append(t[lo // b:-(-hi // b)])
            else:  # not per row (a packed weight's weight_shape): whole
                parts.append(t)
        return np.asarray(self.fmt.dequantize(*parts), np.float32).reshape(hi - lo, self.shape[1])

    def matmul(self, x: np.ndarray) -> np.ndarray:
        if self._lead():
            raise ValueError(f"matmul needs a 2-D weight, this one is {self.shape}")
        compiled = COMPILED.get(self.fmt.family) if fused(int(np.prod(self.shape))) else None
        compiled = compiled if compiled and compiled.takes(self) else None
        ops = compiled.operands(self) if compiled else ()  # once per product, for every block of rows
        if compiled and len(x) <= SMALL_M:
            return compiled.product(ops, np.ascontiguousarray(x, dtype=np.float32), self.shape[0])
        n, k = self.shape
        step = max(self.block_rows, BLOCK_BYTES // (4 * k) // self.block_rows * self.block_rows)
        out = np.empty((len(x), n), np.float32)
        buf = np.empty((min(step, n), k), np.float32) if compiled else None
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            rows = compiled.rows(ops, lo, buf[:hi - lo]) if compiled else self.rows_fp32(lo, hi)
            out[:, lo:hi] = x @ rows.T
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        if self._lead():
            out = np.stack([np.asarray(self[e]) for e in range(self.shape[0])])
        else:
            out = self.rows_fp32(0, self.shape[0])
        return out if dtype is None else out.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"FormattedWeight({self.fmt.name}, shape={self.shape})"


class Plan:
    """The compiled kernel's product with bf16 weights `parts` [N_p, K] joined along the rows: the parts as
    read-only contiguous arrays (one numba type for all) and the work items, blocks of at most 16 rows each
    with the output column where they go, made once per weight."""

    ROWS = 16

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.parts = tuple(_readonly(p) for p in parts)
        items, col = [], 0
        for i, p in enumerate(self.parts):
            for lo in range(0, len(p), self.ROWS):
                items.append((i, lo, min(len(p), lo + self.ROWS), col + lo))
            col += len(p)
        self.blocks, self.n = np.array(items, np.int64).reshape(-1, 4), col

    @classmethod
    def of(cls, parts: list) -> Plan | bool:
        """A plan for weights that are all fused bf16 StoredWeights of one K, else False."""
        ok = all(isinstance(p, StoredWeight) and p.kind == "bf16" and p.data.ndim == 2 for p in parts)
        if not ok or len({p.shape[1] for p in parts}) != 1 or not fused(sum(p.data.size for p in parts)):
            return False
        return cls([p.data for p in parts])

    def matmul(self, x: np.ndarray) -> np.ndarray:
        out = np.empty((len(x), self.n), np.float32)
        kernels.compiled().gemm_bf16(x, self.parts, self.blocks, out)
        return out


def _readonly(a: np.ndarray) -> np.ndarray:
    v = (a if a.flags.c_contiguous else np.ascontiguousarray(a)).view()
    v.flags.writeable = False
    return v


class _Compiled:
    """A format's compiled kernels over its stored tensors (`operands`, made once per product): `product` for up
    to SMALL_M rows of x, `rows` for a block of dequantized weight rows that BLAS multiplies."""

    product_kernel = rows_kernel = ""

    @staticmethod
    def takes(w: FormattedWeight) -> bool:
        """Whether the kernels take this weight of the family (else NumPy dequantizes its blocks of rows)."""
        return True

    @staticmethod
    def operands(w: FormattedWeight) -> tuple:
        raise NotImplementedError

    @classmethod
    def product(cls, ops: tuple, x: np.ndarray, n: int) -> np.ndarray:
        out = np.empty((len(x), n), np.float32)
        getattr(kernels.compiled(), cls.product_kernel)(x, *ops, out)
        return out

    @classmethod
    def rows(cls, ops: tuple, lo: int, out: np.ndarray) -> np.ndarray:
        getattr(kernels.compiled(), cls.rows_kernel)(*ops, lo, out)
        return out


@functools.cache
def _value_tables() -> tuple[np.ndarray, np.ndarray]:
    """The fp32 value of each e4m3 byte and of each E8M0 scale byte (255: 2^128, inf in fp32, as the MXFP4
    dequantization's ldexp gives it)."""
    from ...models.quantized import e4m3_as_fp32

    with np.errstate(over="ignore"):
        e8m0 = np.ldexp(np.float32(1), np.arange(256) - 127).astype(np.float32)
    return e4m3_as_fp32(np.arange(256, dtype=np.uint8)), e8m0


class _Fp8(_Compiled):
    """FP8 (block or per-tensor scales): the e4m3 bytes as stored, the scales as an fp32 grid."""

    product_kernel, rows_kernel = "gemm_fp8", "rows_fp8"

    @staticmethod
    def operands(w: FormattedWeight) -> tuple:
        from ...models.quantized import scale_as_fp32

        q, scale = w.tensors[0], w.tensors[1]
        n, k = w.shape
        bn, bk = w.fmt.params.get("block", (n, k))
        grid = np.ascontiguousarray(scale_as_fp32(scale).reshape(-(-n // bn), -(-k // bk)), dtype=np.float32)
        return np.ascontiguousarray(q).view(np.uint8), grid, bn, bk, _value_tables()[0]


class _Mxfp4(_Compiled):
    """MXFP4: the blocks and E8M0 scales as stored."""

    product_kernel, rows_kernel = "gemm_mxfp4", "rows_mxfp4"

    @staticmethod
    def operands(w: FormattedWeight) -> tuple:
        from ...models.quantized.mxfp4 import E2M1

        blocks, scales = (np.ascontiguousarray(t, dtype=np.uint8) for t in w.tensors)
        return blocks, scales, E2M1, _value_tables()[1]


class _Nvfp4(_Compiled):
    """NVFP4 (compressed-tensors' and ModelOpt's): the packed codes as stored, each block's fp32 scale made once by
    the format's own rule (the per-16 e4m3 scale with the tensor's second-level scale, which ModelOpt multiplies
    and compressed-tensors divides by)."""

    product_kernel, rows_kernel = "gemm_nvfp4", "rows_nvfp4"

    @staticmethod
    def operands(w: FormattedWeight) -> tuple:
        from ...models.quantized.compressed_tensors import nvfp4_block_scales
        from ...models.quantized.modelopt import block_scales
        from ...models.quantized.mxfp4 import E2M1

        rule = block_scales if w.fmt.family == "modelopt_nvfp4" else nvfp4_block_scales
        packed, scale, second = w.tensors[:3]
        blocks = np.ascontiguousarray(rule(scale, second), dtype=np.float32)
        return np.ascontiguousarray(packed, dtype=np.uint8), blocks, E2M1


class _Packed(_Compiled):
    """compressed-tensors' symmetric pack-quantized weights (int4 / int8 values packed in int32 words, the low bits
    first, offset by 2^(bits-1)): the words as stored, the scales as an fp32 grid with the columns each covers."""

    product_kernel, rows_kernel = "gemm_packed", "rows_packed"

    @staticmethod
    def takes(w: FormattedWeight) -> bool:
        p = w.fmt.params
        return not p["asym"] and p["strategy"] in ("group", "channel", "tensor") and p["bits"] in (4, 8)

    @staticmethod
    def operands(w: FormattedWeight) -> tuple:
        from ...models.quantized.compressed_tensors import pack_scale_grid

        n, k = w.shape
        grid, group = pack_scale_grid(w.tensors[1], w.fmt.params, k)
        grid = np.ascontiguousarray(np.broadcast_to(grid, (n, grid.shape[1])), dtype=np.float32)
        words = np.ascontiguousarray(w.tensors[0], dtype=np.int32).view(np.uint32)  # logical shifts
        return words, grid, group, w.fmt.params["bits"], k


# formats whose products run compiled (WeightFormat.family -> its kernels: `product` for up to SMALL_M rows of x,
# `rows` for the dequantized rows a BLAS product takes); the others dequantize a block of rows with NumPy
COMPILED = {"fp8_block": _Fp8, "fp8_tensor": _Fp8, "mxfp4": _Mxfp4, "ct_nvfp4": _Nvfp4,
            "modelopt_nvfp4": _Nvfp4, "ct_pack": _Packed}


class JoinedWeight:
    """Weights joined along the rows (a fused projection whose parts are formatted: q | k | v), or, after
    `reshape([E, rows, K])`, a stack of E experts each joining its parts."""

    dtype = np.dtype(np.float32)

    def __init__(self, parts: list, experts: int = 0) -> None:
        self.parts, self.experts = parts, experts
        self._plan: Plan | bool | None = None  # False: the parts are not all fused bf16
        rows = sum(p.shape[0] for p in parts)
        k = parts[0].shape[-1]
        self.shape = (experts, rows // experts, k) if experts else (rows, k)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __len__(self) -> int:
        return self.shape[0]

    def reshape(self, *shape) -> JoinedWeight:
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else tuple(shape)
        if len(shape) == 3 and not self.experts and len(self.parts) % shape[0] == 0:
            return JoinedWeight(self.parts, shape[0])
        if tuple(shape) == self.shape:
            return self
        raise ValueError(f"joined weight {self.shape} cannot be reshaped to {shape}")

    def __getitem__(self, e) -> Any:
        """One expert (an int, of a stack); any other index: of the fp32 values (a simulation's slices)."""
        if not self.experts or not isinstance(e, (int, np.integer)):
            return np.asarray(self)[e]
        per = len(self.parts) // self.experts
        group = self.parts[int(e) * per:(int(e) + 1) * per]
        return group[0] if per == 1 else JoinedWeight(group)

    def matmul(self, x: np.ndarray) -> np.ndarray:
        if self._plan is None:
            self._plan = Plan.of(self.parts)
        if self._plan and len(x) <= SMALL_M:  # bf16 parts: one kernel call over all of them
            return self._plan.matmul(np.ascontiguousarray(x, dtype=np.float32))
        return np.concatenate([matmul(x, p) for p in self.parts], axis=1)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        if self.experts:
            out = np.stack([np.asarray(self[e]) for e in range(self.experts)])
        else:
            out = np.concatenate([np.asarray(p, np.float32) for p in self.parts], axis=0)
        return out if dtype is None else out.astype(dtype, copy=False)


def join(parts: list) -> Any:
    """The loader's concatenation along the rows: formatted weights and stored BF16 / F16 parts (uint16 bits,
    float16) are kept as they are, side by side (memory-mapped parts stay so: nothing is copied); fp32
    arrays are concatenated."""
    if any(isinstance(p, (FormattedWeight, JoinedWeight, StoredWeight)) for p in parts):
        return JoinedWeight(list(parts))
    small = sum(p.size for p in parts) < kernels.FUSED_MIN  # a small model's: one array, as NumPy multiplies it
    if not small and all(isinstance(p, np.ndarray) and p.dtype in (np.uint16, np.float16) for p in parts):
        return JoinedWeight([StoredWeight.of(p) for p in parts])
    return np.concatenate(parts, axis=0)
