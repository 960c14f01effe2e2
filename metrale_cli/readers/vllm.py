"""vLLM's intermediate tensor logging (`--intermediate-log-config '{"enabled": true}'`, run with
--enforce-eager): a run folder of `step_{s}/` folders (one per forward step), each holding one folder per
module named by its path (`model.layers.0.self_attn.qkv_proj`), which holds `outputs_{device}.pt` (a tensor
output) or `outputs_{i}_{device}.pt` (element i of a tuple output), and `inputs_{i}_{device}.pt`. The device
(`cuda_0`, `cuda_1`, ...) is the TP rank. A module called again in the same step gets a folder suffixed
`_{call}`: the rotary embedding, one module shared by every layer, is `...layers.0.self_attn.rotary_emb_{i}`
for layer i. The token ids are embed_tokens' input, the positions the rotary embedding's first input.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ..errors import InputError
from . import torch_pickle
from .names import Raw

_FILE = re.compile(r"(outputs|inputs)((?:_\d+)*)_([a-z]+)_(\d+)\.pt")
_STEP = re.compile(r"step_(\d+)")
_ROPE = re.compile(r"(.*\.layers\.)0(\.self_attn\.rotary_emb)_(\d+)")


def is_run(p: Path) -> bool:
    return p.is_dir() and (any(_STEP.fullmatch(d.name) for d in p.iterdir() if d.is_dir()) or _is_step(p))


def _is_step(p: Path) -> bool:
    return any(d.is_dir() and any(_FILE.fullmatch(f.name) for f in d.iterdir()) for d in p.iterdir())


def read(p: Path, where: str) -> list[Raw]:
    """Every step of a run folder (or one step folder), in step order."""
    steps = sorted(((int(m.group(1)), d) for d in p.iterdir() if d.is_dir() and (m := _STEP.fullmatch(d.name))))
    dirs = [d for _, d in steps] or ([p] if _is_step(p) else [])
    if not dirs:
        raise InputError(f"{where}: no step_N folders of module dumps: not a vLLM intermediate-logging run")
    return [_step(d, where) for d in dirs]


def _step(d: Path, where: str) -> Raw:
    tensors: dict[str, dict[int, np.ndarray]] = {}
    tokens = positions = None
    names = {m.name for m in d.iterdir() if m.is_dir()}
    for mod in sorted(d.iterdir()):
        if not mod.is_dir():
            continue
        name = mod.name
        rope = _ROPE.fullmatch(name)
        if rope:
            name = f"{rope.group(1)}{rope.group(3)}{rope.group(2)}"
        elif re.fullmatch(r".+_\d+", name) and name.rsplit("_", 1)[0] in names:
            continue  # a later call of a module already read
        for f in sorted(mod.iterdir()):
            m = _FILE.fullmatch(f.name)
            if m is None:
                continue
            kind, index, rank = m.group(1), m.group(2), int(m.group(4))
            value = torch_pickle.load(f, f"{where}: {d.name}/{mod.name}/{f.name}")
            if not isinstance(value, torch_pickle.Tensor):
                continue
            if kind == "inputs":
                if index == "_0" and rank == 0 and name.endswith("embed_tokens"):
                    tokens = [int(t) for t in value.array.reshape(-1)]
                if index == "_0" and rank == 0 and name.endswith("layers.0.self_attn.rotary_emb"):
                    positions = [int(t) for t in value.array.reshape(-1)]
                continue
            key = name + (f"#{index.split('_')[1]}" if index else "")
            tensors.setdefault(key, {})[rank] = value.array
    return Raw({k: _ranked(k, v, where) for k, v in tensors.items()}, positions, tokens)


def _ranked(name: str, by_rank: dict[int, np.ndarray], where: str) -> list[np.ndarray]:
    """The shards in device order (a folder per rank, --tp-dirs, holds one device each)."""
    return [by_rank[r] for r in sorted(by_rank)]
