"""The CUDA engine: the NumPy engine's passes on an NVIDIA GPU through CuPy and metrale's own kernels.

Weights live on the device in bf16 (stored as uint16 bit patterns; F32/F16 checkpoints are rounded at
load), activations in fp32, the KV cache in bf16 [layers, kv_heads, context, head_dim].

Two paths:
- rows path (decode M=1, verify and short prefills M<=16): metrale's own kernels (the ring GEMV for a
  one-row projection where it fits, else the fp32-FMA GEMV below GEMV_TC_MIN_ROWS rows and the tensor-core
  GEMV from there on; flash-decoding attention), no cuBLAS, no host reads, so each (kind, M) is captured
  once as a CUDA graph and replayed; token ids and positions are read from a small device buffer that one
  async copy fills before each replay.
- prefill path (longer prompts): cuBLAS GEMMs (bf16 operands, fp32 output) and tensor-core flash
  attention, in chunks, eagerly.
The residual stream `x` is updated in place by the o_proj/down_proj GEMVs (accumulate), so each layer
is: norm, qkv GEMV, rope (+qk norm), KV append, attention, o GEMV(+=), norm, gate/up GEMV with SwiGLU,
down GEMV(+=).  On the rows path the two norms run inside the GEMVs that consume them (fused RMSNorm
prologue) and rope + KV append are one launch: per layer qkv GEMV(norm), rope_kv_append, attention
(2 launches), o GEMV(+=), gate/up GEMV(norm, SwiGLU), down GEMV(+=).  A sandwich block (Gemma) instead
projects o and down into `h` and adds each through its post-norm (rmsnorm_add): two launches more per
layer.  Each layer's mixer runs through its mixer kind's CUDA module (engine/mixers.py; attention.py for
attention, whose state is the bf16 KV cache).  Longrope's factor set lives in the inv_freq buffers,
rewritten (and the cache recomputed) when a call switches sets, so the captured graphs stay valid.

Tensor parallelism (parallel/): built with `tp`, the engine is one rank - its shard's weights, heads and
vocabulary rows, its own KV heads - and the passes add the collectives on the engine's stream, captured
in the same graphs: the embedding is vocabulary-parallel (vocab_embedding, all-reduce), and each
row-parallel projection (o, down) is all-reduced before anything reads the residual stream - rank 0
adds its partial sum (and the bias) into x as the plain engine does, the other ranks into a zeroed x,
and the all-reduce of x gives every rank x + the sum of the partial sums. With one rank that is the
plain pass plus an identity all-reduce, bit for bit. A decode step also gathers each rank's argmax
candidate (tp.cu) inside its graph. Without `tp` none of this is on the path.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ...config import ModelConfig
from ...engine.longrope import has_longrope, long_factors
from ...engine.loop import decoder_forward
from ...engine.ops import Tap
from ...engine.mixers import kinds_of, mixer_kind
from ...engine_base import EngineBase
from ...errors import DeviceError, UsageError
from ...logits import DevicePtr
from ...models.weights import Weights
from .buffers import MAX_ROWS, Buffers, oom_error
from .graphs import RowsGraphs
from .moe_passes import MoeState
from .passes import FusedRowsPass, PrefillPass, RowsPass, fused_plan
from .paths import BASE_PATH, check_path
from .projections import Projections

PREFILL_CHUNK = 2048  # tokens per eager prefill chunk (bounds the activation buffers)


class CudaEngine(EngineBase):
    """Prefill, decode, verify and trim on the GPU behind the ModelLogits interface: the passes' orchestration
    (passes.py) over the engine's buffers (buffers.py), projections (projections.py), mixer states
    (`states`: per mixer kind, its CUDA module's state of its layers) and captured graphs (graphs.py)."""

    device = "cuda"

    def __init__(self, cfg: ModelConfig, weights: Weights, kern, max_context: int,
                 fp32_logits: bool = False, use_graphs: bool = True, tp=None) -> None:
        cp = kern.cp
        self.cp, self.kern, self.cfg, self.w = cp, kern, cfg, weights
        self.max_context = max_context
        self.length = 0
        self.use_graphs = use_graphs
        self._fp32_logits = fp32_logits
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.tp = tp  # parallel/comm.ParallelRank when this engine is one rank of a group, else None
        V = weights.lm_head.shape[0]  # logits width: a rank's vocabulary rows under tp
        try:
            # each mixer kind's state of its layers (engine/mixers.py): the bf16 KV cache for attention
            self.states = {kind: mixer_kind(kind).backend("cuda").state(self, layers)
                           for kind, layers in kinds_of(cfg.definition.layers).items()}
            self.buffers = Buffers(cp, kern, cfg, max_context, V, fp32_logits)
            # RoPE inverse frequencies per distinct rope of the definition (uploaded before any capture)
            # (longrope: the buffer holds the factor set of the current call, engine/longrope.py; the
            # captured graphs read whatever it holds)
            self._inv_freq = {layer.mixer.rope: cp.asarray(layer.mixer.rope.inv_freq())
                              for layer in cfg.definition.layers if hasattr(layer.mixer, "rope")}
            # the sparse layers' buffers and kernels
            self.moe = MoeState(cp, cfg, kern) if cfg.moe is not None else None
            if tp is not None:
                from .kernels.tp import TpKernels

                tp.stream = self.stream  # the collectives and the gathers run on the engine's stream
                self.tpk = TpKernels(kern)  # compiled now: never during a graph capture
                self._tp_decode_pairs = cp.zeros((1, 2), cp.float32)  # (value, index) of this rank's argmax
                self._tp_decode_gathered = cp.zeros((tp.size, 1, 2), cp.float32)  # every rank's, in the graph
        except cp.cuda.memory.OutOfMemoryError:
            need = Buffers.nbytes_estimate(cfg, max_context, V)
            raise oom_error(cp, f"allocating the KV cache for {max_context} positions", need) from None
        b = self.buffers
        self.proj = Projections(cp, kern, self.stream, weights.lm_head, cfg.definition.final_logit_softcap)
        self._logits = b.rows_logits  # the buffer the last prefill/verify pass wrote
        self._decode_logits = b.decode_logits
        self._hidden = b.hidden
        # The uploads and the zero fills above ran on the legacy default stream, which a non-blocking
        # stream does not wait for: without this, the first passes can read weights still in flight.
        cp.cuda.Device().synchronize()
        # Programmatic dependent launch on the rows path (sm_90+; set_pdl): each kernel's blocks start while the
        # kernel before drains (the ring GEMV requests its first weights before pdl_wait).
        self.graphs = RowsGraphs(self.stream, kern, bool(getattr(kern, "pdl_supported", False)))
        # The rows path (paths.ROWS_PATHS): BASE_PATH until set_path (load_cuda_engine takes DEFAULT_PATH there).
        self.path = BASE_PATH
        self._long_logits = None  # [rows, V] for long prefills, grown on demand
        self._decode_amax_fresh = False
        # longrope (engine/longrope.py): the cached tokens, to recompute the cache when a call switches
        # factor sets, and the set the cache was computed with
        self._longrope = has_longrope(cfg.definition)
        self._tokens = np.zeros(max_context, np.int64)
        self._cache_long = False

    @property
    def use_pdl(self) -> bool:
        """Whether the rows path launches with programmatic dependent launch."""
        return self.graphs.use_pdl

    def set_pdl(self, enabled: bool) -> None:
        """Turn programmatic dependent launch on the rows path on or off (recaptures the graphs)."""
        self.synchronize()
        self.graphs.use_pdl = bool(enabled) and bool(getattr(self.kern, "pdl_supported", False))
        self.graphs.clear()

    def set_path(self, path: str) -> None:
        """Take the rows path `path` (paths.ROWS_PATHS) for decode / verify / short prefills from the next
        call on (recaptures the graphs; the KV cache and length are kept).  "fused" compiles its kernel module
        (kernels.names.fused_name_expressions) and allocates its last-block counters the first time."""
        path = check_path(path)
        if self.tp is not None and path != BASE_PATH:
            raise UsageError(f"the CUDA '{path}' path does not run under --tp yet (a rank runs the {BASE_PATH} path)")
        self.synchronize()
        if path == "fused" and self.buffers.qkv_counters is None:
            cp, cfg = self.cp, self.cfg
            try:
                self.kern.load_fused()
            except Exception as e:
                raise DeviceError(f"cannot compile the fused rows-path kernels ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''})") from None
            attention = [layer.mixer for layer in cfg.definition.layers if layer.mixer.kind == "attention"]
            slots = max((a.num_heads + 2 * a.num_kv_heads for a in attention), default=1)
            self.buffers.qkv_counters = cp.zeros((slots,), cp.int32)
            cp.cuda.Device().synchronize()  # the zero fills ran on the legacy stream
        self.path = path
        self.graphs.clear()

    def fused_plan(self, m: int = 1) -> dict[str, str | None]:
        """What the fused path fuses for m rows ({op: None or why not}; passes.fused_plan)."""
        return fused_plan(self, m)

    def check_fused(self) -> None:
        """On the fused path: raise DeviceError unless every last-block counter is back at zero (a launch
        whose block count went wrong leaves one non-zero, and its outputs unwritten).  Synchronises.  The
        engine checks after the eager warm-up of every graph it captures; tests and bench after their runs."""
        counters = self.buffers.qkv_counters
        if self.path != "fused" or counters is None:
            return
        self.synchronize()
        try:
            self.kern.check_counters(counters, "fused qkv + rope GEMV")
        except RuntimeError as e:
            raise DeviceError(f"the fused rows path went wrong: {e}") from None

    # -- passes --------------------------------------------------------------------------------------
    def synchronize(self) -> None:
        self.stream.synchronize()

    def decode(self, token: int) -> None:
        self._check_tokens([token])
        self._begin_call(1)
        self._run_rows([token], "decode")

    def verify(self, tokens: Sequence[int]) -> int:
        ids = self._check_tokens(tokens)
        self._begin_call(len(ids))
        if len(ids) > MAX_ROWS:  # beyond the GEMV kernels' rows: the cuBLAS path, all rows kept
            return self._prefill_long(ids, all_logits=True)
        self._run_rows(ids, "rows")
        self._n_rows = len(ids)
        return len(ids)

    def prefill(self, tokens: Sequence[int], all_logits: bool = False) -> int:
        ids = self._check_tokens(tokens)
        self._begin_call(len(ids))
        if len(ids) <= MAX_ROWS:  # short prompts take the graph path: the same pass as verify
            self._run_rows(ids, "rows")
            if all_logits:
                self._n_rows = len(ids)
                return len(ids)
            with self.stream:
                self._logits[0] = self._logits[len(ids) - 1]
            self._n_rows = 1
            self._hidden_rows = self.buffers.h[len(ids) - 1:len(ids)]  # the row behind that logits row
            return 1
        return self._prefill_long(ids, all_logits)

    def inv_freq(self, rope):
        return self._inv_freq[rope]

    def _begin_call(self, n: int) -> None:
        """longrope: put the factor set of a call of n tokens in the inv_freq buffers and, when the cache
        was computed with the other set, recompute it from the cached tokens first (engine/longrope.py)."""
        if not self._longrope:
            return
        long = long_factors(self.cfg.definition, self.length + n)
        if long == self._cache_long:
            return
        self._cache_long = long
        for rope, buf in self._inv_freq.items():
            if rope.longrope is not None:
                buf.set(rope.inv_freq(long), stream=self.stream)
        prefix, self.length = self._tokens[:self.length].copy(), 0
        tap, self.tap = self.tap, None  # a cache recomputation is not the caller's pass: not observed
        try:
            if len(prefix) > MAX_ROWS:
                self._prefill_long(prefix, all_logits=False)
            elif len(prefix):
                self._run_rows(prefix, "rows")
        finally:
            self.tap = tap

    def oom(self, what: str, nbytes: int) -> DeviceError:
        return oom_error(self.cp, what, nbytes)

    # -- the rows path (graph-captured) ---------------------------------------------------------------
    def _advance_states(self, rows: int, every: bool) -> None:
        """Before a pass of `rows` tokens: the host's bookkeeping of the mixer states that keep some
        (linear_attention.LinearStates.advance: which ring slots the pass reads and writes); `every`: the rows
        path, which keeps the state after every row. Nothing of it runs on replay, so it is done here."""
        for st in self.states.values():
            advance = getattr(st, "advance", None)
            if advance is not None:
                advance(self.length, rows, every)

    def _run_rows(self, ids: Sequence[int], kind: str) -> None:
        m, b = len(ids), self.buffers
        self._advance_states(m, True)
        b.stage_rows(ids, self.length, self.stream)
        if self.tap is not None:  # observed: the same launches eagerly, the taps computed beside them
            with self.stream:
                self._rows_body(m, kind, self.tap)
        elif not self.use_graphs:
            with self.stream:
                self.graphs.with_pdl(lambda: self._rows_body(m, kind))
        else:
            self.graphs.run((kind, m), lambda: self._rows_body(m, kind), self.check_fused)
        self._tokens[self.length:self.length + m] = ids
        self.length += m
        self._hidden_rows = b.h[:m]  # post-final-norm rows of this pass (hidden_rows_ptr)
        self._decode_amax_fresh = kind == "decode"
        if kind == "rows":
            self._logits = b.rows_logits

    def _rows_body(self, m: int, kind: str, tap: Tap | None = None) -> None:
        """The whole forward of m rows at positions io[1, :m] (engine/loop.py over RowsPass); every launch
        is capturable. Then lm_head into the decode or rows logits buffer."""
        cfg, k, w, s, b, proj = self.cfg, self.kern, self.w, self.stream, self.buffers, self.proj
        rows_pass = FusedRowsPass if self.path == "fused" else RowsPass
        h = decoder_forward(rows_pass(self, m, tap), cfg.definition, w)
        b.hidden[0] = h[m - 1]
        out = b.decode_logits if kind == "decode" else b.rows_logits[:m]
        if self._fp32_logits:
            proj.linear(h, w.lm_head, out)
            proj.softcap_logits(out)
        else:
            proj.linear(h, w.lm_head, b.logits32[:m])
            proj.softcap_logits(b.logits32[:m])
            k.f32_to_bf16(b.logits32[:m], out, stream=s)
        if kind == "decode":
            k.argmax(out, b.decode_amax, workspace=b.amax_ws[1], stream=s)
            if self.tp is not None:  # the distributed argmax's candidates, gathered inside the step
                self.tpk.argmax_pairs(out, b.decode_amax, self._tp_decode_pairs, self.tp.vocab.start, stream=s)
                self.tp.comm.all_gather(self._tp_decode_pairs, self._tp_decode_gathered, s)

    # -- the prefill path (cuBLAS, eager) -------------------------------------------------------------
    def _prefill_long(self, ids: np.ndarray, all_logits: bool) -> int:
        cp = self.cp
        rows, hidden = [], []
        with self.stream:
            for start in range(0, len(ids), PREFILL_CHUNK):
                chunk = ids[start:start + PREFILL_CHUNK]
                last = start + PREFILL_CHUNK >= len(ids)
                h = self._prefill_chunk(chunk, self.tap)
                if all_logits:
                    rows.append(self.proj.lm_head_rows(h))
                    hidden.append(h)
                elif last:
                    rows.append(self.proj.lm_head_rows(h[-1:]))
                    hidden.append(h[-1:])
            logits = rows[0] if len(rows) == 1 else cp.concatenate(rows, axis=0)
            self._hidden_rows = hidden[0] if len(hidden) == 1 else cp.concatenate(hidden, axis=0)
            n = logits.shape[0]
            if self._long_logits is None or self._long_logits.shape[0] < n:
                self._long_logits = cp.empty((n, logits.shape[1]), self.buffers.rows_logits.dtype)
            self._logits = self._long_logits
            if self._fp32_logits:
                self._logits[:n] = logits
            else:
                self.kern.f32_to_bf16(logits, self._logits[:n], stream=self.stream)
        self._n_rows = n
        return n

    def _prefill_chunk(self, ids: np.ndarray, tap: Tap | None = None):
        """One chunk of T tokens at positions length..length+T-1 (engine/loop.py over PrefillPass);
        returns post-final-norm rows [T, H]."""
        self._advance_states(len(ids), False)
        h = decoder_forward(PrefillPass(self, ids, tap), self.cfg.definition, self.w)
        self._tokens[self.length:self.length + len(ids)] = ids
        self.length += len(ids)
        self._hidden[0] = h[len(ids) - 1]
        return h

    # -- checks and LogitsBuffers hooks ---------------------------------------------------------------
    def _row_to_host(self, ptr: DevicePtr) -> np.ndarray:
        self.stream.synchronize()
        row = ptr._buffer[ptr.row].get()
        return row if row.dtype == np.float32 else row.view(np.uint16)

    def _argmax_rows(self, ptr: DevicePtr, n: int, stream: int) -> np.ndarray:
        if ptr._buffer is self._decode_logits and self._decode_amax_fresh and n == 1:
            self.stream.synchronize()
            return self.buffers.decode_amax.get()  # the decode graph already computed it on the device
        out = self.buffers.amax[:n] if n <= MAX_ROWS else self.cp.empty((n,), self.cp.int32)
        self.kern.argmax(ptr._buffer[ptr.row:ptr.row + n], out, workspace=self.buffers.amax_ws.get(n),
                         stream=self.stream)
        self.stream.synchronize()
        return out.get()

    def tp_argmax_pairs(self, rows):
        """A rank's candidates for the distributed argmax (parallel/comm.pick_argmax): [n, 2] fp32 of
        (value, global index) of each row's first maximum in this rank's range; (NaN, -1) for a row
        holding NaN or Inf. Enqueued on the engine's stream (no host sync)."""
        cp, n = self.cp, rows.shape[0]
        idx = cp.empty((n,), cp.int32)
        pairs = cp.empty((n, 2), cp.float32)
        self.kern.argmax(rows, idx, workspace=self.buffers.amax_ws.get(n), stream=self.stream)
        self.tpk.argmax_pairs(rows, idx, pairs, self.tp.vocab.start, stream=self.stream)
        return pairs


__all__ = ["CudaEngine", "MAX_ROWS", "PREFILL_CHUNK"]
