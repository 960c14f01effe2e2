"""Starting the ranks of `--tp N`: one process per GPU (or per NumPy engine with --device cpu).

metrale starts them itself: rank 0 is the CLI process; it spawns ranks 1..N-1 with multiprocessing's
spawn context (fresh interpreters: CUDA cannot survive a fork), each with its end of a pipe, the
`LoadSpec` of what to load, and the rendezvous of the communicator:
- cuda: rank 0 draws the NCCL unique id (cupy.cuda.nccl.get_unique_id) and hands it to every worker;
  rank r uses GPU r; each rank says "hello" before the (blocking) NCCL init, so rank 0 only joins a
  group whose workers are all alive;
- cpu: a shared-memory block and a multiprocessing barrier (parallel/comm.HostCommunicator).
Each rank reads its shard only (parallel/sharding.RankShard while loading), says "ready", and follows
rank 0's commands (parallel/protocol.py) until told to exit.

Failures do not hang: a watchdog thread on rank 0 waits on the workers' process sentinels; when one
dies (its "error" message, or its exit code, is the reason) the group is marked failed, a CPU group's
barrier is broken so rank 0's collective raises a DeviceError at once, and if rank 0 is still stuck after
a grace period (a GPU collective cannot be interrupted from the host) it prints the one-line device
error and exits with code 8. Each worker ignores SIGINT (Ctrl-C is rank 0's: it stops or exits, and the
workers follow) and exits as soon as rank 0's process is gone (a thread on its parent's sentinel).

Several hosts (not implemented here; the design extends): each host would start its ranks itself,
e.g. `METRALE_RANK=r METRALE_WORLD_SIZE=N METRALE_TP_RENDEZVOUS=/shared/fs/run1.id metrale ...`, with
the GPU picked as METRALE_RANK modulo the GPUs per host; rank 0 writes the NCCL unique id to the
rendezvous file (written to a temporary name, then renamed) and the others poll for it, then build the
same NcclCommunicator(N, id, r). The command channel would move from pipes to an NCCL broadcast of a
small int32 buffer per command (op code, argument count, token ids), which keeps the protocol's
messages unchanged; rank 0's watchdog would then rely on NCCL's own timeouts (NCCL_TIMEOUT-style
async error checks) instead of process sentinels.
"""

from __future__ import annotations

from pathlib import Path

import atexit
import multiprocessing as mp
import os
import signal
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Callable

from .. import errors
from ..errors import DeviceError, MetraleError
from .comm import HostCommunicator, NcclCommunicator, ParallelRank
from .engine import TensorParallelEngine
from .protocol import RankServer

HOST_SLOT_BYTES = 4 << 20  # CPU group: shared-memory bytes per rank (larger collectives go in pieces)
GRACE_S = 5.0  # how long rank 0 may stay stuck after a worker died before it exits on its own


@dataclass(frozen=True)
class LoadSpec:
    """What every rank loads (pickled to the workers)."""

    device: str  # "cuda" | "cpu"
    max_context: int
    fp32_logits: bool
    path: str | None = None  # a checkpoint (directory or file), or
    config: Any = None  # a ModelConfig with random weights (RandomTensors(config, seed))
    seed: int = 0
    compute: str = "fp32"  # the NumPy engine's precision (the CUDA engine is bf16)

    def source(self):
        if self.path is not None:
            from ..checkpoint import Checkpoint

            return Checkpoint.open(self.path)
        from ..random_weights import RandomTensors

        return RandomTensors(self.config, seed=self.seed)


def check_devices(device: str, n: int) -> None:
    """Refuse what cannot start before any process does: too few GPUs, no CuPy or NCCL."""
    if device != "cuda":
        return
    count, problem = gpu_status()
    if problem is not None:
        raise DeviceError(problem)
    if n > count:
        raise DeviceError(f"--tp {n} needs {n} CUDA devices, {count} visible")


def gpu_status() -> tuple[int, str | None]:
    """(CUDA devices visible, why --tp cannot use them or None)."""
    try:
        import cupy
        from cupy.cuda import nccl
    except Exception as e:
        return 0, f"--tp with --device cuda needs CuPy with NCCL ({type(e).__name__}: {e})"
    if not getattr(nccl, "available", True):
        return 0, ("--tp with --device cuda needs NCCL, which CuPy does not find: pip install nvidia-nccl-cu12 "
                   "(or -cu13, matching CuPy's CUDA)")
    return cupy.cuda.runtime.getDeviceCount(), None


