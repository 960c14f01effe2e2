"""Python wrappers of the tensor-parallel kernels (tp.cu), a CuPy RawModule of their own.

Built from common.cu + tp.cu only when the engine is one rank of a tensor-parallel group
(parallel/), so the plain engine pays nothing for it. Launches go through the engine's `Kernels` (the
same PDL setting); each method checks its operands (ValueError) and launches without host reads or
syncs, so the rows path stays capturable in a CUDA graph.
"""

from __future__ import annotations

from typing import Any

from .nvrtc import joined_source

PLAIN = ("vocab_embedding_kernel", "argmax_pairs_f32_kernel", "argmax_pairs_bf16_kernel")
MAX_EXACT_INDEX = 1 << 24  # argmax candidates carry their index as a float


def module_source() -> str:
    return joined_source('tp.cu')


class TpKernels:
    """The tensor-parallel kernels, launched through `kern` (a cuda.kernels.Kernels)."""

    def __init__(self, kern: Any) -> None:
        cp = kern._cp
        self.k, self._cp, self._np = kern, cp, kern._np
        try:
            module = cp.RawModule(code=module_source(), options=("-std=c++17", "-DMETRALE_NVRTC"))
            self._fn = {n: module.get_function(n) for n in PLAIN}
        except Exception as e:  # an NVRTC or driver failure: one clear line
            from ....errors import DeviceError

            raise DeviceError(f"cannot compile the tensor-parallel kernels ({type(e).__name__}: "
                              f"{str(e).splitlines()[0]})") from None

    def _launch(self, name: str, grid: tuple, block: tuple, args: tuple, stream: Any) -> None:
        k = self.k
        if k.pdl:
            if k._pdl_launcher is None:
                from .pdl import PdlLauncher

                k._pdl_launcher = PdlLauncher(self._cp)
            k._pdl_launcher.launch(self._fn[name], grid, block, args, stream)
        else:
            self._fn[name](grid, block, args, stream=stream)

    def vocab_embedding(self, ids: Any, table: Any, out: Any, start: int, *, scale: float | None = None,
                        stream: Any = None) -> None:
        """out[m, :] = float32(table[ids[m] - start, :]) (* scale) for ids in [start, start + rows), else 0.
        ids int32[M], table bf16[rows, H] (this rank's vocabulary rows), out f32[M, H]."""
        np, k = self._np, self.k
        k._i32(ids, "ids", 1)
        k._bf16(table, "table", 2)
        k._f32(out, "out", 2)
        (m,), (rows, hidden) = ids.shape, table.shape
        k._shape(out, "out", (m, hidden))
        if m == 0:
            return
        s = np.float32(1.0 if scale is None else scale)
        args = (ids, table, out, np.int32(start), np.int32(rows), np.int32(hidden), s)
        self._launch("vocab_embedding_kernel", (m,), (256,), args, stream)

    def argmax_pairs(self, rows: Any, idx: Any, pairs: Any, start: int, *, stream: Any = None) -> None:
        """pairs f32 [n, 2] = (rows[i, idx[i]], start + idx[i]), or (NaN, -1) where idx[i] < 0; rows f32 or
        bf16 [n, V] (this rank's logits), idx int32 [n] (Kernels.argmax of rows)."""
        np, k = self._np, self.k
        k._arr(rows, "rows")
        k._ndim(rows, "rows", 2)
        k._i32(idx, "idx", 1)
        k._f32(pairs, "pairs", 2)
        n, vocab = rows.shape
        k._shape(idx, "idx", (n,))
        k._shape(pairs, "pairs", (n, 2))
        if start + vocab > MAX_EXACT_INDEX:
            raise ValueError(f"argmax_pairs: indices up to {start + vocab} are not exact as float32")
        name = f"argmax_pairs_{k._f32_or_bf16(rows, 'rows')}_kernel"
        if n == 0:
            return
        args = (rows, idx, pairs, np.int32(n), np.int32(vocab), np.int32(start))
        self._launch(name, (-(-n // 128),), (128,), args, stream)
