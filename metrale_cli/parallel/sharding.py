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
- expert-parallel (mixture-of-experts layers): `experts_gate_up` / `experts_down` split by whole
  experts, rank r holding experts [r*E/N, (r+1)*E/N). The `router` is replicated, so every rank routes
  every token alike (same softmax, same top-k) and computes only the chosen experts it holds, each
  weighted as without sharding; a rank's block output is a partial sum, summed by the all-reduce that
  follows the MLP. A shared expert (qwen2_moe) is a dense MLP: `shared_gate_up` column-, `shared_down`
  row-parallel, in the same all-reduce; its sigmoid gate (the router's last row) is a per-token scalar,
  applied rank-locally to the partial (gate * sum of partials = sum of gate * partial);
- replicated: every norm weight, q/k norms, the router.
The plan depends only on the definition's param keys and shapes, so every family that uses those keys
shards without code of its own; dense layers of a sparse model (mlp_only_layers) shard as dense.

The slices are contiguous ranges, copied with the backend's `concat` (np.concatenate, cupy.concatenate),
so the same plan cuts NumPy arrays, memory maps and device arrays; `RankShard` applies it while the
weights load (load_weights' `shard`), one layer at a time, so a rank never holds the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..errors import UsageError
from ..models.spec import AttentionSpec, LayerSpec, MlpSpec, ModelDefinition, MoeSpec
from ..models.weights import Weights

if TYPE_CHECKING:
    from ..config import ModelConfig

COLUMN, ROW, VOCAB, EXPERT, REPLICATED = "column", "row", "vocab", "expert", "replicated"
KINDS = {"qkv": COLUMN, "qkv_bias": COLUMN, "gate_up": COLUMN, "o": ROW, "down": ROW,
         "shared_gate_up": COLUMN, "shared_down": ROW, "experts_gate_up": EXPERT, "experts_down": EXPERT,
         "experts_gate_up_bias": EXPERT, "experts_down_bias": EXPERT,
         "embed": VOCAB, "lm_head": VOCAB}


def kind_of(key: str) -> str:
    """How `key` is split: qkv / qkv_bias / o by attention heads, the other COLUMN keys ([gate; up] of a
    gated MLP) and ROW keys (its down) by the MLP's intermediate axis, EXPERT keys by whole experts."""
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
    vocab = definition.embed.shape[0]
    if vocab_range(vocab, n - 1, n).stop - vocab_range(vocab, n - 1, n).start < 1:
        raise UsageError(f"--tp {n}: a vocabulary of {vocab} rows leaves the last rank none")
    for layer in definition.layers:
        a = layer.mixer
        if a.kind != "attention":  # the plan splits attention heads; another kind has no plan yet (not even
            # --tp 1, which runs the sharded path on one rank)
            raise UsageError(f"--tp {n}: layers of kind '{a.kind}' have no tensor-parallel split yet (leave --tp out)")
        if n > 1 and a.sinks:
            raise UsageError(f"--tp {n}: attention sinks have no tensor-parallel split yet (use --tp 1)")
        if n > 1 and a.output_gate:
            raise UsageError(f"--tp {n}: the attention output gate has no tensor-parallel split yet (use --tp 1)")
        if a.num_heads % n:
            raise UsageError(f"--tp {n} does not divide num_attention_heads {a.num_heads}")
        if (a.num_kv_heads % n) if n <= a.num_kv_heads else (n % a.num_kv_heads):
            raise UsageError(f"--tp {n} and num_key_value_heads {a.num_kv_heads}: one must divide the other")
        m = layer.mlp
        if isinstance(m, MoeSpec):
            if m.num_experts % n:
                raise UsageError(f"--tp {n} does not divide the {m.num_experts} experts (num_experts)")
            if m.shared_expert_size and m.shared_expert_size % n:
                raise UsageError(f"--tp {n} does not divide shared_expert_intermediate_size {m.shared_expert_size}")
        elif m.intermediate_size % n:
            raise UsageError(f"--tp {n} does not divide intermediate_size {m.intermediate_size}")


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


def expert_range(num_experts: int, rank: int, n: int) -> range:
    """The experts rank `rank` holds (num_experts % n == 0, check_tp)."""
    per = num_experts // n
    return range(rank * per, (rank + 1) * per)


def rank_mlp(mlp: MlpSpec | MoeSpec, rank: int, n: int) -> MlpSpec | MoeSpec:
    """A rank's share of an MLP: the dense width / n, or its experts (routing still over all of them)
    and the shared expert's width / n."""
    if not isinstance(mlp, MoeSpec):
        return replace(mlp, intermediate_size=mlp.intermediate_size // n)
    held = expert_range(mlp.num_experts, rank, n)
    shared = mlp.shared_expert_size // n if mlp.shared_expert_size else mlp.shared_expert_size
    return replace(mlp, first_expert=held.start, held_experts=len(held), shared_expert_size=shared)


def rank_definition(definition: ModelDefinition, rank: int, n: int) -> ModelDefinition:
    """The definition one rank runs: its heads and its share of the MLP (params keep their full names)."""
    layers = []
    for layer in definition.layers:
        a = layer.mixer
        lay = layout(a, rank, n)
        attention = replace(a, num_heads=len(lay.q_heads), num_kv_heads=len(lay.kv_heads))
        layers.append(LayerSpec(attention, rank_mlp(layer.mlp, rank, n), layer.norm, layer.params))
    return replace(definition, layers=tuple(layers))


def _concat(parts: list[Any]) -> Any:
    return np.concatenate(parts, axis=0)


def shard_layer(layer: LayerSpec, weights: dict[str, Any], rank: int, n: int,
                concat: Callable[[list[Any]], Any] = _concat) -> dict[str, Any]:
    """Rank `rank`'s slice of one layer's weights: contiguous row / column ranges of each array, joined
    (and copied, so nothing keeps the whole tensor alive) by `concat` along the rows."""
    a = layer.mixer
    lay = layout(a, rank, n)
    d, q_size, kv_size = a.head_dim, a.q_size, a.kv_size
    q = (lay.q_heads.start * d, lay.q_heads.stop * d)  # columns of o, rows of the q block of qkv
    kv = (lay.kv_heads.start * d, lay.kv_heads.stop * d)
    qkv_rows = [q, (q_size + kv[0], q_size + kv[1]), (q_size + kv_size + kv[0], q_size + kv_size + kv[1])]

    def mine(width: int) -> tuple[int, int]:  # this rank's range of an MLP's intermediate axis
        per = width // n
        return rank * per, (rank + 1) * per

    out = {}
    for key, w in weights.items():
        kind = kind_of(key)
        if key in ("qkv", "qkv_bias"):
            out[key] = concat([w[lo:hi] for lo, hi in qkv_rows])
        elif key == "o":
            out[key] = concat([w[:, q[0]:q[1]]])
        elif kind == COLUMN:  # a gated MLP's [gate; up]: the same range of the gate half and the up half
            inter = w.shape[0] // 2
            lo, hi = mine(inter)
            out[key] = concat([w[lo:hi], w[inter + lo:inter + hi]])
        elif kind == ROW:  # the MLP's down projection: its input columns of the intermediate axis
            lo, hi = mine(w.shape[1])
            out[key] = concat([w[:, lo:hi]])
        elif kind == EXPERT:  # stacked [E, ...]: whole experts
            held = expert_range(w.shape[0], rank, n)
            out[key] = concat([w[held.start:held.stop]])
        else:
            out[key] = w
    return out


def shard_weights(definition: ModelDefinition, w: Weights, rank: int, n: int) -> Weights:
    """Rank `rank`'s weights; embed and lm_head hold its vocabulary range."""
    rows = vocab_range(w.lm_head.shape[0], rank, n)
    layers = [shard_layer(layer, lw, rank, n) for layer, lw in zip(definition.layers, w.layers)]
    return Weights(embed=w.embed[rows.start:rows.stop], final_norm=w.final_norm,
                   lm_head=w.lm_head[rows.start:rows.stop], layers=layers)


@dataclass
class RankShard:
    """load_weights' `shard` for rank `rank` of `n`: each layer cut as it is read, the embedding and
    lm_head to the rank's vocabulary range (copied by `concat`, so the whole table can be freed)."""

    definition: ModelDefinition
    rank: int
    n: int
    concat: Callable[[list[Any]], Any] = _concat

    def layer(self, i: int, weights: dict[str, Any]) -> dict[str, Any]:
        return shard_layer(self.definition.layers[i], weights, self.rank, self.n, self.concat)

    def vocab(self, table: Any) -> Any:
        rows = vocab_range(table.shape[0], self.rank, self.n)
        return self.concat([table[rows.start:rows.stop]])


def rank_config(cfg: ModelConfig, rank: int, n: int) -> ModelConfig:
    """The config one rank's engine is built from: its head counts and MLP width (which size its
    buffers), its experts (cfg.moe), its definition (rank_definition); vocab_size stays the model's
    (token ids are global)."""
    definition = rank_definition(cfg.definition, rank, n)
    a = definition.layers[0].mixer
    moe = None if cfg.moe is None else replace(cfg.moe, spec=rank_mlp(cfg.moe.spec, rank, n))
    out = replace(cfg, num_attention_heads=a.num_heads, num_key_value_heads=a.num_kv_heads,
                  intermediate_size=cfg.intermediate_size // n, moe=moe)
    out.__dict__["definition"] = definition  # the cached_property's slot: not re-derived from the fields
    return out
