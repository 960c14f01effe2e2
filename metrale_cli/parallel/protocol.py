"""The commands rank 0 sends the other ranks, and what every rank does with one (`RankServer`).

Rank 0 parses the CLI, renders, and drives its own engine through `TensorParallelEngine`
(parallel/engine.py); every engine call is first sent to each worker as one small message over its
pipe, then run on rank 0 by the same `RankServer.run` the workers run, so every rank enqueues the same
collectives in the same order. Messages are pickled tuples:

    rank 0 -> worker   ("call", op, args, observed)   op one of OPS; observed: a tap observer is set on
                                                      rank 0, so the rank runs the observed (eager) pass
                       ("exit",)                      leave the loop, free the engine
    worker -> rank 0   ("ready", rank)                after loading its shard
                       ("error", exit_code, message)  anything failed; the worker then exits

Successful calls are not answered (decode steps pipeline); a failure is noticed by rank 0's watchdog
(parallel/launcher.py) as the worker's exit, with this message as the reason.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from .comm import ParallelRank


class RankWorkers(Protocol):
    """How rank 0 reaches ranks 1..N-1 (launcher.Workers: processes and pipes; the GPU tests: threads)."""

    def send(self, op: str, args: tuple, observed: bool) -> None: ...  # one call to every worker
    def check(self) -> None: ...  # raise the first failure a worker reported
    def close(self) -> None: ...  # end the workers

# Engine passes (their arguments as Engine's), then the logits reads every rank takes part in:
#   gather(which, row, n)   rows [n, V] of the "rows" or "decode" logits buffer, gathered to rank 0
#   argmax(which, row, n)   the distributed argmax of those rows: each rank's candidate (value, index)
#   set_graphs(on)          CUDA graph replay on or off (the GPU tests compare the two)
OPS = ("prefill", "decode", "verify", "trim", "reset", "gather", "argmax", "set_graphs")


def _discard(name: str, x: Any) -> None:
    """A worker's tap observer: it runs the observed pass (same launches, same collectives) and keeps nothing."""


class RankServer:
    """One rank's side of every command: the engine call, or a logits read's collectives."""

    def __init__(self, engine: Any, group: ParallelRank) -> None:
        self.engine, self.group = engine, group

    def run(self, op: str, args: tuple) -> Any:
        e = self.engine
        if op in ("prefill", "decode", "verify", "trim", "reset"):
            return getattr(e, op)(*args)
        if op == "gather":
            return self.gather(*args)
        if op == "argmax":
            return self.argmax(*args)
        if op == "set_graphs":
            e.synchronize()
            e.use_graphs = bool(args[0])
            return None
        raise ValueError(f"unknown tensor-parallel command {op!r}")

    def serve(self, op: str, args: tuple, observed: bool) -> None:
        """A worker's run: with rank 0's observer set, the same observed pass, values discarded."""
        self.engine.tap = _discard if observed else None
        self.run(op, args)

    def buffer(self, which: str) -> Any:
        return self.engine._decode_logits if which == "decode" else self.engine._logits

    def gather(self, which: str, row: int, n: int) -> np.ndarray | None:
        """Every rank's rows [row, row + n) of its logits slice, padded to one width and gathered:
        [size, n, padded] on rank 0's host (None on the others)."""
        g, xp = self.group, self.group.xp
        buf = self.buffer(which)
        with g.on_stream():
            send = xp.zeros((n, g.padded_vocab), buf.dtype)
            send[:, :buf.shape[1]] = buf[row:row + n]
            recv = xp.empty((g.size, n, g.padded_vocab), buf.dtype)
            g.comm.all_gather(send, recv, g.stream)
        return g.to_host(recv) if g.rank == 0 else None

    def argmax(self, which: str, row: int, n: int) -> np.ndarray | None:
        """Each rank's argmax candidates of rows [row, row + n), gathered: [size, n, 2] on rank 0."""
        g, xp = self.group, self.group.xp
        rows = self.buffer(which)[row:row + n]
        with g.on_stream():
            pairs = self.engine.tp_argmax_pairs(rows)
            recv = xp.empty((g.size,) + tuple(pairs.shape), xp.float32)
            g.comm.all_gather(pairs, recv, g.stream)
        return g.to_host(recv) if g.rank == 0 else None

    def decode_candidates(self) -> np.ndarray:
        """The last decode step's candidates [size, 1, 2], gathered inside the step itself (rank 0)."""
        return self.group.to_host(self.engine._tp_decode_gathered)
