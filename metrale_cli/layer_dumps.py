"""Per-layer dumps (`--dump-layers PATH`): what every module of the forward computed, written atomically.

A layer dump holds fp32 tensors [rows, width], one per tap, named after the Hugging Face module whose
output it is, for every row the command processed (prompt rows, then each decode step or verify row, in
order):

    model.embed_tokens         the embedding rows (after any embedding scale)
    model.layers.{i}.self_attn attention output after o_proj, before the residual add
    model.layers.{i}.mlp       MLP (or MoE) output, before the residual add
    model.layers.{i}           the residual stream after layer i (transformers' hidden_states[i + 1] for
                               i < L - 1: its last entry, hidden_states[L], is after the final norm)
    model.norm                 after the final norm (transformers' hidden_states[L])

Families with more points add them under their HF module names (e.g. Gemma's
`model.layers.{i}.post_attention_layernorm`, an MoE router's `model.layers.{i}.mlp.gate`); an integer
valued tap (chosen experts) is stored as fp32, exact below 2**24. Forward order (`forward_order`): the
embedding, then per layer (in natural order, 2 before 10) its input norm, self_attn (its parts, q/k/v
projections, rope, o_proj's input, before its output), post-attention norms, mlp (a router's gate and
the projections before its output), other taps, and the layer output last; then model.norm; names metrale does
not know come after, in the order given.

Formats (the extension of PATH picks one):

    .safetensors  one F32 tensor [rows, width] per tap, `positions` I64 [rows] (the input position of
                  each row), `tokens` I64 [n] (the input ids the command ran: row i is the output for
                  tokens[positions[i]]), and string metadata: format "metrale-layer-dump", command,
                  model, rows, layers (JSON list of the selected layer indices), order (JSON list of the
                  tap names in forward order)
    .npz          the same arrays as .npy members (stored, not compressed) plus `__metadata__`, a 0-d
                  unicode array holding the metadata as one JSON object; np.load(allow_pickle=False)
                  reads it
    .json         with --dump-stats: statistics instead of data, for models too big to dump whole:
                  {"format": "metrale-layer-stats", "command", "model", "rows", "layers", "tokens",
                   "positions", "tensors": [{"name", "shape", "min", "max", "mean", "std", "abs_max",
                   "sum", "nan", "inf", "sha256"}]} in forward order. min..sum are over the finite
                  values, in float64 (null when none is finite); nan and inf count the others (inf:
                  both signs); sha256 is of the fp32 little-endian C-order bytes.

Writes go through dumps.commit (temp file, fsync, rename): Ctrl-C or a full disk leaves no partial file.
`read_layer_dump` reads metrale's dumps back, and any .safetensors / .npz of 2-D float tensors named by
module (another engine's dump), for `metrale compare`.
"""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from .dumps import DumpTarget, check_dump_path, commit
from .errors import CheckpointError, InputError, UsageError

LAYER_KINDS = ("safetensors", "npz")
STATS_KINDS = ("json",)
FORMAT = "metrale-layer-dump"
STATS_FORMAT = "metrale-layer-stats"
EMBED = "model.embed_tokens"
NORM = "model.norm"
RESERVED = ("positions", "tokens", "__metadata__")  # array names that are not taps

# -- layer selection and names -----------------------------------------------------------------------------------


def parse_layers(spec: str | None, num_layers: int, option: str = "--layers") -> list[int]:
    """'0,5,-1' -> [0, 5, num_layers - 1]: comma or space separated indices, negative ones counted from the
    end; None or 'all' selects every layer. Returned sorted, without duplicates."""
    if spec is None or spec.strip() == "all":
        return list(range(num_layers))
    parts = [p for p in re.split(r"[\s,]+", spec.strip()) if p]
    if not parts:
        raise UsageError(f"{option} is empty: give layer indices such as '0,5,-1' or 'all'")
    chosen = set()
    for p in parts:
        try:
            i = int(p, 10)
        except ValueError:
            raise UsageError(f"{option}: {p!r} is not a layer index (an integer; -1 is the last layer)") from None
        if not -num_layers <= i < num_layers:
            raise InputError(f"{option}: layer {i} does not exist; the model has {num_layers} layers "
                             f"(0..{num_layers - 1}, or -{num_layers}..-1 from the end)")
        chosen.add(i % num_layers)
    return sorted(chosen)


