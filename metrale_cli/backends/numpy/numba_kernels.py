"""The numba kernels of kernels.py (imported on first use: see there what they compute and why)."""

from __future__ import annotations

import os

import numpy as np

# The threads of a parallel loop sleep when they wait instead of spinning (GNU OpenMP, numba's threading layer
# here): on a machine whose cores are shared, spinning threads take the cores the others need, and a decode
# step of ~100 short parallel loops ran 3-6x slower (measured at load average 2.8 on 2 cores: 520 ms a step
# spinning, 81 ms sleeping). Read when the OpenMP runtime starts, so set before numba is imported; a value
# the user set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numba  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import prange, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402


def set_threads(n: int) -> None:
    """The threads of the parallel loops (at most the threads numba started with)."""
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))


def _jit(**kw):
    """numba.njit with the on-disk cache; without a writable cache location, compiled for this run only."""
    def wrap(fn):
        try:
            return numba.njit(cache=True, **kw)(fn)
        except RuntimeError:  # no cache locator (read-only install and no writable cache directory)
            return numba.njit(**kw)(fn)
    return wrap


@intrinsic
def _bits_as_f32(typingctx, bits):
    """The float32 whose bit pattern is the uint32 `bits` (a register move)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@numba.njit(inline="always")
def _bf16(v):
    return _bits_as_f32(np.uint32(v) << np.uint32(16))


@numba.njit(inline="always")
def _row_products(x, r0, r1, out, j, two):  # pragma: no cover - compiled
    """out[:, j] (and out[:, j + 1] when `two`) = x @ bf16(r0) (and r1): four rows of x per pass over the
    weight rows; two weight rows a pass when x has several rows, so each load of x feeds two products."""
    m_rows, k = x.shape
    m = 0
    while m + 4 <= m_rows:
        x0, x1, x2, x3 = x[m], x[m + 1], x[m + 2], x[m + 3]
        a0 = a1 = a2 = a3 = c0 = c1 = c2 = c3 = np.float32(0.0)
        if two:
            for i in range(k):
                v = _bf16(r0[i])
                u = _bf16(r1[i])
                a0 += x0[i] * v
                a1 += x1[i] * v
                a2 += x2[i] * v
                a3 += x3[i] * v
                c0 += x0[i] * u
                c1 += x1[i] * u
                c2 += x2[i] * u
                c3 += x3[i] * u
            out[m, j + 1], out[m + 1, j + 1], out[m + 2, j + 1], out[m + 3, j + 1] = c0, c1, c2, c3
        else:
            for i in range(k):
                v = _bf16(r0[i])
                a0 += x0[i] * v
                a1 += x1[i] * v
                a2 += x2[i] * v
                a3 += x3[i] * v
        out[m, j], out[m + 1, j], out[m + 2, j], out[m + 3, j] = a0, a1, a2, a3
        m += 4
    while m < m_rows:
        xm = x[m]
        a = c = np.float32(0.0)
        if two:
            for i in range(k):
                a += xm[i] * _bf16(r0[i])
                c += xm[i] * _bf16(r1[i])
            out[m, j + 1] = c
        else:
            for i in range(k):
                a += xm[i] * _bf16(r0[i])
        out[m, j] = a
        m += 1


@_jit(parallel=True, fastmath=True)
def gemm_bf16(x, ws, blocks, out):  # pragma: no cover - compiled
    """out [M, sum N] = x [M, K] @ bf16(ws[0] | ws[1] | ...).T: `ws` a tuple of weights [N_p, K] (the parts of
    a fused projection, or one), `blocks` [B, 4] the work items (part, first row, end row, first output
    column), spread over the threads; one pass over the parts, so a fused projection is one parallel loop."""
    pairs = x.shape[0] > 1
    for b in prange(blocks.shape[0]):
        w = ws[blocks[b, 0]]
        j, end, col = blocks[b, 1], blocks[b, 2], blocks[b, 3]
        while j < end:
            two = pairs and j + 1 < end
            _row_products(x, w[j], w[j + 1] if two else w[j], out, col + j - blocks[b, 1], two)
            j += 2 if two else 1


@_jit(parallel=True)
def widen_bf16(w, out):  # pragma: no cover - compiled
    n, k = w.shape
    bits = out.view(np.uint32)
    for j in prange(n):
        for i in range(k):
            bits[j, i] = np.uint32(w[j, i]) << np.uint32(16)


@numba.njit(inline="always", fastmath=True)
def _times_rows(x, w, out, j):  # pragma: no cover - compiled
    """out[:, j] = x @ w, w one weight row formed in fp32."""
    for m in range(x.shape[0]):
        xm = x[m]
        a = np.float32(0.0)
        for i in range(w.shape[0]):
            a += xm[i] * w[i]
        out[m, j] = a


@_jit(parallel=True, fastmath=True)
def gemm_fp8(x, q, scale, block_n, block_k, lut, out):  # pragma: no cover - compiled
    """out [M, N] = x [M, K] @ (e4m3(q) * scale).T: q [N, K] the e4m3 bytes, scale [ceil(N / block_n),
    ceil(K / block_k)] fp32, lut the 256 e4m3 values. Each weight row's values are formed once, exactly as the
    dequantization forms them (e4m3 value times its block's scale), into a row buffer that every row of x then
    multiplies (the products are those of the dequantized weight)."""
    m_rows, k = x.shape
    n = q.shape[0]
    blocks = (k + block_k - 1) // block_k
    for j in prange(n):
        srow = scale[j // block_n]
        row = q[j]
        w = np.empty(k, np.float32)
        for b in range(blocks):
            s = srow[b]
            for i in range(b * block_k, min(k, b * block_k + block_k)):
                w[i] = lut[row[i]] * s
        _times_rows(x, w, out, j)


@_jit(parallel=True, fastmath=True)
def gemm_mxfp4(x, blocks, scales, e2m1, e8m0, out):  # pragma: no cover - compiled
    """out [M, N] = x [M, K] @ mxfp4(blocks, scales).T: blocks [N, K / 32, 16] (two e2m1 codes a byte, the low
    nibble first), scales [N, K / 32] E8M0 bytes; e2m1 the 16 code values, e8m0 the 256 scale values. Each
    weight row's values (code value times its power-of-two scale, exact) are formed once into a row buffer that
    every row of x then multiplies."""
    m_rows, k = x.shape
    n, groups = scales.shape
    for j in prange(n):
        w = np.empty(k, np.float32)
        for g in range(groups):
            s = e8m0[scales[j, g]]
            for b in range(16):
                byte = blocks[j, g, b]
                w[g * 32 + 2 * b] = e2m1[byte & 15] * s
                w[g * 32 + 2 * b + 1] = e2m1[byte >> 4] * s
        _times_rows(x, w, out, j)


@_jit(parallel=True, fastmath=True)
def gemm_nvfp4(x, packed, blocks, e2m1, out):  # pragma: no cover - compiled
    """out [M, N] = x [M, K] @ nvfp4(packed, blocks).T: packed [N, K / 2] (two e2m1 codes a byte, the low nibble
    first), blocks [N, K / 16] each block's fp32 scale (the format's own rule: stored.COMPILED); e2m1 the 16 code
    values. Each weight row's values (code value times its block's scale, as the dequantization forms them) are
    formed once into a row buffer that every row of x then multiplies."""
    m_rows, k = x.shape
    n, groups = blocks.shape
    for j in prange(n):
        w = np.empty(k, np.float32)
        for g in range(groups):
            s = blocks[j, g]
            for b in range(8):
                byte = packed[j, g * 8 + b]
                w[g * 16 + 2 * b] = e2m1[byte & 15] * s
                w[g * 16 + 2 * b + 1] = e2m1[byte >> 4] * s
        _times_rows(x, w, out, j)


@_jit(parallel=True, fastmath=True)
def gemm_packed(x, packed, grid, group, bits, k, out):  # pragma: no cover - compiled
    """out [M, N] = x [M, K] @ w.T for a symmetric pack-quantized weight: packed int32 [N, ceil(K * bits / 32)]
    (32 / bits values a word, the low bits first, each offset by 2^(bits - 1)), grid fp32 [N, groups], each scale
    covering `group` columns. Each weight row's values (the integer times its scale, as the dequantization forms
    them) are formed once into a row buffer that every row of x then multiplies."""
    n = packed.shape[0]
    per = 32 // bits
    mask = (1 << bits) - 1
    off = 1 << (bits - 1)
    for j in prange(n):
        w = np.empty(k, np.float32)
        _unpack_row(packed[j], grid[j], group, bits, per, mask, off, k, w)
        _times_rows(x, w, out, j)


@_jit(inline="always")
def _unpack_row(words, scales, group, bits, per, mask, off, k, w):  # pragma: no cover - compiled
    if bits == 4 and k % group == 0 and group % 8 == 0:  # int4, whole words a scale group: constant shifts
        wpg = group // 8
        for g in range(k // group):
            s = scales[g]
            for wi in range(g * wpg, (g + 1) * wpg):
                word = words[wi]
                for b in range(8):
                    w[wi * 8 + b] = np.float32(((word >> (4 * b)) & 15) - 8) * s
        return
    if k % group == 0 and group % per == 0:  # whole words in each scale group: no index arithmetic per value
        wpg = group // per
        for g in range(k // group):
            s = scales[g]
            for wi in range(g * wpg, (g + 1) * wpg):
                word = words[wi]
                for b in range(per):
                    w[wi * per + b] = np.float32(((word >> (b * bits)) & mask) - off) * s
        return
    for wi in range(words.shape[0]):
        word = words[wi]
        for b in range(per):
            i = wi * per + b
            if i < k:
                w[i] = np.float32(((word >> (b * bits)) & mask) - off) * scales[i // group]


@_jit(parallel=True)
def rows_fp8(q, scale, block_n, block_k, lut, lo, out):  # pragma: no cover - compiled
    """out [R, K] = the dequantized rows lo .. lo + R of an FP8 weight (see gemm_fp8), for BLAS."""
    k = q.shape[1]
    for r in prange(out.shape[0]):
        j = lo + r
        srow = scale[j // block_n]
        row = q[j]
        for i in range(k):
            out[r, i] = lut[row[i]] * srow[i // block_k]


@_jit(parallel=True)
def rows_mxfp4(blocks, scales, e2m1, e8m0, lo, out):  # pragma: no cover - compiled
    """out [R, K] = the dequantized rows lo .. lo + R of an MXFP4 weight (see gemm_mxfp4), for BLAS."""
    groups = scales.shape[1]
    for r in prange(out.shape[0]):
        j = lo + r
        for g in range(groups):
            s = e8m0[scales[j, g]]
            for b in range(16):
                byte = blocks[j, g, b]
                out[r, g * 32 + 2 * b] = e2m1[byte & 15] * s
                out[r, g * 32 + 2 * b + 1] = e2m1[byte >> 4] * s


@_jit(parallel=True)
def rows_nvfp4(packed, blocks, e2m1, lo, out):  # pragma: no cover - compiled
    """out [R, K] = the dequantized rows lo .. lo + R of an NVFP4 weight (see gemm_nvfp4), for BLAS."""
    groups = blocks.shape[1]
    for r in prange(out.shape[0]):
        j = lo + r
        for g in range(groups):
            s = blocks[j, g]
            for b in range(8):
                byte = packed[j, g * 8 + b]
                out[r, g * 16 + 2 * b] = e2m1[byte & 15] * s
                out[r, g * 16 + 2 * b + 1] = e2m1[byte >> 4] * s


@_jit(parallel=True)
def rows_packed(packed, grid, group, bits, k, lo, out):  # pragma: no cover - compiled
    """out [R, K] = the dequantized rows lo .. lo + R of a symmetric pack-quantized weight (see gemm_packed)."""
    per = 32 // bits
    mask = (1 << bits) - 1
    off = 1 << (bits - 1)
    for r in prange(out.shape[0]):
        _unpack_row(packed[lo + r], grid[lo + r], group, bits, per, mask, off, k, out[r])
