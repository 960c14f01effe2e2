"""MXFP4 experts on the GPU (models/quantized/mxfp4.py: gpt-oss's stacked experts, e2m1 codes in blocks of 32 with
an E8M0 scale each), kept as the checkpoint stores them: the `_blocks` bytes (two codes a byte, the low nibble first)
as rows of K / 2 bytes and the `_scales` bytes, uploaded unchanged (`Mxfp4Experts`), so the device holds the
checkpoint's bytes (gpt-oss-20b holds 13.8 GB, 10.2 GB of it its experts, against 41.8 GB with its experts
dequantized to bf16 at load; gpt-oss-120b 65.2 GB: one 80 GB card).

Rows path: the MoE kernels' MXFP4 policy (kernels/moe.cu MoeMxfp4) widens each 16-byte chunk (32 weights) in
registers to the exact fp32 values the NumPy engine's dequantization gives.  Prefill: the experts the chunk chose are
dequantized to a bf16 scratch of the layer's shape (moe.cu's moe_dequant_bf16_kernel, one launch per expert) for the
batched cuBLAS GEMMs, as FP8 experts are (fp8.py).  gpt-oss interleaves gate and up along the output rows: every
scale belongs to one row, so the loader's de-interleaving reorders the rows of both (`Mxfp4Experts.__getitem__`).
Only experts come in MXFP4 (the quant method formats nothing else), so the entry has no projection kernels."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...models.quantized.mxfp4 import BLOCK
from .formats import CudaFormat, register_cuda_format


class Mxfp4Experts:
    """MXFP4 weights on the device as stored: `data` uint8 [..., N, K / 2] (a `_blocks` row: two e2m1 codes a byte,
    the low nibble first), `scale` uint8 [..., N, K / 32] (E8M0); `shape` the logical [..., N, K] (stacked experts
    [E, N, K], or one expert's [N, K]); per-row scales in blocks of 32 (`srow` 1, `bk` 32: kernels/moe.py's scale
    grid)."""

    moe_format = "mxfp4"  # read as stored by the MoE kernels' MXFP4 policy (kernels/moe.py EXPERT_FORMATS)
    srow, bk = 1, BLOCK

    def __init__(self, fmt: str, data: Any, scale: Any, shape: tuple[int, ...]) -> None:
        self.format, self.data, self.scale, self.shape = fmt, data, scale, tuple(shape)
        self.input_quant = None  # weight-only: the MoE kernels read their inputs unquantized

    def __getitem__(self, index) -> Mxfp4Experts:
        """Expert `index` (an int, of stacked experts), or every expert's rows in the order `order` (`[..., order, :]`:
        the loader's de-interleaving of gate and up, models/weights.deinterleave)."""
        if isinstance(index, (int, np.integer)) and len(self.shape) == 3:
            return Mxfp4Experts(self.format, self.data[index], self.scale[index], self.shape[1:])
        if (isinstance(index, tuple) and len(index) == 3 and index[0] is Ellipsis and index[2] == slice(None)
                and len(index[1]) == self.shape[-2]):  # fancy indexing: fresh arrays, as for a bf16 weight
            return Mxfp4Experts(self.format, self.data[index], self.scale[index], self.shape)
        raise TypeError(f"MXFP4 weights take an expert index or a reordering of their rows, not {index!r}")

    def reshape(self, shape: tuple[int, ...]) -> Mxfp4Experts:
        """Itself: the loader's reshape of a stacked param to its [E, N, K] (already its shape)."""
        if tuple(shape) != self.shape:
            raise ValueError(f"MXFP4 weights of shape {self.shape} cannot be reshaped to {tuple(shape)}")
        return self


def _upload(p: Any, read, kern: Any) -> list[Mxfp4Experts]:
    """Each part's `_blocks` and `_scales` bytes, unchanged: blocks [..., N, K / 32, 16] as rows [..., N, K / 2]."""
    cp, out = kern.cp, []
    for t in p.parts:
        *lead, n, k = t.shape
        blocks = np.ascontiguousarray(read(t.name + "_blocks"), np.uint8).reshape(*lead, n, k // 2)
        scales = np.ascontiguousarray(read(t.name + "_scales"), np.uint8)
        out.append(Mxfp4Experts(p.format, cp.asarray(blocks), cp.asarray(scales), tuple(t.shape)))
    return out


def _concat(parts: list[Mxfp4Experts], cp) -> Mxfp4Experts:
    """One expert's parts (per-expert checkpoints' gate and up) as one weight: their rows, scales with them."""
    first = parts[0]
    if len(parts) == 1:
        return first
    shape = first.shape[:-2] + (sum(q.shape[-2] for q in parts), first.shape[-1])
    return Mxfp4Experts(first.format, cp.concatenate([q.data for q in parts], axis=-2),
                        cp.concatenate([q.scale for q in parts], axis=-2), shape)


def _stack(experts: list[Mxfp4Experts], cp) -> Mxfp4Experts:
    first = experts[0]
    if any(w.shape != first.shape for w in experts):
        raise ValueError("MXFP4 experts of different shapes")
    return Mxfp4Experts(first.format, cp.stack([w.data for w in experts]), cp.stack([w.scale for w in experts]),
                        (len(experts),) + first.shape)


def _experts_bf16(proj, w: Mxfp4Experts, experts: list[int]) -> Any:
    """The prefill's bf16 experts: experts `experts` of w, each weight its exact value rounded to bf16 (moe.cu's
    moe_dequant_bf16_kernel, one launch each), in a fresh [E, N, K] array whose other experts are zeros (the batched
    GEMM's rows for them are never read)."""
    from .moe_passes import moe_kernels

    out = proj.cp.zeros(w.shape, proj.cp.uint16)
    mk = moe_kernels(proj.kern)
    for e in experts:
        mk.dequant_bf16(w, e, out[e], stream=proj.stream)
    return out


register_cuda_format(CudaFormat("mxfp4", _upload, _concat, stack=_stack, experts_bf16=_experts_bf16,
                                stacked_parts=True, reorders_rows=True))
