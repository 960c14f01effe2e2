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
layer.  Sliding layers keep a full-length cache (the NumPy engine's ring buffer is not on the GPU yet);
their attention kernels read only the window.  Longrope's factor set lives in the inv_freq buffers,
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

import os
from typing import Any, Callable, Sequence

import numpy as np

from ...config import ModelConfig
from ...errors import DeviceError, NonFiniteLogitsError, UsageError
from ...engine_base import EngineBase, check_context
from ...logits import DevicePtr
from ...engine.longrope import has_longrope, long_factors
from ...engine.loop import Tap, decoder_forward
from ...models.spec import ModelDefinition, MoeSpec
from ...models.weights import WeightSource, Weights, check_checkpoint, load_weights
from .kernels.tuning import uses_tc
from .moe_passes import MoeState
from .passes import FusedRowsPass, PrefillPass, RowsPass, fused_plan

# The rows paths (`CudaEngine.set_path`, `load_cuda_engine(path=)`, METRALE_CUDA_PATH, `metrale bench --path`), both
# giving the same logits within fp32 summation order (tests/gpu/test_fused_path.py), both launching with
# programmatic dependent launch where the device has it:
# - "fused" (DEFAULT_PATH): FusedRowsPass, the rows path with one launch fewer per layer: rope + KV append in the
#   attention split kernel (one row) or in the qkv GEMV's last blocks (verify rows);
# - "rows" (BASE_PATH, the one path a tensor-parallel rank runs): RowsPass, every one-row projection on the ring GEMV
#   (gemv_ring.cu) where it fits (Kernels.ring_fits), so that a projection's blocks request their first weights
#   while the kernel before it drains.
ROWS_PATHS = ("rows", "fused")
DEFAULT_PATH = "fused"  # what load_cuda_engine gives one GPU (METRALE_CUDA_PATH or its `path` choose another)
BASE_PATH = "rows"  # what the constructor sets up, and the one path a tensor-parallel rank runs (verified under --tp)
PATH_ENV = "METRALE_CUDA_PATH"

MAX_ROWS = 16  # rows the GEMV path takes (decode, verify k <= 15 plus one, short prefills)
PREFILL_CHUNK = 2048  # tokens per eager prefill chunk (bounds the activation buffers)

CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1


def _cupy():
    try:
        import cupy
    except Exception as e:  # ImportError, or a CUDA library that fails to load
        raise DeviceError(f"--device cuda needs CuPy ({type(e).__name__}: {e})") from None
    return cupy


def _oom(cp, what: str, nbytes: int) -> DeviceError:
    free, total = cp.cuda.runtime.memGetInfo()
    need = f"needed {nbytes / 2**20:.0f} MiB more, " if nbytes else ""
    return DeviceError(f"CUDA out of memory {what}: {need}{free / 2**20:.0f} MiB free of {total / 2**20:.0f} MiB")


def upload_weights(cfg: ModelConfig, source: WeightSource, kern, progress: Callable[[int], None] | None = None,
                   rank: tuple[int, int] | None = None) -> Weights:
    """Read each tensor once from `source`, round it to bf16 and place it on the device, fusing
    multi-part params (q/k/v, gate/up) on the device. RandomTensors draw on the device directly.
    `rank` = (r, n): keep tensor-parallel rank r's shard (parallel/sharding.RankShard), each layer cut on
    the device as soon as it is uploaded."""
    cp = kern._cp
    if rank is None:  # refuse before reading anything when the bf16 weights cannot fit (a tp rank holds a share)
        need = cfg.definition.parameter_count() * 2  # what is read: not a checkpoint's vision tower, say
        free, total = cp.cuda.runtime.memGetInfo()
        if need > free:
            raise DeviceError(
                f"the weights need {need / 2**30:.1f} GiB in bf16 and the GPU has {free / 2**30:.1f} GiB free "
                f"of {total / 2**30:.1f} GiB: use a GPU with more memory, or split the model with --tp N")

    def get(name: str):
        info = source.info(name)
        nbytes = int(np.prod(info.shape)) * 2
        try:
            if source.draws_on_device:
                f32 = source.device_array(name, cp)
                out = cp.empty(f32.shape, cp.uint16)
                kern.f32_to_bf16(f32, out)
                del f32
            else:
                host = source.array(name)
                if info.dtype == "BF16":
                    out = cp.asarray(np.ascontiguousarray(host).view(np.uint16))
                else:  # F32/F16: round on the device, bit-identical to torch's rounding
                    f32 = cp.asarray(np.asarray(host, dtype=np.float32))
                    out = cp.empty(f32.shape, cp.uint16)
                    kern.f32_to_bf16(f32, out)
                    del f32
                source.release(name)
        except cp.cuda.memory.OutOfMemoryError:
            raise _oom(cp, f"loading {name}", nbytes) from None
        if progress is not None:
            progress(nbytes)
        return out

    def concat(parts):  # a fresh contiguous array (a shard's slice must not keep its whole tensor alive)
        return parts[0].copy() if len(parts) == 1 else cp.concatenate(parts, axis=0)

    shard = None
    if rank is not None:
        from ...parallel.sharding import RankShard

        shard = RankShard(cfg.definition, rank[0], rank[1], concat)
    try:
        return load_weights(cfg.definition, get, concat, shard=shard)
    except cp.cuda.memory.OutOfMemoryError:  # fusing parts (q/k/v, gate/up) or stacking experts: a copy's peak
        raise _oom(cp, "fusing the weights' parts on the device", 0) from None


class CudaEngine(EngineBase):
    """Prefill, decode, verify and trim on the GPU behind the ModelLogits interface."""

    device = "cuda"

    def __init__(self, cfg: ModelConfig, weights: Weights, kern, max_context: int,
                 fp32_logits: bool = False, use_graphs: bool = True, tp=None) -> None:
        cp = kern._cp
        self.cp, self.kern, self.cfg, self.w = cp, kern, cfg, weights
        self.max_context = max_context
        self.length = 0
        self.use_graphs = use_graphs
        self._fp32_logits = fp32_logits
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.tp = tp  # parallel/comm.ParallelRank when this engine is one rank of a group, else None
        L, nkv, d, H = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        V, R = weights.lm_head.shape[0], MAX_ROWS  # logits width: a rank's vocabulary rows under tp
        ldt = cp.float32 if fp32_logits else cp.uint16
        try:
            self._kc = cp.zeros((L, nkv, max_context, d), cp.uint16)  # bf16 K cache
            self._vc = cp.zeros((L, nkv, max_context, d), cp.uint16)  # bf16 V cache
            self._io = cp.zeros((2, R), cp.int32)  # row 0: token ids, row 1: positions (graph inputs)
            self._x = cp.zeros((R, H), cp.float32)  # residual stream
            self._h = cp.zeros((R, H), cp.float32)  # normed activations (rows path: final norm only)
            self._qkv = cp.zeros((R, cfg.q_size + 2 * cfg.kv_size), cp.float32)
            self._q = cp.zeros((R, cfg.num_attention_heads, d), cp.float32)  # rotated q when m > 1
            self._attn = cp.zeros((R, cfg.num_attention_heads, d), cp.float32)
            self._act = cp.zeros((R, cfg.intermediate_size), cp.float32)
            self._logits32 = cp.zeros((R, V), cp.float32)
            self._rows_logits = cp.zeros((R, V), ldt)  # rows-path output (fixed: graphs write here)
            self._logits = self._rows_logits  # the buffer the last prefill/verify pass wrote
            self._decode_logits = cp.zeros((1, V), ldt)
            self._hidden = cp.zeros((1, H), cp.float32)
            self._amax = cp.zeros((R,), cp.int32)
            self._decode_amax = cp.zeros((1,), cp.int32)  # argmax of the decode row, computed in the graph
            # the split argmax's workspaces, one per row count (n's counters are the first n elements,
            # where a smaller count's partials would lie; they start at zero and every launch leaves them so)
            self._amax_ws = {m: cp.zeros((max(1, kern.argmax_workspace_size(m, kern.argmax_blocks(m, V))),), cp.int32)
                             for m in range(1, R + 1)}
            # attention splits per row count (fixed in each captured graph; the length is read on the device)
            nh = cfg.num_attention_heads
            self._splits = {m: kern.decode_splits(max_context, nkv, m, nh, d) for m in range(1, R + 1)}
            ws = max(kern.decode_workspace_size(m, nh, d, s) for m, s in self._splits.items())
            self._ws = cp.zeros(ws, cp.float32)
            # RoPE inverse frequencies per distinct rope of the definition (uploaded before any capture)
            # (longrope: the buffer holds the factor set of the current call, engine/longrope.py; the
            # captured graphs read whatever it holds)
            self._inv_freq = {layer.mixer.rope: cp.asarray(layer.mixer.rope.inv_freq())
                              for layer in cfg.definition.layers}
            self._io_host = cp.cuda.alloc_pinned_memory(2 * R * 4)
            # the sparse layers' buffers and kernels
            self.moe = MoeState(cfg, kern) if cfg.moe is not None else None
            if tp is not None:
                from .kernels.tp import TpKernels

                tp.stream = self.stream  # the collectives and the gathers run on the engine's stream
                self.tpk = TpKernels(kern)  # compiled now: never during a graph capture
                self._tp_decode_pairs = cp.zeros((1, 2), cp.float32)  # (value, index) of this rank's argmax
                self._tp_decode_gathered = cp.zeros((tp.size, 1, 2), cp.float32)  # every rank's, in the graph
        except cp.cuda.memory.OutOfMemoryError:
            need = 2 * L * nkv * max_context * d * 2 + R * V * 8
            raise _oom(cp, f"allocating the KV cache for {max_context} positions", need) from None
        self._io_np = np.frombuffer(self._io_host, np.int32, 2 * R).reshape(2, R)
        # The uploads and the zero fills above ran on the legacy default stream, which a non-blocking
        # stream does not wait for: without this, the first passes can read weights still in flight.
        cp.cuda.Device().synchronize()
        self._graphs: dict[tuple[str, int], Any] = {}
        # Programmatic dependent launch on the rows path (sm_90+; set_pdl): each kernel's blocks start while the
        # kernel before drains (the ring GEMV requests its first weights before pdl_wait).
        self.use_pdl = bool(getattr(kern, "pdl_supported", False))
        # The rows path (ROWS_PATHS): BASE_PATH until set_path (load_cuda_engine takes DEFAULT_PATH there).  The
        # fused path's last-block counters are allocated when it is first taken.
        self.path = BASE_PATH
        self._qkv_counters = None
        self._long_logits = None  # [rows, V] for long prefills, grown on demand
        self._decode_amax_fresh = False
        # longrope (engine/longrope.py): the cached tokens, to recompute the cache when a call switches
        # factor sets, and the set the cache was computed with
        self._longrope = has_longrope(cfg.definition)
        self._tokens = np.zeros(max_context, np.int64)
        self._cache_long = False

    def set_pdl(self, enabled: bool) -> None:
        """Turn programmatic dependent launch on the rows path on or off (recaptures the graphs)."""
        self.synchronize()
        self.use_pdl = bool(enabled) and bool(getattr(self.kern, "pdl_supported", False))
        self._graphs.clear()

    def set_path(self, path: str) -> None:
        """Take the rows path `path` (ROWS_PATHS) for decode / verify / short prefills from the next
        call on (recaptures the graphs; the KV cache and length are kept).  "fused" compiles its kernel module
        (kernels.names.fused_name_expressions) and allocates its last-block counters the first time."""
        path = check_path(path)
        if self.tp is not None and path != BASE_PATH:
            raise UsageError(f"the CUDA '{path}' path does not run under --tp yet (a rank runs the {BASE_PATH} path)")
        self.synchronize()
        if path == "fused" and self._qkv_counters is None:
            cp, cfg = self.cp, self.cfg
            try:
                self.kern.load_fused()
            except Exception as e:
                raise DeviceError(f"cannot compile the fused rows-path kernels ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''})") from None
            slots = max(a.num_heads + 2 * a.num_kv_heads for a in (layer.mixer for layer in cfg.definition.layers))
            self._qkv_counters = cp.zeros((slots,), cp.int32)
            cp.cuda.Device().synchronize()  # the zero fills ran on the legacy stream
        self.path = path
        self._graphs.clear()

    def fused_plan(self, m: int = 1) -> dict[str, str | None]:
        """What the fused path fuses for m rows ({op: None or why not}; passes.fused_plan)."""
        return fused_plan(self, m)

    def check_fused(self) -> None:
        """On the fused path: raise DeviceError unless every last-block counter is back at zero (a launch
        whose block count went wrong leaves one non-zero, and its outputs unwritten).  Synchronises.  The
        engine checks after the eager warm-up of every graph it captures; tests and bench after their runs."""
        if self.path != "fused" or self._qkv_counters is None:
            return
        self.synchronize()
        try:
            self.kern.check_counters(self._qkv_counters, "fused qkv + rope GEMV")
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
            self._hidden_rows = self._h[len(ids) - 1:len(ids)]  # the row behind that logits row
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
        return _oom(self.cp, what, nbytes)

    # -- the rows path (graph-captured) ---------------------------------------------------------------
    def _run_rows(self, ids: Sequence[int], kind: str) -> None:
        m = len(ids)
        self._io_np[0, :m] = ids
        self._io_np[1, :m] = np.arange(self.length, self.length + m)
        self._io.set(self._io_np, stream=self.stream)  # async from pinned memory
        key = (kind, m)
        if self.tap is not None:  # observed: the same launches eagerly, the taps computed beside them
            with self.stream:
                self._rows_body(m, kind, self.tap)
        elif not self.use_graphs:
            with self.stream:
                self._rows_body_pdl(m, kind)
        else:
            graph = self._graphs.get(key)
            if graph is None:
                graph = self._capture(m, kind)
            graph.launch(stream=self.stream)
        self._tokens[self.length:self.length + m] = ids
        self.length += m
        self._hidden_rows = self._h[:m]  # post-final-norm rows of this pass (hidden_rows_ptr)
        self._decode_amax_fresh = kind == "decode"
        if kind == "rows":
            self._logits = self._rows_logits

    def _capture(self, m: int, kind: str):
        with self.stream:
            self._rows_body(m, kind)  # warm-up: compiles, allocates workspaces outside the capture
        self.stream.synchronize()
        self.check_fused()
        self.stream.begin_capture()
        try:
            with self.stream:
                self._rows_body_pdl(m, kind)
        finally:
            graph = self.stream.end_capture()
        self._graphs[(kind, m)] = graph
        return graph

    def _rows_body_pdl(self, m: int, kind: str) -> None:
        self.kern.pdl = self.use_pdl
        try:
            self._rows_body(m, kind)
        finally:
            self.kern.pdl = False

    def _rows_body(self, m: int, kind: str, tap: Tap | None = None) -> None:
        """The whole forward of m rows at positions io[1, :m] (engine/loop.py over RowsPass); every launch
        is capturable. Then lm_head into the decode or rows logits buffer."""
        cfg, k, w, s = self.cfg, self.kern, self.w, self.stream
        rows_pass = FusedRowsPass if self.path == "fused" else RowsPass
        h = decoder_forward(rows_pass(self, m, tap), cfg.definition, w)
        self._hidden[0] = h[m - 1]
        out = self._decode_logits if kind == "decode" else self._rows_logits[:m]
        if self._fp32_logits:
            self._linear(h, w.lm_head, out)
            self._softcap_logits(out)
        else:
            self._linear(h, w.lm_head, self._logits32[:m])
            self._softcap_logits(self._logits32[:m])
            k.f32_to_bf16(self._logits32[:m], out, stream=s)
        if kind == "decode":
            k.argmax(out, self._decode_amax, workspace=self._amax_ws[1], stream=s)
            if self.tp is not None:  # the distributed argmax's candidates, gathered inside the step
                self.tpk.argmax_pairs(out, self._decode_amax, self._tp_decode_pairs, self.tp.vocab.start, stream=s)
                self.tp.comm.all_gather(self._tp_decode_pairs, self._tp_decode_gathered, s)

    def _linear(self, x, w, out, bias=None, *, accumulate=False, swiglu=False, norm_weight=None,
                eps: float = 1e-6, norm_offset: float = 0.0, activation: str = "silu") -> None:
        """One projection of the rows path, with the RMSNorm of x (norm_weight, eps, norm_offset) fused in its
        prologue when given and, with swiglu, the gate activation in its epilogue: the ring GEMV for one row
        where it fits (Kernels.ring_fits), else the tensor-core GEMV from GEMV_TC_MIN_ROWS rows on and the
        fp32-FMA GEMV below."""
        k, s = self.kern, self.stream
        norm = dict(norm_weight=norm_weight, eps=eps, norm_offset=norm_offset)
        m, kk = x.shape
        if k.ring_fits(m, kk, out.shape[1], swiglu):
            k.gemv_ring(x, w, out, bias, accumulate=accumulate, swiglu=swiglu, activation=activation, stream=s,
                        chunks=k.ring_chunks(kk, out.shape[1], swiglu), **norm)
        elif uses_tc(m):
            k.gemv_tc(x, w, out, bias, accumulate=accumulate, swiglu=swiglu, activation=activation, stream=s,
                      **norm)
        elif swiglu:
            k.gemv_swiglu(x, w, out, activation=activation, stream=s, **norm)
        else:
            k.gemv(x, w, out, bias, accumulate=accumulate, stream=s, **norm)

    def _softcap_logits(self, logits) -> None:
        """Final-logit softcapping (Gemma 2) on fp32 logits rows, in place, before any bf16 rounding."""
        cap = self.cfg.definition.final_logit_softcap
        if cap is not None:
            self.kern.softcap(logits, cap, stream=self.stream)

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
                    rows.append(self._lm_head_rows(h))
                    hidden.append(h)
                elif last:
                    rows.append(self._lm_head_rows(h[-1:]))
                    hidden.append(h[-1:])
            logits = rows[0] if len(rows) == 1 else cp.concatenate(rows, axis=0)
            self._hidden_rows = hidden[0] if len(hidden) == 1 else cp.concatenate(hidden, axis=0)
            n = logits.shape[0]
            if self._long_logits is None or self._long_logits.shape[0] < n:
                self._long_logits = cp.empty((n, logits.shape[1]), self._rows_logits.dtype)
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
        h = decoder_forward(PrefillPass(self, ids, tap), self.cfg.definition, self.w)
        self._tokens[self.length:self.length + len(ids)] = ids
        self.length += len(ids)
        self._hidden[0] = h[len(ids) - 1]
        return h

    def _gemm(self, x, w, bias=None, accumulate_into=None):
        """x f32 [T, K] @ w.T (w bf16 bits [N, K]) -> f32 [T, N], through cuBLAS with bf16 operands.
        With accumulate_into (f32 [T, N]) the product is added to it in the GEMM (beta = 1) instead."""
        cp = self.cp
        from cupy_backends.cuda.libs import cublas

        t, kdim = x.shape
        n = w.shape[0]
        xb = cp.empty((t, kdim), cp.uint16)
        self.kern.f32_to_bf16(x, xb, stream=self.stream)
        out = cp.empty((t, n), cp.float32) if accumulate_into is None else accumulate_into
        one = np.array(1.0, np.float32)
        zero = np.array(0.0 if accumulate_into is None else 1.0, np.float32)  # beta
        handle = cp.cuda.device.get_cublas_handle()
        cublas.setStream(handle, self.stream.ptr)
        # Row-major out[t, n] = xb @ w.T is column-major out^T[n, t] = w^T(op T of [k, n]) @ xb^T.
        cublas.gemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, t, kdim,
                      one.ctypes.data, w.data.ptr, CUDA_R_16BF, kdim,
                      xb.data.ptr, CUDA_R_16BF, kdim,
                      zero.ctypes.data, out.data.ptr, CUDA_R_32F, n,
                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
        if bias is not None:
            b32 = cp.empty(bias.shape, cp.float32)
            self.kern.bf16_to_f32(bias, b32, stream=self.stream)
            out += b32
        return out

    def _gemm_experts(self, xb, w, rows: int, out, used=None):
        """out[e*rows:(e+1)*rows] = xb[e*rows:(e+1)*rows] @ w[e].T for every expert e of w (bf16 bits
        [E, N, K]), xb bf16 bits [E*rows, K], out f32 [E*rows, N]: one cuBLAS strided batched GEMM (the
        mixture-of-experts prefill's per-expert GEMMs).  With used = [(expert, n)], one GEMM per listed
        expert over its first n rows instead (the rest of out is left unwritten)."""
        cp = self.cp
        from cupy_backends.cuda.libs import cublas

        experts, n, kdim = w.shape
        one, zero = np.array(1.0, np.float32), np.array(0.0, np.float32)
        handle = cp.cuda.device.get_cublas_handle()
        cublas.setStream(handle, self.stream.ptr)
        if used is not None:
            for ex, count in used:
                cublas.gemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, count, kdim,
                              one.ctypes.data, w.data.ptr + ex * n * kdim * 2, CUDA_R_16BF, kdim,
                              xb.data.ptr + ex * rows * kdim * 2, CUDA_R_16BF, kdim,
                              zero.ctypes.data, out.data.ptr + ex * rows * n * 4, CUDA_R_32F, n,
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
            return out
        cublas.gemmStridedBatchedEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, rows, kdim,
                                    one.ctypes.data, w.data.ptr, CUDA_R_16BF, kdim, n * kdim,
                                    xb.data.ptr, CUDA_R_16BF, kdim, rows * kdim,
                                    zero.ctypes.data, out.data.ptr, CUDA_R_32F, n, rows * n,
                                    experts, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
        return out

    def _lm_head_rows(self, h):
        if h.shape[0] <= MAX_ROWS:
            out = self.cp.empty((h.shape[0], self.w.lm_head.shape[0]), self.cp.float32)
            self._linear(self.cp.ascontiguousarray(h), self.w.lm_head, out)
        else:
            out = self._gemm(h, self.w.lm_head)
        self._softcap_logits(out)
        return out

    # -- checks and LogitsBuffers hooks ---------------------------------------------------------------
    def _row_to_host(self, ptr: DevicePtr) -> np.ndarray:
        self.stream.synchronize()
        row = ptr._buffer[ptr.row].get()
        return row if row.dtype == np.float32 else row.view(np.uint16)

    def _argmax_rows(self, ptr: DevicePtr, n: int, stream: int) -> np.ndarray:
        if ptr._buffer is self._decode_logits and self._decode_amax_fresh and n == 1:
            self.stream.synchronize()
            return self._decode_amax.get()  # the decode graph already computed it on the device
        out = self._amax[:n] if n <= MAX_ROWS else self.cp.empty((n,), self.cp.int32)
        self.kern.argmax(ptr._buffer[ptr.row:ptr.row + n], out, workspace=self._amax_ws.get(n),
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
        self.kern.argmax(rows, idx, workspace=self._amax_ws.get(n), stream=self.stream)
        self.tpk.argmax_pairs(rows, idx, pairs, self.tp.vocab.start, stream=self.stream)
        return pairs


# The block weights the CUDA passes compute with (engine/loop.py's keys): a family adding another is refused
# until the kernels take it.  A sparse layer's are the MoE kernels' (moe_passes.py), which have no sandwich
# post-norm.
_DENSE_KEYS = {"input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "attn_out_norm", "mlp_norm",
               "gate_up", "down", "mlp_out_norm"}
_MOE_KEYS = {"input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "attn_out_norm", "mlp_norm",
             "router", "experts_gate_up", "experts_down", "shared_gate_up", "shared_down"}


def unsupported_features(definition: ModelDefinition) -> list[str]:
    """What the model definition asks for that the CUDA kernels do not compute. Each is refused with a
    DeviceError naming it, never run with wrong numbers (the NumPy engine runs them all). The issue-13
    features (embedding scale, softcaps, (1 + w) norms, sliding windows, partial rotary, linear and
    longrope scaling, gelu_tanh, sandwich norms) run in the kernels; what remains is a weight the passes
    do not know, a gate activation the fused MLP lacks, and what the MoE kernels do not take."""
    from .kernels.tuning import ACTIVATIONS  # no CuPy needed

    found: list[str] = []
    for layer in definition.layers:
        if isinstance(layer.mlp, MoeSpec):  # kernels/moe.cu: SwiGLU experts after a plain RMSNorm
            found += [f"mixture-of-experts activation {layer.mlp.activation}"] if layer.mlp.activation != "silu" else []
            found += ["(1 + w) RMSNorm in a mixture-of-experts layer"] if layer.norm.offset else []
            known = _MOE_KEYS
        else:
            found += [f"activation {layer.mlp.activation}"] if layer.mlp.activation not in ACTIVATIONS else []
            known = _DENSE_KEYS
        found += [f"weight {k}" for k in sorted(layer.keys() - known)]
    return list(dict.fromkeys(found))


def check_path(path: str) -> str:
    """A rows-path name (ROWS_PATHS), or UsageError naming the valid ones."""
    name = str(path).strip().lower()
    if name not in ROWS_PATHS:
        raise UsageError(f"unknown CUDA engine path '{path}' (choose from {', '.join(ROWS_PATHS)})")
    return name


def default_path(tensor_parallel: bool = False) -> str:
    """The rows path an engine starts on: $METRALE_CUDA_PATH when set (checked), else DEFAULT_PATH, or BASE_PATH
    for a tensor-parallel rank."""
    value = os.environ.get(PATH_ENV, "").strip()
    return check_path(value) if value else BASE_PATH if tensor_parallel else DEFAULT_PATH


def load_cuda_engine(cfg: ModelConfig, source, max_context: int, fp32_logits: bool = False,
                     progress: Callable[[int], None] | None = None, use_graphs: bool = True, tp=None,
                     path: str | None = None) -> CudaEngine:
    """Check the tensors, upload them once, and build the engine (CuPy is imported here, not before).
    With `tp` (parallel/comm.ParallelRank, its device current) only that rank's shard is uploaded, and the
    engine is that rank's. `path`: the rows path (ROWS_PATHS; None: default_path(), i.e.
    $METRALE_CUDA_PATH or DEFAULT_PATH); a tensor-parallel rank runs BASE_PATH only (the fused path is not
    verified under --tp)."""
    path = check_path(path) if path is not None else default_path(tp is not None)
    if tp is not None and path != BASE_PATH:
        raise UsageError(f"the CUDA '{path}' path does not run under --tp yet (unset {PATH_ENV} or choose {BASE_PATH})")
    check_context(cfg, max_context)
    full = cfg
    if tp is not None:
        from ...parallel.sharding import rank_config

        cfg = rank_config(full, tp.rank, tp.size)
    missing = unsupported_features(cfg.definition)
    if missing:
        raise DeviceError(f"{cfg.model_type}: the CUDA engine does not implement {', '.join(missing)} yet; "
                          "use --device cpu")
    if cfg.moe is not None:
        from .kernels.moe import MoeKernels

        s = cfg.moe.spec
        why = MoeKernels.check_sizes(s.num_experts, s.top_k, s.intermediate_size, s.shared_expert_size or 8)
        if why is not None:
            raise DeviceError(f"{cfg.model_type}: the CUDA MoE kernels do not take {why}; use --device cpu")
    if not source.made_from_definition:
        check_checkpoint(full, source)  # the whole model's tensors, before a rank keeps its share
    _cupy()
    from .kernels import DECODE_HEAD_DIMS, PREFILL_HEAD_DIMS, Kernels

    dims = sorted(set(DECODE_HEAD_DIMS) & set(PREFILL_HEAD_DIMS))
    if cfg.head_dim not in dims:
        raise DeviceError(f"head_dim {cfg.head_dim} is not supported by the CUDA kernels "
                          f"(supported: {', '.join(map(str, dims))}); use --device cpu")
    odd = [n for n, v in (("hidden_size", cfg.hidden_size), ("intermediate_size", cfg.intermediate_size))
           if v % 8]
    if odd:
        raise DeviceError(f"{odd[0]} must be a multiple of 8 for the CUDA kernels; use --device cpu")

    try:
        kern = Kernels()
    except Exception as e:
        raise DeviceError(f"cannot compile the CUDA kernels ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    weights = upload_weights(full, source, kern, progress, None if tp is None else (tp.rank, tp.size))
    engine = CudaEngine(cfg, weights, kern, max_context, fp32_logits, use_graphs, tp)
    if path != engine.path:
        engine.set_path(path)
    return engine


__all__ = ["CudaEngine", "load_cuda_engine", "upload_weights", "NonFiniteLogitsError", "ROWS_PATHS", "check_path"]
