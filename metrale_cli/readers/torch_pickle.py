"""PyTorch `.pt` files read without torch and without running any code from them.

`torch.save` writes a zip archive: `<dir>/data.pkl` (a pickle of the saved object, protocol 2), one raw
little-endian file per storage, `<dir>/data/<key>`, and `<dir>/byteorder`. Tensors appear in the pickle
as calls of `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks)` whose
storage is a persistent id `('storage', torch.<Dtype>Storage, key, location, numel)`. The legacy format
(`_use_new_zipfile_serialization=False`) is a bare stream: a magic number, a protocol version and system
info pickles, the object's pickle, the list of storage keys, then each storage as an 8-byte element count
and its bytes.

Pickle can call any importable function, so a .pt file from elsewhere is a program. This reader allows only
the globals a saved tensor, list, tuple or dict needs (`ALLOWED` below: the tensor and parameter rebuild
functions, the storage types, `collections.OrderedDict`) and refuses every other one by name before it is
resolved (`UnsafePickleError`, exit 5): nothing named in the file is imported or called. The rebuild
functions are this module's own, returning NumPy arrays (views of one storage share its buffer; strides and
offsets are checked against the storage's size). bfloat16 storages become float32 exactly (a bf16 is the
top half of an fp32); `Tensor.dtype_name` keeps what was stored.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import InputError

# torch storage type -> (numpy dtype of the stored bytes, metrale's name for it)
STORAGE_DTYPES: dict[str, tuple[str, str]] = {
    "FloatStorage": ("<f4", "f32"), "DoubleStorage": ("<f8", "f64"), "HalfStorage": ("<f2", "f16"),
    "BFloat16Storage": ("<u2", "bf16"), "LongStorage": ("<i8", "i64"), "IntStorage": ("<i4", "i32"),
    "ShortStorage": ("<i2", "i16"), "CharStorage": ("i1", "i8"), "ByteStorage": ("u1", "u8"),
    "BoolStorage": ("?", "bool"),
}
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


class UnsafePickleError(InputError):
    """A .pt file whose pickle names a global outside the allowed set: refused, never resolved or run."""

    def __init__(self, message: str, global_name: str) -> None:
        super().__init__(message)
        self.global_name = global_name


@dataclass
class Tensor:
    """A tensor read from a .pt file: its values (bf16 widened to float32) and the stored dtype."""

    array: np.ndarray
    dtype_name: str  # f32 | f16 | bf16 | f64 | i64 | i32 | i16 | i8 | u8 | bool


@dataclass
class _StorageType:
    name: str


class _Storage:
    """One storage of the file, read (once) when a tensor first uses it."""

    def __init__(self, kind: _StorageType, numel: int, load: Callable[[], bytes]) -> None:
        self.kind, self.numel, self._load, self._array = kind, numel, load, None

    def array(self) -> np.ndarray:
        if self._array is None:
            np_dtype = np.dtype(STORAGE_DTYPES[self.kind.name][0])
            raw = self._load()
            if len(raw) < self.numel * np_dtype.itemsize:
                raise pickle.UnpicklingError(f"storage holds {len(raw)} bytes, fewer than its {self.numel} "
                                             f"elements of {np_dtype.itemsize} bytes")
            self._array = np.frombuffer(raw, dtype=np_dtype, count=self.numel)
        return self._array


@dataclass
class _Pending:
    """A tensor as the pickle describes it; read from its storage once the whole file is parsed."""

    storage: _Storage
    offset: int
    size: tuple
    stride: tuple

    def __setstate__(self, state: Any) -> None:  # a BUILD opcode aimed at a tensor: not from torch.save
        raise pickle.UnpicklingError("unexpected state for a tensor")

    def read(self) -> Tensor:
        base = self.storage.array()
        offset, size, stride = self.offset, self.size, self.stride
        n = math.prod(size)  # exact (no overflow): a size past the storage is refused below
        last = offset + sum((s - 1) * st for s, st in zip(size, stride)) if n else offset
        if n and last >= base.size:
            raise pickle.UnpicklingError(f"a tensor [{', '.join(map(str, size))}] at offset {offset} reaches "
                                         f"past its storage of {base.size} elements")
        view = np.lib.stride_tricks.as_strided(base[offset:] if n else base[:0], shape=size,
                                               strides=tuple(st * base.itemsize for st in stride), writeable=False)
        values = np.array(view)  # a copy: contiguous and owning its memory, whatever views the file held
        kind = STORAGE_DTYPES[self.storage.kind.name][1]
        if kind == "bf16":
            values = (values.astype(np.uint32) << 16).view(np.float32)
        return Tensor(values, kind)


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *_ignored: Any) -> _Pending:
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("a tensor's storage is not a storage record")
    if not (isinstance(offset, int) and isinstance(size, tuple) and isinstance(stride, tuple)
            and len(size) == len(stride) and all(isinstance(v, int) and v >= 0 for v in (*size, *stride, offset))):
        raise pickle.UnpicklingError("a tensor's offset, size or stride is malformed")
    return _Pending(storage, offset, size, stride)


def _rebuild_parameter(data: Any, *_ignored: Any) -> Any:
    if not isinstance(data, _Pending):
        raise pickle.UnpicklingError("a parameter's data is not a tensor")
    return data


def _ordered_dict(*args: Any) -> Any:
    return collections.OrderedDict(*args)


ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("collections", "OrderedDict"): _ordered_dict,
    **{("torch", name): _StorageType(name) for name in STORAGE_DTYPES},
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, stream: io.BytesIO, where: str, storage: Callable[[tuple], _Storage]) -> None:
        super().__init__(stream)
        self._where, self._storage = where, storage

    def find_class(self, module: str, name: str) -> Any:
        found = ALLOWED.get((module, name))
        if found is None:
            what = f"{'builtins' if module == '__builtin__' else module}.{name}"  # protocol 2's old name
            hint = " (a storage dtype metrale does not read)" if module == "torch" and name.endswith("Storage") else ""
            raise UnsafePickleError(f"{self._where}: refused: its pickle names {what}{hint}; a .pt file is read "
                                    "only when it holds tensors, lists, tuples and dicts (nothing in it is run)",
                                    what)
        return found

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[4], int) and pid[4] >= 0):
            raise pickle.UnpicklingError(f"unexpected persistent id {str(pid)[:60]}")
        return self._storage(pid)


def load(path: str | Path, where: str | None = None) -> Any:
    """The object a .pt file holds, tensors as `Tensor`; InputError (UnsafePickleError for a refused
    global) for anything else, naming `where` (default: the path)."""
    p = Path(path)
    where = where or str(p)
    try:
        if zipfile.is_zipfile(p):
            return _load_zip(p, where)
        return _load_legacy(p, where)
    except InputError:
        raise
    except (pickle.UnpicklingError, EOFError, zipfile.BadZipFile, KeyError, ValueError, TypeError, struct.error,
            IndexError, AttributeError, RecursionError) as e:
        raise InputError(f"{where}: not a complete PyTorch .pt file ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:160]})") from None
    except OSError as e:
        raise InputError(f"{where}: cannot be read ({e.strerror or e})") from None


def _load_zip(p: Path, where: str) -> Any:
    with zipfile.ZipFile(p) as z:
        names = z.namelist()
        pkl = next((n for n in names if n.endswith("/data.pkl") or n == "data.pkl"), None)
        if pkl is None:
            raise InputError(f"{where}: a zip archive without data.pkl: not a file torch.save wrote")
        prefix = pkl[: -len("data.pkl")]
        order = prefix + "byteorder"
        if order in names and z.read(order).strip() not in (b"little", b""):
            raise InputError(f"{where}: stored big-endian; metrale reads little-endian .pt files")
        cache: dict[str, _Storage] = {}

        def storage(pid: tuple) -> _Storage:
            key = str(pid[2])
            if key not in cache:
                member = f"{prefix}data/{key}"
                cache[key] = _Storage(pid[1], pid[4], lambda: z.read(member))
            return cache[key]

        obj = _Unpickler(io.BytesIO(z.read(pkl)), where, storage).load()
        return _materialize(obj)


def _load_legacy(p: Path, where: str) -> Any:
    raw = p.read_bytes()
    stream = io.BytesIO(raw)
    guard = _Unpickler(stream, where, lambda pid: (_ for _ in ()).throw(pickle.UnpicklingError("storage in header")))
    if guard.load() != LEGACY_MAGIC:
        raise InputError(f"{where}: not a PyTorch .pt file (neither a zip archive nor the legacy format)")
    guard.load()  # protocol version
    guard.load()  # system info
    pending: dict[str, _Storage] = {}

    def storage(pid: tuple) -> _Storage:
        key = str(pid[2])
        if key not in pending:
            pending[key] = _Storage(pid[1], pid[4], lambda: b"")
        return pending[key]

    obj = _Unpickler(stream, where, storage).load()
    keys = _Unpickler(stream, where, storage).load()
    if not isinstance(keys, list):
        raise pickle.UnpicklingError("the storage key list is missing")
    for key in keys:
        (count,) = struct.unpack("<q", stream.read(8))
        s = pending.get(str(key))
        if s is None:
            raise pickle.UnpicklingError(f"storage {key} is not used by the object")
        data = stream.read(count * np.dtype(STORAGE_DTYPES[s.kind.name][0]).itemsize)
        s._load = lambda data=data: data
    return _materialize(obj)


def _materialize(obj: Any) -> Any:
    """Check what came out: only tensors, containers of them and plain values."""
    if isinstance(obj, _Pending):
        return obj.read()
    if isinstance(obj, (str, int, float, bool, type(None), bytes)):
        return obj
    if isinstance(obj, dict):
        return {k: _materialize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_materialize(v) for v in obj)
    raise pickle.UnpicklingError(f"holds a {type(obj).__name__}, not a tensor or container")
