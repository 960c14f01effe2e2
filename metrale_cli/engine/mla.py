"""The "mla" mixer kind: DeepSeek-V2/V3's multi-head latent attention (models/spec.MlaSpec), in the order
every backend runs it.

    q      = q_b(q_a_norm(q_a(h))) or q_proj(h), h = input_norm(x)    ops.linear (the input norm fused)
    kv     = kv_a_proj_with_mqa(h)                                       ops.linear
    latent = [kv_a_norm(kv[:kv_lora]); rope(kv[kv_lora:])]  -> cache    ops.mixer(i).append_latent
    chosen = the positions the indexer picks (DeepSeek sparse attention) ops.mixer(i).index
    y      = attention of rope(q) over the cached latents (the chosen)   ops.mixer(i).attention
    x     += o_proj(y)                                                   sublayer_out

The attention has two algebras that agree up to rounding: the naive form decompresses every cached latent
into per-head keys and values through kv_b_proj (as transformers computes), the absorbed form folds
kv_b_proj's key part into the query and its value part into the output, and attends over the latents
themselves (as inference engines do). A backend picks one (the NumPy engine: `--mla naive|absorbed`).

Taps: `model.layers.{i}.self_attn.kv_a_layernorm` (the normed latent [T, kv_lora_rank]), with an indexer
`model.layers.{i}.self_attn.indexer` (the chosen positions [T, topk] in ascending order, -1 last where a row sees
fewer: transformers' indexer returns them by score, padded with later positions), and `model.layers.{i}.self_attn`
(after o_proj). Backends: `backends/numpy/mla.py` (both forms) and
`backends/cuda/mla.py` (the absorbed form over a bf16 latent cache).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from .mixers import MixerKind, register_mixer
from .ops import sublayer_out

if TYPE_CHECKING:
    from ..models.spec import LayerSpec, MlaSpec
    from .ops import X, Ops

FORMS = ("naive", "absorbed")  # the attention algebras a backend may run (the NumPy engine's --mla)


class MlaOps(Protocol):
    """What a backend's latent attention does in one pass of T rows (`ops.mixer(i)`)."""

    def append_latent(self, kv: X, layer: int, spec: MlaSpec, kv_norm: Any) -> X:
        """Norm the latent, rotate the shared key, append both to the cache; returns the normed latent."""
        ...

    def index(self, q_idx: X, k_idx: X, weights: X, layer: int, spec: MlaSpec, k_norm: tuple[Any, Any]) -> X:
        """The indexer (spec.indexer): its key of each row appended to its cache, then per row the positions
        [T, min(topk, start + T)] it scores highest among those it may see, in ascending order; -1 fills the end of
        the row of a query that sees fewer than topk positions."""
        ...

    def last_index(self) -> X:
        """The positions the last `index` of this pass chose (a shared indexer layer attends to them)."""
        ...

    def attention(self, q: X, layer: int, spec: MlaSpec, kv_b: Any, chosen: X | None = None) -> X:
        """[T, heads * v_head_dim]: the rope part of q rotated, attention over positions 0..start+T-1 (of those, only
        the `chosen` ones of each row when given)."""
        ...


def forward(ops: Ops, i: int, layer: LayerSpec, lw: dict[str, Any], x: X) -> X:
    m, p = layer.mixer, f"model.layers.{i}"
    norm = (lw["input_norm"], layer.norm)
    qa = None
    if m.q_lora_rank is not None:
        qa = ops.linear(x, lw["q_a"], out="q_a", norm=norm)
        q = ops.linear(qa, lw["q_b"], out="q", norm=(lw["q_a_norm"], m.latent_norm))
    else:
        q = ops.linear(x, lw["q"], out="q", norm=norm)
    kv = ops.linear(x, lw["kv_a"], out="kv_a", norm=norm)
    mla: MlaOps = ops.mixer(i)
    ops.tap(f"{p}.self_attn.kv_a_layernorm", mla.append_latent(kv, i, m, lw["kv_a_norm"]))
    chosen = None
    if m.indexer is not None and m.indexer.shared:  # GLM-5's shared layers: the last indexer's choice
        chosen = mla.last_index()
    elif m.indexer is not None:  # DeepSeek sparse attention (its spec says the q_lora form: parse refuses q_proj)
        iq = ops.linear(qa, lw["idx_q"], out="idx_q", norm=(lw["q_a_norm"], m.latent_norm))
        ik = ops.linear(x, lw["idx_k"], out="idx_k", norm=norm)
        iw = ops.linear(x, lw["idx_w"], out="idx_w", norm=norm)
        chosen = mla.index(iq, ik, iw, i, m, (lw["idx_k_norm"], lw["idx_k_norm_bias"]))
        ops.tap(f"{p}.self_attn.indexer", chosen)
    y = mla.attention(q, i, m, lw["kv_b"], chosen)
    return sublayer_out(ops, y, lw["o"], None, None, layer.norm, x, f"{p}.self_attn", f"{p}.post_attention_layernorm")


def tap_names(p: str, layer: LayerSpec) -> list[str]:
    ix = layer.mixer.indexer
    indexer = [f"{p}.self_attn.indexer"] if ix is not None and not ix.shared else []
    return [f"{p}.self_attn.kv_a_layernorm", *indexer, f"{p}.self_attn"]


MLA = register_mixer(MixerKind("mla", forward, tap_names, backends={"numpy": "metrale_cli.backends.numpy.mla",
                                                                    "cuda": "metrale_cli.backends.cuda.mla"}))
