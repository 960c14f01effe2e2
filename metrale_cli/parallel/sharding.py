"""The tensor-parallel plan: which engine weight is split how over N ranks, and the per-rank definition.

Megatron style, as vLLM and gpt-fast shard a decoder:
- column-parallel (each rank holds some output rows, its input is the full replicated activation):
  `qkv` and its bias split by heads (query heads N ways; KV heads N ways, or replicated when N exceeds
  num_key_value_heads: rank r then holds the KV head its query heads read), `gate_up` split by the
  intermediate axis (the gate half and the up half alike, so act(gate) * up stays rank-local);
- row-parallel (each rank holds some input columns and produces a partial sum): `o` and `down`; their
  outputs are summed across ranks (one all-reduce after attention, one after the MLP) and the bias is
  added once, after the sum;
- vocabulary-parallel: `embed` rows and `lm_head` rows split by vocabulary range (a rank's embedding
  lookup gives zeros outside its range and the all-reduce assembles the rows; each rank computes the
  logits of its range and they are gathered, or reduced to an argmax);
- replicated: every norm weight, q/k norms.
The plan depends only on the definition's param keys and shapes, so every family that uses those keys
shards without code of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import UsageError
from ..models.spec import AttentionSpec, LayerSpec, ModelDefinition
from ..models.weights import Weights

COLUMN, ROW, VOCAB, REPLICATED = "column", "row", "vocab", "replicated"
KINDS = {"qkv": COLUMN, "qkv_bias": COLUMN, "gate_up": COLUMN, "o": ROW, "down": ROW,
         "embed": VOCAB, "lm_head": VOCAB}


def kind_of(key: str) -> str:
    return KINDS.get(key, REPLICATED)


@dataclass(frozen=True)
class RankLayout:
    """Which heads of a layer rank `rank` of `n` holds."""

    rank: int
    n: int
    q_heads: range  # query heads of the full model
    kv_heads: range  # KV heads of the full model (one, shared with other ranks, when n > num_kv_heads)


def check_tp(definition: ModelDefinition, n: int) -> None:
    """Refuse a degree the model cannot be split into (a UsageError naming the dimension)."""
    if n < 1:
        raise UsageError(f"--tp must be >= 1, got {n}")
    for layer in definition.layers:
        a = layer.attention
        if a.num_heads % n:
            raise UsageError(f"--tp {n} does not divide num_attention_heads {a.num_heads}")
        if (a.num_kv_heads % n) if n <= a.num_kv_heads else (n % a.num_kv_heads):
            raise UsageError(f"--tp {n} and num_key_value_heads {a.num_kv_heads}: one must divide the other")
        if layer.mlp.intermediate_size % n:
            raise UsageError(f"--tp {n} does not divide intermediate_size {layer.mlp.intermediate_size}")


def layout(a: AttentionSpec, rank: int, n: int) -> RankLayout:
    per_q = a.num_heads // n
    q = range(rank * per_q, (rank + 1) * per_q)
    if n <= a.num_kv_heads:
        per_kv = a.num_kv_heads // n
        kv = range(rank * per_kv, (rank + 1) * per_kv)
    else:  # more ranks than KV heads: each rank keeps the one KV head its query heads read
        head = q.start // a.n_rep
        kv = range(head, head + 1)
    return RankLayout(rank, n, q, kv)


def vocab_range(vocab: int, rank: int, n: int) -> range:
    """Rows of the embedding / lm_head rank `rank` holds (ceil-split: the last rank may hold fewer)."""
    per = -(-vocab // n)
    return range(min(rank * per, vocab), min((rank + 1) * per, vocab))


def rank_definition(definition: ModelDefinition, rank: int, n: int) -> ModelDefinition:
    """The definition one rank runs: its heads and its share of the MLP (params keep their full names)."""
    layers = []
    for layer in definition.layers:
        a = layer.attention
        lay = layout(a, rank, n)
        attention = replace(a, num_heads=len(lay.q_heads), num_kv_heads=len(lay.kv_heads))
        mlp = replace(layer.mlp, intermediate_size=layer.mlp.intermediate_size // n)
        layers.append(LayerSpec(attention, mlp, layer.norm, layer.params))
    return replace(definition, layers=tuple(layers))


def shard_layer(layer: LayerSpec, weights: dict[str, Any], rank: int, n: int) -> dict[str, Any]:
    """Rank `rank`'s slice of one layer's weights (any array type with NumPy slicing and `concat`)."""
    a = layer.attention
    lay = layout(a, rank, n)
    d, q_size, kv_size = a.head_dim, a.q_size, a.kv_size
    q_rows = np.arange(lay.q_heads.start * d, lay.q_heads.stop * d)
    kv_rows = np.arange(lay.kv_heads.start * d, lay.kv_heads.stop * d)
    qkv_rows = np.concatenate([q_rows, q_size + kv_rows, q_size + kv_size + kv_rows])
    inter = layer.mlp.intermediate_size
    per = inter // n
    mine = np.arange(rank * per, (rank + 1) * per)
    gate_up_rows = np.concatenate([mine, inter + mine])
    out = {}
    for key, w in weights.items():
        if key in ("qkv", "qkv_bias"):
            out[key] = w[qkv_rows]
        elif key == "gate_up":
            out[key] = w[gate_up_rows]
        elif key == "o":
            out[key] = w[:, q_rows]
        elif key == "down":
            out[key] = w[:, mine]
        else:
            out[key] = w
    return out


def shard_weights(definition: ModelDefinition, w: Weights, rank: int, n: int) -> Weights:
    """Rank `rank`'s weights; embed and lm_head hold its vocabulary range."""
    rows = vocab_range(w.lm_head.shape[0], rank, n)
    layers = [shard_layer(layer, lw, rank, n) for layer, lw in zip(definition.layers, w.layers)]
    return Weights(embed=w.embed[rows.start:rows.stop], final_norm=w.final_norm,
                   lm_head=w.lm_head[rows.start:rows.stop], layers=layers)
