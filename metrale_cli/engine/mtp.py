"""A multi-token-prediction layer's pass (models/mtp.py), written once for every backend that runs one.

Rows are the tokens x_p at positions p with `previous` [T, H], the main model's hidden rows (after its final norm)
at p - 1, or, for a draft beyond the first, the MTP layer's own output row at p - 1 (the value its logits come
from, as transformers chains one MTP layer's output into the next)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .loop import decoder_block
from .ops import Ops, X

if TYPE_CHECKING:
    from ..models.spec import ModelDefinition
    from ..models.weights import Weights


def mtp_forward(ops: Ops, definition: ModelDefinition, w: Weights, previous: X) -> X:
    """eh_proj([enorm(embed(x)), hnorm(previous)]), the block, the final norm (shared_head.norm); returns the
    normed rows [T, H] the lm_head reads.

    Taps, as the one-layer model the layer is (a backend names them after the checkpoint's layer:
    backends/numpy/mtp.py): `model.embed_tokens`, `model.layers.0.enorm` / `.hnorm` / `.eh_proj`, the block's
    (engine/loop.py), `model.norm` (shared_head.norm)."""
    layer, lw = definition.layers[0], w.layers[0]
    x = ops.embed(w.embed, scale=definition.embed_scale)
    ops.tap("model.embed_tokens", x)
    e = ops.norm(x, lw["mtp_enorm"], layer.norm, out="x", tap="model.layers.0.enorm")
    h = ops.norm(previous, lw["mtp_hnorm"], layer.norm, out="h", tap="model.layers.0.hnorm")
    x = ops.linear(ops.join(e, h, out="eh"), lw["mtp_eh_proj"], out="x", tap="model.layers.0.eh_proj")
    x = decoder_block(ops, 0, layer, lw, x)
    return ops.norm(x, w.final_norm, definition.norm, out="h", tap="model.norm")
