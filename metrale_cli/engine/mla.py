"""The "mla" mixer kind: DeepSeek-V2/V3's multi-head latent attention (models/spec.MlaSpec), in the order
every backend runs it.

    q      = q_b(q_a_norm(q_a(h))) or q_proj(h), h = input_norm(x)    ops.linear (the input norm fused)
    kv     = kv_a_proj_with_mqa(h)                                       ops.linear
    latent = [kv_a_norm(kv[:kv_lora]); rope(kv[kv_lora:])]  -> cache    ops.mixer(i).append_latent
    y      = attention of rope(q) over the cached latents                ops.mixer(i).attention
    x     += o_proj(y)                                                   sublayer_out

The attention has two algebras that agree up to rounding: the naive form decompresses every cached latent
into per-head keys and values through kv_b_proj (as transformers computes), the absorbed form folds
kv_b_proj's key part into the query and its value part into the output, and attends over the latents
themselves (as inference engines do). A backend picks one (the NumPy engine: `--mla naive|absorbed`).

Taps: `model.layers.{i}.self_attn.kv_a_layernorm` (the normed latent [T, kv_lora_rank]) and
`model.layers.{i}.self_attn` (after o_proj). Backends: `backends/numpy/mla.py` (both forms) and
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

    def attention(self, q: X, layer: int, spec: MlaSpec, kv_b: Any) -> X:
        """[T, heads * v_head_dim]: the rope part of q rotated, attention over positions 0..start+T-1."""
        ...


def forward(ops: Ops, i: int, layer: LayerSpec, lw: dict[str, Any], x: X) -> X:
    m, p = layer.mixer, f"model.layers.{i}"
    norm = (lw["input_norm"], layer.norm)
    if m.q_lora_rank is not None:
        qa = ops.linear(x, lw["q_a"], out="q_a", norm=norm)
        q = ops.linear(qa, lw["q_b"], out="q", norm=(lw["q_a_norm"], m.latent_norm))
    else:
        q = ops.linear(x, lw["q"], out="q", norm=norm)
    kv = ops.linear(x, lw["kv_a"], out="kv_a", norm=norm)
    mla: MlaOps = ops.mixer(i)
    ops.tap(f"{p}.self_attn.kv_a_layernorm", mla.append_latent(kv, i, m, lw["kv_a_norm"]))
    y = mla.attention(q, i, m, lw["kv_b"])
    return sublayer_out(ops, y, lw["o"], None, None, layer.norm, x, f"{p}.self_attn", f"{p}.post_attention_layernorm")


def tap_names(p: str, layer: LayerSpec) -> list[str]:
    return [f"{p}.self_attn.kv_a_layernorm", f"{p}.self_attn"]


MLA = register_mixer(MixerKind("mla", forward, tap_names, backends={"numpy": "metrale_cli.backends.numpy.mla",
                                                                    "cuda": "metrale_cli.backends.cuda.mla"}))
