"""The collectives of a tensor-parallel rank, and what a sharded engine knows of its group.

A sharded engine calls two collectives, both on its own stream:
- `all_reduce(x)`: x (fp32, contiguous) becomes the sum of every rank's x, in place (after the
  row-parallel o / down projections and the vocabulary-parallel embedding);
- `all_gather(send, recv)`: recv [size, *send.shape] holds every rank's send, rank order (logits rows
  of each vocabulary range, argmax candidates); any dtype, moved as bytes.

Two implementations behind that interface:
- `NcclCommunicator`: cupy.cuda.nccl, one GPU per process; the calls are enqueued on the engine's
  stream, so they are captured in the rows path's CUDA graphs like any kernel;
- `HostCommunicator`: NumPy arrays in a shared-memory block and a multiprocessing barrier, for
  `--tp N --device cpu` (N NumPy engine processes): the same ranks, launcher and protocol as on the GPUs,
  so they run in CI. Every rank sums the slots in rank order, so every rank holds the same bits.

`ParallelRank` is the group as an engine sees it: its communicator, rank, size, vocabulary rows, and
the array module and stream its arrays live on (RankServer's gathers use them, backend-agnostic).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..errors import DeviceError
from .sharding import vocab_range


class Communicator(Protocol):
    rank: int
    size: int

    def all_reduce(self, x: Any, stream: Any = None) -> None: ...
    def all_gather(self, send: Any, recv: Any, stream: Any = None) -> None: ...
    def abort(self) -> None: ...


@dataclass
class ParallelRank:
    """One rank of a tensor-parallel group, as its engine and RankServer use it."""

    comm: Communicator
    rank: int
    size: int
    vocab_size: int  # the model's (token ids are global)
    xp: Any = np  # numpy or cupy: the module of the engine's arrays
    stream: Any = None  # the engine's CUDA stream (bound by the CUDA engine), None on the CPU
    failure: list[str] = field(default_factory=list)  # why the group broke (set by the launcher's watchdog)

    @property
    def vocab(self) -> range:
        """This rank's rows of the embedding and lm_head."""
        return vocab_range(self.vocab_size, self.rank, self.size)

    @property
    def padded_vocab(self) -> int:
        """Every rank's logits width rounded up to the widest range (all_gather moves equal counts)."""
        return -(-self.vocab_size // self.size)

    def on_stream(self):
        return self.stream if self.stream is not None else contextlib.nullcontext()

    def to_host(self, a: Any) -> np.ndarray:
        return a.get(stream=self.stream) if self.xp is not np else np.array(a)


class HostCommunicator:
    """Collectives between CPU processes through one shared-memory block (size slots of `capacity`
    bytes) and a barrier; arrays larger than a slot go through in pieces."""

    def __init__(self, rank: int, size: int, shm_name: str, barrier: Any, capacity: int,
                 failure: list[str] | None = None) -> None:
        from multiprocessing import shared_memory

        self.rank, self.size, self.capacity = rank, size, capacity
        self._barrier = barrier
        self._failure = failure if failure is not None else []
        self._shm = shared_memory.SharedMemory(name=shm_name)
        self._slots = np.ndarray((size, capacity), np.uint8, buffer=self._shm.buf)

    @staticmethod
    def create_block(size: int, capacity: int):
        """The shared-memory block rank 0 creates (and unlinks when the group ends)."""
        from multiprocessing import shared_memory

        return shared_memory.SharedMemory(create=True, size=size * capacity)

    def all_reduce(self, x: np.ndarray, stream: Any = None) -> None:
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            raise ValueError("all_reduce takes a contiguous float32 array")
        flat = x.reshape(-1)
        step = self.capacity // 4
        f32 = self._slots.view(np.float32)  # [size, capacity / 4]
        for lo in range(0, flat.size, step):
            part = flat[lo:lo + step]
            f32[self.rank, :part.size] = part
            self._wait()
            part[:] = f32[0, :part.size]
            for r in range(1, self.size):  # rank order on every rank: the same bits everywhere
                part += f32[r, :part.size]
            self._wait()  # nobody overwrites a slot before every rank has read it

    def all_gather(self, send: np.ndarray, recv: np.ndarray, stream: Any = None) -> None:
        src = np.ascontiguousarray(send).reshape(-1).view(np.uint8)
        dst = recv.reshape(self.size, -1).view(np.uint8)  # recv is ours, contiguous
        for lo in range(0, src.size, self.capacity):
            part = src[lo:lo + self.capacity]
            self._slots[self.rank, :part.size] = part
            self._wait()
            dst[:, lo:lo + part.size] = self._slots[:, :part.size]
            self._wait()

    def abort(self) -> None:
        self._barrier.abort()

    def close(self) -> None:
        self._slots = None
        self._shm.close()

    def _wait(self) -> None:
        import threading

        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            why = self._failure[0] if self._failure else "another rank left the group"
            raise DeviceError(f"tensor parallelism: {why}") from None


class NcclCommunicator:
    """cupy.cuda.nccl's communicator of one rank (one GPU per process); calls go on the given stream."""

    def __init__(self, rank: int, size: int, unique_id: tuple) -> None:
        from cupy.cuda import nccl

        self.rank, self.size = rank, size
        self._nccl = nccl
        self._comm = nccl.NcclCommunicator(size, unique_id, rank)

    def all_reduce(self, x: Any, stream: Any = None) -> None:
        if x.dtype.itemsize != 4 or x.dtype.kind != "f" or not x.flags.c_contiguous:
            raise ValueError("all_reduce takes a contiguous float32 array")
        n = self._nccl
        self._comm.allReduce(x.data.ptr, x.data.ptr, x.size, n.NCCL_FLOAT32, n.NCCL_SUM, _ptr(stream))

    def all_gather(self, send: Any, recv: Any, stream: Any = None) -> None:
        if not (send.flags.c_contiguous and recv.flags.c_contiguous) or recv.nbytes != self.size * send.nbytes:
            raise ValueError("all_gather takes contiguous arrays, recv [size, *send.shape]")
        self._comm.allGather(send.data.ptr, recv.data.ptr, send.nbytes, self._nccl.NCCL_INT8, _ptr(stream))

    def abort(self) -> None:
        self._comm.abort()


def _ptr(stream: Any) -> int:
    if stream is not None:
        return stream.ptr
    import cupy

    return cupy.cuda.get_current_stream().ptr


def pick_argmax(pairs: np.ndarray) -> np.ndarray:
    """The distributed argmax: pairs [size, n, 2] holds each rank's (value, global index) of its own
    range's first maximum (index -1: a non-finite value in its range). Returns [n] int: the first index
    of the row's maximum (ranks hold increasing ranges, so the first rank holding it), -1 when any rank
    saw a non-finite value - exactly what one argmax over the whole row gives."""
    values, index = pairs[..., 0], pairs[..., 1].astype(np.int64)
    bad = (index < 0).any(axis=0)
    best = np.argmax(np.where(index < 0, -np.inf, values), axis=0)  # the first rank on ties
    out = index[best, np.arange(pairs.shape[1])]
    out[bad] = -1
    return out


def assemble_rows(gathered: np.ndarray, vocab_size: int) -> np.ndarray:
    """gathered [size, n, padded] (each rank's logits rows, padded) -> [n, vocab_size] in vocab order."""
    size = gathered.shape[0]
    parts = []
    for r in range(size):
        rows = vocab_range(vocab_size, r, size)
        parts.append(gathered[r, :, :len(rows)])
    return np.concatenate(parts, axis=1)
