"""The "attention" mixer kind: grouped-query / multi-query attention with rope, sliding windows, score
softcaps and attention sinks (models/spec.AttentionSpec), in the order every backend runs it.

    qkv = qkv_proj(input_norm(x))            ops.linear (the norm fused where the backend can)
    q   = rope(q); the cache gets rope(k), v ops.mixer(i).rope_kv_append (q/k norm first when the spec has it)
    a   = softmax(q k^T * scale) v           ops.mixer(i).attention (window, softcap, sinks)
    a  *= sigmoid(gate)                      ops.mixer(i).output_gate, when the spec has an output gate
    x  += o_proj(a)                          sublayer_out (through the sandwich post-norm when the layer has one)

Backends: `backends/numpy/attention.py` (the reference, and its KV cache with rings for sliding layers),
`backends/cuda/attention.py` (the kernels' launches and the bf16 KV cache).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from .mixers import MixerKind, register_mixer
from .ops import sublayer_out

if TYPE_CHECKING:
    from ..models.spec import AttentionSpec, LayerSpec, Norm
    from .ops import X, Ops


class AttentionOps(Protocol):
    """What a backend's attention implementation does in one pass of T rows (`ops.mixer(i)`)."""

    def rope_kv_append(self, qkv: X, layer: int, spec: AttentionSpec, q_norm: Any, k_norm: Any,
                       norm: Norm) -> X: ...  # rotated q [T, heads, d]; rotated k and v appended to the cache
    def attention(self, q: X, layer: int, spec: AttentionSpec, *, sinks: Any = None) -> X:
        """[T, heads * d]; `sinks` [heads]: one learned logit per head in every row's softmax (gpt-oss)."""
        ...
    def output_gate(self, y: X, qkv: X, spec: AttentionSpec) -> X:
        """y * sigmoid(gate), the gate rows of each head in the doubled q projection (spec.output_gate)."""
        ...


def forward(ops: Ops, i: int, layer: LayerSpec, lw: dict[str, Any], x: X) -> X:
    a, p = layer.mixer, f"model.layers.{i}"
    fine = getattr(ops, "fine_taps", False)
    if fine:
        ops.tap(f"{p}.input_layernorm", ops.norm(x, lw["input_norm"], layer.norm, out="h"))
    qkv = ops.linear(x, lw["qkv"], lw.get("qkv_bias"), out="qkv", norm=(lw["input_norm"], layer.norm))
    if fine:  # the projections' outputs (biases added): q (with a gate's rows when it has one), k, v
        qp = a.q_proj_size
        ops.tap(f"{p}.self_attn.q_proj", qkv[:, :qp])
        ops.tap(f"{p}.self_attn.k_proj", qkv[:, qp:qp + a.kv_size])
        ops.tap(f"{p}.self_attn.v_proj", qkv[:, qp + a.kv_size:])
    att: AttentionOps = ops.mixer(i)
    q = att.rope_kv_append(qkv, i, a, lw.get("q_norm"), lw.get("k_norm"), layer.norm)  # fine: q/k norm, rope taps
    y = att.attention(q, i, a, sinks=lw.get("sinks"))
    if a.output_gate:  # qwen3_next: y * sigmoid(gate), the gate from the doubled q projection
        y = att.output_gate(y, qkv, a)
    if fine:
        ops.tap(f"{p}.self_attn.o_proj.input", y)
    return sublayer_out(ops, y, lw["o"], lw.get("o_bias"), lw.get("attn_out_norm"), layer.norm, x,
                        f"{p}.self_attn", f"{p}.post_attention_layernorm")


def tap_names(p: str, layer: LayerSpec, fine: bool = False) -> list[str]:
    names = [f"{p}.self_attn"] + ([f"{p}.post_attention_layernorm"] if "attn_out_norm" in layer.keys() else [])
    if not fine:
        return names
    qk_norm = [f"{p}.self_attn.q_norm", f"{p}.self_attn.k_norm"] if "q_norm" in layer.keys() else []
    return ([f"{p}.input_layernorm"] + [f"{p}.self_attn.{n}_proj" for n in "qkv"] + qk_norm
            + [f"{p}.self_attn.q_rope", f"{p}.self_attn.k_rope", f"{p}.self_attn.o_proj.input"] + names)


ATTENTION = register_mixer(MixerKind(
    "attention", forward, tap_names,
    backends={"numpy": "metrale_cli.backends.numpy.attention", "cuda": "metrale_cli.backends.cuda.attention"}))
