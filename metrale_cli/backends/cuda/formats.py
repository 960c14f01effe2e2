"""Weight formats on the GPU (models/formats.py says what each format stores and its exact value): per format,
how the CUDA engine keeps such a weight on the device (`upload`, `concat`) and multiplies by it (`linear` on the
rows path, capturable; `gemm` on the prefill path). `projections.weight_format` sends every weight that is not a
plain bf16 array here; a weight whose format has no entry, or whose key is neither a projection nor stacked experts
the entry can `stack`, is dequantized and rounded to bf16 at load instead (loading.kept_as_stored). The built-in entries come with the formats' kernels; `register_cuda_format` adds
one (a test's toy format, say)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

# Param keys whose weights reach the projections (a formatted weight of any other key but EXPERT_KEYS is dequantized
# to bf16 at load: latent attention's kernels and the embedding gather read bf16 weights directly).
PROJECTION_KEYS = frozenset({"qkv", "o", "gate_up", "down", "router", "shared_gate_up", "shared_down", "lm_head",
                             "lin_in", "lin_out"})
# Stacked MoE experts: kept as stored where the format's entry has `stack` (the MoE kernels' format policies read them:
# FP8, MXFP4).
EXPERT_KEYS = frozenset({"experts_gate_up", "experts_down"})


@dataclass(frozen=True)
class CudaFormat:
    name: str  # a weight format's name, or the kind of a family of them (WeightFormat.family: "fp8_block")
    # upload(param, read, kern) -> one device weight per part: read(name) gives a stored tensor as a host array
    upload: Callable[[Any, Callable[[str], Any], Any], list[Any]]
    concat: Callable[[list[Any], Any], Any]  # concat(parts, cp): a fused param's parts (q, k, v -> qkv) as one weight
    # linear(proj, x, w, out, bias, accumulate=, swiglu=, norm_weight=, eps=, norm_offset=, activation=); None: the
    # format has no projection kernels (its projections are dequantized to bf16 at load; MXFP4 formats experts only)
    linear: Callable[..., None] | None = None
    gemm: Callable[..., Any] | None = None  # gemm(proj, x, w, bias, accumulate_into) -> f32 [T, N]
    accepts: Callable[[dict], bool] = lambda params: True  # which of the kind's formats (WeightFormat.params) it runs
    refuses: Callable[[Any], str | None] = lambda param: None  # why it cannot run this param (its sizes), or None
    # input_quant(param, read, kern) -> how the weight's inputs are quantized under `--activation-quant emulate`
    # (set as the device weight's `input_quant`, which `linear` and `gemm` apply to x first); None: not emulated
    input_quant: Callable[[Any, Callable[..., Any], Any], Any] | None = None
    # nbytes(param) -> the bytes its device weights hold, where they differ from the stored bytes (4-bit codes
    # with fp32 scales for their e4m3 or bf16 ones); None: the checkpoint's stored bytes (formats.stored_nbytes)
    nbytes: Callable[[Any], int] | None = None
    # stack(experts, cp): stacked MoE experts (`Param.experts`) kept as stored, from each expert's fused weight (concat
    # of its parts), for the MoE kernels; None: the format's experts are dequantized to bf16 at load
    stack: Callable[[list[Any], Any], Any] | None = None
    # experts_bf16(proj, w, experts) -> bf16 bits [E, N, K] of stacked experts w, the listed ones dequantized (the
    # MoE prefill's batched cuBLAS GEMMs; required with `stack`)
    experts_bf16: Callable[[Any, Any, list[int]], Any] | None = None
    # stacked_parts: `upload` also takes experts stored stacked, one [E, N, K] tensor per part (Param.experts 0:
    # gpt-oss), each part's device weight already the stacked experts
    stacked_parts: bool = False
    # reorders_rows: the device weight takes the loader's de-interleaving of its rows, `w[..., order, :]`
    # (Param.interleaved: gpt-oss's gate / up; a format whose every scale belongs to one row)
    reorders_rows: bool = False


_FORMATS: dict[str, CudaFormat] = {}
# the built-in entries, imported on the first lookup (no CuPy needed)
BUILTIN = ("metrale_cli.backends.cuda.fp8", "metrale_cli.backends.cuda.w4", "metrale_cli.backends.cuda.mxfp4")


def register_cuda_format(fmt: CudaFormat) -> CudaFormat:
    _FORMATS[fmt.name] = fmt
    return fmt


def cuda_format(name: str) -> CudaFormat | None:
    """The entry that runs weight format `name`: registered under the name itself, or under its kind and
    accepting its parameters; None when the CUDA engine cannot run it."""
    if name in _FORMATS:
        return _FORMATS[name]
    for module in BUILTIN:
        importlib.import_module(module)
    from ...models.formats import weight_format

    try:
        wf = weight_format(name)
    except KeyError:
        return None
    entry = _FORMATS.get(wf.family)
    if entry is None or not entry.accepts(wf.params):
        return None
    _FORMATS[name] = entry  # resolved once: the projections look a weight's format up on every call
    return entry


def rows_linear(proj: Any, x: Any, out: Any, gemv: Callable[..., None], tag: str, *, accumulate: bool,
                swiglu: bool, norm_weight: Any, eps: float, norm_offset: float, activation: str,
                prepare: Callable[[Any], Any] | None = None) -> None:
    """A format's rows-path `linear` through its GEMV (qgemv.cu), which fuses the RMSNorm of x and the gate
    activation: `gemv(x, out, accumulate=, swiglu=, norm_weight=, eps=, norm_offset=, activation=)`. With
    `prepare(x)` (an input quantization, which must see the normed values) the RMSNorm runs first, into a scratch
    row block named `tag`_norm."""
    if prepare is not None:
        if norm_weight is not None:
            xn = proj.scratch(f"{tag}_norm", x.shape)
            proj.kern.rmsnorm(x, norm_weight, eps, xn, offset=norm_offset, stream=proj.stream)
            x, norm_weight = xn, None
        x = prepare(x)
    gemv(x, out, accumulate=accumulate, swiglu=swiglu, norm_weight=norm_weight, eps=eps, norm_offset=norm_offset,
         activation=activation)


def dequantized_gemm(proj: Any, x: Any, shape: tuple[int, int], dequant: Callable[[Any], None], bias: Any = None,
                     accumulate_into: Any = None) -> Any:
    """A format's prefill `gemm`: the weight dequantized by `dequant(out)` into a bf16 temporary of `shape`, then the
    bf16 cuBLAS GEMM (Projections.gemm_bf16)."""
    wb = proj.cp.empty(shape, proj.cp.uint16)
    dequant(wb)
    return proj.gemm_bf16(x, wb, bias, accumulate_into)

