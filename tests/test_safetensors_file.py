"""SafetensorsFile: exact round-trips against the reference writer, and one malformed file per failure."""

from __future__ import annotations

import json
import mmap
import os
import struct
import sys
from pathlib import Path
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from metrale_cli.errors import CheckpointError
from metrale_cli.safetensors_file import STRICTER_THAN_REFERENCE, SafetensorsFile, TensorInfo

# --- helpers -------------------------------------------------------------------------------------


def raw_file(header: bytes | str | dict, data: bytes = b"", length: int | None = None) -> bytes:
    """8-byte length + header + data; `length` overrides the header length field."""
    if isinstance(header, dict):
        header = json.dumps(header)
    if isinstance(header, str):
        header = header.encode("utf-8")
    n = len(header) if length is None else length
    return struct.pack("<Q", n) + header + data


def entry(dtype: str = "F32", shape: list | object = (2,), offsets: list | object = (0, 8)) -> dict:
    return {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape,
            "data_offsets": list(offsets) if isinstance(offsets, tuple) else offsets}


def write(tmp_path: Path, content: bytes, name: str = "weights.safetensors") -> Path:
    path = tmp_path / name
    path.write_bytes(content)
    return path


def reference_accepts(path: Path) -> bool:
    try:
        with safe_open(str(path), "np") as f:
            list(f.keys())
    except Exception:
        return False
    return True


# --- round trips ---------------------------------------------------------------------------------


def sample_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "bf16": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
        "f16": rng.standard_normal((4,)).astype(np.float16),
        "f32": rng.standard_normal((2, 3, 2)).astype(np.float32),
        "i64": np.arange(-3, 4, dtype=np.int64),
        "i32": np.arange(5, dtype=np.int32),
        "u8": np.arange(7, dtype=np.uint8),
        "bool": np.array([True, False, True]),
        "f64": np.array([1.5, -2.25]),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "empty_bf16": np.zeros((3, 0), dtype=ml_dtypes.bfloat16),
        "scalar": np.array(3.5, dtype=np.float32),
    }


def test_round_trip_matches_reference_writer_bytes(tmp_path: Path) -> None:
    tensors = sample_tensors()
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "héllo"})
    with SafetensorsFile.open(path) as f:
        assert f.metadata == {"format": "pt", "note": "héllo"}
        assert set(f.tensors) == set(tensors)
        for name, want in tensors.items():
            got = f.array(name)
            assert got.dtype == want.dtype, name
            assert got.shape == want.shape, name
            assert got.tobytes() == want.tobytes(), name
            assert not got.flags.writeable
            assert f.tensors[name].nbytes == want.nbytes
        assert f.tensors["bf16"].dtype == "BF16" and f.tensors["bool"].dtype == "BOOL"


