"""The "linear_attention" mixer kind: Gated DeltaNet (qwen3_next, qwen3_5; models/spec.LinearAttentionSpec), in
the order every backend runs it.

    q, k, v, z, b, a = in_proj(input_norm(x))        ops.linear (one fused projection, `lin_in`)
    q, k, v = silu(causal_conv1d(q | k | v))        ops.mixer(i).mix: the conv state holds the last K - 1 inputs
    q, k    = l2norm(q), l2norm(k)
    beta    = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)
    o       = gated delta rule (q, k, v, g, beta)   the recurrent state [v_heads, k_dim, v_dim] carries on
    y       = rms_norm(o) * w * silu(z)             per value head (RMSNormGated)
    x      += out_proj(y)                           sublayer_out; tap model.layers.{i}.linear_attn

Backends: `backends/numpy/linear_attention.py` (the reference: the recurrent rule for decode and verify,
the chunked rule for prefill, and the states with their rollback), `backends/cuda/linear_attention.py` (the
kernels' launches, the states in rings of per-position slots on the device).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from .mixers import MixerKind, register_mixer
from .ops import sublayer_out

if TYPE_CHECKING:
    from ..models.spec import LayerSpec, LinearAttentionSpec
    from .ops import X, Ops


class LinearAttentionOps(Protocol):
    def mix(self, proj: X, layer: int, spec: LinearAttentionSpec, lw: dict[str, Any]) -> X:
        """The projected rows [T, in_size] -> the gated-normed rule output [T, v_dim]; advances the layer's
        conv and recurrent states by the T tokens."""
        ...


def forward(ops: Ops, i: int, layer: LayerSpec, lw: dict[str, Any], x: X) -> X:
    p = f"model.layers.{i}"
    proj = ops.linear(x, lw["lin_in"], out="lin_in", norm=(lw["input_norm"], layer.norm))
    lin: LinearAttentionOps = ops.mixer(i)
    y = lin.mix(proj, i, layer.mixer, lw)
    return sublayer_out(ops, y, lw["lin_out"], None, lw.get("attn_out_norm"), layer.norm, x,
                        f"{p}.linear_attn", f"{p}.post_attention_layernorm")


def tap_names(p: str, layer: LayerSpec) -> list[str]:
    return [f"{p}.linear_attn"] + ([f"{p}.post_attention_layernorm"] if "attn_out_norm" in layer.keys() else [])


LINEAR_ATTENTION = register_mixer(MixerKind(
    "linear_attention", forward, tap_names, backends={"numpy": "metrale_cli.backends.numpy.linear_attention",
                                            "cuda": "metrale_cli.backends.cuda.linear_attention"}))
