"""Property test: mutated safetensors files either load correctly or raise CheckpointError, and our verdict
agrees with the reference reader (`safetensors.safe_open`) except for documented stricter rejections."""

from __future__ import annotations

import itertools
import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Any, Callable

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import save

from metrale_cli.errors import CheckpointError
from metrale_cli.safetensors_file import DTYPES, STRICTER_THAN_REFERENCE, SafetensorsFile, numpy_dtype

MAX_EXAMPLES = int(os.environ.get("METRALE_FUZZ_EXAMPLES", "2000"))


def _raw(header: dict, data: bytes) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


BASES: list[bytes] = [
    save(
        {
            "a": np.arange(6, dtype=np.float32).reshape(2, 3),
            "b": np.arange(4, dtype=np.float32).astype(ml_dtypes.bfloat16),
            "c": np.array([-1, 7], dtype=np.int64),
            "z": np.zeros((0, 2), dtype=np.float16),
        },
        metadata={"format": "pt"},
    ),
    save({"x": np.arange(5, dtype=np.uint8), "s": np.array(2.5, dtype=np.float16)}),
    _raw({"q": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]},
          "e": {"dtype": "F8_E4M3", "shape": [3], "data_offsets": [2, 5]}}, bytes(range(5))),
    _raw({}, b""),
]

# --- mutations: each is a function bytes -> bytes ----------------------------------------------

Mutation = Callable[[bytes], bytes]
INTERESTING_INTS = [0, 1, 2, 3, 4, 7, 8, 255, 2**31, 2**32, 2**61, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64]
ints = st.one_of(st.integers(-3, 40), st.sampled_from(INTERESTING_INTS), st.integers(-(2**70), 2**70))
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), ints, st.floats(), st.text(max_size=6), st.sampled_from(list(DTYPES))),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=6,
)
positions = st.integers(0, 2**16)


def _split(buf: bytes) -> tuple[int, bytes, bytes] | None:
    """(header length, header, data) when the length field fits the buffer."""
    if len(buf) < 8:
        return None
    n = int.from_bytes(buf[:8], "little")
    return (n, buf[8 : 8 + n], buf[8 + n :]) if 8 + n <= len(buf) else None


def _header_json(buf: bytes) -> tuple[dict, bytes] | None:
    parts = _split(buf)
    if parts is None:
        return None
    try:
        header = json.loads(parts[1])
    except ValueError:
        return None
    return (header, parts[2]) if isinstance(header, dict) else None


@st.composite
def byte_mutation(draw: st.DrawFn) -> Mutation:
    kind = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "append", "length", "length_delta"]))
    pos = draw(positions)
    blob = draw(st.binary(min_size=1, max_size=8))
    if kind == "flip":
        bit = draw(st.integers(0, 7))
        return lambda b: b[: pos % len(b)] + bytes([b[pos % len(b)] ^ (1 << bit)]) + b[pos % len(b) + 1 :] if b else b
    if kind == "insert":
        return lambda b: b[: pos % (len(b) + 1)] + blob + b[pos % (len(b) + 1) :]
    if kind == "delete":
        n = draw(st.integers(1, 8))
        return lambda b: b[: pos % (len(b) + 1)] + b[pos % (len(b) + 1) + n :]
    if kind == "truncate":
        return lambda b: b[: pos % (len(b) + 1)]
    if kind == "append":
        return lambda b: b + blob
    if kind == "length":
        value = draw(st.one_of(st.sampled_from(INTERESTING_INTS[:-1]), st.integers(0, 2**64 - 1)))
        return lambda b: struct.pack("<Q", value) + b[8:]
    delta = draw(st.integers(-9, 9))
    return lambda b: struct.pack("<Q", max(0, int.from_bytes(b[:8], "little") + delta) % 2**64) + b[8:] if len(b) >= 8 else b


