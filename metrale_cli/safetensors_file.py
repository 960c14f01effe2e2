"""A strict reader for one .safetensors file: our own header parser over a single read-only memory map.

Layout (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N, N bytes of
UTF-8 JSON (optionally padded with trailing spaces), then the data section. Every tensor's
`data_offsets` are relative to the start of the data section; sorted by offset they must tile it
exactly, from 0 to its end, with no holes, overlaps or trailing bytes.

We accept nothing that the reference Rust reader (safetensors 0.8) rejects. We are stricter in the
cases listed in `STRICTER_THAN_REFERENCE`, each because the reference's leniency hides a broken or
ambiguous file (or one numpy cannot represent).

Arrays are zero-copy, read-only views of the mapping, so the weights are read from disk once, by the
page faults of whoever converts them; `release(name)` lets that caller drop the pages again.
"""

from __future__ import annotations

import json
import mmap
import os
import stat
from dataclasses import dataclass
from difflib import get_close_matches
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from metrale_cli.errors import CheckpointError

if TYPE_CHECKING:
    import numpy as np

# The reference reader's limit on the JSON header (safetensors MAX_HEADER_SIZE).
MAX_HEADER_BYTES = 100_000_000
# numpy cannot describe an array needing 2**63 bytes or more, even when a zero dimension makes it empty.
_MAX_ADDRESSABLE_BYTES = 2**63 - 1
_LFS_PREFIX = b"version https://git-lfs.github.com/spec/"
_ZIP_PREFIX = b"PK\x03\x04"
_TENSOR_FIELDS = ("dtype", "shape", "data_offsets")

# Where we reject a file that safetensors 0.8 accepts. Each entry is a substring of our message; the
# fuzz test checks that every disagreement with the reference is one of these.
STRICTER_THAN_REFERENCE: dict[str, str] = {
    "is listed twice": "duplicate tensor names (the reference silently keeps the last one)",
    "appears twice": "a duplicate key inside __metadata__ or a tensor entry",
    "unexpected field": "unknown fields in a tensor entry (the reference ignores them)",
    "__metadata__ must be an object": "`__metadata__: null` (the reference treats it as absent)",
    "too large to address": "a (zero-size) shape whose non-zero dimensions need 2**63 bytes or more",
}


# dtype name -> (bits per element, numpy type: a numpy dtype string, "ml_dtypes.NAME" for the types
# numpy lacks, or None where numpy has no layout at all). Resolved by numpy_dtype() on first use: numpy
# and above all ml_dtypes (about a second) are imported only when an array is read.
DTYPES: dict[str, tuple[int, str | None]] = {
    "BOOL": (8, "bool"),
    "U8": (8, "u1"),
    "I8": (8, "i1"),
    "F8_E5M2": (8, "ml_dtypes.float8_e5m2"),
    "F8_E4M3": (8, "ml_dtypes.float8_e4m3fn"),  # torch.float8_e4m3fn is stored as F8_E4M3
    "F8_E8M0": (8, "ml_dtypes.float8_e8m0fnu"),
    "F8_E4M3FNUZ": (8, "ml_dtypes.float8_e4m3fnuz"),
    "F8_E5M2FNUZ": (8, "ml_dtypes.float8_e5m2fnuz"),
    "I16": (16, "<i2"),
    "U16": (16, "<u2"),
    "F16": (16, "<f2"),
    "BF16": (16, "ml_dtypes.bfloat16"),
    "I32": (32, "<i4"),
    "U32": (32, "<u4"),
    "F32": (32, "<f4"),
    "C64": (64, "<c8"),
    "F64": (64, "<f8"),
    "I64": (64, "<i8"),
    "U64": (64, "<u8"),
    # Packed sub-byte floats: valid in a file, but numpy has no packed layout for them.
    "F4": (4, None),
    "F6_E2M3": (6, None),
    "F6_E3M2": (6, None),
}


