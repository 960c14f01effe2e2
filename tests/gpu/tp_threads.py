"""N tensor-parallel CUDA ranks in one process on ONE GPU, for the GPU tests: the sharded engines, the
RankServer protocol and TensorParallelEngine exactly as `--tp N` runs them, with two stand-ins for what
needs N GPUs: each rank is a thread (not a spawned process) and the collectives go through
`ThreadCommunicator` (device copies and a barrier, rank-order sums: every rank holds the same bits) instead
of NCCL. The ranks run eagerly (a host barrier cannot sit inside a CUDA graph); tests/gpu/test_tp_cuda.py
checks the NCCL path and graph capture with one rank.

    with threaded_tp(path, n=4, max_context=96, fp32_logits=True) as engine:
        engine.prefill(...)  # an Engine: decode, verify, logits rows, argmax, as open_model(..., tp=n)
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any

from metrale_cli.checkpoint import Checkpoint
from metrale_cli.config import load_config
from metrale_cli.errors import DeviceError
from metrale_cli.parallel.comm import ParallelRank
from metrale_cli.parallel.engine import TensorParallelEngine
from metrale_cli.parallel.protocol import RankServer

TIMEOUT_S = 120.0  # a rank that never arrives (an exception on another thread) breaks the barrier


class _Group:
    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=TIMEOUT_S)
        self.slots: list[Any] = [None] * n


class ThreadCommunicator:
    """The Communicator interface (parallel/comm.py) between threads of one process on one GPU."""

    def __init__(self, rank: int, size: int, group: _Group) -> None:
        self.rank, self.size, self._g = rank, size, group

    def all_reduce(self, x: Any, stream: Any = None) -> None:
        import cupy as cp

        if x.dtype != cp.float32 or not x.flags.c_contiguous:
            raise ValueError("all_reduce takes a contiguous float32 array")
        stream.synchronize()  # x is final on this rank's stream
        self._g.slots[self.rank] = x
        self._wait()
        with stream:
            total = self._g.slots[0].copy()
            for r in range(1, self.size):  # rank order on every rank: the same bits everywhere
                total += self._g.slots[r]
        stream.synchronize()
        self._wait()  # every rank has read every slot before any is overwritten
        with stream:
            x[...] = total
        stream.synchronize()

    def all_gather(self, send: Any, recv: Any, stream: Any = None) -> None:
        stream.synchronize()
        self._g.slots[self.rank] = send
        self._wait()
        with stream:
            for r in range(self.size):
                recv[r] = self._g.slots[r]
        stream.synchronize()
        self._wait()

    def abort(self) -> None:
        self._g.barrier.abort()

    def _wait(self) -> None:
        try:
            self._g.barrier.wait()
        except threading.BrokenBarrierError:
            raise DeviceError("tensor parallelism (threads): another rank left the group") from None


class ThreadWorkers:
    """The launcher's Workers interface (send, check, close) over ranks 1..n-1 running in threads."""

    def __init__(self, servers: list[RankServer], group: _Group) -> None:
        self.size = len(servers) + 1
        self._g = group
        self._queues: list[queue.Queue] = [queue.Queue() for _ in servers]
        self.errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._loop, args=(s, q), daemon=True)
                         for s, q in zip(servers, self._queues)]
        for t in self._threads:
            t.start()

    def _loop(self, server: RankServer, q: queue.Queue) -> None:
        while True:
            msg = q.get()
            if msg is None:
                return
            try:
                server.serve(*msg)
            except BaseException as e:  # noqa: BLE001 - reported to rank 0 by check()
                self.errors.append(e)
                self._g.barrier.abort()
                return

    def send(self, op: str, args: tuple, observed: bool) -> None:
        self.check()
        for q in self._queues:
            q.put((op, args, observed))

    def check(self) -> None:
        if self.errors:
            raise self.errors[0]

    def close(self) -> None:
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(TIMEOUT_S)


@contextlib.contextmanager
def threaded_tp(path, n: int, max_context: int, fp32_logits: bool = True):
    """TensorParallelEngine of n CUDA ranks on the current GPU (threads, ThreadCommunicator), eager."""
    import cupy as cp

    from metrale_cli.backends.cuda.loading import load_cuda_engine

    cfg = load_config(path)
    group = _Group(n)
    engines, servers, sources = [], [], []
    workers = None
    try:
        for rank in range(n):
            pr = ParallelRank(ThreadCommunicator(rank, n, group), rank, n, cfg.vocab_size, xp=cp)
            src = Checkpoint.open(path)
            sources.append(src)
            e = load_cuda_engine(cfg, src, max_context, fp32_logits, tp=pr)
            e.use_graphs = False
            engines.append(e)
            servers.append(RankServer(e, pr))
        workers = ThreadWorkers(servers[1:], group)
        yield TensorParallelEngine(cfg, engines[0], servers[0], workers)
    finally:
        if workers is not None:
            workers.close()
        for s in sources:
            s.close()