def layer_tap_names(layers: Sequence[int]) -> list[str]:
    """The standard taps for the selected layers, in forward order."""
    names = [EMBED]
    for i in sorted(layers):
        names += [f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp", f"model.layers.{i}"]
    return names + [NORM]


_LAYER = re.compile(r"^model\.layers\.(\d+)(?:\.(.+))?$")
# Rank of a sub-module inside its layer, by the first component of its name (the order HF runs them).
_SUB_RANK = {"input_layernorm": 0, "self_attn": 1, "post_attention_layernorm": 2,
             "pre_feedforward_layernorm": 3, "mlp": 4, "block_sparse_moe": 4, "post_feedforward_layernorm": 5,
             # a multi-token-prediction layer (engine/mtp.py): its input before the block, its norm after it
             "enorm": -3, "hnorm": -2, "eh_proj": -1, "shared_head": 10}


# Rank of a part inside self_attn / mlp (the finer taps other engines dump): projections, q/k norms, rope,
# the input of the output projection, the output projection; a router's gate before the experts' projections.
# Latent attention's normed latent, then its indexer's choice (DeepSeek-V3.2), come before the attention's output.
_INNER_RANK = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "q_norm": 3, "k_norm": 4, "q_rope": 5, "k_rope": 6,
               "kv_a_layernorm": 6.25, "indexer": 6.5, "o_proj.input": 7, "o_proj": 8,
               "gate": 0, "gate.top_k_index": 1, "gate.top_k_weights": 2, "gate_proj": 3, "up_proj": 4,
               "down_proj.input": 5, "down_proj": 6}


def forward_key(name: str) -> tuple:
    """Sort key putting tap names in forward order (see the module docstring)."""
    if name == EMBED:
        return (0,)
    m = _LAYER.match(name)
    if m:
        layer, sub = int(m.group(1)), m.group(2)
        if sub is None:
            return (1, layer, 9)  # the layer's output comes after everything inside it
        head, _, rest = sub.partition(".")
        inner = 9 if not rest else _INNER_RANK.get(rest, 8)  # a module's own output after its parts
        return (1, layer, _SUB_RANK.get(head, 6), inner, sub.count("."))
    if name == NORM:
        return (2,)
    return (3,)


def forward_order(names: Sequence[str]) -> list[str]:
    """Names sorted into forward order; names of equal rank (unknown ones) keep their given order."""
    return sorted(names, key=forward_key)  # sorted() is stable


# -- what a dump holds -------------------------------------------------------------------------------------------


@dataclass
class LayerDumpInfo:
    """Metadata every layer dump carries."""

    command: str
    model: str
    tokens: list[int]
    layers: list[int]
    engine: dict[str, str] = field(default_factory=dict)  # as dumps.DumpInfo.engine


@dataclass
class LayerDump:
    """A layer dump read back: taps in forward order, fp32 [rows, width] each."""

    path: Path
    tensors: dict[str, np.ndarray]
    positions: list[int] | None
    tokens: list[int] | None
    metadata: dict[str, Any] = field(default_factory=dict)
    source: str = "layer dump"

    @property
    def rows(self) -> int | None:
        first = next(iter(self.tensors.values()), None)
        return None if first is None else int(first.shape[0])


def _checked(tensors: Mapping[str, np.ndarray], positions: Sequence[int]) -> dict[str, np.ndarray]:
    """Taps as contiguous little-endian fp32 [rows, width]; a wrong shape is a bug in the caller."""
    rows = len(positions)
    out = {}
    for name, arr in tensors.items():
        if name in RESERVED:
            raise ValueError(f"{name!r} is reserved in layer dumps and cannot name a tap")
        a = np.ascontiguousarray(arr, dtype="<f4")
        if a.ndim != 2 or a.shape[0] != rows:
            raise ValueError(f"tap {name}: shape {a.shape}, expected [{rows}, width]")
        out[name] = a
    return out


def _metadata(info: LayerDumpInfo, rows: int, order: list[str]) -> dict[str, str]:
    return {"format": FORMAT, "command": info.command, "model": info.model, "rows": str(rows),
            "layers": json.dumps([int(i) for i in info.layers], separators=(",", ":")),
            "order": json.dumps(order, separators=(",", ":")), **info.engine}


# -- writing -------------------------------------------------------------------------------------------------------


def check_layer_dump_path(value: str, stats: bool = False, option: str = "--dump-layers") -> DumpTarget:
    """Validate a --dump-layers destination before any work: .safetensors/.npz, or .json with --dump-stats."""
    if stats:
        return check_dump_path(value, f"{option} (with --dump-stats)", STATS_KINDS, stdout_ok=False)
    return check_dump_path(value, option, LAYER_KINDS, stdout_ok=False)


