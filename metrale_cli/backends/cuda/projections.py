"""The CUDA engine's projections: the one place where a weight is multiplied by activations.

`Projections.linear` is the rows path's projection (one launch of metrale's own GEMV kernels, capturable) and
`Projections.gemm` / `gemm_experts` the prefill path's (cuBLAS, bf16 operands, fp32 output).  Each first asks
`weight_format` what the weight is: a plain bf16 device array (uint16 bits, HF layout [out, in]) runs the kernels
below; a weight stored in another format (models/formats.py; a device object with a `format` name) goes to that
format's entry in formats.py, and no pass changes.  The lm_head's rows and the final-logit softcap are here too."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import DeviceError
from .buffers import MAX_ROWS
from .formats import cuda_format
from .kernels.tuning import uses_tc

CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1


def weight_format(w: Any) -> str:
    """The format of a weight: "bf16" (a device array of bf16 bits) or the name a formatted weight carries
    (formats.py dispatches it)."""
    if getattr(w, "dtype", None) == np.uint16:
        return "bf16"
    name = getattr(w, "format", None)
    if name is not None and cuda_format(name) is not None:
        return name
    raise DeviceError(f"the CUDA engine has no projection kernels for a weight of type {type(w).__name__}")


class Projections:
    """Projections on the engine's stream with its kernels (`kern`), lm_head and final-logit softcap."""

    def __init__(self, cp: Any, kern: Any, stream: Any, lm_head: Any, final_logit_softcap: float | None) -> None:
        self.cp, self.kern, self.stream = cp, kern, stream
        self.lm_head, self.final_logit_softcap = lm_head, final_logit_softcap
        self._scratch: dict[tuple, Any] = {}

    def scratch(self, tag: str, shape: tuple[int, ...]) -> Any:
        """A persistent f32 work buffer of `shape` for a format's rows path (allocated on its first, eager use,
        so a captured graph only ever sees buffers that outlive it)."""
        key = (tag, tuple(shape))
        if key not in self._scratch:
            self._scratch[key] = self.cp.empty(shape, self.cp.float32)
        return self._scratch[key]

    def linear(self, x, w, out, bias=None, *, accumulate=False, swiglu=False, norm_weight=None,
               eps: float = 1e-6, norm_offset: float = 0.0, activation: str = "silu") -> None:
        """out (=|+=) x @ w.T (+ bias) on the rows path (x f32 [M <= MAX_ROWS, K]), with the RMSNorm of x
        (norm_weight, eps, norm_offset) fused in the GEMV's prologue when given and, with swiglu, the gate
        activation in its epilogue (w = concat(gate, up)): the ring GEMV for one row where it fits
        (Kernels.ring_fits), else the tensor-core GEMV from GEMV_TC_MIN_ROWS rows on and the fp32-FMA GEMV below."""
        fmt = weight_format(w)
        if fmt != "bf16":
            return cuda_format(fmt).linear(self, x, w, out, bias, accumulate=accumulate, swiglu=swiglu,
                                           norm_weight=norm_weight, eps=eps, norm_offset=norm_offset,
                                           activation=activation)
        k, s = self.kern, self.stream
        norm = dict(norm_weight=norm_weight, eps=eps, norm_offset=norm_offset)
        m, kk = x.shape
        if k.ring_fits(m, kk, out.shape[1], swiglu):
            k.gemv_ring(x, w, out, bias, accumulate=accumulate, swiglu=swiglu, activation=activation, stream=s,
                        chunks=k.ring_chunks(kk, out.shape[1], swiglu), **norm)
        elif uses_tc(m):
            k.gemv_tc(x, w, out, bias, accumulate=accumulate, swiglu=swiglu, activation=activation, stream=s,
                      **norm)
        elif swiglu:
            k.gemv_swiglu(x, w, out, activation=activation, stream=s, **norm)
        else:
            k.gemv(x, w, out, bias, accumulate=accumulate, stream=s, **norm)

    def gemm(self, x, w, bias=None, accumulate_into=None):
        """x f32[T, K] @ w.T (w bf16 bits [N, K]) -> f32 [T, N], through cuBLAS with bf16 operands.
        With accumulate_into (f32 [T, N]) the product is added to it in the GEMM (beta = 1) instead."""
        fmt = weight_format(w)
        if fmt != "bf16":
            return cuda_format(fmt).gemm(self, x, w, bias, accumulate_into)
        return self.gemm_bf16(x, w, bias, accumulate_into)

    def gemm_bf16(self, x, w, bias=None, accumulate_into=None):
        """gemm for a bf16 weight: one cuBLAS GemmEx."""
        cp = self.cp
        from cupy_backends.cuda.libs import cublas

        t, kdim = x.shape
        n = w.shape[0]
        xb = cp.empty((t, kdim), cp.uint16)
        self.kern.f32_to_bf16(x, xb, stream=self.stream)
        out = cp.empty((t, n), cp.float32) if accumulate_into is None else accumulate_into
        one = np.array(1.0, np.float32)
        zero = np.array(0.0 if accumulate_into is None else 1.0, np.float32)  # beta
        handle = cp.cuda.device.get_cublas_handle()
        cublas.setStream(handle, self.stream.ptr)
        # Row-major out[t, n] = xb @ w.T is column-major out^T[n, t] = w^T(op T of [k, n]) @ xb^T.
        cublas.gemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, t, kdim,
                      one.ctypes.data, w.data.ptr, CUDA_R_16BF, kdim,
                      xb.data.ptr, CUDA_R_16BF, kdim,
                      zero.ctypes.data, out.data.ptr, CUDA_R_32F, n,
                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
        if bias is not None:
            b32 = cp.empty(bias.shape, cp.float32)
            self.kern.bf16_to_f32(bias, b32, stream=self.stream)
            out += b32
        return out

    def gemm_experts(self, xb, w, rows: int, out, used=None):
        """out[e*rows:(e+1)*rows] = xb[e*rows:(e+1)*rows] @ w[e].T for every expert e of w (bf16 bits
        [E, N, K]), xb bf16 bits [E*rows, K], out f32 [E*rows, N]: one cuBLAS strided batched GEMM (the
        mixture-of-experts prefill's per-expert GEMMs).  With used = [(expert, n)], one GEMM per listed
        expert over its first n rows instead (the rest of out is left unwritten)."""
        if weight_format(w) != "bf16":  # experts kept as stored come through experts_bf16 first
            raise DeviceError("the CUDA MoE prefill's GEMMs take bf16 expert weights only")
        cp = self.cp
        from cupy_backends.cuda.libs import cublas

        experts, n, kdim = w.shape
        one, zero = np.array(1.0, np.float32), np.array(0.0, np.float32)
        handle = cp.cuda.device.get_cublas_handle()
        cublas.setStream(handle, self.stream.ptr)
        if used is not None:
            for ex, count in used:
                cublas.gemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, count, kdim,
                              one.ctypes.data, w.data.ptr + ex * n * kdim * 2, CUDA_R_16BF, kdim,
                              xb.data.ptr + ex * rows * kdim * 2, CUDA_R_16BF, kdim,
                              zero.ctypes.data, out.data.ptr + ex * rows * n * 4, CUDA_R_32F, n,
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
            return out
        cublas.gemmStridedBatchedEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, rows, kdim,
                                    one.ctypes.data, w.data.ptr, CUDA_R_16BF, kdim, n * kdim,
                                    xb.data.ptr, CUDA_R_16BF, kdim, rows * kdim,
                                    zero.ctypes.data, out.data.ptr, CUDA_R_32F, n, rows * n,
                                    experts, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
        return out

    def experts_bf16(self, w, experts: list[int]):
        """Stacked experts w as bf16 bits [E, N, K] for gemm_experts: w itself when bf16; experts kept as stored in a
        format (FP8, MXFP4) dequantized by the format's entry, the listed experts only (the others zeros: the GEMMs'
        rows for an expert no pair chose are never read)."""
        fmt = weight_format(w)
        return w if fmt == "bf16" else cuda_format(fmt).experts_bf16(self, w, experts)

    def lm_head_rows(self, h):
        """The softcapped fp32 logits [T, V] of post-final-norm rows h [T, H] (a fresh array)."""
        if h.shape[0] <= MAX_ROWS:
            out = self.cp.empty((h.shape[0], self.lm_head.shape[0]), self.cp.float32)
            self.linear(self.cp.ascontiguousarray(h), self.lm_head, out)
        else:
            out = self.gemm(h, self.lm_head)
        self.softcap_logits(out)
        return out

    def softcap_logits(self, logits) -> None:
        """Final-logit softcapping (Gemma 2) on fp32 logits rows, in place, before any bf16 rounding."""
        if self.final_logit_softcap is not None:
            self.kern.softcap(logits, self.final_logit_softcap, stream=self.stream)
