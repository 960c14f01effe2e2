"""Reading the two sides of `metrale compare`: logits matrices [rows, vocab] in every format, or layer dumps.

Logits inputs (the extension decides):
    .safetensors  metrale's logits dump (tensor `logits`, BF16 or F32, positions in the metadata); any
                  other file with `--tensor NAME` (F32, F16, BF16, F64; U16 as bf16/f16 bit patterns with
                  --dtype), or its only tensor. A metrale layer dump, or a file of several tensors and no
                  --tensor, is read as a layer dump instead.
    .npy          metrale's logits dump (float32, or uint16 bf16 bit patterns, described by the
                  PATH.json sidecar), or a plain array: float32, float16, float64, or uint16 bit
                  patterns with --dtype bf16 (or f16)
    .bin          metrale's raw rows with their PATH.json sidecar, or raw little-endian rows with
                  --vocab N --dtype f32|bf16|f16
    .npz          with --tensor NAME one array of it; without, a layer dump
Other engines' dumps (a folder, a .pt file, llama.cpp's outputs, or any input with --from/--from-a) are
read by the readers package into the same kinds, or into llama.cpp's printed statistics; a --dump-stats
file is read for a statistics comparison with those.
--dtype and --vocab apply only to inputs that do not record them (raw .bin, uint16 .npy, U16 tensors).
A leading batch dimension of 1 ([1, rows, vocab]) is dropped; a 1-D array is one row. Values are
converted exactly to float32 (float64 inputs stay float64); every problem is an InputError that names
the side ("A" or "B") and the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import CheckpointError, InputError, UsageError
from .layer_dumps import FORMAT as LAYER_FORMAT
from .layer_dumps import LayerDump, is_stats_file, read_layer_dump

DTYPES = ("f32", "bf16", "f16")
_ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2}


@dataclass
class ReadOptions:
    """How to read inputs that do not describe themselves."""

    tensor: str | None = None  # --tensor: the tensor/array to read from .safetensors/.npz (both sides)
    tensor_b: str | None = None  # --tensor-b: B's, when it is named differently
    vocab: int | None = None  # --vocab: row width of a raw .bin
    dtype: str | None = None  # --dtype: f32 | bf16 | f16 for raw .bin and uint16 data
    fmt_a: str | None = None  # --from-a: A's format (None: by content)
    fmt_b: str | None = None  # --from: B's format
    map_file: str | None = None  # --map: name rules for engine dumps
    model: str | None = None  # --model: the config.json that splits fused outputs
    tp_dirs: list[str] | None = None  # --tp-dirs: B's folders, one per TP rank

    def check(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.vocab is not None and self.vocab <= 0:
            raise UsageError(f"--vocab must be at least 1, got {self.vocab}")
        from .readers import FORMATS

        for option, fmt in (("--from-a", self.fmt_a), ("--from", self.fmt_b)):
            if fmt is not None and fmt not in FORMATS:
                raise UsageError(f"{option} takes {', '.join(FORMATS)}, got {fmt!r}")


@dataclass
class Matrix:
    """One side of a logits comparison."""

    label: str  # "A" or "B"
    path: Path
    source: str  # how it was read, e.g. "metrale logits dump (.safetensors)"
    dtype: str  # the stored dtype: fp32 | bf16 | f16 | f64
    values: np.ndarray  # [rows, vocab] float32 (float64 for f64 inputs)
    positions: list[int] | None = None
    tokens: list[int] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.values.shape[0]), int(self.values.shape[1])


def read_input(path: str | Path, label: str, opts: ReadOptions) -> Any:
    """Side `label` of a comparison: a logits Matrix or a LayerDump (see the module docstring); llama.cpp's
    printed statistics (readers.llamacpp.EvalCallback) or a --dump-stats file (compare_stats.StatsDoc)."""
    p = Path(path)
    where = f"{label}: {p}"
    fmt = opts.fmt_b if label == "B" else opts.fmt_a
    from .readers import FILE_FORMATS, LogitsRows, is_engine_input, read_engine

    if is_engine_input(p, fmt):
        got = read_engine(p, label, fmt, map_file=opts.map_file, model=opts.model,
                          tp_dirs=opts.tp_dirs if label == "B" else None)
        if isinstance(got, LogitsRows):
            kind = {"f32": "fp32", "f64": "f64", "f16": "f16", "bf16": "bf16"}.get(got.dtype)
            if kind is None:
                raise InputError(f"{where}: holds a {got.dtype} tensor; logits are floating point")
            values = got.values.astype(np.float64 if kind == "f64" else np.float32)
            return Matrix(label, got.path or p, got.source, kind, _rows(values, where), got.positions, got.tokens)
        if got is not None:
            return got  # a LayerDump, or llama.cpp's statistics
    elif fmt in FILE_FORMATS and p.suffix.lower() not in FILE_FORMATS[fmt]:
        raise InputError(f"{where}: --from {fmt} reads {' or '.join(FILE_FORMATS[fmt])} files, not "
                         f"'{p.suffix or '(none)'}'")
    if p.is_dir():
        raise InputError(f"{where}: is a directory, not a dump file")
    if not p.is_file():
        raise InputError(f"{where}: no such file")
    tensor = opts.tensor_b if label == "B" and opts.tensor_b is not None else opts.tensor
    ext = p.suffix.lower()
    if ext == ".safetensors":
        return _from_safetensors(p, label, where, tensor, opts)
    if ext == ".npz":
        if tensor is None:
            return read_layer_dump(p, label)
        return _from_npz(p, label, where, tensor, opts)
    if ext == ".npy":
        return _from_npy(p, label, where, opts)
    if ext == ".bin":
        return _from_bin(p, label, where, opts)
    if ext == ".json" and is_stats_file(p):
        from .compare_stats import read_stats_file

        return read_stats_file(p, label)  # statistics: compared only with llama.cpp's printed ones
    raise InputError(f"{where}: unknown extension '{p.suffix or '(none)'}'; compare reads .safetensors, "
                     ".npy, .bin and .npz")


def logits_side(dump: LayerDump, label: str) -> Matrix:
    """The logits an engine's layer dump kept aside, as a logits Matrix (InputError when it has none)."""
    values = dump.metadata.get("logits")
    if values is None:
        raise InputError(f"{label} ({dump.path}) is a layer dump holding no logits (no logits_processor or "
                         "lm_head output): compare it with a layer dump")
    return Matrix(label, dump.path, f"{dump.source}, logits", "fp32", _rows(np.asarray(values), f"{label}: {dump.path}"),
                  dump.metadata.get("logits_positions"), dump.tokens)


