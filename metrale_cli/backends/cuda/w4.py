"""4-bit weights on the GPU, kept as stored: NVFP4 (models/quantized/modelopt.py, and compressed-tensors'
nvfp4-pack-quantized: e2m1 codes with an e4m3 scale per 16 values and a tensor's second-level scale) and
compressed-tensors' symmetric pack-quantized int4 (W4A16: q + 8 in int32 words, a scale per group, row or tensor).
The rows path's GEMV (kernels/qgemv.cu) reads the packed codes and their scales and dequantizes in registers, so a
decode step reads about a quarter of the bytes of bf16 (with NVFP4's e4m3 scale bytes as stored, int4's fp32 ones);
the prefill path dequantizes one weight at a time to bf16 into a temporary buffer for cuBLAS, as fp8.py does.

At upload each row's codes become 32-bit words (value k in bits 4 (k % 8) of word k / 8: NVFP4's bytes, the low
nibble first, read as little-endian words; pack-quantized's words as stored), each row padded to 16 bytes. NVFP4
keeps its e4m3 scale bytes and gives each row its tensor's second-level scale as a factor, so that the kernel forms
each scale as the NumPy engine does (modelopt.block_scales: fp32(e4m3) * weight_scale_2;
compressed_tensors.nvfp4_block_scales: fp32(e4m3) / weight_global_scale, one fp32 product or quotient); int4's
scales are formed on the host by pack_scale_grid (a per-row or per-tensor scale repeated to one per row). The
kernels' value, code value * scale, is then the NumPy engine's bit for bit. Every scale and factor is per row, so a
fused weight's parts concatenate. The kernels take input widths that are multiples of 8 and groups that are
multiples of 8 (a word never straddles two groups): int4 in other groups is dequantized to bf16 at load (`accepts`),
other widths are refused by --device cuda (`refuses`). Asymmetric and 8-bit pack-quantized weights are dequantized
to bf16 at load."""

from __future__ import annotations

from typing import Any

import numpy as np

from .formats import CudaFormat, dequantized_gemm, register_cuda_format, rows_linear


class W4Weight:
    """A 4-bit weight on the device: words uint32 [N, padded_words(K)] (eight codes a word, `code` "e2m1" or
    "int4"), scales [N, ceil(K / group)] stored as `scales` says (kernels/w4.PAIRS: fp32, or NVFP4's e4m3 bytes
    with `factor`, fp32 [N], each row's second-level scale); `shape` the logical [N, K]."""

    def __init__(self, fmt: str, data: Any, scale: Any, group: int, code: str, scales: str, factor: Any,
                 k: int) -> None:
        self.format, self.data, self.scale, self.group, self.code = fmt, data, scale, group, code
        self.scales, self.factor = scales, factor
        self.shape = (data.shape[0], k)
        self.input_quant = None  # the W4A4 input schemes are not emulated on the GPU (check_activation_quant)


def _kernels(kern: Any):
    w4 = getattr(kern, "_w4_kernels", None)
    if w4 is None:
        from .kernels.w4 import W4Kernels

        w4 = kern._w4_kernels = W4Kernels(kern)
    return w4


