"""Launch wrappers of argmax.cu: the first maximum of each logits row (one block per row, or several and a last-
block reduction)."""

from __future__ import annotations

from typing import Any

from .tuning import ARGMAX_CHUNK, ARGMAX_THREADS, _ceil_div


class ArgmaxKernels:

    def argmax_blocks(self, n: int, V: int) -> int:
        """Blocks per row of the split argmax (argmax_split_*_kernel) for n rows of V, or 0 for the one-block-
        per-row kernel: one block per ARGMAX_CHUNK elements, at most 8 resident-sized waves of the GPU over
        all rows; the one-block kernel when the row fits in two chunks or n rows alone fill the SMs."""
        chunks = _ceil_div(int(V), ARGMAX_CHUNK)
        if chunks < 2 or n >= self.num_sms:
            return 0
        return max(2, min(chunks, (8 * self.num_sms) // max(1, int(n))))

    @staticmethod
    def argmax_workspace_size(n: int, nb: int) -> int:
        """int32 elements of the split argmax's workspace: n counters (zero before and after every launch)
        and nb (value, index) partials per row."""
        return int(n) + 2 * int(n) * int(nb)

    def argmax(self, rows: Any, out: Any, *, workspace: Any = None, stream: Any = None) -> None:
        """out[i] = index of the first maximum of rows[i] (torch.argmax), or -1 if rows[i] holds
        any NaN or +-Inf.  rows f32 or bf16 [n, V]; out int32[n].
        Fewer rows than SMs (argmax_blocks > 0): several blocks per row in one launch, the last block of
        each row reducing their partials (argmax_split_*_kernel); else one block per row.  The same index
        either way (ties, NaN, Inf: tests/gpu/test_kernels.py).  The split kernel needs `workspace`:
        int32[>= argmax_workspace_size(n, argmax_blocks(n, V))] whose first n elements are zero (every
        launch leaves them zero; the rest is scratch), used for this row count n only (another n's partials
        would lie on its counters); None: an internal one per n, grown on demand (zeroed and
        synchronised: make one eager call before capturing, or pass your own, and pass your own when calls
        on different streams may overlap)."""
        np = self._np
        self._arr(rows, "rows")
        self._i32(out, "out", 1)
        self._ndim(rows, "rows", 2)
        n, V = rows.shape
        self._shape(out, "out", (n,))
        if V == 0 or V >= 2**31:
            raise ValueError(f"argmax: V = {V} must be in 1..2^31-1")
        kind = self._f32_or_bf16(rows, "rows")
        if n == 0:
            return
        nb = self.argmax_blocks(n, V)
        if nb == 0:
            self._launch(f"argmax_{kind}_kernel", (n,), (1024,), (rows, out, np.int32(V)), stream)
            return
        need = self.argmax_workspace_size(n, nb)
        if workspace is None:  # one per row count: n's counters must not lie where another n's partials went
            spaces = self.__dict__.setdefault("_argmax_ws", {})
            ws = spaces.get(n)
            if ws is None or ws.size < need:
                ws = self._cp.zeros(max(need, 1 << 12), dtype=self._cp.int32)
                self._cp.cuda.Device().synchronize()  # the zero fill ran on the current stream
                spaces[n] = ws
            workspace = ws
        else:
            self._i32(workspace, "workspace", 1)
            if workspace.shape[0] < need:
                raise ValueError(f"workspace: {workspace.shape[0]} int32 elements, need {need}")
            self._disjoint(workspace, "workspace", out, "out")
        self._launch(f"argmax_split_{kind}_kernel", (nb, n), (ARGMAX_THREADS,), (rows, out, np.int32(V), workspace),
                     stream)