def write_layer_dump(target: DumpTarget | Path, tensors: Mapping[str, np.ndarray], positions: Sequence[int],
                     info: LayerDumpInfo) -> None:
    """Write the taps (name -> [rows, width], in forward order) atomically as .safetensors or .npz."""
    path, kind = _dest(target)
    taps = _checked(tensors, positions)
    pos = np.asarray(positions, dtype="<i8")
    toks = np.asarray(info.tokens, dtype="<i8")
    meta = _metadata(info, len(pos), list(taps))
    if kind == "safetensors":
        commit([(path, _safetensors_chunks(taps, pos, toks, meta))])
    elif kind == "npz":
        commit([(path, _npz_chunks(taps, pos, toks, meta))])
    else:
        raise ValueError(f"layer dumps are .safetensors or .npz, not .{kind}")


def write_layer_stats(target: DumpTarget | Path, tensors: Mapping[str, np.ndarray], positions: Sequence[int],
                      info: LayerDumpInfo) -> None:
    """--dump-stats: per-tap statistics (not the data) as JSON, atomically."""
    path, _ = _dest(target)
    taps = _checked(tensors, positions)
    doc = {"format": STATS_FORMAT, "command": info.command, "model": info.model, "rows": len(positions),
           "layers": [int(i) for i in info.layers], "tokens": [int(t) for t in info.tokens],
           "positions": [int(p) for p in positions],
           **info.engine, "tensors": [tensor_stats(name, a) for name, a in taps.items()]}
    commit([(path, [_stats_json(doc).encode()])])


def _stats_json(doc: dict[str, Any]) -> str:
    """One key per line and one tensor per line: readable, and diffable with line tools."""
    def dumps(v: Any) -> str:
        return json.dumps(v, allow_nan=False, ensure_ascii=False)

    items = [f" {dumps(k)}: {dumps(v)}" for k, v in doc.items() if k != "tensors"]
    tensors = ",\n".join(f"  {dumps(t)}" for t in doc["tensors"])
    return "{\n" + ",\n".join(items) + ',\n "tensors": [\n' + tensors + "\n ]\n}\n"


def write_layers(target: DumpTarget, tensors: Mapping[str, np.ndarray], positions: Sequence[int],
                 info: LayerDumpInfo) -> None:
    """What --dump-layers writes: statistics for a .json target (--dump-stats), else the tensors."""
    if target.kind == "json":
        write_layer_stats(target, tensors, positions, info)
    else:
        write_layer_dump(target, tensors, positions, info)


def tensor_stats(name: str, arr: np.ndarray) -> dict[str, Any]:
    """Statistics of one tap: over its finite values in float64, the non-finite ones counted."""
    a = np.ascontiguousarray(arr, dtype="<f4")
    finite = a[np.isfinite(a)].astype(np.float64)
    stats: dict[str, Any] = {"name": name, "shape": list(a.shape)}
    if finite.size:
        stats.update({"min": float(finite.min()), "max": float(finite.max()), "mean": float(finite.mean()),
                      "std": float(finite.std()), "abs_max": float(np.abs(finite).max()),
                      "sum": float(finite.sum())})
    else:
        stats.update(dict.fromkeys(("min", "max", "mean", "std", "abs_max", "sum")))
    stats.update({"nan": int(np.isnan(a).sum()), "inf": int(np.isinf(a).sum()),
                  "sha256": hashlib.sha256(a.tobytes()).hexdigest()})
    return stats


def _dest(target: DumpTarget | Path) -> tuple[Path, str]:
    if isinstance(target, DumpTarget):
        assert target.path is not None
        return target.path, target.kind
    p = Path(target)
    return p, p.suffix.lower().lstrip(".")


def _safetensors_chunks(taps: dict[str, np.ndarray], pos: np.ndarray, toks: np.ndarray,
                        meta: dict[str, str]) -> list[Any]:
    header: dict[str, Any] = {"__metadata__": meta}
    data: list[Any] = []
    offset = 0
    arrays = [(n, "F32", a) for n, a in taps.items()] + [("positions", "I64", pos), ("tokens", "I64", toks)]
    for name, dtype, a in arrays:
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        if a.nbytes:
            data.append(memoryview(a).cast("B"))
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    return [len(raw).to_bytes(8, "little"), raw, *data]


