"""Launch wrappers of gemv_ring.cu: the ring GEMV of one row (every one-row projection it fits on the rows paths)."""

from __future__ import annotations

from typing import Any

from .names import gemv_ring_name
from .tuning import (
    GEMV_RING_CHUNKS,
    GEMV_RING_DEEP_BYTES,
    GEMV_RING_K_MULTIPLE,
    GEMV_RING_MAX_N,
    GEMV_RING_SMEM_SLACK,
    GEMV_RING_STAGES,
    GEMV_RING_THREADS,
    ring_fixed_smem_bytes,
)


class GemvRingKernels:

    def ring_fits(self, m: int, k: int, n: int, gated: bool = False) -> bool:
        """Whether the engine's rows path takes gemv_ring for this projection: one row, K a multiple of
        GEMV_RING_K_MULTIPLE, at most GEMV_RING_MAX_N outputs, and x, the partials and a one-chunk ring
        within a block's shared memory."""
        if m != 1 or k % GEMV_RING_K_MULTIPLE or n > GEMV_RING_MAX_N:
            return False
        return self._ring_fit(k, n, gated)[3] >= 1

    @staticmethod
    def ring_chunks(k: int, n: int, gated: bool) -> int:
        """gemv_ring's chunks per thread and slot on the engine's rows path (tuning.py, GEMV_RING_DEEP_BYTES)."""
        return 2 if (2 if gated else 1) * n * k * 2 >= GEMV_RING_DEEP_BYTES else 1

    def _ring_fit(self, k: int, n: int, gated: bool) -> tuple[int, int, int, int]:
        """(grid, shared bytes besides the ring, ring bytes per chunk per thread and slot, the most chunks per
        thread and slot that fit) of gemv_ring: one block per SM, within all the shared memory a block may have."""
        grid = min(n, self.num_sms)
        fixed = ring_fixed_smem_bytes(k, n, grid, gated, GEMV_RING_THREADS)
        per_chunk = GEMV_RING_STAGES * GEMV_RING_THREADS * 16
        budget = self.smem_per_block_optin + 1024
        return grid, fixed, per_chunk, (budget - GEMV_RING_SMEM_SLACK - fixed) // per_chunk

    def _ring_geometry(self, norm: bool, k: int, n: int, gated: bool, chunks: int | None) -> tuple[str, int, int]:
        """(kernel name, grid, shared bytes) of a gemv_ring launch, computed once per shape (_ring_fit): the
        deepest compiled ring (GEMV_RING_CHUNKS chunks per thread and slot) that fits, or `chunks`."""
        cache = self.__dict__.setdefault("_ring_geometries", {})
        key = (norm, k, n, gated, chunks)
        if key not in cache:
            grid, fixed, per_chunk, fit = self._ring_fit(k, n, gated)
            p = max((c for c in GEMV_RING_CHUNKS if c <= fit), default=0) if chunks is None else chunks
            if p < 1 or p > fit:
                raise ValueError(f"gemv_ring: K = {k}, N = {n}: a ring of {p} chunks per thread does not fit "
                                 f"(at most {fit})")
            name = gemv_ring_name(norm, gated, p, GEMV_RING_THREADS)
            fn = self._fn[name]
            # opt in to more than 48 KiB of dynamic shared memory: the device's most, once for every geometry (a
            # launch with more than the function's limit fails, and the geometries of one kernel differ)
            fn.max_dynamic_shared_size_bytes = self.smem_per_block_optin - int(fn.attributes.get("shared_size_bytes", 0))
            cache[key] = (name, grid, fixed + p * per_chunk)
        return cache[key]

    def gemv_ring(self, x: Any, w: Any, out: Any, bias: Any = None, *, norm_weight: Any = None,
                  accumulate: bool = False, swiglu: bool = False, activation: str = "silu", eps: float = 1e-6,
                  norm_offset: float = 0.0, chunks: int | None = None, stream: Any = None) -> None:
        """The ring GEMV (gemv_ring.cu), one row: the function of gemv / gemv_swiglu for M = 1 (the norm fused
        when norm_weight is given, norm_offset added to it in fp32), x f32[1, K] with K a multiple of
        GEMV_RING_K_MULTIPLE.  `chunks`: 16-byte chunks per thread in each ring slot (None: the most that fit).
        The result depends on (N, K, the grid) only: fixed for a device, whatever the ring."""
        np = self._np
        op = "gemv_ring"
        M, K, N, norm = self._linear_operands(op, x, w, "w", out, bias, norm_weight, swiglu)
        if M != 1:
            raise ValueError(f"{op}: M = {M} rows; this kernel takes 1")
        if K % GEMV_RING_K_MULTIPLE:
            raise ValueError(f"{op}: K = {K} must be a multiple of {GEMV_RING_K_MULTIPLE}")
        if swiglu and accumulate:
            raise ValueError(f"{op}: accumulate is not supported with swiglu")
        if chunks is not None and chunks not in GEMV_RING_CHUNKS:
            raise ValueError(f"{op}: chunks = {chunks}: compiled {', '.join(map(str, GEMV_RING_CHUNKS))}")
        name, grid, smem = self._ring_geometry(norm, K, N, swiglu, chunks)
        args = (
            x, w, self._dummy if bias is None else bias, out, np.int32(N), np.int32(K),
            np.int32(1 if accumulate else 0), np.int32(0 if bias is None else 1),
            norm_weight if norm else self._dummy, np.float32(eps), np.float32(norm_offset), self._act(activation),
        )
        self._launch(name, (grid,), (GEMV_RING_THREADS,), args, stream, shared_mem=smem)