def test_arrays_are_zero_copy_views_of_one_mapping(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": np.arange(8, dtype=np.float32)}, str(path))
    with SafetensorsFile.open(path) as f:
        a = f.array("a")
        assert not a.flags.owndata
        base = a
        while isinstance(base, np.ndarray) and base.base is not None:
            base = base.base
        if isinstance(base, memoryview):
            base = base.obj
        assert base is f._mmap
        with pytest.raises(ValueError):
            a[0] = 1.0  # read-only


def test_tensor_info_fields(tmp_path: Path) -> None:
    path = write(tmp_path, raw_file({"a": entry("F32", (2,), (0, 8)), "b": entry("F16", (1, 2), (8, 12))}, bytes(12)))
    with SafetensorsFile.open(path) as f:
        assert f.tensors["b"] == TensorInfo("b", "F16", (1, 2), 8, 12)
        assert f.tensors["b"].nbytes == 4 and f.tensors["b"].data_offsets == (8, 12)
        assert list(f.tensors) == ["a", "b"]


def test_header_padding_and_unaligned_data_are_accepted(tmp_path: Path) -> None:
    data = np.arange(3, dtype=np.float32).tobytes()
    for header in ['{"x":%s}   ', ' \n{"x":%s}\t ', '{"x":%s}']:
        text = header % json.dumps(entry("F32", (3,), (0, 12)))
        path = write(tmp_path, raw_file(text, data))
        assert reference_accepts(path)
        with SafetensorsFile.open(path) as f:
            np.testing.assert_array_equal(f.array("x"), [0, 1, 2])


def test_empty_header_and_zero_size_only_files(tmp_path: Path) -> None:
    with SafetensorsFile.open(write(tmp_path, raw_file("{}"))) as f:
        assert f.tensors == {} and f.metadata == {}
    zero = {"a": entry("F32", (0, 3), (0, 0)), "b": entry("BF16", (0,), (0, 0)), "__metadata__": {}}
    with SafetensorsFile.open(write(tmp_path, raw_file(zero), "z.safetensors")) as f:
        assert f.array("a").shape == (0, 3) and f.array("b").dtype == ml_dtypes.bfloat16


def test_release_keeps_values_readable(tmp_path: Path) -> None:
    big = np.arange(5 * mmap.PAGESIZE, dtype=np.float32)
    path = tmp_path / "big.safetensors"
    save_file({"small": np.ones(3, np.float32), "big": big}, str(path))
    with SafetensorsFile.open(path) as f:
        before = f.array("big")
        np.testing.assert_array_equal(before, big)
        f.release("big")
        f.release("small")  # smaller than a page: nothing to drop, must not fail
        np.testing.assert_array_equal(f.array("big"), big)


def test_close_with_live_arrays_and_use_after_close(tmp_path: Path) -> None:
    path = tmp_path / "c.safetensors"
    save_file({"a": np.arange(4, dtype=np.int64)}, str(path))
    f = SafetensorsFile.open(path)
    a = f.array("a")
    f.close()
    f.close()  # idempotent
    assert f.closed
    np.testing.assert_array_equal(a, [0, 1, 2, 3])  # the mapping lives until its last view goes
    with pytest.raises(ValueError, match="closed"):
        f.array("a")


def test_unknown_name_suggests_a_close_match(tmp_path: Path) -> None:
    path = tmp_path / "n.safetensors"
    save_file({"model.embed_tokens.weight": np.zeros(2, np.float32)}, str(path))
    with SafetensorsFile.open(path) as f, pytest.raises(CheckpointError, match="did you mean 'model.embed_tokens.weight'"):
        f.array("model.embed_token.weight")


def test_sub_byte_dtype_opens_but_cannot_be_read(tmp_path: Path) -> None:
    path = write(tmp_path, raw_file({"q": entry("F4", (4,), (0, 2))}, bytes(2)))
    assert reference_accepts(path)
    with SafetensorsFile.open(path) as f:
        assert f.tensors["q"].dtype == "F4"
        with pytest.raises(CheckpointError, match="dtype F4, which metrale cannot read"):
            f.array("q")


def test_fp8_and_other_readable_dtypes(tmp_path: Path) -> None:
    header = {"e4": entry("F8_E4M3", (2,), (0, 2)), "e5": entry("F8_E5M2", (2,), (2, 4)),
              "u16": entry("U16", (1,), (4, 6)), "c": entry("C64", (1,), (6, 14))}
    with SafetensorsFile.open(write(tmp_path, raw_file(header, bytes(14)))) as f:
        assert f.array("e4").dtype == ml_dtypes.float8_e4m3fn
        assert f.array("e5").dtype == ml_dtypes.float8_e5m2
        assert f.array("c").dtype == np.complex64 and f.array("u16").dtype == np.uint16


# --- malformed files: one case per failure -------------------------------------------------------

F32x2 = entry("F32", (2,), (0, 8))
D8 = bytes(8)

# id -> (file bytes, distinctive message substring, does the reference reader accept it?)
MALFORMED: dict[str, tuple[bytes, str, bool]] = {
    "empty-file": (b"", "empty file", False),
    "shorter-than-8": (b"\x05\x00\x00", "shorter than the 8-byte header length", False),
    "header-above-100MB": (raw_file("{}", length=100_000_001), "100 MB", False),
    "header-past-eof": (raw_file("{}", length=4096), "runs past the end of the file", False),
    "header-length-zero": (raw_file("", b"{}"), "not valid JSON", False),
    "header-not-utf8": (raw_file(b'{"\xff\xfe":1}'), "not valid UTF-8", False),
    "header-not-json": (raw_file('{"a": '), "not valid JSON", False),
    "header-json-nan": (raw_file('{"__metadata__": {"a": NaN}}'), "not valid JSON", False),
    "header-garbage-after-json": (raw_file("{}xyz"), "not valid JSON", False),
    "header-lone-surrogate": (raw_file('{"t\\ud800": %s}' % json.dumps(F32x2), D8), "surrogate", False),
    "header-bom": (raw_file(b"\xef\xbb\xbf{}"), "not valid JSON", False),
    "header-deep-nesting": (raw_file("[" * 100_000 + "]" * 100_000), "not valid JSON", False),
    "header-not-object": (raw_file("[1, 2]"), "not a JSON object (it is a JSON array)", False),
    "entry-not-object": (raw_file({"t": [1, 2]}), "header entry is a JSON array, not an object", False),
    "entry-missing-dtype": (raw_file({"t": {"shape": [2], "data_offsets": [0, 8]}}, D8), "lacks 'dtype'", False),
    "entry-missing-shape": (raw_file({"t": {"dtype": "F32", "data_offsets": [0, 8]}}, D8), "lacks 'shape'", False),
    "entry-missing-offsets": (raw_file({"t": {"dtype": "F32", "shape": [2]}}, D8), "lacks 'data_offsets'", False),
    "entry-unexpected-field": (raw_file({"t": {**F32x2, "extra": 1}}, D8), "unexpected field 'extra'", True),
    "dtype-unknown": (raw_file({"t": entry("F33")}, D8), "unknown dtype 'F33'", False),
    "dtype-lowercase": (raw_file({"t": entry("f32")}, D8), "unknown dtype 'f32'", False),
    "dtype-not-string": (raw_file({"t": entry(32)}, D8), "unknown dtype 32", False),
    "shape-negative": (raw_file({"t": entry(shape=[-2])}, D8), "shape entry -2 is not a non-negative integer", False),
    "shape-minus-zero": (raw_file('{"t": {"dtype": "F32", "shape": [-0], "data_offsets": [0, 0]}}'), "shape entry -0", False),
    "shape-float": (raw_file({"t": entry(shape=[2.0])}, D8), "shape entry 2.0 is not", False),
    "shape-bool": (raw_file({"t": entry(shape=[True])}, D8), "shape entry True is not", False),
    "shape-not-list": (raw_file({"t": entry(shape=2)}, D8), "shape must be a list", False),
    "shape-overflow": (raw_file({"t": entry(shape=[2**40, 2**40, 2**40])}, D8), "too large to address", False),
    "shape-overflow-zero-size": (raw_file({"t": entry(shape=[0, 2**62, 4], offsets=[0, 0])}), "too large to address", True),
    "shape-exceeds-data": (raw_file({"t": entry(shape=[1000], offsets=[0, 8])}, D8), "more than the whole data section", False),
    "offsets-one-value": (raw_file({"t": entry(offsets=[8])}, D8), "data_offsets must be [begin, end]", False),
    "offsets-three-values": (raw_file({"t": entry(offsets=[0, 8, 8])}, D8), "data_offsets must be [begin, end]", False),
    "offsets-negative": (raw_file({"t": entry(offsets=[-8, 0])}, D8), "data_offsets must be [begin, end]", False),
    "offsets-float": (raw_file({"t": entry(offsets=[0, 8.0])}, D8), "data_offsets must be [begin, end]", False),
    "offsets-backwards": (raw_file({"t": entry(offsets=[8, 0])}, D8), "run backwards", False),
    "offsets-size-mismatch": (raw_file({"t": entry(offsets=[0, 4])}, D8), "span 4 bytes but shape [2] of F32 needs 8", False),
    "offsets-hole-at-start": (raw_file({"t": entry(offsets=[4, 12])}, bytes(12)), "hole in the data section: bytes 0..4", False),
    "offsets-hole-between": (raw_file({"a": entry(offsets=[0, 8]), "b": entry(offsets=[12, 20])}, bytes(20)), "hole in the data section", False),
    "offsets-overlap": (raw_file({"a": entry(offsets=[0, 8]), "b": entry(offsets=[4, 12])}, bytes(12)), "overlap tensor 'a'", False),
    "zero-size-inside-other": (raw_file({"a": entry(offsets=[0, 8]), "z": entry(shape=[0], offsets=[4, 4])}, D8), "overlap", False),
    "sub-byte-partial": (raw_file({"t": entry("F4", [3], [0, 2])}, bytes(2)), "whole number of bytes", False),
    "data-truncated": (raw_file({"t": F32x2}, bytes(5)), "truncated file", False),
    "data-trailing-bytes": (raw_file({"t": F32x2}, bytes(12)), "4 trailing bytes after the last tensor", False),
    "duplicate-tensor-name": (raw_file('{"t": %s, "t": %s}' % (json.dumps(F32x2), json.dumps(F32x2)), D8), "tensor 't' is listed twice", True),
    "duplicate-field": (raw_file('{"t": {"dtype": "F32", "dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', D8), "field 'dtype' appears twice", False),
    "metadata-null": (raw_file({"__metadata__": None, "t": F32x2}, D8), "__metadata__ must be an object", True),
    "metadata-list": (raw_file({"__metadata__": ["a"], "t": F32x2}, D8), "__metadata__ must be an object", False),
    "metadata-int-value": (raw_file({"__metadata__": {"k": 1}, "t": F32x2}, D8), "__metadata__ values must be strings, but key 'k'", False),
    "metadata-duplicate-key": (raw_file('{"__metadata__": {"k": "a", "k": "b"}}'), "__metadata__ key 'k' appears twice", True),
    "git-lfs-pointer": (
        b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"ab" * 32 + b"\nsize 4944388888\n",
        "is a Git LFS pointer, not the weights; run `git lfs pull`",
        False,
    ),
    "zip-archive": (b"PK\x03\x04" + bytes(60), "is a zip archive", False),
}


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
def test_malformed_file_is_a_checkpoint_error(tmp_path: Path, case: str) -> None:
    content, needle, ref_accepts = MALFORMED[case]
    path = write(tmp_path, content, f"{case}.safetensors")
    with pytest.raises(CheckpointError) as info:
        SafetensorsFile.open(path)
    message = str(info.value)
    assert needle in message
    assert path.name in message
    assert "\n" not in message
    assert info.value.exit_code == 3
    # We never accept what the reference rejects; where it accepts, the reason is a documented one.
    assert reference_accepts(path) == ref_accepts
    if ref_accepts:
        assert any(reason in message for reason in STRICTER_THAN_REFERENCE)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="nope.safetensors: file does not exist"):
        SafetensorsFile.open(tmp_path / "nope.safetensors")
    (tmp_path / "d.safetensors").mkdir()
    with pytest.raises(CheckpointError, match="d.safetensors: is a directory"):
        SafetensorsFile.open(tmp_path / "d.safetensors")


@pytest.mark.skipif(not hasattr(os, "mkfifo") or sys.platform == "win32", reason="needs POSIX FIFOs")
def test_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    # Opening a FIFO for reading would block until a writer appears: the type must be checked first.
    with pytest.raises(CheckpointError, match="pipe.safetensors: is not a regular file"):
        SafetensorsFile.open(fifo)


def test_enough_malformed_cases() -> None:
    assert len(MALFORMED) >= 25
