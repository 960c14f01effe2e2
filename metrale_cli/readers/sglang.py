"""SGLang's two dump formats.

`--debug-tensor-dump-output-folder DIR`: a folder per rank, `TP{t}_PP{p}_Rank{r}_pid{pid}/`, holding one
`Pass{n:05d}.pt` per forward pass: a dict from module path to that module's output (a tensor, or a list for
a tuple output), plus `model.forward_batch_info.input_ids` / `.positions`. The dict is written when the
top-level `model` returns, so the `model` and `logits_processor` outputs of pass n land in pass n + 1's
file; they are moved back to their pass here.

The dumper (`sglang.srt.debug_utils.dumper`, DUMPER_ENABLE=1): one file per tensor, its tags in the name,
`key=value` joined by `___` (`step=0___rank=0___dump_index=3___name=attn_out___layer_id=2.pt`; older
versions `forward_pass_id=...`), holding the tensor or {"value": tensor, "meta": {...}}. Tensors are named
`model.layers.{layer_id}.{name}` when tagged with a layer, else `{name}`; `rank` is the TP rank.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError
from . import torch_pickle
from .names import Raw

RANK_DIR = re.compile(r"TP(\d+)_PP(\d+)_Rank(\d+)(?:_pid\d+)?")
_PASS = re.compile(r"Pass(\d+)\.pt")
_SHIFTED = ("model", "logits_processor")  # recorded after their pass's file was written


def is_pass_dir(p: Path) -> bool:
    return p.is_dir() and any(_PASS.fullmatch(f.name) for f in p.iterdir())


def stage_dirs(p: Path) -> list[list[Path]]:
    """The TP{t}_PP{p}_Rank{r} folders under p: per pipeline stage (in stage order), its TP ranks in TP order."""
    found = [(int(m.group(2)), int(m.group(1)), d) for d in p.iterdir()
             if d.is_dir() and (m := RANK_DIR.fullmatch(d.name))]
    stages: dict[int, list[Path]] = {}
    for pp, _, d in sorted(found, key=lambda x: x[:2]):
        stages.setdefault(pp, []).append(d)
    widths = {len(ds) for ds in stages.values()}
    if len(widths) > 1:
        raise InputError(f"{p}: the pipeline stages hold different numbers of TP ranks "
                         f"({', '.join(f'PP{s}: {len(ds)}' for s, ds in stages.items())})")
    return [stages[s] for s in sorted(stages)]


def read_passes(d: Path, where: str) -> list[Raw]:
    """One rank's Pass files, in pass order, each a Raw with a single rank."""
    files = sorted((int(m.group(1)), f) for f in d.iterdir() if (m := _PASS.fullmatch(f.name)))
    dicts = []
    for _, f in files:
        obj = torch_pickle.load(f, f"{where}: {d.name}/{f.name}")
        if not isinstance(obj, dict):
            raise InputError(f"{where}: {d.name}/{f.name} holds a {type(obj).__name__}, not a dict of tensors")
        dicts.append(obj)
    for k in range(len(dicts) - 1):  # move the late outputs back to their own pass
        for key in _SHIFTED:
            if key in dicts[k + 1]:
                dicts[k][key] = dicts[k + 1].pop(key)
    return [_raw(obj) for obj in dicts if any(not k.startswith("model.forward_batch_info") for k in obj)]


def _raw(obj: dict[str, Any]) -> Raw:
    tensors: dict[str, list[np.ndarray]] = {}
    for key, value in flatten(obj).items():
        tensors[key] = [value.array]
    ids = tensors.pop("model.forward_batch_info.input_ids", None)
    pos = tensors.pop("model.forward_batch_info.positions", None)
    tensors.pop("model.forward_batch_info.seq_lens", None)
    return Raw(tensors, None if pos is None else [int(x) for x in pos[0].reshape(-1)],
               None if ids is None else [int(x) for x in ids[0].reshape(-1)])


def flatten(obj: Any, prefix: str = "") -> dict[str, torch_pickle.Tensor]:
    """name -> tensor; a list or tuple value gives NAME#0, NAME#1, a nested dict NAME.KEY."""
    out: dict[str, torch_pickle.Tensor] = {}
    if isinstance(obj, torch_pickle.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        items = [v for v in obj if isinstance(v, torch_pickle.Tensor)]
        if len(items) == 1:  # (output, None): the one tensor
            out[prefix] = items[0]
        else:
            for i, v in enumerate(obj):
                out.update(flatten(v, f"{prefix}#{i}"))
    return out


# -- the dumper's one file per tensor ------------------------------------------------------------------------------

def is_dumper_dir(p: Path) -> bool:
    return p.is_dir() and any(f.suffix == ".pt" and "name=" in f.name for f in p.iterdir())


def dumper_tags(filename: str) -> dict[str, str]:
    stem = filename[:-3] if filename.endswith(".pt") else filename
    return {k: v for part in stem.split("___") if "=" in part for k, v in [part.split("=", 1)]}


def read_dumper(d: Path, where: str) -> list[Raw]:
    """Files grouped by step (or forward_pass_id), then by rank."""
    steps: dict[int, dict[str, dict[int, np.ndarray]]] = {}
    for f in sorted(d.iterdir()):
        if f.suffix != ".pt" or "name=" not in f.name:
            continue
        tags = dumper_tags(f.name)
        step = _int(tags.get("step", tags.get("forward_pass_id", "0")))
        rank = _int(tags.get("rank", "0"))
        obj = torch_pickle.load(f, f"{where}: {f.name}")
        if isinstance(obj, dict) and "value" in obj:
            obj = obj["value"]
        name = tags["name"]
        if "layer_id" in tags:
            name = f"model.layers.{tags['layer_id']}.{name}"
        for key, t in flatten(obj, name).items():
            steps.setdefault(step, {}).setdefault(key, {})[rank] = t.array
    if not steps:
        raise InputError(f"{where}: no dumper files (name=...pt)")
    out = []
    for _, tensors in sorted(steps.items()):
        out.append(Raw({k: [v[r] for r in sorted(v)] for k, v in tensors.items()}))
    return out


def _int(v: str) -> int:
    try:
        return int(v)
    except ValueError:
        return 0