def numpy_dtype(name: str) -> np.dtype | None:
    """The numpy dtype of safetensors dtype `name`; None where numpy cannot hold it (packed sub-byte
    floats, or an ml_dtypes too old to know the type)."""
    import numpy as np

    spec = DTYPES[name][1]
    if spec is None:
        return None
    if spec.startswith("ml_dtypes."):
        import ml_dtypes

        found = getattr(ml_dtypes, spec.removeprefix("ml_dtypes."), None)
        return np.dtype(found) if found is not None else None
    return np.dtype(spec)


@dataclass(frozen=True)
class TensorInfo:
    """One header entry. `begin`/`end` are offsets into the data section (not the file)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def data_offsets(self) -> tuple[int, int]:
        return (self.begin, self.end)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class _BadNumber:
    """A JSON integer that cannot be a size: negative (including `-0`, which serde reads as a float) or huge."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _parse_int(text: str) -> int | _BadNumber:
    # Sizes are unsigned; 30 digits is far above 2**64 and stops Python's slow huge-int parsing.
    if text.startswith("-") or len(text) > 30:
        return _BadNumber(text)
    return int(text)


def _reject_constant(text: str) -> Any:
    raise ValueError(f"{text} is not valid JSON")


class _JSONObject(dict):
    """A JSON object that remembers keys it saw twice (json.loads would silently keep the last one)."""

    duplicates: list[str]


def _utf8_clean(s: str) -> bool:
    # json.loads decodes a lone \ud800 escape into an unencodable str; serde_json rejects it.
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _object_pairs(pairs: list[tuple[str, Any]]) -> _JSONObject:
    obj = _JSONObject()
    obj.duplicates = []
    for key, value in pairs:
        if not _utf8_clean(key) or (isinstance(value, str) and not _utf8_clean(value)):
            raise ValueError("invalid \\u escape (a lone UTF-16 surrogate)")
        if key in obj:
            obj.duplicates.append(key)
        obj[key] = value
    return obj


