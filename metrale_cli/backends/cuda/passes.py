"""engine/loop.py's ops on the GPU: the rows path (fused kernels, graph-capturable) and the prefill path.

`RowsPass` (decode, verify, short prefills: M <= MAX_ROWS rows) writes into the engine's preallocated
buffers and launches only metrale's own kernels, so a whole pass can be captured once as a CUDA graph:
the norm before a projection runs inside the GEMV that consumes it, the o/down projections add into the
residual stream in their epilogue, rope + KV append are one launch. `PrefillPass` (long prompts, eager)
runs cuBLAS GEMMs and tensor-core flash attention over freshly allocated chunk buffers.  A pass reaches the
engine through its public parts: its buffers (buffers.py), its projections (projections.py, the one place a
weight meets activations), its kernels and stream; each layer's mixer ops come from the layer's mixer kind
(engine/mixers.py; the attention kind's in attention.py) over the engine's state of that kind.

Both keep the fused path untouched when a tap observer is set: the tapped value of a fused projection
(`self_attn`, `mlp` before the residual add) is computed by a second, non-accumulating launch of the same
kernel beside it, and copied to the host for the observer.

The family features of models/spec.py run in the same kernels: the (1 + w) norm offset in every norm
and fused norm prologue, the embedding scale in the gather, gelu_tanh as the gated MLP's gate
activation, partial rotary and longrope's attention factor in rope_kv_append, the window (only the
keys some row sees are read) and the score softcap in both attention kernels, and the sandwich post-norms
as a projection into `h` followed by one norm-and-add launch (rmsnorm_add).  What the kernels lack is
refused before any pass runs (loading.unsupported_features).

`FusedRowsPass` (engine path "fused", `CudaEngine.set_path`) is RowsPass with one launch fewer per layer:
rope + KV append in the attention split kernel (one row) or in the qkv GEMV's epilogue (verify; the pass
records the qkv projection's operands for attention.FusedRowsAttention); `fused_plan` is the one place that
decides what it fuses for a row count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ...engine.mixers import mixer_kind
from ...errors import DeviceError
from .moe_passes import PrefillMoe, RowsMoe
from .projections import weight_format

if TYPE_CHECKING:
    from ...config import ModelConfig
    from ...engine.ops import Tap
    from ...models.spec import Norm, Rope
    from ...models.weights import Weights
    from .buffers import Buffers
    from .moe_passes import MoeState
    from .projections import Projections


class PassEngine(Protocol):
    """What a pass reads of its engine (engine.CudaEngine is one): the passes talk to these public parts only."""

    cp: Any  # the CuPy module
    kern: Any  # kernels.Kernels
    stream: Any  # the engine's stream: every launch of a pass goes there
    cfg: ModelConfig
    w: Weights
    max_context: int
    length: int  # positions cached before this pass
    buffers: Buffers  # the rows path's preallocated activations (buffers.py)
    proj: Projections  # every projection (projections.py)
    states: dict[str, Any]  # each mixer kind's state (engine/mixers.py)
    moe: MoeState | None  # the sparse layers' buffers and kernels
    tp: Any  # parallel/comm.ParallelRank of a tensor-parallel rank, else None
    tpk: Any  # kernels.tp.TpKernels under tp

    def inv_freq(self, rope: Rope) -> Any: ...  # the rope's inverse frequencies on the device
    def oom(self, what: str, nbytes: int) -> DeviceError: ...  # the DeviceError of an out-of-memory


def _check_activation(activation: str) -> None:
    from .kernels.tuning import ACTIVATIONS

    if activation not in ACTIVATIONS:
        raise DeviceError(f"the CUDA kernels have no fused gated MLP for activation '{activation}'")


def _share(e: PassEngine, bias):
    """A row-parallel projection's bias on a tensor-parallel rank: added once, by rank 0."""
    return bias if e.tp.rank == 0 else None


def _never(w) -> bool:
    return False


def _no_buffers(m: int) -> dict:
    return {}


