"""Operand checks of the launch wrappers: every wrapper checks shapes, dtypes, contiguity, device,
alignment and overlap before it launches, and raises ValueError with the operand's name."""

from __future__ import annotations

from typing import Any

from .tuning import ACTIVATIONS, GEMV_MAX_M, LOG2E


class OperandChecks:
    """Check helpers of `Kernels` (they read its _cp, _np, device_id and _bf16_dtype)."""

    def _arr(self, a: Any, name: str) -> Any:
        if not isinstance(a, self._cp.ndarray):
            raise ValueError(f"{name}: expected a cupy.ndarray, got {type(a).__name__}")
        if not a.flags.c_contiguous:
            raise ValueError(f"{name}: must be C-contiguous (shape {a.shape}, strides {a.strides})")
        if a.device.id != self.device_id:
            raise ValueError(f"{name}: on device {a.device.id}, kernels on device {self.device_id}")
        return a

    @staticmethod
    def _ndim(a: Any, name: str, ndim: int | None) -> None:
        if ndim is not None and a.ndim != ndim:
            raise ValueError(f"{name}: expected {ndim} dimensions, got shape {a.shape}")

    def _typed(self, a: Any, name: str, dtype_ok: bool, want: str, ndim: int | None) -> Any:
        """The end of _f32 / _i32 / _bf16, once _arr has passed: the dtype verdict, then ndim."""
        if not dtype_ok:
            raise ValueError(f"{name}: dtype must be {want}, got {a.dtype}")
        self._ndim(a, name, ndim)
        return a

    def _f32(self, a: Any, name: str, ndim: int | None = None) -> Any:
        self._arr(a, name)
        return self._typed(a, name, a.dtype == self._np.float32, "float32", ndim)

    def _i32(self, a: Any, name: str, ndim: int | None = None) -> Any:
        self._arr(a, name)
        return self._typed(a, name, a.dtype == self._np.int32, "int32", ndim)

    def _is_bf16(self, dtype: Any) -> bool:
        return dtype in (self._np.uint16, self._np.int16) or (
            self._bf16_dtype is not None and dtype == self._bf16_dtype
        )

    def _f32_or_bf16(self, a: Any, name: str) -> str:
        """'f32' or 'bf16', the kernel instance for a's dtype (ValueError for any other dtype)."""
        if a.dtype == self._np.float32:
            return "f32"
        if self._is_bf16(a.dtype):
            return "bf16"
        raise ValueError(f"{name}: dtype must be float32 or bfloat16, got {a.dtype}")

    def _bf16(self, a: Any, name: str, ndim: int | None = None) -> Any:
        self._arr(a, name)
        return self._typed(a, name, self._is_bf16(a.dtype), "bfloat16 (or uint16 raw bits)", ndim)

    @staticmethod
    def _shape(a: Any, name: str, shape: tuple[int, ...]) -> None:
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(a.shape)}")

    @staticmethod
    def _aligned(a: Any, name: str, nbytes: int = 16) -> None:
        if a.data.ptr % nbytes:
            raise ValueError(f"{name}: device pointer must be {nbytes}-byte aligned")

    @staticmethod
    def _disjoint(a: Any, an: str, b: Any, bn: str) -> None:
        a0, b0 = a.data.ptr, b.data.ptr
        if a0 < b0 + b.nbytes and b0 < a0 + a.nbytes:
            raise ValueError(f"{an} and {bn} must not overlap")

    def _linear_operands(self, op: str, x: Any, w: Any, wname: str, out: Any, bias: Any, norm_weight: Any,
                         swiglu: bool) -> tuple[int, int, int, bool]:
        """Check the operands of a GEMV (gemv, gemv_swiglu, gemv_tc); returns (M, K, N, norm), N the
        output columns (I with swiglu, whose w holds 2I rows)."""
        self._f32(x, "x", 2)
        self._bf16(w, wname, 2)
        self._f32(out, "out", 2)
        M, K = x.shape
        rows = w.shape[0]
        if w.shape[1] != K:
            raise ValueError(f"{wname}: expected shape (N, {K}) to match x {x.shape}, got {w.shape}")
        if swiglu:
            if rows % 2:
                raise ValueError(f"{wname}: expected shape (2*I, {K}) with swiglu, got {w.shape}")
            if bias is not None:
                raise ValueError(f"{op}: bias is not supported with swiglu")
        N = rows // 2 if swiglu else rows
        self._shape(out, "out", (M, N))
        if not 1 <= M <= GEMV_MAX_M:
            raise ValueError(f"{op}: M = {M} rows; this kernel takes 1..{GEMV_MAX_M} (use a GEMM)")
        if K % 8:
            raise ValueError(f"{op}: K = {K} must be a multiple of 8")
        if N == 0 or K == 0:
            raise ValueError(f"{op}: empty operand (N = {N}, K = {K})")
        self._aligned(x, "x")
        self._aligned(w, wname)
        self._disjoint(x, "x", out, "out")
        if bias is not None:
            self._bf16(bias, "bias", 1)
            self._shape(bias, "bias", (N,))
        return M, K, N, self._norm_weight(norm_weight, K)

    def _norm_weight(self, norm_weight: Any, K: int) -> bool:
        """Check the optional fused-RMSNorm weight of a GEMV; True when it is given."""
        if norm_weight is None:
            return False
        self._bf16(norm_weight, "norm_weight", 1)
        self._shape(norm_weight, "norm_weight", (K,))
        self._aligned(norm_weight, "norm_weight")
        return True

    def _check_cache(self, k_cache: Any, v_cache: Any) -> tuple[int, int, int]:
        self._bf16(k_cache, "k_cache", 3)
        self._bf16(v_cache, "v_cache", 3)
        if k_cache.shape != v_cache.shape:
            raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ in shape")
        self._disjoint(k_cache, "k_cache", v_cache, "v_cache")
        n_kv, max_ctx, hd = k_cache.shape
        return n_kv, max_ctx, hd

    def _act(self, activation: str) -> Any:
        """The gate_act code (common.cu) of a gated MLP's activation."""
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: supported {', '.join(ACTIVATIONS)}")
        return self._np.int32(ACTIVATIONS[activation])

    @staticmethod
    def _rotary_dim(hd: int, rotary_dim: int | None) -> int:
        """The rotated dims of a head (None: all of them; fewer: partial rotary)."""
        rd = hd if rotary_dim is None else int(rotary_dim)
        if rd <= 0 or rd % 2 or rd > hd:
            raise ValueError(f"rotary_dim = {rd} must be even and in 2..head_dim {hd}")
        return rd

    def _window_softcap(self, window: int | None, softcap: float | None) -> tuple[Any, Any]:
        """Attention kernel arguments: window (0 = none) and the softcap in base 2, softcap * log2(e)
        (0 = none)."""
        np = self._np
        if window is not None and int(window) <= 0:
            raise ValueError(f"window = {window} must be positive")
        if softcap is not None and not float(softcap) > 0:
            raise ValueError(f"softcap = {softcap} must be positive")
        return (np.int32(0 if window is None else int(window)),
                np.float32(0.0 if softcap is None else float(softcap) * LOG2E))