def _is_size(v: Any) -> bool:
    """A JSON non-negative integer (bool is an int subclass in Python, but not in JSON)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class _HeaderParser:
    """Validates the header JSON of one file; `fail` messages are prefixed with the file by the caller."""

    def __init__(self, path: Path, data_size: int) -> None:
        self.path = path
        self.data_size = data_size

    def fail(self, problem: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {problem}")

    def parse(self, raw: bytes) -> tuple[dict[str, str], dict[str, TensorInfo]]:
        header = self._load_json(raw)
        metadata: dict[str, str] = {}
        infos: list[TensorInfo] = []
        for key, value in header.items():
            if key == "__metadata__":
                metadata = self._metadata(value)
            else:
                infos.append(self._tensor(key, value))
        infos.sort(key=lambda t: (t.begin, t.end))  # the reference sorts the same way before checking
        self._check_tiling(infos)
        return metadata, {t.name: t for t in infos}

    def _load_json(self, raw: bytes) -> _JSONObject:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"header is not valid UTF-8 (bad byte at header offset {e.start}); not a safetensors file")
        try:
            header = json.loads(
                text, object_pairs_hook=_object_pairs, parse_int=_parse_int, parse_constant=_reject_constant
            )
        except RecursionError:
            raise self.fail("header is not valid JSON: nested too deeply") from None
        except ValueError as e:  # JSONDecodeError and our hooks' errors
            raise self.fail(f"header is not valid JSON: {e}") from None
        if not isinstance(header, dict):
            raise self.fail(f"header is not a JSON object (it is a JSON {_json_kind(header)})")
        if header.duplicates:
            key = header.duplicates[0]
            if key == "__metadata__":
                raise self.fail("__metadata__ appears twice in the header")
            raise self.fail(f"tensor {_show(key)} is listed twice in the header")
        return header

    def _metadata(self, value: Any) -> dict[str, str]:
        if not isinstance(value, dict):
            raise self.fail(f"__metadata__ must be an object of string values, not a JSON {_json_kind(value)}")
        if value.duplicates:
            raise self.fail(f"__metadata__ key {_show(value.duplicates[0])} appears twice")
        for k, v in value.items():
            if not isinstance(v, str):
                raise self.fail(f"__metadata__ values must be strings, but key {_show(k)} holds a JSON {_json_kind(v)}")
        return dict(value)

    def _tensor(self, name: str, entry: Any) -> TensorInfo:
        where = f"tensor {_show(name)}"
        if not isinstance(entry, dict):
            raise self.fail(f"{where}: header entry is a JSON {_json_kind(entry)}, not an object")
        if entry.duplicates:
            raise self.fail(f"{where}: field {_show(entry.duplicates[0])} appears twice in its header entry")
        for field in _TENSOR_FIELDS:
            if field not in entry:
                raise self.fail(f"{where}: header entry lacks {field!r}")
        for field in entry:
            if field not in _TENSOR_FIELDS:
                raise self.fail(f"{where}: unexpected field {_show(field)} in header entry")
        dtype = self._dtype(where, entry["dtype"])
        shape = self._shape(where, entry["shape"])
        begin, end = self._offsets(where, entry["data_offsets"])
        info = TensorInfo(name, dtype, shape, begin, end)
        self._check_size(where, info)
        return info

    def _dtype(self, where: str, dtype: Any) -> str:
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise self.fail(f"{where}: unknown dtype {_show(dtype)} (expected one of {', '.join(DTYPES)})")
        return dtype

    def _shape(self, where: str, shape: Any) -> tuple[int, ...]:
        if not isinstance(shape, list):
            raise self.fail(f"{where}: shape must be a list of non-negative integers, not a JSON {_json_kind(shape)}")
        for d in shape:
            if not _is_size(d):
                raise self.fail(f"{where}: shape entry {_show(d)} is not a non-negative integer")
        return tuple(shape)

    def _offsets(self, where: str, offsets: Any) -> tuple[int, int]:
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_size(o) for o in offsets)):
            raise self.fail(f"{where}: data_offsets must be [begin, end] non-negative integers, got {_show(offsets)}")
        begin, end = offsets
        if begin > end:
            raise self.fail(f"{where}: data_offsets [{begin}, {end}] run backwards (begin > end)")
        return begin, end

    def _check_size(self, where: str, info: TensorInfo) -> None:
        bits = DTYPES[info.dtype][0]
        # Python ints cannot overflow; bound the shape so that numpy (and usize in the reference) can hold it.
        nonzero = 1
        for d in info.shape:
            nonzero *= d or 1
        if nonzero * bits > 8 * _MAX_ADDRESSABLE_BYTES:
            raise self.fail(f"{where}: shape {list(info.shape)} is too large to address (2**63 bytes or more)")
        nbits = info.numel * bits
        if nbits % 8:
            raise self.fail(f"{where}: {info.numel} {info.dtype} elements do not fill a whole number of bytes")
        need = nbits // 8
        if need == info.nbytes:
            return  # a data section too short for consistent offsets is reported as truncation later
        if need > self.data_size:
            raise self.fail(
                f"{where}: shape {list(info.shape)} of {info.dtype} needs {need} bytes, "
                f"more than the whole data section ({self.data_size} bytes)"
            )
        raise self.fail(
            f"{where}: data_offsets [{info.begin}, {info.end}] span {info.nbytes} bytes "
            f"but shape {list(info.shape)} of {info.dtype} needs {need}"
        )

    def _check_tiling(self, infos: list[TensorInfo]) -> None:
        cursor, previous = 0, None
        for t in infos:
            if t.begin < cursor:
                raise self.fail(
                    f"tensor {_show(t.name)} data_offsets [{t.begin}, {t.end}] overlap tensor "
                    f"{_show(previous.name)} [{previous.begin}, {previous.end}]"  # type: ignore[union-attr]
                )
            if t.begin > cursor:
                raise self.fail(
                    f"hole in the data section: bytes {cursor}..{t.begin} before tensor {_show(t.name)} belong to no tensor"
                )
            cursor, previous = t.end, t
        if cursor > self.data_size:
            raise self.fail(
                f"data section is {self.data_size} bytes but the header needs {cursor}: "
                "truncated file (incomplete download?)"
            )
        if cursor < self.data_size:
            raise self.fail(
                f"{self.data_size - cursor} trailing bytes after the last tensor (data section is "
                f"{self.data_size} bytes, tensors cover {cursor}): corrupt or polyglot file"
            )


def _json_kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float, _BadNumber)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def _show(v: Any, limit: int = 60) -> str:
    """A short rendering of a JSON value for a one-line message."""
    text = repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def listed_tensors(path: Path) -> tuple[dict[str, TensorInfo], int]:
    """What a safetensors header lists, each entry checked on its own, and the bytes of data the file holds:
    a file the strict reader refuses (truncated, holes...) still says this much, for inspect to describe.
    No tensors when the header itself cannot be read."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            raw = f.read(n) if n <= MAX_HEADER_BYTES else b""
        if len(raw) != n:
            return {}, 0
        parser = _HeaderParser(path, 8 * _MAX_ADDRESSABLE_BYTES)  # sizes checked against the shapes only
        header = parser._load_json(raw)
    except (OSError, CheckpointError):
        return {}, 0
    tensors = {}
    for name, entry in header.items():
        try:
            if name != "__metadata__":
                tensors[name] = parser._tensor(name, entry)
        except CheckpointError:
            continue
    return tensors, size - 8 - n


