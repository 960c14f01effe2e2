"""The reference engine: every family's decoder in fp32 NumPy.

It is the oracle the CUDA engine is tested against, and the engine users without a GPU run, so it is
written to be read and to be fast enough: whole heads and rows at once, projections kept as the checkpoint
stores them and widened to fp32 inside each product (stored.py), a preallocated KV cache written by
position. The block order is engine/loop.py's; this module implements its ops (`NumpyPass`) plainly, with
no fusion.

Passes (all start at the current cache length `self.length`): see engine/protocols.py.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ...config import ModelConfig
from ...engine.longrope import has_longrope, long_factors
from ...models.formats import check_stored, dequantize, stored_tensors, weight_format
from ...engine.loop import decoder_forward
from ...engine.ops import Tap
from ...engine.mixers import kinds_of, mixer_kind
from ...engine.mla import FORMS as MLA_FORMS
from ...engine_base import EngineBase, check_context
from ...errors import UsageError
from ...logits import DevicePtr, bf16_bits_to_fp32, fp32_to_bf16_bits, host_argmax
from ...models.spec import MoeSpec, Norm, Rope
from ...models.weights import WeightSource, Weights, check_checkpoint, load_weights
from . import kernels, moe
from .ops import ROUNDING, InputQuantized, as_fp32, glu, rms_norm, softcap
from .stored import PROJECTIONS, FormattedWeight, StoredWeight, join, matmul, rows as table_rows

# Queries per prefill chunk: bounds the attention scores to heads x chunk x context floats.
PREFILL_CHUNK = 256


def read_weights(cfg: ModelConfig, source: WeightSource, progress: Callable[[int], None] | None = None,
                 shard=None, compute: str = "fp32", activation_quant: str = "none") -> Weights:
    """The engine's weights. Projections stored as BF16 or F16 stay so (stored.StoredWeight, memory-mapped;
    a fused one its parts side by side, stored.JoinedWeight); every other weight, and F32 projections, is
    converted to fp32, each tensor read once from the memory map and its pages released right after, so peak
    memory stays near the stored bytes. `shard` (models/weights.Shard) keeps one tensor-parallel rank's
    share. With compute "bf16" every weight is rounded to bf16 (an F32 or F16 checkpoint run by a bf16
    engine; its projections are then kept as bf16). With activation_quant "emulate" each weight whose format
    quantizes its input (WeightFormat.input_quant) carries that quantization (ops.InputQuantized)."""
    if not source.made_from_definition:
        check_checkpoint(cfg, source)
    r = ROUNDING[compute]
    as_stored = _stored_names(cfg, source, compute)

    def read(name: str) -> np.ndarray:
        a = source.array(name, bf16_bits=True)
        if name in as_stored:  # BF16 bits / F16 as they are; F32 or F16 under bf16 compute: rounded to bf16 bits
            out = a if as_stored[name] else fp32_to_bf16_bits(as_fp32(a))
            if out is not a:
                source.release(name)
        else:
            out = r(as_fp32(a))
            source.release(name)
        if progress is not None:
            progress(a.nbytes)
        return out

    def mapped(name: str) -> np.ndarray:
        return source.array(name, bf16_bits=True)  # stays memory-mapped: a lookup touches only its rows

    def stored(name: str) -> np.ndarray:  # a formatted param's stored tensor or scale, as stored
        out = source.array(name, bf16_bits=True)
        if progress is not None:
            progress(out.nbytes)
        return out

    def dequantized(p) -> list[np.ndarray]:  # formats.py's exact fp32 value of each part
        parts = [r(part) for part in dequantize(p, stored)]
        for t in stored_tensors(p):
            source.release(t.name)
        return parts

    def kept(p) -> list:  # each part as stored, dequantized a block of rows at a time (a format that says so)
        fmt = weight_format(p.format)
        if not fmt.row_slices:  # its dequantize takes whole tensors only: the exact fp32 weight, as before
            return dequantized(p)
        check_stored(p, stored)
        return [FormattedWeight(fmt, tuple(stored(s.name) for s in fmt.tensors(t)), t.shape) for t in p.parts]

    # Formatted weights stay as stored for the fp32 reference; a bf16 engine rounds their values and a
    # tensor-parallel rank slices them, so those read the dequantized fp32 weights.
    formatted = kept if compute == "fp32" and shard is None else dequantized
    concat = join if shard is None else (lambda parts: np.concatenate(parts, axis=0))  # a rank slices its arrays
    w = load_weights(cfg.definition, read, concat, embed=mapped, shard=shard, read_formatted=formatted)
    keys = {p.key for p in cfg.definition.params() if p.key in PROJECTIONS and p.format is None}
    w.layers = [{k: StoredWeight.of(v) if k in keys else v for k, v in lw.items()} for lw in w.layers]
    if w.lm_head is w.embed:  # tied: one table, looked up and multiplied
        w.embed = w.lm_head = StoredWeight.of(w.embed)
    else:
        w.lm_head = StoredWeight.of(w.lm_head)
    if activation_quant == "emulate":
        for i, layer in enumerate(cfg.definition.layers):
            for p in layer.params:
                quant = input_quant(p, source)
                if quant is not None:
                    w.layers[i][p.key] = InputQuantized(w.layers[i][p.key], quant)
    return w


def input_quant(p, source: WeightSource):
    """x -> x' as param p's format quantizes a matmul's input (None: p's input stays fp32). A fused param's
    parts each carry their static input scale; the largest is used for all (as engines fuse them)."""
    if p.format is None:
        return None
    fmt = weight_format(p.format)
    if fmt.input_quant is None:
        if fmt.input_quant_doc:  # the scheme quantizes its inputs in a way metrale does not emulate
            raise UsageError(f"--activation-quant emulate: {p.parts[0].name}'s input activations: "
                             f"{fmt.input_quant_doc}")
        return None
    companions = [[source.array(c.name, bf16_bits=True) for c in fmt.companions(t)] for t in p.parts]
    if len(companions) > 1 and companions[0]:  # the largest of each companion over the parts
        merged = [max(parts, key=lambda a: float(np.max(as_fp32(a)))) for parts in zip(*companions)]
    else:
        merged = companions[0]
    return lambda x: fmt.input_quant(x, *merged)


def _stored_names(cfg: ModelConfig, source: WeightSource, compute: str) -> dict[str, bool]:
    """The tensors read as stored: every part of a dense projection whose parts are all BF16 (or F16 under fp32
    compute) -> True (kept as it is), or, under bf16 compute, F32 / F16 -> False (rounded to bf16 bits)."""
    out: dict[str, bool] = {}
    for p in cfg.definition.params():
        if p.key not in PROJECTIONS or p.format is not None:
            continue
        dtypes = {source.info(t.name).dtype for t in p.parts}
        if len(dtypes) != 1:
            continue
        dtype = dtypes.pop()
        if dtype == "BF16" or (dtype == "F16" and compute == "fp32"):
            out.update((t.name, True) for t in p.parts)
        elif compute == "bf16":
            out.update((t.name, False) for t in p.parts)
    return out


ACTIVATION_QUANT = ("none", "emulate")  # --activation-quant: fp32 activations, or as the checkpoint's scheme


class NumpyPass:
    """engine/loop.py's ops for one pass of T rows at positions start..start+T-1 (plain NumPy)."""

    def __init__(self, engine: NumpyEngine, ids: np.ndarray, tap: Tap | None = None, long: bool = False,
                 verify: bool = False) -> None:
        self.e, self.ids, self.t, self.start = engine, ids, len(ids), engine.length
        self.verify = verify  # a verify pass: a recurrent state keeps each row's state (for trim)
        self.long = long  # longrope: this call runs the long factors (engine/longrope.py)
        self._tap = tap
        self.fine_taps = tap is not None and getattr(engine, "fine_taps", False)  # engine/ops.Ops.fine_taps
        self._rope: dict[object, tuple[np.ndarray, np.ndarray]] = {}
        self._mixers: dict[str, object] = {}
        self.tp = getattr(engine, "tp", None)  # parallel/comm.ParallelRank of a sharded engine, else None
        self.r = ROUNDING[getattr(engine, "compute", "fp32")]  # ops.ROUNDING: fp32 keeps, bf16 rounds

    def embed(self, table, scale=None) -> np.ndarray:
        if self.tp is not None:  # vocabulary-parallel: the rows of this rank's range, zeros elsewhere, summed
            vocab = self.tp.vocab
            mine = (self.ids >= vocab.start) & (self.ids < vocab.stop)
            x = np.zeros((self.t, table.shape[1]), np.float32)
            x[mine] = table_rows(table, self.ids[mine] - vocab.start)
            x = x if scale is None else x * np.float32(scale)
            self.tp.comm.all_reduce(x)
            return x
        x = self.r(table_rows(table, self.ids))  # [T, H]
        # Gemma: times sqrt(hidden) as an fp32 value, as transformers computes in fp32; in bf16 it rounds the
        # normalizer to bf16 first (sqrt(3584) = 59.87 -> 60.0), as a bf16 forward does.
        return x if scale is None else self.r(x * self.r(np.float32(scale)))

    def linear(self, x, w, bias=None, *, out, norm=None, residual=None, tap=None, reduce=False):
        if norm is not None:
            x = rms_norm(x, norm[0], norm[1].eps, norm[1].offset, self.r)
        y = matmul(x, w)
        sharded = reduce and self.tp is not None  # a row-parallel partial sum: bias on rank 0 only, then summed
        if bias is not None and not (sharded and self.tp.rank != 0):
            y += bias
        y = self.r(y)
        if sharded:
            y = np.ascontiguousarray(y, dtype=np.float32)
            self.tp.comm.all_reduce(y)
        if tap is not None:
            self.tap(tap, y)
        return y if residual is None else self.r(residual + y)

    def norm(self, x, weight, norm: Norm, *, out, residual=None, tap=None):
        y = rms_norm(x, weight, norm.eps, norm.offset, self.r)
        if tap is not None:
            self.tap(tap, y)
        return y if residual is None else self.r(residual + y)

    def gated_mlp(self, x, w_gate_up, *, norm, activation):
        gu = self.linear(x, w_gate_up, out="gate_up", norm=norm)  # [T, 2I]
        return glu(activation, r=self.r)(gu)  # [T, I]

    def route(self, x, w_router, spec: MoeSpec, *, norm, bias=None, correction=None):
        return moe.route(rms_norm(x, norm[0], norm[1].eps, norm[1].offset, self.r), w_router, spec, bias, correction,
                         self.r)

    def experts(self, x, route, w_gate_up, w_down, spec: MoeSpec, *, norm, shared, tap, bias=None):
        y = self.experts_partial(x, route, w_gate_up, w_down, spec, norm=norm, shared=shared, bias=bias)
        if self.tp is not None:  # this rank's experts and shared-expert columns: a partial sum
            y = np.ascontiguousarray(y, dtype=np.float32)
            self.tp.comm.all_reduce(y)
        self.tap(tap, y)
        return self.r(x + y)

    def experts_partial(self, x, route, w_gate_up, w_down, spec: MoeSpec, *, norm, shared, bias=None):
        """The sparse block's y before any all-reduce: the held experts (spec.held) and the shared expert
        (whichever columns of it the weights hold), the shared gate applied to them."""
        r = self.r
        h = rms_norm(x, norm[0], norm[1].eps, norm[1].offset, r)
        y = moe.experts(h, route, w_gate_up, w_down, glu(spec.activation, spec.swiglu_limit, spec.swiglu_alpha, r),
                        spec.first_expert, bias, r)
        if shared is not None:  # qwen2_moe: + sigmoid(shared_expert_gate(h)) * shared_expert(h); DeepSeek: ungated
            s = r(matmul(moe.gated(h, shared[0], glu(spec.activation, r=r), r=r), shared[1]))
            y = r(y + (r(route.shared_gate * s) if spec.shared_expert_gated else s))
        return y

    def mixer(self, layer: int):
        """Layer `layer`'s mixer ops for this pass (engine/mixers.py), over the engine's state of its kind."""
        kind = self.e.cfg.definition.layers[layer].mixer.kind
        if kind not in self._mixers:
            self._mixers[kind] = mixer_kind(kind).backend("numpy").ops(self, self.e.states[kind])
        return self._mixers[kind]

    def join(self, a, b, *, out):
        return np.concatenate([a, b], axis=1)

    def tap(self, name: str, x) -> None:
        if self._tap is not None:
            self._tap(name, x)

    def cos_sin(self, rope: Rope) -> tuple[np.ndarray, np.ndarray]:
        """cos/sin [T, r/2] of this pass's positions, once per distinct rope (layers share it)."""
        if rope not in self._rope:
            inv = self.e.inv_freq(rope, self.long and rope.longrope is not None)
            first = self.start + getattr(self.e, "position_offset", 0)  # NumpyEngine.position_offset
            angles = np.arange(first, first + self.t, dtype=np.float32)[:, None] * inv[None, :]
            cos, sin = np.cos(angles), np.sin(angles)
            if rope.attention_scaling != 1.0:  # longrope: both scaled, as transformers does
                s = np.float32(rope.attention_scaling)
                cos, sin = cos * s, sin * s
            self._rope[rope] = (cos, sin)
        return self._rope[rope]