@st.composite
def json_mutation(draw: st.DrawFn) -> Mutation:
    """Rewrite the header JSON (then re-serialize with a fresh, possibly padded, length)."""
    kind = draw(st.sampled_from(["set", "delete_field", "nudge", "dtype", "add", "drop", "metadata", "dup", "pad"]))
    pick, field = draw(positions), draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))
    value, delta, index = draw(json_values), draw(st.integers(-9, 9)), draw(st.integers(0, 3))
    dtype = draw(st.one_of(st.sampled_from(list(DTYPES)), st.text(max_size=5)))
    name = draw(st.text(max_size=4))
    padding = draw(st.sampled_from(["", " ", " " * 7, "\n", "\t ", "  \r\n"]))
    leading = draw(st.sampled_from(["", " ", "\n"]))
    fix_length = draw(st.booleans()) or kind != "pad"

    def mutate(b: bytes) -> bytes:
        parsed = _header_json(b)
        if parsed is None:
            return b
        header, data = parsed
        names = [k for k in header if k != "__metadata__"]
        target = names[pick % len(names)] if names else None
        entry = header.get(target) if target is not None else None
        text: str | None = None
        if kind == "set" and isinstance(entry, dict):
            entry[field] = value
        elif kind == "delete_field" and isinstance(entry, dict):
            entry.pop(field, None)
        elif kind == "nudge" and isinstance(entry, dict):
            key = "shape" if index % 2 else "data_offsets"
            seq = entry.get(key)
            if isinstance(seq, list) and seq and isinstance(seq[index % len(seq)], int):
                seq[index % len(seq)] += delta
        elif kind == "dtype" and isinstance(entry, dict):
            entry["dtype"] = dtype
        elif kind == "add":
            header[name] = value if index == 0 else {"dtype": dtype, "shape": [index], "data_offsets": [0, delta % 9]}
        elif kind == "drop" and target is not None:
            del header[target]
        elif kind == "metadata":
            header["__metadata__"] = value if index else {name: name}
        elif kind == "dup" and target is not None:
            body = json.dumps(header)
            text = body[:-1] + f', {json.dumps(target)}: {json.dumps(header[target])}}}'
        if text is None:
            text = json.dumps(header)
        raw = (leading + text + padding).encode("utf-8", "surrogatepass")
        n = len(raw) if fix_length else int.from_bytes(b[:8], "little")
        return struct.pack("<Q", n % 2**64) + raw + data

    return mutate


mutations = st.lists(st.one_of(byte_mutation(), json_mutation()), min_size=1, max_size=3)

# --- verdicts ------------------------------------------------------------------------------------


def reference_verdict(path: Path) -> dict[str, Any] | None:
    """What the reference reader sees, or None when it rejects the file."""
    try:
        with safe_open(str(path), "np") as f:
            return {
                "metadata": f.metadata() or {},
                "tensors": {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()},
            }
    except Exception:
        return None


def our_verdict(path: Path, content: bytes) -> dict[str, Any] | CheckpointError:
    """Open with our reader and read every tensor fully; a CheckpointError is the only allowed failure."""
    try:
        f = SafetensorsFile.open(path)
    except CheckpointError as e:
        return e
    with f:
        for name, info in f.tensors.items():
            np_dtype = numpy_dtype(info.dtype)
            if np_dtype is None:
                with pytest.raises(CheckpointError, match="cannot read"):
                    f.array(name)
                continue
            arr = f.array(name)
            assert arr.shape == info.shape and arr.dtype == np.dtype(np_dtype)
            assert not arr.flags.writeable
            start = f.data_start + info.begin
            assert arr.tobytes() == content[start : start + info.nbytes]
            f.release(name)
        return {"metadata": f.metadata, "tensors": {k: (t.dtype, t.shape) for k, t in f.tensors.items()}}


_counter = itertools.count()


@pytest.fixture(scope="module")
def scratch() -> Any:
    with tempfile.TemporaryDirectory(prefix="metrale-fuzz-") as d:
        yield Path(d)


@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
@given(base=st.sampled_from(range(len(BASES))), steps=mutations)
def test_mutated_files_load_or_fail_cleanly(scratch: Path, base: int, steps: list[Mutation]) -> None:
    content = BASES[base]
    for step in steps:
        content = step(content)
    path = scratch / f"f{next(_counter)}.safetensors"
    path.write_bytes(content)
    try:
        ours = our_verdict(path, content)  # any exception but CheckpointError fails the test
        ref = reference_verdict(path)
    finally:
        path.unlink()
    if isinstance(ours, CheckpointError):
        message = str(ours)
        assert path.name in message and "\n" not in message
        event("both reject" if ref is None else "only the reference accepts")
        if ref is not None:
            assert any(reason in message for reason in STRICTER_THAN_REFERENCE), (
                f"reference accepts a file we reject without a documented reason: {message}"
            )
    else:
        event("both accept")
        assert ref is not None, f"we accept a file the reference rejects: {content[:300]!r}"
        assert ours == ref


@pytest.mark.parametrize("base", range(len(BASES)))
def test_unmutated_bases_agree(scratch: Path, base: int) -> None:
    path = scratch / f"base{base}.safetensors"
    path.write_bytes(BASES[base])
    ours = our_verdict(path, BASES[base])
    assert not isinstance(ours, CheckpointError)
    assert ours == reference_verdict(path)