class SafetensorsFile:
    """One validated .safetensors file, memory-mapped read-only. Use `SafetensorsFile.open(path)`."""

    def __init__(
        self,
        path: Path,
        mapping: mmap.mmap | None,
        data_start: int,
        metadata: dict[str, str],
        tensors: dict[str, TensorInfo],
    ) -> None:
        self.path = path
        self.metadata = metadata
        self.tensors = tensors
        self.data_start = data_start
        self._mmap = mapping

    # --- opening -------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> SafetensorsFile:
        path = Path(path)
        mapping, size = _map_file(path)
        try:
            return cls._from_mapping(path, mapping, size)
        except BaseException:
            mapping.close()
            raise

    @classmethod
    def _from_mapping(cls, path: Path, mapping: mmap.mmap, size: int) -> SafetensorsFile:
        if mapping[: len(_LFS_PREFIX)] == _LFS_PREFIX:
            raise CheckpointError(
                f"{path}: is a Git LFS pointer, not the weights; run `git lfs pull` in the checkpoint "
                "repository (or download the file again) to fetch them"
            )
        if mapping[:4] == _ZIP_PREFIX:
            raise CheckpointError(
                f"{path}: is a zip archive (a PyTorch .bin/.pt checkpoint?), not safetensors; "
                "convert it to safetensors first"
            )
        n = int.from_bytes(mapping[:8], "little")
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(
                f"{path}: header length {n} is above the {MAX_HEADER_BYTES}-byte (100 MB) limit; "
                "not a safetensors file or corrupt"
            )
        if 8 + n > size:
            raise CheckpointError(
                f"{path}: header length {n} runs past the end of the file ({size} bytes); truncated or not safetensors"
            )
        parser = _HeaderParser(path, size - 8 - n)
        metadata, tensors = parser.parse(mapping[8 : 8 + n])
        return cls(path, mapping, 8 + n, metadata, tensors)

    # --- access --------------------------------------------------------------------------------

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor named {name!r}{_suggest(name, self.tensors)}") from None

    def array(self, name: str, *, bf16_bits: bool = False) -> np.ndarray:
        """A read-only, zero-copy view of tensor `name` with its numpy dtype and shape. With bf16_bits a
        BF16 tensor comes as its uint16 bit patterns (which needs no ml_dtypes)."""
        import numpy as np

        info = self.info(name)
        dtype = np.dtype("<u2") if bf16_bits and info.dtype == "BF16" else numpy_dtype(info.dtype)
        if dtype is None:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has dtype {info.dtype}, which metrale cannot read "
                "(packed sub-byte floats, or an ml_dtypes too old to know it)"
            )
        mapping = self._live()
        if info.nbytes == 0:
            # A view at the very end of the buffer is not allowed; an empty array holds no data anyway.
            out = np.empty(info.shape, dtype=dtype)
        else:
            out = np.frombuffer(mapping, dtype=dtype, count=info.numel, offset=self.data_start + info.begin)
            out = out.reshape(info.shape)
        out.flags.writeable = False
        return out

    def raw(self, name: str) -> np.ndarray:
        """The bytes of tensor `name` as a read-only, zero-copy uint8 view (any dtype, packed ones too)."""
        import numpy as np

        info = self.info(name)
        if info.nbytes == 0:
            return np.empty(0, np.uint8)
        out = np.frombuffer(self._live(), dtype=np.uint8, count=info.nbytes, offset=self.data_start + info.begin)
        out.flags.writeable = False
        return out

    def release(self, name: str) -> None:
        """Drop the resident pages wholly inside tensor `name` (advisory; they are re-read if touched again)."""
        info = self.info(name)
        mapping = self._live()
        if not hasattr(mmap, "MADV_DONTNEED") or not hasattr(mapping, "madvise"):
            return
        page = mmap.PAGESIZE
        start = self.data_start + info.begin
        lo = -(-start // page) * page  # round up: never drop a page shared with a neighbouring tensor
        hi = (start + info.nbytes) // page * page
        if hi > lo:
            try:
                mapping.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            except OSError:
                pass  # advice only: failing to drop pages is not an error

    def _live(self) -> mmap.mmap:
        if self._mmap is None:
            raise ValueError(f"{self.path}: SafetensorsFile is closed")
        return self._mmap

    # --- lifetime ------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def close(self) -> None:
        mapping, self._mmap = self._mmap, None
        if mapping is None:
            return
        try:
            mapping.close()
        except BufferError:
            # Arrays still view the mapping; it is unmapped when the last of them is freed.
            pass

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self.tensors)} tensors"
        return f"SafetensorsFile({str(self.path)!r}, {state})"


