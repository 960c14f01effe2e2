"""Rank 0's engine under tensor parallelism: the Engine protocol over N ranks.

`TensorParallelEngine` is what the CLI, decoding and dumps see: prefill / decode / verify / trim /
reset are sent to every worker (parallel/protocol.py) and run on rank 0's own engine (a sharded
NumpyEngine or CudaEngine); the ranks meet in the all-reduces inside the pass. The logits live sharded:
each rank holds its vocabulary range of every row. A row read (copy_logits_to_host) gathers that row's
ranges to rank 0; an argmax is distributed - each rank's candidate (value, index) is gathered and rank 0
picks (parallel/comm.pick_argmax), so only the index and the rows asked for cross to the host. A decode
step gathers its candidates inside the step (in the CUDA graph), so greedy decoding sends no extra
command. Hidden rows are replicated (after the final norm every rank holds them): read from rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..engine_base import EngineBase
from ..logits import DevicePtr
from .comm import assemble_rows, pick_argmax
from .protocol import RankServer, RankWorkers

if TYPE_CHECKING:
    from ..config import ModelConfig
    from ..engine.ops import Tap


@dataclass(frozen=True)
class ShardedRows:
    """Stands for a logits buffer whose columns are spread over the ranks (a DevicePtr's _buffer)."""

    name: str  # "rows" (prefill / verify) or "decode"
    shape: tuple[int, int]  # [rows, vocab]
    dtype: np.dtype


class TensorParallelEngine(EngineBase):
    """The model sharded over `workers.size` ranks, behind the ModelLogits interface (rank 0)."""

    def __init__(self, cfg: ModelConfig, local: Any, server: RankServer, workers: RankWorkers) -> None:
        self.cfg, self.local, self.server, self.workers = cfg, local, server, workers
        self.tp_size = server.group.size
        self.device = local.device
        self.max_context = local.max_context
        self.length = 0
        self._fp32_logits = local._fp32_logits
        self._dtype = np.dtype(np.float32 if self._fp32_logits else np.uint16)
        self._logits = ShardedRows("rows", (1, cfg.vocab_size), self._dtype)
        self._decode_logits = ShardedRows("decode", (1, cfg.vocab_size), self._dtype)
        self._hidden = local._hidden
        self._decode_fresh = False
        self._tap: Tap | None = None

    # the CUDA timer of `metrale bench` records events on rank 0's stream
    @property
    def cp(self):
        return self.local.cp

    @property
    def stream(self):
        return self.local.stream

    @property
    def tap(self) -> Tap | None:
        return self._tap

    @tap.setter
    def tap(self, observer: Tap | None) -> None:
        self._tap = observer
        self.local.tap = observer

    # -- passes --------------------------------------------------------------------------------------
    def prefill(self, tokens: Sequence[int], all_logits: bool = False) -> int:
        ids = [int(t) for t in self._check_tokens(tokens)]
        return self._pass("prefill", ids, bool(all_logits))

    def decode(self, token: int) -> None:
        ids = self._check_tokens([token])
        self._pass("decode", int(ids[0]))
        self._decode_fresh = True

    def verify(self, tokens: Sequence[int]) -> int:
        ids = [int(t) for t in self._check_tokens(tokens)]
        return self._pass("verify", ids)

    def trim(self, length: int) -> None:
        self.local.trim(length)  # first: a refusal (InputError, a ring's lost positions) stops it here
        super().trim(length)
        self.workers.send("trim", (length,), False)

    def reset(self) -> None:
        super().reset()
        self.local.reset()
        self.workers.send("reset", (), False)

    def synchronize(self) -> None:
        self.local.synchronize()
        self.workers.check()

    def set_graphs(self, enabled: bool) -> None:
        """CUDA graph replay on every rank (off: the same launches eagerly)."""
        self._call("set_graphs", bool(enabled))

    def _call(self, op: str, *args: Any) -> Any:
        self.workers.send(op, args, self._tap is not None)
        return self.server.run(op, args)

    def _pass(self, op: str, *args: Any) -> Any:
        self._decode_fresh = False
        out = self._call(op, *args)
        loc = self.local
        self.length = loc.length
        self._n_rows = loc._n_rows
        self._hidden_rows = loc._hidden_rows
        self._logits = ShardedRows("rows", (int(loc._logits.shape[0]), self.cfg.vocab_size), self._dtype)
        return out

    # -- LogitsBuffers hooks -------------------------------------------------------------------------
    def _row_to_host(self, ptr: DevicePtr) -> np.ndarray:
        buf = ptr._buffer
        if not isinstance(buf, ShardedRows):  # hidden rows: replicated, rank 0's own
            return self.local._row_to_host(ptr)
        gathered = self._call("gather", buf.name, ptr.row, 1)
        return assemble_rows(gathered, self.cfg.vocab_size)[0]

    def _argmax_rows(self, ptr: DevicePtr, n: int, stream: int) -> np.ndarray:
        buf = ptr._buffer
        if buf.name == "decode" and self._decode_fresh and ptr.row == 0 and n == 1:
            self.local.synchronize()
            self.workers.check()
            return pick_argmax(self.server.decode_candidates())  # gathered inside the decode step
        return pick_argmax(self._call("argmax", buf.name, ptr.row, n))

    def close(self) -> None:
        self.workers.close()
