"""The block features of a model definition as plain data, for `inspect` (cli.py) to report.

Read from the definition the engines run (not from config.json), so what inspect shows is what runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .spec import Rope

if TYPE_CHECKING:
    from .model_config import ModelConfig


def rope_info(rope: Rope) -> dict[str, Any]:
    """{"theta", "type", "scaling", "rotary_fraction"}; scaling holds the type's numbers (no factor lists)."""
    scaling: dict[str, Any] | None = None
    kind = "default"
    if rope.scaling is not None:
        s, kind = rope.scaling, "llama3"
        scaling = {"factor": s.factor, "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                   "original_max_position_embeddings": s.original_max_position_embeddings}
    elif rope.longrope is not None:
        lr, kind = rope.longrope, "longrope"
        scaling = {"original_max_position_embeddings": lr.original_max_position_embeddings,
                   "attention_factor": lr.attention_factor}
    elif rope.yarn is not None:
        y, kind = rope.yarn, "yarn"
        scaling = {"factor": y.factor, "original_max_position_embeddings": y.original_max_position_embeddings,
                   "attention_factor": y.attention_factor, "beta_fast": y.beta_fast, "beta_slow": y.beta_slow,
                   "truncate": y.truncate}
    elif rope.linear_factor != 1.0:
        kind, scaling = "linear", {"factor": rope.linear_factor}
    return {"theta": rope.theta, "type": kind, "scaling": scaling, "rotary_fraction": rope.dims / rope.head_dim}


def block_features(cfg: ModelConfig) -> dict[str, Any]:
    """Sliding layers, softcaps, norms, activation, embedding scale and the rope of each layer kind."""
    d = cfg.definition
    layers = d.layers
    attention = [(i, layer.mixer) for i, layer in enumerate(layers) if layer.mixer.kind == "attention"]
    if not attention:  # another mixer kind that rotates (latent attention): its rope and scale
        attention = [(i, layer.mixer) for i, layer in enumerate(layers) if hasattr(layer.mixer, "rope")]
    sliding = [i for i, a in attention if getattr(a, "window", None) is not None]
    first_full = next((a for _, a in attention if getattr(a, "window", None) is None),
                      attention[0][1] if attention else None)
    first_sliding = layers[sliding[0]].mixer if sliding else None
    sliding_rope = first_sliding.rope if first_sliding is not None else None
    full_rope = first_full.rope if first_full is not None else None
    return {
        "rope": rope_info(full_rope) if full_rope is not None else None,
        "sliding_layers": sliding,
        "sliding_rope": rope_info(sliding_rope) if sliding_rope not in (None, full_rope) else None,
        "attn_logit_softcapping": getattr(attention[0][1], "softcap", None) if attention else None,
        "attention_sinks": any(getattr(a, "sinks", False) for _, a in attention),  # gpt-oss: a logit per head
        "final_logit_softcapping": d.final_logit_softcap,
        "attention_scale": attention[0][1].scale if attention else None,
        "norm": "rmsnorm (1 + w)" if d.norm.offset else "rmsnorm",
        "post_norms": "attn_out_norm" in layers[0].keys(),
        "activation": layers[0].mlp.activation,
        "embed_scale": d.embed_scale,
    }


def linear_attention_info(cfg: ModelConfig) -> dict[str, Any] | None:
    """The linear-attention (Gated DeltaNet) layers and the state one sequence keeps for them (fp32, as the
    NumPy engine holds it: conv [conv_dim, kernel - 1] + recurrent [v_heads, k_head_dim, v_head_dim] per
    layer); None for a model without them."""
    layers = [(i, layer.mixer) for i, layer in enumerate(cfg.definition.layers) if layer.mixer.kind == "linear_attention"]
    if not layers:
        return None
    s = layers[0][1]
    conv = sum(m.conv_dim * (m.conv_kernel - 1) * 4 for _, m in layers)
    recurrent = sum(m.num_v_heads * m.k_head_dim * m.v_head_dim * 4 for _, m in layers)
    return {"layers": [i for i, _ in layers], "key_heads": s.num_k_heads, "key_head_dim": s.k_head_dim,
            "value_heads": s.num_v_heads, "value_head_dim": s.v_head_dim, "conv_kernel": s.conv_kernel,
            "conv_state_bytes": conv, "recurrent_state_bytes": recurrent, "state_bytes_per_sequence": conv + recurrent}
