"""FP8 weights on the GPU (models/quantized/fp8.py: e4m3 with block or per-tensor scales): they stay FP8 on the
device. The rows path's GEMV (kernels/qgemv.cu) reads the e4m3 bytes and their fp32 block scales and dequantizes in
registers, so a decode step reads about half the bytes of bf16; the prefill path dequantizes one weight at a time
to bf16 into a temporary buffer for cuBLAS (the bf16 path rounds the activations to bf16 there too).

A fused weight (q, k, v -> qkv) keeps its parts' block scales when every part but the last has a multiple of the
block height in rows; otherwise (and for per-tensor scales, one per part) its scales are expanded to one row each.
The GEMV needs the block width to be a multiple of 16 (a 16-byte load never spans two scale blocks): other block
widths are refused by --device cuda (`accepts`).

Stacked MoE experts in FP8 stay FP8 too (`Fp8Experts`: e4m3 bytes [E, N, K], fp32 scales [E, SB, KB]; each expert's
parts fused as a projection's are, so gate and up share one scale layout), read as stored by the MoE kernels on the
rows path (kernels/moe.cu's experts kernels with their FP8 policy); the prefill dequantizes the experts a chunk chose to a bf16 scratch for
the batched cuBLAS GEMMs (`_experts_bf16`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...models.quantized import scale_as_fp32
from .formats import CudaFormat, dequantized_gemm, register_cuda_format, rows_linear


class Fp8Weight:
    """An FP8 weight on the device: e4m3 bytes [N, K] (uint8), fp32 scales [ceil(N / srow), ceil(K / bk)]; and
    under `--activation-quant emulate`, how its inputs are quantized (`input_quant`, an Fp8Input)."""

    moe_format = "fp8"  # the MoE down kernel reads a shared expert's FP8 down weight (kernels/moe.py EXPERT_FORMATS)

    def __init__(self, fmt: str, data: Any, scale: Any, srow: int, bk: int) -> None:
        self.format, self.data, self.scale, self.srow, self.bk = fmt, data, scale, srow, bk
        self.shape = data.shape
        self.input_quant: Fp8Input | None = None

    def per_row(self, cp) -> Any:
        """The scales expanded to one row per weight row."""
        return self.scale if self.srow == 1 else cp.ascontiguousarray(cp.repeat(self.scale, self.srow, axis=0)[:self.shape[0]])


class Fp8Experts:
    """Stacked FP8 experts on the device: e4m3 bytes `data` uint8 [E, N, K], fp32 `scale` [E, ceil(N / srow),
    ceil(K / bk)] (every expert's scales laid out alike); `experts[e]` is expert e as an Fp8Weight (views)."""

    moe_format = "fp8"  # read as stored by the MoE kernels' FP8 policy (kernels/moe.py EXPERT_FORMATS)

    def __init__(self, fmt: str, data: Any, scale: Any, srow: int, bk: int) -> None:
        self.format, self.data, self.scale, self.srow, self.bk = fmt, data, scale, srow, bk
        self.shape = data.shape
        self.input_quant: Fp8Input | None = None

    def __getitem__(self, e: int) -> Fp8Weight:
        return Fp8Weight(self.format, self.data[e], self.scale[e], self.srow, self.bk)

    def reshape(self, shape: tuple[int, ...]) -> Fp8Experts:
        """Itself: the loader's reshape of a stacked param to its [E, N, K] (already its shape)."""
        if tuple(shape) != tuple(self.shape):
            raise ValueError(f"FP8 experts of shape {tuple(self.shape)} cannot be reshaped to {tuple(shape)}")
        return self


class Fp8Input:
    """How an FP8 W8A8 engine quantizes this weight's input (models/quantized/activations.py): e4m3 with a dynamic
    scale per token and `group` columns (a power of two with ue8m0), or the checkpoint's static activation scale
    (`static`, f32 [1] on the device: the largest of a fused weight's parts, as the NumPy engine and vLLM take)."""

    def __init__(self, group: int, ue8m0: bool = False, static: Any = None) -> None:
        self.group, self.ue8m0, self.static = group, ue8m0, static

    def apply(self, proj, x, tag: str):
        """x's quantized values in a scratch buffer (rows path) or a fresh array (prefill)."""
        out = proj.scratch(tag, x.shape) if tag else proj.cp.empty(x.shape, proj.cp.float32)
        _kernels(proj.kern).act_quant(x, self.group, self.ue8m0, self.static, out, stream=proj.stream)
        return out


def _kernels(kern: Any):
    fp8 = getattr(kern, "_fp8_kernels", None)
    if fp8 is None:
        from .kernels.fp8 import Fp8Kernels

        fp8 = kern._fp8_kernels = Fp8Kernels(kern)
    return fp8


def _upload(p: Any, read, kern: Any) -> list[Fp8Weight]:
    from ...models.formats import weight_format

    cp, wf = kern.cp, weight_format(p.format)
    out = []
    for t in p.parts:
        rows, cols = t.shape
        data = cp.asarray(np.ascontiguousarray(read(t.name)).view(np.uint8))
        scale = scale_as_fp32(read(t.name + "_scale_inv"))
        if wf.kind == "fp8_tensor":  # one scale: a single block covering the weight
            srow, bk, scale = rows, cols, scale.reshape(1, 1)
        else:
            srow, bk = wf.params["block"]
        out.append(Fp8Weight(p.format, data, cp.asarray(np.ascontiguousarray(scale, np.float32)), srow, bk))
    return out


def _concat(parts: list[Fp8Weight], cp) -> Fp8Weight:
    first = parts[0]
    if len(parts) == 1:
        return first
    data = cp.concatenate([p.data for p in parts], axis=0)
    aligned = (all(p.srow == first.srow and p.bk == first.bk for p in parts)
               and all(p.shape[0] % p.srow == 0 for p in parts[:-1]))
    if aligned:
        fused = Fp8Weight(first.format, data, cp.concatenate([p.scale for p in parts], axis=0), first.srow, first.bk)
    elif len({p.bk for p in parts}) != 1:  # per-tensor parts of different widths cannot happen (fused parts share K)
        raise ValueError("fused FP8 parts with different scale block widths")
    else:
        fused = Fp8Weight(first.format, data, cp.concatenate([p.per_row(cp) for p in parts], axis=0), 1, first.bk)
    fused.input_quant = first.input_quant  # the param's (loading sets it on every part)
    return fused


def _stack(experts: list[Fp8Weight], cp) -> Fp8Experts:
    """Each expert's (fused) weight stacked: [E, N, K] bytes and [E, SB, KB] scales (the experts' parts have the
    same shapes, so their fused scales have one layout)."""
    first = experts[0]
    if any(w.srow != first.srow or w.bk != first.bk or w.scale.shape != first.scale.shape for w in experts):
        raise ValueError("FP8 experts with different scale layouts")
    return Fp8Experts(first.format, cp.stack([w.data for w in experts]), cp.stack([w.scale for w in experts]),
                      first.srow, first.bk)


def _experts_bf16(proj, w: Fp8Experts, experts: list[int]) -> Any:
    """The prefill's bf16 experts: experts `experts` of w dequantized (bf16(e4m3 * scale), qgemv.cu's
    qdequant_bf16_kernel, one launch each) into a fresh [E, N, K] array whose other experts are zeros (the
    batched GEMM's rows for them are never read)."""
    out = proj.cp.zeros(w.shape, proj.cp.uint16)
    fp8 = _kernels(proj.kern)
    for e in experts:
        fp8.dequant_bf16(w.data[e], w.scale[e], w.srow, w.bk, out[e], stream=proj.stream)
    return out


def _linear(proj, x, w: Fp8Weight, out, bias=None, *, accumulate=False, swiglu=False, norm_weight=None, eps=1e-6,
            norm_offset=0.0, activation="silu") -> None:
    """The rows path (formats.rows_linear): the FP8 GEMV with the RMSNorm and gate activation fused, of x's quantized
    values under `--activation-quant emulate`."""
    fp8 = _kernels(proj.kern)

    def gemv(x, y, **options):
        fp8.gemv(x, w.data, w.scale, w.srow, w.bk, y, bias, stream=proj.stream, **options)

    prepare = None if w.input_quant is None else (lambda x: w.input_quant.apply(proj, x, "fp8_input"))
    rows_linear(proj, x, out, gemv, "fp8", accumulate=accumulate, swiglu=swiglu, norm_weight=norm_weight, eps=eps,
                norm_offset=norm_offset, activation=activation, prepare=prepare)


def _gemm(proj, x, w: Fp8Weight, bias=None, accumulate_into=None):
    """The prefill path: the weight dequantized to bf16 (a temporary), then the bf16 cuBLAS GEMM (of x's quantized
    values under `--activation-quant emulate`)."""
    if w.input_quant is not None:
        x = w.input_quant.apply(proj, x, "")
    fp8 = _kernels(proj.kern)
    return dequantized_gemm(proj, x, w.shape, lambda wb: fp8.dequant_bf16(w.data, w.scale, w.srow, w.bk, wb,
                                                                         stream=proj.stream), bias, accumulate_into)


def _input_quant(p: Any, read, kern: Any) -> Fp8Input:
    """How param p's inputs are quantized (`--activation-quant emulate`), from its format and, for a static scheme,
    its parts' activation_scale tensors."""
    from ...models.formats import weight_format

    wf = weight_format(p.format)
    k = p.parts[0].shape[-1]
    if not wf.params.get("static"):
        group = wf.params["block"][1] if wf.kind == "fp8_block" else k
        return Fp8Input(group, bool(wf.params.get("ue8m0")))
    scales = [float(np.max(scale_as_fp32(read(t.name.removesuffix("weight") + "activation_scale", bf16_bits=True))))
              for t in p.parts]
    return Fp8Input(k, static=kern.cp.asarray(np.array([max(scales)], np.float32)))


def _accepts(params: dict) -> bool:
    return params.get("block", (1, 16))[1] % 16 == 0


def _refuses(p) -> str | None:
    k = p.parts[0].shape[-1]
    return f"{p.key} in FP8 with an input width of {k} (the FP8 GEMV takes multiples of 16)" if k % 16 else None


for _kind in ("fp8_block", "fp8_tensor"):
    register_cuda_format(CudaFormat(_kind, _upload, _concat, _linear, _gemm, accepts=_accepts, refuses=_refuses,
                                    input_quant=_input_quant, stack=_stack, experts_bf16=_experts_bf16))
