"""Dump files: logits rows and hidden states, written atomically.

`--dump-logits PATH` writes every logits row the command produced (decoding's `Rows`: the bytes exactly
as copy_logits_to_host gave them), in order, in the chosen logits dtype. Row i holds the logits computed at
input position `positions[i]` (they predict the token at positions[i] + 1):

    .safetensors  tensor `logits` [rows, vocab] BF16 or F32 (the row bytes verbatim), tensor `tokens` I64
                  [n] (the input ids the command ran), and string metadata: format, dtype, vocab, rows,
                  command, model, positions (a JSON list)
    .npy          FP32 rows as float32; BF16 rows as uint16 bit patterns; plus a PATH.json sidecar
    .bin          the concatenated row bytes and nothing else; plus a PATH.json sidecar
    -             the concatenated row bytes on stdout (the report then goes to stderr)

The sidecar (`<PATH>.json`, e.g. `logits.npy.json`) records: command, model, dtype ("bf16"|"fp32"),
storage ("float32" | "uint16 bf16 bit patterns" | "raw little-endian bf16/fp32"), shape [rows, vocab],
vocab, tokens, positions; for a bf16 .npy (which np.load reads as uint16: the format has no bf16 type)
"to_float32", the expression giving the values. .safetensors stores a typed BF16 tensor.

`tokens` are the ids the model ran: the prompt, then for decode the produced tokens fed back, for
verify the k drafts; so row i is the output for input tokens[positions[i]].

`--dump-hidden PATH` writes the post-final-norm hidden state of every row the command produced, [rows,
hidden] float32, in the same row order (and with the same tokens and positions) as the logits dump:
row i is the hidden state logits row i was computed from. `.safetensors`: tensor `hidden` F32 and
`tokens` I64, metadata format "metrale-hidden", dtype, hidden_size, rows, command, model, positions;
`.npy` float32 and `.bin` raw little-endian fp32, each with a PATH.json sidecar (as above, with
hidden_size in place of vocab).

Every file is written to a temporary file in the destination's directory, fsynced and renamed over the
destination with os.replace; on any error or Ctrl-C the temporary file is removed and the destination is
left as it was. A failure to write is an OutputError naming the destination path.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import signal
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Iterable, Iterator, Sequence

from .errors import OutputError, UsageError

if TYPE_CHECKING:  # numpy is imported by the writers: the CLI checks dump paths before any math
    import numpy as np

    from .decoding.results import HiddenRows, Rows

LOGITS_KINDS = ("safetensors", "npy", "bin")
HIDDEN_KINDS = ("safetensors", "npy", "bin")


@dataclass(frozen=True)
class DumpTarget:
    option: str  # the option that named it, for messages
    path: Path | None  # None: stdout
    kind: str  # "safetensors" | "npy" | "bin"

    @property
    def to_stdout(self) -> bool:
        return self.path is None

    @property
    def sidecar(self) -> Path | None:
        if self.path is None or self.kind == "safetensors":
            return None
        return self.path.with_name(self.path.name + ".json")


def check_dump_path(value: str, option: str, kinds: Sequence[str] = LOGITS_KINDS,
                    stdout_ok: bool = True) -> DumpTarget:
    """Validate a dump destination before any work is done (nothing is created here)."""
    if value == "-":
        if not stdout_ok:
            raise UsageError(f"{option} cannot write to stdout ('-'); give a file path")
        return DumpTarget(option, None, "bin")
    if not value:
        raise UsageError(f"{option} is empty; give a file path")
    p = Path(value)
    if p.is_dir():
        raise OutputError(f"{option} {value}: is a directory")
    kind = p.suffix.lower().lstrip(".")
    if kind not in kinds:
        exts = ", ".join("." + k for k in kinds) + (" or -" if stdout_ok else "")
        raise UsageError(f"{option} {value}: unknown extension '{p.suffix or '(none)'}'; use {exts}")
    parent = p.parent
    if not parent.exists():
        raise OutputError(f"{option} {value}: directory {parent} does not exist")
    if not parent.is_dir():
        raise OutputError(f"{option} {value}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{option} {value}: directory {parent} is not writable")
    if p.exists() and not p.is_file():
        raise OutputError(f"{option} {value}: exists and is not a regular file")
    return DumpTarget(option, p, kind)


# -- logits ------------------------------------------------------------------------------------------------


@dataclass
class DumpInfo:
    command: str
    model: str
    tokens: list[int]
    positions: list[int]
    # how the engine computed the rows where a model offers a choice (a quantized checkpoint's
    # "activation_quant": none | emulate), written into the metadata beside the rest
    engine: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _Matrix:
    """Rows of one dump: what they are (`name` names the safetensors tensor), their dtype and width."""

    name: str  # "logits" | "hidden"
    dtype: str  # "bf16" | "fp32"
    width: int
    data: Sequence[bytes]  # one entry per row

    @property
    def width_key(self) -> str:
        return "vocab" if self.name == "logits" else "hidden_size"


def write_logits(target: DumpTarget, rows: Rows, info: DumpInfo, stdout: IO[bytes] | None = None) -> None:
    if len(info.positions) != len(rows.data):
        raise ValueError(f"{len(rows.data)} rows but {len(info.positions)} positions")
    if target.to_stdout:
        _write_stream(stdout, rows.data)
        return
    _write_matrix(target, _Matrix("logits", rows.dtype, rows.vocab, rows.data), info)


def write_hidden(target: DumpTarget, hidden: HiddenRows, info: DumpInfo) -> None:
    """The hidden state behind every logits row, [rows, hidden] fp32 (see the module docstring)."""
    import numpy as np

    data = [np.ascontiguousarray(r, dtype="<f4").tobytes() for r in hidden.data]
    if len(info.positions) != len(data):
        raise ValueError(f"{len(data)} hidden rows but {len(info.positions)} positions")
    _write_matrix(target, _Matrix("hidden", "fp32", hidden.size, data), info)


def _write_matrix(target: DumpTarget, m: _Matrix, info: DumpInfo) -> None:
    assert target.path is not None
    if target.kind == "safetensors":
        commit([(target.path, _safetensors_chunks(m, info))])
        return
    chunks = list(m.data) if target.kind == "bin" else [_npy_header(m), *m.data]
    commit([(target.path, chunks), (target.sidecar, [_sidecar(target, m, info)])])


def _safetensors_chunks(m: _Matrix, info: DumpInfo) -> list[bytes]:
    import numpy as np

    n = sum(len(r) for r in m.data)
    tokens = np.asarray(info.tokens, dtype="<i8").tobytes()
    header = {
        "__metadata__": {
            "format": f"metrale-{m.name}", "dtype": m.dtype, m.width_key: str(m.width),
            "rows": str(len(m.data)), "command": info.command, "model": info.model,
            "positions": json.dumps(info.positions, separators=(",", ":")), **info.engine,
        },
        m.name: {"dtype": "F32" if m.dtype == "fp32" else "BF16", "shape": [len(m.data), m.width],
                 "data_offsets": [0, n]},
        "tokens": {"dtype": "I64", "shape": [len(info.tokens)], "data_offsets": [n, n + len(tokens)]},
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    return [len(raw).to_bytes(8, "little"), raw, *m.data, tokens]


def _npy_header(m: _Matrix) -> bytes:
    import numpy as np

    dtype = np.dtype("<f4" if m.dtype == "fp32" else "<u2")
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
              "shape": (len(m.data), m.width)})
    return buf.getvalue()


BF16_NPY_LOAD = "(np.load(PATH).astype(np.uint32) << 16).view(np.float32)"


def _sidecar(target: DumpTarget, m: _Matrix, info: DumpInfo) -> bytes:
    if target.kind == "npy":
        storage = "float32" if m.dtype == "fp32" else "uint16 bf16 bit patterns"
    else:
        storage = f"raw little-endian {m.dtype}"
    doc = {"command": info.command, "model": info.model, "dtype": m.dtype, "storage": storage,
           "shape": [len(m.data), m.width], m.width_key: m.width, "tokens": info.tokens,
           "positions": info.positions, **info.engine}
    if target.kind == "npy" and m.dtype == "bf16":  # .npy has no bf16: np.load gives the bits as uint16
        doc["to_float32"] = BF16_NPY_LOAD
    return (json.dumps(doc, indent=1) + "\n").encode()


# -- atomic writes ---------------------------------------------------------------------------------------------


def commit(files: list[tuple[Path, Iterable[bytes]]]) -> None:
    """Write every file to a temp file beside it, then rename them all into place.

    Any error or KeyboardInterrupt before the renames removes the temp files and leaves every
    destination untouched; Ctrl-C during the renames is held until they are done.
    """
    temps: list[tuple[str, Path]] = []
    try:
        for path, chunks in files:
            temps.append((_write_temp(path, chunks), path))
        with _sigint_deferred():
            for tmp, path in temps:
                _os_call(path, os.replace, tmp, path)
            for directory in {p.parent for _, p in temps}:
                _fsync_dir(directory)
    except BaseException:
        for tmp, _ in temps:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise


def _write_temp(path: Path, chunks: Iterable[bytes]) -> str:
    fd, tmp = _os_call(path, tempfile.mkstemp, prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        try:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                while view.nbytes:
                    view = view[_os_call(path, os.write, fd, view):]
            _os_call(path, os.fchmod, fd, 0o644)
            _os_call(path, os.fsync, fd)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def _os_call(path: Path, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except OSError as e:
        raise OutputError(f"{path}: cannot write: {_reason(e)}") from None


def _reason(e: OSError) -> str:
    names = {errno.ENOSPC: "no space left on device", errno.EACCES: "permission denied",
             errno.EISDIR: "is a directory", errno.EROFS: "read-only file system"}
    if hasattr(errno, "EDQUOT"):
        names[errno.EDQUOT] = "disk quota exceeded"
    return names.get(e.errno, e.strerror or str(e))


def _fsync_dir(directory: Path) -> None:
    # Make the rename itself durable; not every platform or file system allows it.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold a Ctrl-C that arrives inside the block and raise it after (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
    if caught:
        raise KeyboardInterrupt


def _write_stream(stream: IO[bytes] | None, chunks: Iterable[bytes]) -> None:
    if stream is None:
        raise OutputError("--dump-logits -: stdout does not accept bytes here")
    try:
        for chunk in chunks:
            stream.write(chunk)
        stream.flush()
    except BrokenPipeError:  # the reader left (`| head -c`): the CLI's quiet exit, not an output error
        raise
    except OSError as e:
        raise OutputError(f"--dump-logits -: cannot write to stdout: {_reason(e)}") from None