class NumpyEngine(EngineBase):
    """The fp32 NumPy engine behind the ModelLogits interface."""

    device = "cpu"
    position_offset = 0  # the rope position of cache row 0 (an MTP layer's first row is position 1: mtp.py)

    def __init__(self, cfg: ModelConfig, weights: Weights, max_context: int, fp32_logits: bool = False,
                 pass_rows: int = PREFILL_CHUNK, tp=None, compute: str = "fp32", mla: str = "naive",
                 activation_quant: str = "none"):
        """`pass_rows`: the most tokens one forward runs (prefill and verify are chunked to it); it sizes
        the sliding layers' ring buffers (engine/kv_layout.py). `tp` (parallel/comm.ParallelRank): this
        engine is one tensor-parallel rank, `cfg` and `weights` its shard (parallel/sharding.py).
        `compute`: "fp32" (the reference) or "bf16" (every intermediate rounded where transformers' bf16
        forward rounds it, its weights read with read_weights(compute="bf16")). `mla`: the algebra of
        latent-attention layers, "naive" (as transformers) or "absorbed" (engine/mla.py)."""
        check_context(cfg, max_context)
        self.compute = compute
        self.mla = mla
        self.activation_quant = activation_quant  # "emulate": quantized weights' inputs as their scheme says
        self.cfg = cfg
        self.w = weights
        self.max_context = max_context
        self.length = 0  # positions held in the KV cache
        self.pass_rows = pass_rows
        self._fp32_logits = fp32_logits
        self._inv_freq: dict[tuple[Rope, bool], np.ndarray] = {}  # (Rope, long) -> [r/2] fp32
        # each mixer kind's cache of its layers (engine/mixers.py): a KV cache for attention
        self.states = {kind: mixer_kind(kind).backend("numpy").state(self, layers)
                       for kind, layers in kinds_of(cfg.definition.layers).items()}
        # longrope (engine/longrope.py): the tokens cached so far, and which factor set computed them
        self._longrope = has_longrope(cfg.definition)
        self._tokens = np.zeros(max_context, np.int64)
        self._cache_long = False
        self.tp = tp
        self._logits_dtype = np.float32 if fp32_logits else np.uint16  # bf16 rows as bit patterns
        vocab = weights.lm_head.shape[0]  # the logits width: a rank's vocabulary range under tp
        self._logits = np.zeros((1, vocab), self._logits_dtype)  # [rows, V], grown on demand
        self._decode_logits = np.zeros((1, vocab), self._logits_dtype)  # [1, V]
        # bf16 rows: the argmax of each row's fp32 logits before rounding (fp32_argmax)
        self._rows_fp32_argmax = self._decode_fp32_argmax = np.zeros(1, np.int64)
        if tp is not None:  # each decode step's argmax candidates of every rank ([size, 1, (value, index)])
            self._tp_decode_gathered = np.zeros((tp.size, 1, 2), np.float32)
        self._hidden = np.zeros((1, cfg.hidden_size), np.float32)  # [1, H]

    def inv_freq(self, rope: Rope, long: bool = False) -> np.ndarray:
        if (rope, long) not in self._inv_freq:
            self._inv_freq[rope, long] = rope.inv_freq(long)
        return self._inv_freq[rope, long]

    # -- passes ------------------------------------------------------------------------------------------
    def prefill(self, tokens: Sequence[int], all_logits: bool = False) -> int:
        """Run the prompt; write every row's logits (all_logits) or only the last row's to the logits
        buffer. Returns the number of rows written."""
        ids = self._check_tokens(tokens)
        rows = self._chunks(ids, all_logits)
        self._write_rows(np.concatenate(rows, axis=0))
        return len(ids) if all_logits else 1

    def decode(self, token: int) -> None:
        ids = self._check_tokens([token])
        h = self._forward(ids, long=self._begin_call(len(ids)))
        logits = self._lm_head(h)
        self._decode_fp32_argmax = self._argmax_before_rounding(logits)
        self._decode_logits[:] = self._round_logits(logits)
        self._hidden_rows = h  # [1, H]
        if self.tp is not None:  # the distributed argmax's candidates, as the CUDA decode graph gathers them
            self.tp.comm.all_gather(self.tp_argmax_pairs(self._decode_logits), self._tp_decode_gathered)

    def verify(self, tokens: Sequence[int]) -> int:
        """k draft tokens at the next k positions in one forward; rows [k, vocab] in the logits buffer."""
        ids = self._check_tokens(tokens)
        self._write_rows(np.concatenate(self._chunks(ids, True, verify=True), axis=0))
        return len(ids)

    # -- the forward ---------------------------------------------------------------------------------------
    def _chunks(self, ids: np.ndarray, all_rows: bool, verify: bool = False) -> list[np.ndarray]:
        """One call (prefill, verify) in forwards of at most pass_rows tokens; the post-norm rows
        of every token (all_rows) or of the last one."""
        long, rows = self._begin_call(len(ids)), []
        for start in range(0, len(ids), self.pass_rows):
            h = self._forward(ids[start:start + self.pass_rows], long, verify=verify)
            if all_rows or start + self.pass_rows >= len(ids):
                rows.append(h if all_rows else h[-1:])
        return rows

    def _begin_call(self, n: int) -> bool:
        """The longrope factor set of a call of n tokens; a cache computed with the other set is first
        recomputed from its tokens (engine/longrope.py). False for every other model."""
        if not self._longrope:
            return False
        long = long_factors(self.cfg.definition, self.length + n)
        if long != self._cache_long:
            self._cache_long = long
            prefix, self.length = self._tokens[:self.length].copy(), 0
            for start in range(0, len(prefix), self.pass_rows):
                self._forward(prefix[start:start + self.pass_rows], long, quiet=True)  # not the caller's pass
        return long

    def _forward(self, ids: np.ndarray, long: bool = False, quiet: bool = False, verify: bool = False) -> np.ndarray:
        """Run ids [T] at positions length..length+T-1, append their K/V, return the post-final-norm
        hidden states [T, H]. The hidden state of the last position is kept for hidden_after_norm().
        The pass's taps go to the engine's observer (`self.tap`), unless `quiet` (a cache recomputation)."""
        h = self._run(NumpyPass(self, ids, None if quiet else self.tap, long, verify))
        self._tokens[self.length:self.length + len(ids)] = ids
        self.length += len(ids)
        self._hidden[0] = h[-1]
        return h

    def _run(self, ops: NumpyPass) -> np.ndarray:
        """The blocks of one pass (ops: its rows and positions); the post-final-norm rows [T, H]."""
        return decoder_forward(ops, self.cfg.definition, self.w)

    def _lm_head(self, h: np.ndarray) -> np.ndarray:
        r = ROUNDING[self.compute]
        logits = r(matmul(h, self.w.lm_head))  # [rows, V]
        cap = self.cfg.definition.final_logit_softcap
        return logits if cap is None else softcap(logits, cap, r)

    # -- buffers -------------------------------------------------------------------------------------------
    def _write_rows(self, h: np.ndarray) -> None:
        """lm_head over the post-norm rows h [n, H]; the logits buffer holds exactly these n rows."""
        logits = self._lm_head(h)
        self._hidden_rows = h  # the rows behind these logits (hidden_rows_ptr)
        if self._logits.shape[0] != logits.shape[0]:
            self._logits = np.empty(logits.shape, self._logits_dtype)
        self._rows_fp32_argmax = self._argmax_before_rounding(logits)
        self._logits[:] = self._round_logits(logits)
        self._n_rows = logits.shape[0]

    def _round_logits(self, logits: np.ndarray) -> np.ndarray:
        """fp32 logits in the buffers' dtype: kept as they are, or rounded to bf16 (nearest even)."""
        return logits if self._fp32_logits else fp32_to_bf16_bits(logits)

    def _argmax_before_rounding(self, logits: np.ndarray) -> np.ndarray:
        """For bf16 rows, each fp32 row's argmax (one pass over the rows; nothing for fp32 rows)."""
        return np.empty(0, np.int64) if self._fp32_logits else host_argmax(logits)

    def fp32_argmax(self, ptr: DevicePtr) -> int | None:
        """The argmax of row `ptr`'s fp32 logits before they were rounded to bf16 (-1: NaN/Inf), where a
        bf16 row's own argmax may differ (two logits rounding to one bf16 value); None for fp32 rows."""
        if self._fp32_logits:
            return None
        rows = self._decode_fp32_argmax if ptr._buffer is self._decode_logits else self._rows_fp32_argmax
        return int(rows[ptr.row])

    # -- LogitsBuffers hooks -----------------------------------------------------------------------------
    def _row_to_host(self, ptr: DevicePtr) -> np.ndarray:
        return ptr._buffer[ptr.row]

    def _argmax_rows(self, ptr: DevicePtr, n: int, stream: int) -> np.ndarray:
        rows = ptr._buffer[ptr.row:ptr.row + n]
        return host_argmax(bf16_bits_to_fp32(rows) if rows.dtype == np.uint16 else rows)

    def tp_argmax_pairs(self, rows: np.ndarray) -> np.ndarray:
        """A rank's candidates for the distributed argmax (parallel/comm.pick_argmax): [n, 2] fp32 of
        (value, global index) of each row's first maximum in this rank's range; (NaN, -1) for a row
        holding NaN or Inf."""
        values = bf16_bits_to_fp32(rows) if rows.dtype == np.uint16 else np.asarray(rows, np.float32)
        idx = host_argmax(values)
        out = np.empty((len(idx), 2), np.float32)
        out[:, 0] = np.where(idx >= 0, values[np.arange(len(idx)), np.maximum(idx, 0)], np.nan)
        out[:, 1] = np.where(idx >= 0, idx + self.tp.vocab.start, -1)
        return out