def words(codes: np.ndarray, k: int) -> np.ndarray:
    """uint32 [rows, padded_words(k)]: a row's 4-bit codes (uint8 two a byte, the low nibble first, or int32
    words of eight) as little-endian words, each row padded with zero words to a multiple of 16 bytes."""
    from .kernels.w4 import padded_words

    b = np.ascontiguousarray(codes)
    rows = b.shape[0]
    w = b.reshape(rows, -1).view(np.uint8).reshape(rows, -1)[:, :k // 2]
    out = np.zeros((rows, padded_words(k) * 4), np.uint8)
    out[:, :k // 2] = w
    return out.view(np.uint32)


def host_weight(p_format: str, t_name: str, k: int, read) -> tuple[np.ndarray, np.ndarray, Any, int, str, str]:
    """(words, scales [rows, groups], factors [rows] or None, group, code, scales' storage) of one part as the
    kernels take it: NVFP4's e4m3 scale bytes as stored with the tensor's second-level scale as each row's factor
    (ModelOpt: times weight_scale_2; compressed-tensors: over weight_global_scale; the kernel's one fp32 product or
    quotient is the NumPy engine's scale, modelopt.block_scales / compressed_tensors.nvfp4_block_scales), int4's
    fp32 scales by the NumPy engine's rule (pack_scale_grid: a per-row or per-tensor scale repeated to one per row)."""
    from ...models.formats import weight_format
    from ...models.quantized import scale_as_fp32
    from ...models.quantized.compressed_tensors import NVFP4_GROUP, pack_scale_grid

    wf = weight_format(p_format)
    if wf.family in NVFP4_KINDS:
        modelopt = wf.family == "modelopt_nvfp4"
        packed = read(t_name if modelopt else t_name + "_packed")
        second = scale_as_fp32(read(t_name + ("_scale_2" if modelopt else "_global_scale"))).reshape(())
        scale = np.ascontiguousarray(read(t_name + "_scale")).view(np.uint8)
        factor = np.full(packed.shape[0], second, np.float32)
        return words(packed, k), scale, factor, NVFP4_GROUP, "e2m1", "e4m3_mul" if modelopt else "e4m3_div"
    packed = read(t_name + "_packed")  # ct_pack, symmetric int4 (`accepts`)
    grid, group = pack_scale_grid(read(t_name + "_scale", bf16_bits=True), wf.params, k)
    scale = np.ascontiguousarray(np.broadcast_to(grid, (packed.shape[0], grid.shape[1])), np.float32)
    return words(np.asarray(packed, np.int32), k), scale, None, group, "int4", "f32"


def _upload(p: Any, read, kern: Any) -> list[W4Weight]:
    cp, out = kern.cp, []
    for t in p.parts:
        k = t.shape[-1]
        data, scale, factor, group, code, scales = host_weight(p.format, t.name, k, read)
        out.append(W4Weight(p.format, cp.asarray(data), cp.asarray(scale), group, code, scales,
                            None if factor is None else cp.asarray(factor), k))
    return out


def _concat(parts: list[W4Weight], cp) -> W4Weight:
    first = parts[0]
    if len(parts) == 1:
        return first
    if len({(p.group, p.code, p.scales, p.shape[1]) for p in parts}) != 1:  # one format per param: cannot happen
        raise ValueError("fused 4-bit parts with different groups, codes, scales or input widths")
    factor = None if first.factor is None else cp.concatenate([p.factor for p in parts])
    return W4Weight(first.format, cp.concatenate([p.data for p in parts], axis=0),
                    cp.concatenate([p.scale for p in parts], axis=0), first.group, first.code, first.scales, factor,
                    first.shape[1])


def _linear(proj, x, w: W4Weight, out, bias=None, *, accumulate=False, swiglu=False, norm_weight=None, eps=1e-6,
            norm_offset=0.0, activation="silu") -> None:
    """The rows path (formats.rows_linear): the 4-bit GEMV with the RMSNorm and gate activation fused."""
    w4 = _kernels(proj.kern)

    def gemv(x, y, **options):
        w4.gemv(x, w.data, w.scale, w.group, w.code, w.scales, w.factor, y, bias, stream=proj.stream, **options)

    rows_linear(proj, x, out, gemv, "w4", accumulate=accumulate, swiglu=swiglu, norm_weight=norm_weight, eps=eps,
                norm_offset=norm_offset, activation=activation)


def _gemm(proj, x, w: W4Weight, bias=None, accumulate_into=None):
    """The prefill path: the weight dequantized to bf16 (a temporary), then the bf16 cuBLAS GEMM."""
    w4 = _kernels(proj.kern)
    return dequantized_gemm(proj, x, w.shape, lambda wb: w4.dequant_bf16(w.data, w.scale, w.group, w.code, w.scales,
                                                                        w.factor, wb, stream=proj.stream),
                            bias, accumulate_into)


def _refuses(p) -> str | None:
    k = p.parts[0].shape[-1]
    return f"{p.key} in 4 bits with an input width of {k} (the 4-bit GEMV takes multiples of 8)" if k % 8 else None


def held_nbytes(p) -> int:
    """The bytes a param holds on the device: its words (rows padded to 16 bytes) and scales (NVFP4: an e4m3 byte a
    group and a 4-byte factor a row; int4: 4 bytes a group)."""
    from ...models.formats import weight_format
    from ...models.quantized.compressed_tensors import NVFP4_GROUP
    from .kernels.w4 import padded_words

    wf = weight_format(p.format)
    total = 0
    for t in p.parts:
        rows, k = t.shape
        if wf.family in NVFP4_KINDS:
            total += rows * (4 * padded_words(k) + -(-k // NVFP4_GROUP) + 4)
        else:
            group = wf.params["group"] if wf.params["strategy"] == "group" else 0
            total += rows * (4 * padded_words(k) + 4 * (-(-k // group) if group else 1))
    return total


def _accepts_pack(params: dict) -> bool:
    """Symmetric int4 in groups of a multiple of 8 values, per row or per tensor."""
    return (params["bits"] == 4 and not params["asym"] and params["strategy"] in ("group", "channel", "tensor")
            and (params["strategy"] != "group" or params["group"] % 8 == 0))


NVFP4_KINDS = ("modelopt_nvfp4", "ct_nvfp4")
W4_FAMILIES = NVFP4_KINDS + ("ct_pack",)  # the weight formats' kinds registered here

for _kind in NVFP4_KINDS:
    register_cuda_format(CudaFormat(_kind, _upload, _concat, _linear, _gemm, refuses=_refuses, nbytes=held_nbytes))
register_cuda_format(CudaFormat("ct_pack", _upload, _concat, _linear, _gemm, accepts=_accepts_pack, refuses=_refuses,
                                nbytes=held_nbytes))