# -- the formats ----------------------------------------------------------------------------------------------


def _from_safetensors(p: Path, label: str, where: str, tensor: str | None,
                      opts: ReadOptions) -> Matrix | LayerDump:
    from .safetensors_file import SafetensorsFile

    try:
        f = SafetensorsFile.open(p)
    except CheckpointError as e:
        raise InputError(f"{where}: not a readable safetensors file ({e})") from None
    with f:
        meta = f.metadata
        if tensor is None:
            if meta.get("format") == LAYER_FORMAT or ("logits" not in f.tensors and len(f.tensors) > 1):
                return read_layer_dump(p, label)
            tensor = "logits" if "logits" in f.tensors else next(iter(f.tensors), None)
            if tensor is None:
                raise InputError(f"{where}: holds no tensors")
        if tensor not in f.tensors:
            names = ", ".join(list(f.tensors)[:8]) + (" ..." if len(f.tensors) > 8 else "")
            raise InputError(f"{where}: no tensor named {tensor!r} (it holds {names or 'none'})")
        dtype = f.info(tensor).dtype
        raw = f.array(tensor)
        ours = meta.get("format") == "metrale-logits" and tensor == "logits"
        tokens = [int(t) for t in f.array("tokens").reshape(-1)] if ours and "tokens" in f.tensors else None
        kind = {"F32": "fp32", "F16": "f16", "BF16": "bf16", "F64": "f64"}.get(dtype)
        if kind is not None:
            values = raw.astype(np.float64 if kind == "f64" else np.float32)
        elif dtype == "U16":
            kind, values = _u16(raw, opts, where, f"tensor {tensor!r} is U16")
        else:
            raise InputError(f"{where}: tensor {tensor!r} has dtype {dtype}; logits are F32, BF16, F16 or F64")
    source = "metrale logits dump (.safetensors)" if ours else f"safetensors tensor {tensor!r}"
    positions = _json_list(meta.get("positions")) if ours else None
    return Matrix(label, p, source, kind, _rows(values, where), positions, tokens)


def _from_npz(p: Path, label: str, where: str, tensor: str, opts: ReadOptions) -> Matrix:
    try:
        with np.load(p, allow_pickle=False) as z:
            if tensor not in z.files:
                raise InputError(f"{where}: no array named {tensor!r} (it holds {', '.join(z.files[:8])})")
            raw = z[tensor]
    except (OSError, ValueError) as e:
        raise InputError(f"{where}: not a readable .npz file ({' '.join(str(e).split())})") from None
    kind, values = _plain_array(raw, opts, where)
    return Matrix(label, p, f"npz array {tensor!r}", kind, _rows(values, where))


