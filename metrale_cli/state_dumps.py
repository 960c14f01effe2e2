"""State dumps (`--dump-state PATH`): the recurrent and conv states of a model's linear-attention layers after
the command's passes, as safetensors written atomically, to compare with another engine's state directly.

Tensors `model.layers.{i}.linear_attn.conv_state` [conv_dim, kernel - 1] (the last kernel - 1 conv inputs,
oldest first; transformers' cache keeps one more, the oldest, which is never read again) and
`model.layers.{i}.linear_attn.recurrent_state` [v_heads, k_head_dim, v_head_dim], fp32; the metadata says
how many positions the state has consumed (`position`). Each mixer kind's state offers them through
`tensors()` (a state without one, a KV cache, is not dumped).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .dumps import commit
from .errors import UsageError

STATEFUL_KINDS = ("linear_attention",)


def check_state_dump(path: str, definition: Any) -> Path:
    """The --dump-state target, refused before anything loads: a .safetensors path, a model with a state."""
    p = Path(path)
    if p.suffix.lower() != ".safetensors":
        raise UsageError(f"--dump-state writes .safetensors, got {path!r}")
    if p.is_dir():
        raise UsageError(f"--dump-state {path} is a directory")
    if not any(layer.mixer.kind in STATEFUL_KINDS for layer in definition.layers):
        raise UsageError(f"--dump-state: {definition.family} has no recurrent state (no linear-attention layers)")
    return p


def state_tensors(engine: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for st in getattr(engine, "states", {}).values():
        tensors = getattr(st, "tensors", None)
        if tensors is not None:
            out.update(tensors())
    if not out:
        raise UsageError(f"--dump-state: the {engine.device} engine does not expose its state")
    return out


def write_state_dump(path: Path, engine: Any) -> None:
    import numpy as np

    tensors = state_tensors(engine)
    header: dict[str, Any] = {"__metadata__": {"format": "metrale-state", "position": str(engine.length)}}
    data, offset = [], 0
    for name in sorted(tensors, key=lambda n: (int(n.split(".")[2]), n)):
        a = np.ascontiguousarray(tensors[name], dtype=np.float32)
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        data.append(memoryview(a).cast("B"))
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    commit([(path, [len(raw).to_bytes(8, "little"), raw, *data])])