def load_numpy_engine(cfg: ModelConfig, source: WeightSource, max_context: int, fp32_logits: bool = False,
                      progress=None, tp=None, compute: str = "fp32", mla: str = "naive",
                      activation_quant: str = "none", threads: int | None = None) -> NumpyEngine:
    """Check and convert the weights, then build the engine (cache sized for max_context positions).
    With `tp` (parallel/comm.ParallelRank) only that rank's shard is kept, and the engine is that rank's.
    `compute`: "fp32" or "bf16"; `mla`: "naive" or "absorbed" (NumpyEngine); `threads`: the threads of the
    projections (kernels.py; default: the cores available)."""
    check_context(cfg, max_context)  # refuse before converting gigabytes of weights
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be 1 or more, got {threads}")
    kernels.set_threads(threads or kernels.cores())
    if compute not in ROUNDING:
        raise UsageError(f"unknown compute precision '{compute}' (choose from {', '.join(ROUNDING)})")
    if mla not in MLA_FORMS:
        raise UsageError(f"--mla must be one of {', '.join(MLA_FORMS)}, got {mla!r}")
    if activation_quant not in ACTIVATION_QUANT:
        raise UsageError(f"--activation-quant must be one of {', '.join(ACTIVATION_QUANT)}, got {activation_quant!r}")
    if activation_quant != "none" and tp is not None:
        raise UsageError("--activation-quant emulate does not run under --tp yet")
    for kind in kinds_of(cfg.definition.layers):  # a kind's module may compute in fewer precisions (COMPUTE)
        if compute not in getattr(mixer_kind(kind).backend("numpy"), "COMPUTE", ROUNDING):
            raise UsageError(f"--compute {compute} is not implemented for {kind.replace('_', '-')} layers yet "
                             "(use --compute fp32)")
    if tp is None:
        return NumpyEngine(cfg, read_weights(cfg, source, progress, compute=compute, activation_quant=activation_quant),
                           max_context, fp32_logits, compute=compute, mla=mla, activation_quant=activation_quant)
    from ...parallel.sharding import RankShard, rank_config

    shard = RankShard(cfg.definition, tp.rank, tp.size)
    return NumpyEngine(rank_config(cfg, tp.rank, tp.size), read_weights(cfg, source, progress, shard, compute),
                       max_context, fp32_logits, tp=tp, compute=compute)