class _Pass:
    kind = ""  # which ops a mixer kind's CUDA module gives this pass: "rows", "fused" or "prefill"

    def __init__(self, engine: PassEngine, tap: Tap | None) -> None:
        self.e, self.k, self.s = engine, engine.kern, engine.stream
        self._tap = tap
        self._mixers: dict[str, Any] = {}

    def mixer(self, layer: int):
        """Layer `layer`'s mixer ops for this pass (engine/mixers.py), over the engine's state of its kind."""
        kind = self.e.cfg.definition.layers[layer].mixer.kind
        if kind not in self._mixers:
            self._mixers[kind] = mixer_kind(kind).backend("cuda").ops(self, self.e.states[kind])
        return self._mixers[kind]

    def tap(self, name: str, x: Any) -> None:
        if self._tap is not None:
            self.s.synchronize()
            self._tap(name, x.get(stream=self.s))

    def add_reduced(self, residual: Any, accumulate: Any) -> Any:
        """residual += the sum over the ranks of what accumulate(residual) adds on each (a row-parallel
        projection, a rank's experts): rank 0 alone keeps the residual stream, every rank adds its partial
        sum, the all-reduce sums them.  Without --tp: just accumulate(residual)."""
        tp = self.e.tp
        if tp is not None and tp.rank != 0:
            residual.fill(0)
        accumulate(residual)
        if tp is not None:
            tp.comm.all_reduce(residual, self.s)
        return residual


class RowsPass(RowsMoe, _Pass):
    """m rows at positions io[1, :m] (device): every launch is capturable, every buffer preallocated."""

    kind = "rows"

    def __init__(self, engine: PassEngine, m: int, tap: Tap | None = None) -> None:
        super().__init__(engine, tap)
        b = engine.buffers
        self.m = m
        self.ids, self.pos = b.io[0, :m], b.io[1, :m]
        self.buffers = {"x": b.x[:m], "h": b.h[:m], "qkv": b.qkv[:m]}
        for st in engine.states.values():  # a mixer kind's own projection outputs (linear attention's lin_in, MLA's q)
            self.buffers.update(getattr(st, "rows_buffers", _no_buffers)(m))

    def embed(self, table, scale=None):
        x = self.buffers["x"]
        if self.e.tp is not None:  # vocabulary-parallel: this rank's rows, zeros elsewhere, summed
            self.e.tpk.vocab_embedding(self.ids, table, x, self.e.tp.vocab.start, scale=scale, stream=self.s)
            self.e.tp.comm.all_reduce(x, self.s)
            return x
        self.k.embedding(self.ids, table, x, scale=scale, stream=self.s)
        return x

    def linear(self, x, w, bias=None, *, out, norm=None, residual=None, tap=None, reduce=False):
        if reduce and self.e.tp is not None:
            return self._reduced(x, w, bias, out, residual, tap)
        nw, eps, off = (norm[0], norm[1].eps, norm[1].offset) if norm is not None else (None, 1e-6, 0.0)
        if tap is not None and self._tap is not None and residual is not None:  # the value before the add
            y = self.e.cp.empty((self.m, w.shape[0]), self.e.cp.float32)
            self.e.proj.linear(x, w, y, bias, norm_weight=nw, eps=eps, norm_offset=off)
            self.tap(tap, y)
        target = residual if residual is not None else self.buffers[out]
        self.e.proj.linear(x, w, target, bias, accumulate=residual is not None, norm_weight=nw, eps=eps, norm_offset=off)
        if tap is not None and residual is None:  # a sandwich block's projection: its own output is the value
            self.tap(tap, target)
        return target

    def _reduced(self, x, w, bias, out, residual, tap):
        """A row-parallel projection on a tensor-parallel rank (engine.py's docstring): the partial sum
        all-reduced before anything reads it."""
        e, comm = self.e, self.e.tp.comm
        bias = _share(e, bias)
        if residual is None:  # a sandwich block's projection: summed, then its post-norm adds it
            y = self.buffers[out]
            e.proj.linear(x, w, y, bias)
            comm.all_reduce(y, self.s)
            if tap is not None:
                self.tap(tap, y)
            return y
        if tap is not None and self._tap is not None:  # the summed value before the add, on the side
            y = e.cp.empty((self.m, w.shape[0]), e.cp.float32)
            e.proj.linear(x, w, y, bias)
            comm.all_reduce(y, self.s)
            self.tap(tap, y)
        return self.add_reduced(residual, lambda r: e.proj.linear(x, w, r, bias, accumulate=True))

    def norm(self, x, weight, norm: Norm, *, out, residual=None, tap=None):
        if residual is None:
            y = self.buffers[out]
            self.k.rmsnorm(x, weight, norm.eps, y, offset=norm.offset, stream=self.s)
            return y
        if tap is not None and self._tap is not None:  # the normed value before the add, on the side
            y = self.e.cp.empty_like(x)
            self.k.rmsnorm(x, weight, norm.eps, y, offset=norm.offset, stream=self.s)
            self.tap(tap, y)
        self.k.rmsnorm_add(x, weight, norm.eps, residual, offset=norm.offset, stream=self.s)
        return residual

    def gated_mlp(self, x, w_gate_up, *, norm, activation):
        _check_activation(activation)
        act = self.e.buffers.act[:self.m]
        self.e.proj.linear(x, w_gate_up, act, swiglu=True, norm_weight=norm[0], eps=norm[1].eps,
                           norm_offset=norm[1].offset, activation=activation)
        return act