class _Spool:
    """A write-only, unseekable sink: zipfile then streams entries with data descriptors, and the bytes
    written so far can be taken out after each member, so the archive is never whole in memory."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._pos = 0

    def write(self, b: Any) -> int:
        data = bytes(b)
        self._parts.append(data)
        self._pos += len(data)
        return len(data)

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        pass

    def take(self) -> bytes:
        out, self._parts = b"".join(self._parts), []
        return out


def _npz_chunks(taps: dict[str, np.ndarray], pos: np.ndarray, toks: np.ndarray,
                meta: dict[str, str]) -> Iterator[bytes]:
    spool = _Spool()
    members = list(taps.items()) + [("positions", pos), ("tokens", toks),
                                    ("__metadata__", np.array(json.dumps(meta)))]
    with zipfile.ZipFile(spool, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, a in members:
            with zf.open(name + ".npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, a, allow_pickle=False)
            yield spool.take()
    yield spool.take()  # the central directory


# -- reading -------------------------------------------------------------------------------------------------------

_FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}


def read_layer_dump(path: str | Path, label: str = "") -> LayerDump:
    """A layer dump (.safetensors or .npz) as fp32 taps in forward order. Any file of 2-D float tensors
    works (another engine's dump); `positions`/`tokens` are read when present. Problems are InputErrors
    naming the file (prefixed with `label`, e.g. "A")."""
    p = Path(path)
    where = f"{label}: {p}" if label else str(p)
    if not p.is_file():
        raise InputError(f"{where}: no such file")
    kind = p.suffix.lower()
    if kind == ".safetensors":
        arrays, meta = _read_safetensors(p, where)
    elif kind == ".npz":
        arrays, meta = _read_npz(p, where)
    else:
        raise InputError(f"{where}: a layer dump is .safetensors or .npz, not '{p.suffix or '(none)'}'")
    return _assemble(p, where, arrays, meta)


def _read_safetensors(p: Path, where: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    from .safetensors_file import SafetensorsFile

    try:
        with SafetensorsFile.open(p) as f:
            arrays = {}
            for name, info in f.tensors.items():
                if name not in RESERVED and info.dtype not in _FLOAT_DTYPES:
                    raise InputError(f"{where}: tensor {name!r} has dtype {info.dtype}; taps are float tensors")
                a = f.array(name)
                arrays[name] = np.array(a, dtype=np.int64 if name in RESERVED else np.float32)
            meta: dict[str, Any] = dict(f.metadata)
    except CheckpointError as e:
        raise InputError(f"{where}: not a readable safetensors file ({e})") from None
    return arrays, meta


def _read_npz(p: Path, where: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    try:
        with np.load(p, allow_pickle=False) as z:
            raw = {name: z[name] for name in z.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise InputError(f"{where}: not a readable .npz file ({' '.join(str(e).split())})") from None
    meta: dict[str, Any] = {}
    if "__metadata__" in raw:
        try:
            meta = json.loads(str(raw.pop("__metadata__")))
        except ValueError:
            raise InputError(f"{where}: __metadata__ is not a JSON object") from None
    arrays = {}
    for name, a in raw.items():
        if name in RESERVED:
            arrays[name] = np.asarray(a, dtype=np.int64)
        elif a.dtype.kind != "f":
            raise InputError(f"{where}: array {name!r} has dtype {a.dtype}; taps are float arrays")
        else:
            arrays[name] = np.asarray(a, dtype=np.float32)
    return arrays, meta


def _assemble(p: Path, where: str, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> LayerDump:
    positions = arrays.pop("positions", None)
    tokens = arrays.pop("tokens", None)
    taps: dict[str, np.ndarray] = {}
    for name, a in arrays.items():
        while a.ndim > 2 and a.shape[0] == 1:  # [1, rows, width]: a batch of one
            a = a[0]
        if a.ndim == 1:
            a = a[None, :]
        if a.ndim != 2:
            raise InputError(f"{where}: tap {name!r} has shape {list(a.shape)}; expected [rows, width]")
        taps[name] = a
    if not taps:
        raise InputError(f"{where}: holds no tensors to compare")
    order = _stored_order(meta, taps) or forward_order(list(taps))
    source = "metrale layer dump" if meta.get("format") == FORMAT else "layer tensors"
    return LayerDump(p, {n: taps[n] for n in order},
                     None if positions is None else [int(x) for x in positions.reshape(-1)],
                     None if tokens is None else [int(x) for x in tokens.reshape(-1)], meta, source)


def _stored_order(meta: dict[str, Any], taps: dict[str, np.ndarray]) -> list[str] | None:
    """The forward order the writer recorded, when it names exactly the taps present."""
    order = meta.get("order")
    if isinstance(order, str):
        try:
            order = json.loads(order)
        except ValueError:
            return None
    if isinstance(order, list) and sorted(map(str, order)) == sorted(taps):
        return [str(n) for n in order]
    return None


def is_stats_file(path: str | Path) -> bool:
    """Whether path is a --dump-stats JSON file (statistics, not data)."""
    try:
        with open(path, "rb") as f:
            head = f.read(200)
    except OSError:
        return False
    return STATS_FORMAT.encode() in head