def _suggest(name: str, names: Any) -> str:
    close = get_close_matches(name, list(names), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _map_file(path: Path) -> tuple[mmap.mmap, int]:
    """Map `path` read-only, after checking it is a regular file of at least 8 bytes."""
    try:
        # Check the type before opening: opening a FIFO for reading blocks until a writer appears.
        if not (stat.S_ISREG(os.stat(path).st_mode) or os.path.isdir(path)):
            raise CheckpointError(f"{path}: is not a regular file")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file does not exist") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, not a .safetensors file") from None
    except PermissionError:
        raise CheckpointError(f"{path}: permission denied; cannot read the file") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise CheckpointError(f"{path}: is a directory, not a .safetensors file")
        if not stat.S_ISREG(st.st_mode):
            # A FIFO or device would block or never end; a weights file is always a regular file.
            raise CheckpointError(f"{path}: is not a regular file")
        size = st.st_size
        if size == 0:
            raise CheckpointError(f"{path}: empty file (0 bytes); the download or conversion did not finish")
        if size < 8:
            raise CheckpointError(f"{path}: file is only {size} bytes, shorter than the 8-byte header length")
        try:
            return mmap.mmap(fd, 0, access=mmap.ACCESS_READ), size
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot memory-map the file: {e}") from None
    finally:
        os.close(fd)  # mmap keeps its own duplicate of the descriptor


def open_safetensors(path: str | os.PathLike[str]) -> SafetensorsFile:
    """Open and validate one .safetensors file (same as `SafetensorsFile.open`)."""
    return SafetensorsFile.open(path)
