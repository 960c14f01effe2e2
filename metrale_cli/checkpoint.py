"""Checkpoint discovery: find the safetensors weights of a Hugging Face checkpoint and open them all.

A checkpoint is a directory holding either `model.safetensors` or `model.safetensors.index.json` plus
the shards its `weight_map` names. Every file is opened (and so validated) at `Checkpoint.open` time and
stays memory-mapped, so a bad shard fails before any compute and no weight is read twice.

config.json is not parsed here; `directory` tells the config loader where to look.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path, PurePosixPath, PureWindowsPath
from types import TracebackType
from typing import TYPE_CHECKING, Any, Iterable

from metrale_cli.errors import CheckpointError
from metrale_cli.safetensors_file import SafetensorsFile, TensorInfo, _show, _suggest, listed_tensors

if TYPE_CHECKING:
    import numpy as np

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_NAME = "tokenizer.json"
# Weights in formats metrale does not read; named in the "no weights" error so the user knows why.
_FOREIGN_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.h5", "*.msgpack")


class Checkpoint:
    """All safetensors files of one checkpoint, validated and memory-mapped. Use `Checkpoint.open(path)`.
    A WeightSource (models/weights.py): engines check it against the model definition before reading."""

    made_from_definition = False
    draws_on_device = False

    def __init__(self, directory: Path, index_path: Path | None, shards: list[SafetensorsFile]) -> None:
        self.directory = directory
        self.index_path = index_path
        self._shards = shards
        self.files: list[Path] = [s.path for s in shards]
        self._owner: dict[str, SafetensorsFile] = {}
        for shard in shards:
            for name in shard.tensors:
                self._owner[name] = shard
        # safetensors __metadata__ of all shards (e.g. {"format": "pt"}); the first shard wins a clash.
        self.metadata: dict[str, str] = {}
        for shard in shards:
            for k, v in shard.metadata.items():
                self.metadata.setdefault(k, v)

    # --- opening -------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Checkpoint:
        """Open a checkpoint directory, a single .safetensors file, or a model.safetensors.index.json."""
        path = Path(path)
        try:
            exists = path.exists()
        except (OSError, ValueError) as e:  # a name too long, a NUL byte
            raise CheckpointError(f"{path}: cannot look up the checkpoint path: {e}") from None
        if not exists:
            raise CheckpointError(f"{path}: checkpoint path does not exist")
        if path.is_dir():
            return cls._open_directory(path)
        if path.name.endswith(".index.json"):
            return cls._open_index(path)
        if path.suffix == ".safetensors":
            return cls(path.parent, None, [SafetensorsFile.open(path)])
        if path.match("*.bin") or path.suffix in (".pt", ".pth", ".ckpt"):
            raise CheckpointError(
                f"{path}: PyTorch pickle weights, which metrale cannot read; convert them to .safetensors"
            )
        raise CheckpointError(
            f"{path}: not a checkpoint directory, a .safetensors file or a {INDEX_NAME}"
        )

    @classmethod
    def _open_directory(cls, directory: Path) -> Checkpoint:
        # Like transformers, a single model.safetensors wins over an index when both exist.
        single = directory / SINGLE_NAME
        if single.exists():
            return cls(directory, None, [SafetensorsFile.open(single)])
        index = directory / INDEX_NAME
        if index.exists():
            return cls._open_index(index)
        raise CheckpointError(_no_weights_message(directory))

    @classmethod
    def _open_index(cls, index: Path) -> Checkpoint:
        weight_map = _read_weight_map(index)
        directory = index.parent
        shard_names = sorted(set(weight_map.values()))
        paths = [_shard_path(index, directory, name, weight_map) for name in shard_names]
        shards = _open_all(paths)
        try:
            _check_index_agrees(index, weight_map, dict(zip(shard_names, shards)))
        except BaseException:
            for shard in shards:
                shard.close()
            raise
        return cls(directory, index, shards)

    # --- queries -------------------------------------------------------------------------------

    def tensor_names(self) -> list[str]:
        """All tensor names in storage order (shard by shard, then by data offset): sequential reads."""
        return [name for shard in self._shards for name in shard.tensors]

    def __contains__(self, name: object) -> bool:
        return name in self._owner

    def _file_of(self, name: str) -> SafetensorsFile:
        try:
            return self._owner[name]
        except KeyError:
            raise CheckpointError(
                f"{self.directory}: checkpoint has no tensor {name!r}{_suggest(name, self._owner)}"
            ) from None

    def file_of(self, name: str) -> Path:
        """The shard that holds tensor `name`."""
        return self._file_of(name).path

    def info(self, name: str) -> TensorInfo:
        return self._file_of(name).tensors[name]

    def array(self, name: str, *, bf16_bits: bool = False) -> np.ndarray:
        """A read-only, zero-copy view of tensor `name` over its shard's memory map (BF16 as uint16 bit
        patterns with bf16_bits)."""
        return self._file_of(name).array(name, bf16_bits=bf16_bits)

    def raw(self, name: str) -> np.ndarray:
        """The bytes of tensor `name`: a read-only, zero-copy uint8 view over its shard's memory map."""
        return self._file_of(name).raw(name)

    def release(self, name: str) -> None:
        """Let the OS drop tensor `name`'s resident pages (after the caller converted it)."""
        self._file_of(name).release(name)

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data over all shards (headers excluded)."""
        return sum(t.nbytes for shard in self._shards for t in shard.tensors.values())

    def dtypes(self) -> dict[str, int]:
        return dtype_counts(t for shard in self._shards for t in shard.tensors.values())

    @property
    def has_tokenizer(self) -> bool:
        return (self.directory / TOKENIZER_NAME).is_file()

    # --- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        for shard in self._shards:
            shard.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.directory)!r}, {len(self.files)} file(s), {len(self._owner)} tensors)"


def dtype_counts(tensors: Iterable[TensorInfo]) -> dict[str, int]:
    """dtype name -> number of tensors stored in it, most common first."""
    return dict(Counter(t.dtype for t in tensors).most_common())


class HeaderListing:
    """What the headers of a checkpoint that does not open still list (inspect describes a broken
    checkpoint from it): the queries inspect asks of a Checkpoint, from each .safetensors header alone,
    and the tensors whose data lies beyond the end of their file."""

    def __init__(self, path: Path) -> None:
        self.directory = path if path.is_dir() else path.parent
        self.files = [path] if path.suffix == ".safetensors" else sorted(self.directory.glob("*.safetensors"))
        self._tensors: dict[str, TensorInfo] = {}
        self.truncated: list[str] = []
        for file in self.files:
            tensors, data_bytes = listed_tensors(file)
            self._tensors.update(tensors)
            self.truncated += [t.name for t in tensors.values() if t.end > data_bytes]

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def info(self, name: str) -> TensorInfo:
        return self._tensors[name]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self._tensors.values())

    def dtypes(self) -> dict[str, int]:
        return dtype_counts(self._tensors.values())

    @property
    def has_tokenizer(self) -> bool:
        return (self.directory / TOKENIZER_NAME).is_file()

    def close(self) -> None:
        pass


def _no_weights_message(directory: Path) -> str:
    head = f"{directory}: no {SINGLE_NAME} or {INDEX_NAME} in this directory"
    foreign = sorted({p.name for pattern in _FOREIGN_PATTERNS for p in directory.glob(pattern)})
    if foreign:
        return (
            f"{head}; found {_names(foreign)}, a weights format metrale cannot read: "
            "convert the checkpoint to safetensors"
        )
    others = sorted(p.name for p in directory.glob("*.safetensors"))
    if len(others) == 1:
        return f"{head}; found {others[0]}: pass that file's path instead"
    if others:
        return f"{head}; found {_names(others)} but no {INDEX_NAME} mapping tensors to them"
    return f"{head}; no weights found"


def _names(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        raw = index.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{index}: cannot read the shard index: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{index}: shard index is not valid UTF-8 (bad byte at offset {e.start})") from None
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise CheckpointError(f"{index}: shard index is not valid JSON: nested too deeply") from None
    except ValueError as e:
        raise CheckpointError(f"{index}: shard index is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{index}: shard index is not a JSON object")
    if "weight_map" not in doc:
        raise CheckpointError(f"{index}: shard index has no weight_map")
    weight_map = doc["weight_map"]
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: weight_map is not an object mapping tensor names to shard files")
    if not weight_map:
        raise CheckpointError(f"{index}: weight_map is empty; it names no tensors")
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointError(f"{index}: weight_map entry {_show(name)} is not a shard file name string")
    return weight_map


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # A tensor listed twice in weight_map could name two shards; json.loads would keep the last silently.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {_show(key)} appears twice")
        out[key] = value
    return out


def _allowed_roots(directory: Path) -> list[Path]:
    root = directory.resolve()
    roots = [root]
    # The Hugging Face hub cache stores snapshots/<revision>/<file> as symlinks into ../../blobs/.
    if root.parent.name == "snapshots":
        roots.append(root.parent.parent / "blobs")
    return roots


def _shard_path(index: Path, directory: Path, name: str, weight_map: dict[str, str]) -> Path:
    """`directory / name`, refusing names that escape the checkpoint directory (a hostile index)."""
    example = next(t for t, s in weight_map.items() if s == name)
    where = f"{index}: shard {_show(name)} (for tensor {_show(example)})"
    if not name or "\x00" in name:
        raise CheckpointError(f"{where} is not a valid file name")
    if PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute() or PureWindowsPath(name).drive:
        raise CheckpointError(f"{where} is an absolute path; shards must lie inside the checkpoint directory")
    if ".." in PurePosixPath(name.replace("\\", "/")).parts:
        raise CheckpointError(f"{where} leaves the checkpoint directory ('..')")
    path = directory / name
    try:
        resolved = path.resolve()
        exists = path.exists()
    except (OSError, ValueError, RuntimeError) as e:  # name too long, symlink loop
        raise CheckpointError(f"{where} cannot be looked up: {e}") from None
    if not any(resolved.is_relative_to(root) for root in _allowed_roots(directory)):
        raise CheckpointError(f"{where} is a symlink that resolves outside the checkpoint directory, to {resolved}")
    if not exists:
        raise CheckpointError(f"{where} does not exist in {directory}")
    return path


def _open_all(paths: Iterable[Path]) -> list[SafetensorsFile]:
    opened: list[SafetensorsFile] = []
    try:
        for path in paths:
            opened.append(SafetensorsFile.open(path))
    except BaseException:
        for shard in opened:
            shard.close()
        raise
    return opened


def _check_index_agrees(index: Path, weight_map: dict[str, str], shards: dict[str, SafetensorsFile]) -> None:
    """The index and the shards' own headers must describe the same tensor -> shard mapping."""
    owner: dict[str, str] = {}
    for shard_name, shard in shards.items():
        for tensor in shard.tensors:
            if tensor in owner:
                raise CheckpointError(
                    f"{index}: tensor {tensor!r} is stored in two shards, {owner[tensor]} and {shard_name}"
                )
            owner[tensor] = shard_name
    for tensor, shard_name in weight_map.items():
        actual = owner.get(tensor)
        if actual is None:
            raise CheckpointError(
                f"{index}: the index places tensor {tensor!r} in {shard_name}, but that shard does not hold it"
            )
        if actual != shard_name:
            raise CheckpointError(
                f"{index}: the index places tensor {tensor!r} in {shard_name}, but that shard does not hold it "
                f"(it is in {actual})"
            )
    for tensor, shard_name in owner.items():
        if tensor not in weight_map:
            raise CheckpointError(f"{index}: shard {shard_name} holds tensor {tensor!r}, which the index does not list")