def _from_npy(p: Path, label: str, where: str, opts: ReadOptions) -> Matrix:
    try:
        raw = np.load(p, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise InputError(f"{where}: not a readable .npy file ({' '.join(str(e).split())})") from None
    side = _sidecar(p)
    if side is not None:  # metrale's own dump: the sidecar says what the uint16 patterns are
        kind = side["dtype"]
        if kind == "bf16" and raw.dtype == np.uint16:
            values = _bf16_bits(raw)
        elif kind == "fp32" and raw.dtype == np.float32:
            values = np.array(raw, dtype=np.float32)
        else:
            raise InputError(f"{where}: holds {raw.dtype} but its sidecar {p.name}.json says {kind}")
        return Matrix(label, p, "metrale logits dump (.npy)", kind, _rows(values, where),
                      _json_list(side.get("positions")), _json_list(side.get("tokens")))
    kind, values = _plain_array(raw, opts, where)
    return Matrix(label, p, "npy array", kind, _rows(values, where))


def _from_bin(p: Path, label: str, where: str, opts: ReadOptions) -> Matrix:
    side = _sidecar(p)
    if side is not None:
        kind = side["dtype"]
        shape = side.get("shape")
        if kind not in ("bf16", "fp32") or not (isinstance(shape, list) and len(shape) == 2):
            raise InputError(f"{where}: its sidecar {p.name}.json has no dtype bf16/fp32 and [rows, vocab] shape")
        dtype, vocab, source = ("f32" if kind == "fp32" else "bf16"), int(shape[1]), "metrale logits dump (.bin)"
    else:
        if opts.vocab is None or opts.dtype is None:
            raise InputError(f"{where}: a raw .bin needs --vocab N and --dtype f32|bf16|f16 "
                             f"(no sidecar {p.name}.json beside it)")
        dtype, vocab, kind, source = opts.dtype, opts.vocab, _KIND[opts.dtype], "raw .bin"
    size = p.stat().st_size
    row_bytes = vocab * _ITEMSIZE[dtype]
    if size == 0 or size % row_bytes:
        raise InputError(f"{where}: {size} bytes is not a whole number of {dtype} rows of {vocab} "
                         f"({row_bytes} bytes each)")
    raw = np.fromfile(p, dtype={"f32": "<f4", "bf16": "<u2", "f16": "<f2"}[dtype]).reshape(-1, vocab)
    values = _bf16_bits(raw) if dtype == "bf16" else raw.astype(np.float32)
    if side is not None and list(values.shape) != [int(x) for x in side["shape"]]:
        raise InputError(f"{where}: holds {list(values.shape)} rows x vocab but its sidecar says {side['shape']}")
    positions = _json_list(side.get("positions")) if side else None
    tokens = _json_list(side.get("tokens")) if side else None
    return Matrix(label, p, source, kind, values, positions, tokens)


_KIND = {"f32": "fp32", "bf16": "bf16", "f16": "f16"}


# -- helpers --------------------------------------------------------------------------------------------------


def _plain_array(raw: np.ndarray, opts: ReadOptions, where: str) -> tuple[str, np.ndarray]:
    if raw.dtype == np.float32:
        return "fp32", np.array(raw, dtype=np.float32)
    if raw.dtype == np.float16:
        return "f16", raw.astype(np.float32)
    if raw.dtype == np.float64:
        return "f64", np.array(raw, dtype=np.float64)
    if raw.dtype == np.uint16:
        return _u16(raw, opts, where, "holds uint16")
    raise InputError(f"{where}: holds {raw.dtype}; logits are float32, float16, float64, or uint16 "
                     "bf16 bit patterns with --dtype bf16")


def _u16(raw: np.ndarray, opts: ReadOptions, where: str, what: str) -> tuple[str, np.ndarray]:
    if opts.dtype == "bf16":
        return "bf16", _bf16_bits(raw)
    if opts.dtype == "f16":
        return "f16", np.ascontiguousarray(raw).view(np.float16).astype(np.float32)
    raise InputError(f"{where}: {what}: pass --dtype bf16 if these are bfloat16 bit patterns (or --dtype f16)")


def _bf16_bits(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns -> float32, exactly (a bf16 is the top half of an fp32)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _rows(values: np.ndarray, where: str) -> np.ndarray:
    while values.ndim > 2 and values.shape[0] == 1:  # [1, rows, vocab]: a batch of one
        values = values[0]
    if values.ndim == 1:
        values = values[None, :]
    if values.ndim != 2 or 0 in values.shape:
        raise InputError(f"{where}: has shape {list(values.shape)}; expected [rows, vocab]")
    return values


def _sidecar(p: Path) -> dict[str, Any] | None:
    """metrale's `<PATH>.json` description of a .npy/.bin dump, when there is one."""
    side = p.with_name(p.name + ".json")
    if not side.is_file():
        return None
    try:
        doc = json.loads(side.read_text("utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"{side}: sidecar is not readable JSON ({' '.join(str(e).split())})") from None
    return doc if isinstance(doc, dict) and "dtype" in doc and "shape" in doc else None


def _json_list(value: Any) -> list[int] | None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return [int(v) for v in value]
    return None