# Why the fused path rotates one row in the attention kernel, not in the qkv GEMV.
ROPE_IN_ATTENTION = "one row: rope + KV append run in the attention split kernel where Kernels.rope_fits"


def fused_plan(engine: PassEngine, m: int) -> dict[str, str | None]:
    """What the fused rows path fuses for m rows, decided here and only here: {op: None (fused) or why
    it runs the rows path's launches instead}.  "qkv_rope": the qkv GEMV with rope + KV append in its
    epilogue (gemv_qkv_rope), from 2 rows on (one row: rope + KV append in the attention split kernel instead,
    per layer where Kernels.rope_fits, else rope_kv_append).  Every model feature of the rows path is in the
    fused kernels (they call the same rope code: partial rotary, longrope factors, q/k norms, qkv bias, every
    head_dim)."""
    return {"qkv_rope": ROPE_IN_ATTENTION if m == 1 else engine.kern.qkv_rope_fusable(m)}


class FusedRowsPass(RowsPass):
    """The rows path with fewer launches per layer (engine path "fused").  One row (decode): the attention split
    kernel rotates q itself and appends k/v to the cache (attention_decode with `rope`) where Kernels.rope_fits
    (tensor-core head dims, no window / softcap), so per dense layer: qkv, attention split (+ rope + append),
    combine, o(+=), gate_up(norm, act), down(+=) = 6 launches (rows: 7).  From 2 rows (verify): the qkv GEMV
    (norm fused) also rotates q/k and appends k/v in the block that finishes each head (gemv_qkv_rope).
    The deferred launches: `linear(out="qkv")` of an attention layer records its operands and the mixer's
    `rope_kv_append` launches the fused GEMV (2+ rows), or `rope_kv_append` records the rope and `attention`
    launches it (one row): attention.FusedRowsAttention; decoder_forward always calls them in that order.  A
    sparse layer runs as on the rows path.  Values equal the rows path's within fp32 rounding (the same rope
    code, rope_kv_slot; the same GEMV), which tests/gpu/test_fused_path.py checks."""

    kind = "fused"

    def __init__(self, engine: PassEngine, m: int, tap: Tap | None = None) -> None:
        super().__init__(engine, m, tap)
        self.plan = fused_plan(engine, m)
        self._qkv_args = None

    def linear(self, x, w, bias=None, *, out, norm=None, residual=None, tap=None, reduce=False):
        if (out == "qkv" and residual is None and norm is not None and tap is None and self.plan["qkv_rope"] is None
                and self._fused_qkv(w)):
            self._qkv_args = (x, w, bias, norm)
            return self.buffers["qkv"]  # written by the fused launch in the mixer's rope_kv_append
        return super().linear(x, w, bias, out=out, norm=norm, residual=residual, tap=tap, reduce=reduce)

    def _fused_qkv(self, w) -> bool:
        """Whether some mixer kind's fused ops launch this qkv projection themselves (the attention kind's:
        attention.KVCache.fuses_qkv); another kind's qkv is projected here."""
        return weight_format(w) == "bf16" and any(getattr(st, "fuses_qkv", _never)(w) for st in self.e.states.values())

    def take_qkv(self):
        """The qkv projection's operands (x, w, bias, norm) that `linear` recorded instead of launching, for the
        mixer's fused qkv + rope launch (once), or None when it launched the projection itself."""
        args, self._qkv_args = self._qkv_args, None
        return args