def start(cfg, spec: LoadSpec, n: int, *, source=None, progress: Callable[[int], None] | None = None) -> TensorParallelEngine:
    """Spawn ranks 1..n-1, load rank 0's shard here, wait until every rank is ready; the engine of rank 0.
    `source`: rank 0's weight source when the caller has it open already (else spec.source())."""
    from .sharding import check_tp

    check_tp(cfg.definition, n)
    check_devices(spec.device, n)
    ctx = mp.get_context("spawn")
    workers = Workers(ctx, n, spec)
    try:
        rendezvous = workers.rendezvous()
        workers.spawn(rendezvous)
        workers.wait_for("hello")
        group = _group(spec, 0, n, cfg.vocab_size, rendezvous, workers.failure)
        workers.comm = group.comm
        engine = _load(cfg, spec, group, source if source is not None else spec.source(), progress)
        workers.wait_for("ready")
        return TensorParallelEngine(cfg, engine, RankServer(engine, group), workers)
    except BaseException:
        workers.close()
        raise


def _group(spec: LoadSpec, rank: int, n: int, vocab: int, rendezvous: tuple, failure: list[str]) -> ParallelRank:
    if spec.device == "cuda":
        import cupy

        cupy.cuda.Device(rank).use()
        return ParallelRank(NcclCommunicator(rank, n, rendezvous[1]), rank, n, vocab, xp=cupy, failure=failure)
    _, shm_name, barrier = rendezvous
    comm = HostCommunicator(rank, n, shm_name, barrier, HOST_SLOT_BYTES, failure)
    return ParallelRank(comm, rank, n, vocab, failure=failure)


def _load(cfg, spec: LoadSpec, group: ParallelRank, source, progress):
    if spec.device == "cuda":
        from ..backends.cuda.loading import load_cuda_engine

        return load_cuda_engine(cfg, source, spec.max_context, spec.fp32_logits, progress, tp=group)
    from ..backends.numpy.engine import load_numpy_engine

    return load_numpy_engine(cfg, source, spec.max_context, spec.fp32_logits, progress, tp=group,
                             compute=spec.compute)


