"""Tensor parallelism simulated on one CPU: N ranks' shards run in lockstep, all-reduces are sums.

This is the NumPy reference for the multi-GPU engine: every rank holds exactly the weights
`sharding.shard_weights` gives it and runs engine/loop.py with NumPy's ops over its own heads and its
own KV cache; where the GPUs would all-reduce (after the row-parallel o and down projections, after a
mixture-of-experts block whose experts are split over the ranks, and to assemble vocabulary-parallel
embedding rows) the partial results are summed; lm_head rows of each
rank's vocabulary range are concatenated as a gather would. Comparing it with the unsharded NumPy
engine checks the sharding plan for every family without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Sequence

import numpy as np

from ..backends.numpy.attention import KVCache
from ..backends.numpy.engine import NumpyPass
from ..backends.numpy.ops import rms_norm, softcap
from ..backends.numpy.stored import matmul, rows as table_rows
from ..engine.longrope import long_factors
from ..engine.loop import decoder_forward
from ..models.spec import AttentionSpec, ModelDefinition, MoeSpec
from ..models.weights import Weights
from .sharding import (COLUMN, ROW, VOCAB, check_tp, kind_of, rank_definition, rank_mlp, shard_weights,
                       vocab_range)


@dataclass
class Sharded:
    """One weight as every rank holds it."""

    kind: str  # sharding.COLUMN | ROW | VOCAB | REPLICATED
    parts: list[Any]  # per rank


class PerRank(list):
    """An activation that differs per rank (the output of a column-parallel projection)."""


class _RankState:
    """What NumpyPass reads of an engine: one rank's definition, KV cache (its KV heads only) and length."""

    def __init__(self, definition: ModelDefinition, max_context: int) -> None:
        self.cfg = SimpleNamespace(definition=definition)
        self.states = {"attention": KVCache(definition, max_context, rows=max_context)}  # no ring: every position kept
        self.length = 0
        self._inv: dict[object, np.ndarray] = {}

    def inv_freq(self, rope, long: bool = False) -> np.ndarray:
        return self._inv.setdefault((rope, long), rope.inv_freq(long))