class PrefillPass(PrefillMoe, _Pass):
    """T tokens at positions length..length+T-1 (eager): cuBLAS GEMMs, flash attention, chunk buffers."""

    kind = "prefill"

    def __init__(self, engine: PassEngine, ids: np.ndarray, tap: Tap | None = None) -> None:
        super().__init__(engine, tap)
        cp, cfg = engine.cp, engine.cfg
        self.t, self.start = len(ids), engine.length
        t = self.t
        try:
            self.ids = cp.asarray(ids.astype(np.int32))
            self.pos = cp.arange(self.start, self.start + t, dtype=cp.int32)
            self.x = cp.empty((t, cfg.hidden_size), cp.float32)
            self.h = cp.empty_like(self.x)  # every norm's output (consumed before the next norm)
            self.attn = cp.empty((t, cfg.num_attention_heads, cfg.head_dim), cp.float32)
            self.q = cp.empty((t, cfg.num_attention_heads, cfg.head_dim), cp.float32)
        except cp.cuda.memory.OutOfMemoryError:
            raise engine.oom(f"prefilling {t} tokens", t * cfg.hidden_size * 16) from None

    def embed(self, table, scale=None):
        if self.e.tp is not None:  # vocabulary-parallel, as RowsPass.embed
            self.e.tpk.vocab_embedding(self.ids, table, self.x, self.e.tp.vocab.start, scale=scale, stream=self.s)
            self.e.tp.comm.all_reduce(self.x, self.s)
            return self.x
        self.k.embedding(self.ids, table, self.x, scale=scale, stream=self.s)
        return self.x

    def linear(self, x, w, bias=None, *, out, norm=None, residual=None, tap=None, reduce=False):
        if reduce and self.e.tp is not None:
            return self._reduced(x, w, bias, residual, tap)
        if norm is not None:
            x = self.norm(x, norm[0], norm[1], out="h")
        if residual is None:  # a sandwich block's projection, or qkv / gate_up: its own output
            y = self.e.proj.gemm(x, w, bias)
            if tap is not None:
                self.tap(tap, y)
            return y
        if tap is not None and self._tap is not None:  # the value before the residual add, on the side
            self.tap(tap, self.e.proj.gemm(x, w, bias))
        return self.e.proj.gemm(x, w, bias, accumulate_into=residual)

    def _reduced(self, x, w, bias, residual, tap):
        """RowsPass._reduced with cuBLAS: the partial sum all-reduced before anything reads it."""
        e, comm = self.e, self.e.tp.comm
        bias = _share(e, bias)
        if residual is None:
            y = e.proj.gemm(x, w, bias)
            comm.all_reduce(y, self.s)
            if tap is not None:
                self.tap(tap, y)
            return y
        if tap is not None and self._tap is not None:
            y = e.proj.gemm(x, w, bias)
            comm.all_reduce(y, self.s)
            self.tap(tap, y)
        return self.add_reduced(residual, lambda r: e.proj.gemm(x, w, bias, accumulate_into=r))

    def norm(self, x, weight, norm: Norm, *, out, residual=None, tap=None):
        if residual is None:  # into h; a norm of another width (the latent attention's q_a_norm): its own buffer
            y = self.h if x.shape == self.h.shape else self.e.cp.empty(x.shape, self.e.cp.float32)
            self.k.rmsnorm(x, weight, norm.eps, y, offset=norm.offset, stream=self.s)
            return y
        if tap is not None and self._tap is not None:  # the normed value before the add, on the side
            self.k.rmsnorm(x, weight, norm.eps, self.h, offset=norm.offset, stream=self.s)
            self.tap(tap, self.h)
        self.k.rmsnorm_add(x, weight, norm.eps, residual, offset=norm.offset, stream=self.s)
        return residual

    def gated_mlp(self, x, w_gate_up, *, norm, activation):
        _check_activation(activation)
        gu = self.linear(x, w_gate_up, out="gate_up", norm=norm)
        act = self.e.cp.empty((self.t, gu.shape[1] // 2), self.e.cp.float32)
        self.k.swiglu(gu, act, activation=activation, stream=self.s)
        return act