class Workers:
    """Rank 0's handles on ranks 1..n-1: their processes, pipes and the watchdog."""

    def __init__(self, ctx, n: int, spec: LoadSpec) -> None:
        self.ctx, self.size, self.spec = ctx, n, spec
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.failure: list[str] = []  # shared with rank 0's ParallelRank / HostCommunicator
        self.comm = None
        self._block = None  # the CPU group's shared memory (rank 0 owns it)
        self._errors: dict[int, MetraleError] = {}  # why worker i failed (its message, or its exit)
        self._lock = threading.Lock()
        self._serving = False  # every rank ready: from now on rank 0 may be inside a collective
        self._closing = False
        self._done = threading.Event()
        atexit.register(self.close)

    def rendezvous(self) -> tuple:
        if self.spec.device == "cuda":
            from cupy.cuda import nccl

            return ("nccl", nccl.get_unique_id())
        self._block = HostCommunicator.create_block(self.size, HOST_SLOT_BYTES)
        return ("host", self._block.name, self.ctx.Barrier(self.size))

    def spawn(self, rendezvous: tuple) -> None:
        for rank in range(1, self.size):
            mine, theirs = self.ctx.Pipe()
            p = self.ctx.Process(target=worker_main, args=(rank, self.size, self.spec, theirs, rendezvous),
                                 name=f"metrale-tp-rank{rank}", daemon=True)
            p.start()
            theirs.close()
            self.procs.append(p)
            self.conns.append(mine)
        if self.procs:
            threading.Thread(target=self._watch, name="metrale-tp-watchdog", daemon=True).start()

    def wait_for(self, what: str) -> None:
        """Every worker's `what` message; a worker's error (or death) is raised here, as its own error."""
        pending = set(range(len(self.procs)))
        while pending:
            ready = wait([self.conns[i] for i in pending] + [self.procs[i].sentinel for i in pending])
            for i in list(pending):
                with self._lock:
                    msg = self._recv(i) if i not in self._errors else None
                    if msg is not None and msg[0] == what:
                        pending.discard(i)
                        continue
                    if msg is not None:
                        self._errors[i] = _error(msg, i + 1, self.procs[i])
                if i in self._errors or self.procs[i].sentinel in ready:
                    raise self._failed(i)
        self._serving = what == "ready"

    def send(self, op: str, args: tuple, observed: bool) -> None:
        self.check()
        for i, conn in enumerate(self.conns):
            try:
                conn.send(("call", op, args, observed))
            except OSError:
                self.procs[i].join(1.0)
                raise self._failed(i) from None

    def check(self) -> None:
        if self.failure:
            raise DeviceError(f"tensor parallelism: {self.failure[0]}")

    def close(self) -> None:
        """Tell every worker to exit, then make sure they have (terminate, kill); free the CPU block."""
        if self._closing:
            return
        self._closing = True
        if self.comm is not None and self.spec.device != "cuda" and self.procs:
            self.comm.abort()  # a worker stuck in a collective rank 0 left is released
        for conn in self.conns:
            try:
                conn.send(("exit",))
            except OSError:
                pass
        for p in self.procs:
            p.join(5.0)
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self.conns:
            conn.close()
        if self.comm is not None and hasattr(self.comm, "close"):
            self.comm.close()
        if self._block is not None:
            self._block.close()
            self._block.unlink()
            self._block = None
        self._done.set()
        atexit.unregister(self.close)

    def _recv(self, i: int):
        try:
            return self.conns[i].recv() if self.conns[i].poll() else None
        except (EOFError, OSError):
            return None

    def _failed(self, i: int) -> MetraleError:
        """Worker i's failure (read once: the watchdog and the main thread may both ask)."""
        with self._lock:
            if i not in self._errors:
                self._errors[i] = _error(self._recv(i), i + 1, self.procs[i])
            return self._errors[i]

    def _watch(self) -> None:
        """Wait for a worker's death; mark the group failed and unblock (or, after GRACE_S, end) rank 0."""
        sentinels = {p.sentinel: i for i, p in enumerate(self.procs)}
        died = wait(list(sentinels))
        if self._closing:
            return
        i = sentinels[died[0]]
        self.failure.append(str(self._failed(i)))
        if not self._serving:  # still loading: wait_for raises it (rank 0 is in no collective yet)
            return
        if self.comm is not None and self.spec.device != "cuda":
            self.comm.abort()  # rank 0's collective raises at once
        if not self._done.wait(GRACE_S) and not self._closing:
            sys.stderr.write(f"device error: tensor parallelism: {self.failure[0]}\n")
            sys.stderr.flush()
            os._exit(DeviceError.exit_code)


def _error(msg, rank: int, proc) -> MetraleError:
    """A worker's failure as the error its rank raised (same class, so the same exit code)."""
    if msg is not None and msg[0] == "error":
        code, text = msg[1], msg[2]
        cls = next((c for c in vars(errors).values()
                    if isinstance(c, type) and issubclass(c, MetraleError) and c.exit_code == code), MetraleError)
        return cls(f"rank {rank}: {text}")
    proc.join(0.5)
    return DeviceError(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")


# -- the worker process ------------------------------------------------------------------------------


def worker_main(rank: int, size: int, spec: LoadSpec, conn, rendezvous: tuple) -> None:
    """Rank `rank`'s process: join the group, load the shard, follow rank 0 until told to exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_with_parent, args=(parent.sentinel,), daemon=True).start()
    try:
        cfg = spec.config if spec.config is not None else _config(spec.path)
        conn.send(("hello", rank))
        group = _group(spec, rank, size, cfg.vocab_size, rendezvous, [])
        engine = _load(cfg, spec, group, spec.source(), None)
        conn.send(("ready", rank))
        server = RankServer(engine, group)
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                break
            if msg[0] == "exit":
                break
            _, op, args, observed = msg
            server.serve(op, args, observed)
    except BaseException as e:  # report it, then leave: rank 0's watchdog sees the exit
        code = e.exit_code if isinstance(e, MetraleError) else MetraleError.exit_code
        text = str(e) if isinstance(e, MetraleError) else f"{type(e).__name__}: {e}"
        try:
            conn.send(("error", code, text))
        except OSError:
            pass
        conn.close()
        os._exit(1)
    conn.close()


def _config(path: str):
    """The config of LoadSpec.path: a checkpoint directory, or a .safetensors / index file inside one."""
    from ..config import load_config

    p = Path(path)
    return load_config(p.parent if p.is_file() else p)


def _exit_with_parent(sentinel) -> None:
    wait([sentinel])
    os._exit(1)


__all__ = ["LoadSpec", "start", "check_devices", "worker_main"]