class _LockstepPass:
    """engine/loop.py's ops over all ranks at once."""

    def __init__(self, sim: SimulatedTensorParallel, ids: np.ndarray) -> None:
        self.sim, self.ids = sim, ids
        # longrope: the call's factor set (the engine's recomputation at a switch is not simulated)
        long = long_factors(sim.definition, sim.states[0].length + len(ids))
        self.ranks = [NumpyPass(state, ids, long=long) for state in sim.states]

    def embed(self, table: Sharded, scale=None):
        vocab = self.sim.vocab
        total = np.zeros((len(self.ids), table.parts[0].shape[1]), np.float32)
        for r, part in enumerate(table.parts):  # each rank looks up the ids in its range; all-reduce
            rows = vocab_range(vocab, r, self.sim.n)
            mine = (self.ids >= rows.start) & (self.ids < rows.stop)
            total[mine] += table_rows(part, self.ids[mine] - rows.start)
        return total if scale is None else total * np.float32(scale)

    def linear(self, x, w: Sharded, bias=None, *, out, norm=None, residual=None, tap=None, reduce=False):
        if norm is not None:
            x = rms_norm(x, norm[0].parts[0], norm[1].eps, norm[1].offset)
        if w.kind == COLUMN:
            return PerRank(matmul(x, wr) + (0 if bias is None else bias.parts[r]) for r, wr in enumerate(w.parts))
        assert w.kind == ROW, w.kind
        y = sum(matmul(xr, wr) for xr, wr in zip(x, w.parts))  # the all-reduce
        if bias is not None:
            y = y + bias.parts[0]  # replicated: added once, after the sum
        if tap is not None:
            self.tap(tap, y)
        return y if residual is None else residual + y

    def norm(self, x, weight: Sharded, norm, *, out, residual=None, tap=None):
        y = rms_norm(x, weight.parts[0], norm.eps, norm.offset)  # replicated: on the all-reduced rows
        return y if residual is None else residual + y

    def gated_mlp(self, x, w_gate_up: Sharded, *, norm, activation):
        h = rms_norm(x, norm[0].parts[0], norm[1].eps, norm[1].offset)
        return PerRank(rank.gated_mlp(h, wr, norm=None, activation=activation)
                       for rank, wr in zip(self.ranks, w_gate_up.parts))

    def route(self, x, w_router: Sharded, spec: MoeSpec, *, norm, bias=None, correction=None):
        # replicated router: every rank computes this same route; rank 0's stands for all
        return self.ranks[0].route(x, w_router.parts[0], spec, norm=(norm[0].parts[0], norm[1]),
                                  bias=_part(bias, 0), correction=_part(correction, 0))

    def experts(self, x, route, w_gate_up: Sharded, w_down: Sharded, spec: MoeSpec, *, norm, shared, tap, bias=None):
        norm = (norm[0].parts[0], norm[1])
        y = sum(rank.experts_partial(x, route, w_gate_up.parts[r], w_down.parts[r], rank_mlp(spec, r, self.sim.n),
                                     norm=norm, shared=None if shared is None else (shared[0].parts[r],
                                                                                    shared[1].parts[r]),
                                     bias=None if bias is None else (bias[0].parts[r], bias[1].parts[r]))
                for r, rank in enumerate(self.ranks))  # each rank's experts and shared columns; the all-reduce
        self.tap(tap, y)
        return x + y

    def mixer(self, layer: int):
        return self  # attention (the only mixer kind tensor parallelism splits: parallel/sharding.py)

    def rope_kv_append(self, qkv: PerRank, layer: int, a: AttentionSpec, q_norm, k_norm, norm):
        return PerRank(rank.mixer(layer).rope_kv_append(qkv[r], layer, self.sim.spec(r, layer), _part(q_norm, r),
                                                        _part(k_norm, r), norm) for r, rank in enumerate(self.ranks))

    def attention(self, q: PerRank, layer: int, a: AttentionSpec, *, sinks=None):
        return PerRank(rank.mixer(layer).attention(q[r], layer, self.sim.spec(r, layer), sinks=_part(sinks, r))
                       for r, rank in enumerate(self.ranks))

    def tap(self, name: str, x) -> None:
        pass


def _part(w: Sharded | None, r: int):
    return None if w is None else w.parts[r]


class SimulatedTensorParallel:
    """prefill / decode of an N-way sharded model on the CPU; logits rows in fp32."""

    def __init__(self, definition: ModelDefinition, weights: Weights, n: int, max_context: int) -> None:
        check_tp(definition, n)
        self.n, self.definition = n, definition
        self.vocab = weights.lm_head.shape[0]
        shards = [shard_weights(definition, weights, r, n) for r in range(n)]
        self.rank_definitions = [rank_definition(definition, r, n) for r in range(n)]
        self.states = [_RankState(d, max_context) for d in self.rank_definitions]
        layers = [{key: Sharded(kind_of(key), [s.layers[i][key] for s in shards]) for key in lw}
                  for i, lw in enumerate(weights.layers)]
        self.weights = Weights(embed=Sharded(VOCAB, [s.embed for s in shards]),
                               final_norm=Sharded(kind_of("final_norm"), [s.final_norm for s in shards]),
                               lm_head=Sharded(VOCAB, [s.lm_head for s in shards]), layers=layers)

    def spec(self, rank: int, layer: int) -> AttentionSpec:
        return self.rank_definitions[rank].layers[layer].mixer

    def forward(self, tokens: Sequence[int]) -> np.ndarray:
        """Run tokens at the next positions; the logits rows [T, V] gathered from every rank's range."""
        ids = np.asarray(tokens, dtype=np.int64)
        h = decoder_forward(_LockstepPass(self, ids), self.definition, self.weights)
        for state in self.states:
            state.length += len(ids)
        logits = np.concatenate([matmul(h, part) for part in self.weights.lm_head.parts], axis=1)
        cap = self.definition.final_logit_softcap
        return logits if cap is None else softcap(logits, cap)
