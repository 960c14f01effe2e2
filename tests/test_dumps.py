"""Every dump format, re-read and compared bit for bit with rows read straight from the engine; and the
atomic writer's behaviour on errors and Ctrl-C."""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from metrale_cli import dumps
from metrale_cli.errors import OutputError, UsageError
from metrale_cli.model import open_model

REPO = Path(__file__).resolve().parent.parent
LLAMA = "tests/fixtures/models/llama"  # relative: the CLI tests run in REPO

PROMPT = [1, 2, 3]
STEPS = 5
DRAFTS = [270, 157, 5]  # the first two are the model's greedy tokens, the third is not


# -- the reference: rows read through ModelLogits, without the decoding package ----------------------------------------------


def _engine(dtype: str):
    return open_model(REPO / LLAMA, device="cpu", max_context=64, fp32_logits=dtype == "fp32").engine


def _row(e, ptr) -> bytes:
    buf = bytearray(e.row_nbytes(ptr))
    e.copy_logits_to_host(ptr, buf)
    return bytes(buf)


def reference(command: str, dtype: str) -> tuple[list[bytes], list[int], list[int]]:
    """(rows, tokens, positions) as the dump must hold them."""
    e = _engine(dtype)
    n = len(PROMPT)
    if command == "forward":
        e.prefill(PROMPT, all_logits=True)
        buf = e.logits_buffer_ptr()
        return [_row(e, buf.row_ptr(i)) for i in range(n)], PROMPT, list(range(n))
    e.prefill(PROMPT)
    first = e.logits_buffer_ptr().row_ptr(0)
    rows = [_row(e, first)]
    if command == "verify":
        e.verify(DRAFTS)
        buf = e.logits_buffer_ptr()
        rows += [_row(e, buf.row_ptr(i)) for i in range(len(DRAFTS))]
        return rows, PROMPT + DRAFTS, list(range(n - 1, n + len(DRAFTS)))
    tokens = [e.argmax_on_device(first)]
    for _ in range(STEPS - 1):
        e.decode(tokens[-1])
        ptr = e.decode_logits_ptr()
        rows.append(_row(e, ptr))
        tokens.append(e.argmax_on_device(ptr))
    return rows, PROMPT + tokens[:-1], list(range(n - 1, n + STEPS - 1))


def command_args(command: str) -> list:
    args = [command, "-m", LLAMA, "-t", " ".join(map(str, PROMPT)), "-f", "json", "--device", "cpu"]
    if command == "decode":
        args += ["--steps", STEPS]
    elif command == "verify":
        args += ["--draft", " ".join(map(str, DRAFTS))]
    else:
        args += ["--rows", "all"]
    return args


# -- readers, independent of dumps.py ---------------------------------------------------------------------------


def read_safetensors(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


COMMANDS = ["decode", "verify", "forward"]
DTYPES = ["bf16", "fp32"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("command", COMMANDS)
def test_safetensors_dump_is_bit_exact(run_cli, tmp_path, command, dtype):
    out = tmp_path / "logits.safetensors"
    r = run_cli(*command_args(command), "--logits-dtype", dtype, "--dump-logits", out)
    assert r.exit_code == 0, r.stderr
    rows, tokens, positions = reference(command, dtype)
    header, data = read_safetensors(out)
    width = 4 if dtype == "fp32" else 2
    n = len(rows) * 300 * width
    assert header["logits"] == {"dtype": "F32" if dtype == "fp32" else "BF16", "shape": [len(rows), 300],
                                "data_offsets": [0, n]}
    assert header["tokens"] == {"dtype": "I64", "shape": [len(tokens)], "data_offsets": [n, n + 8 * len(tokens)]}
    assert data[:n] == b"".join(rows)
    assert np.frombuffer(data[n:], "<i8").tolist() == tokens
    meta = header["__metadata__"]
    assert meta["dtype"] == dtype and meta["vocab"] == "300" and meta["command"] == command
    assert meta["model"] == LLAMA and json.loads(meta["positions"]) == positions
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logits.safetensors"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_safetensors_dump_loads_with_the_safetensors_library(run_cli, tmp_path, dtype):
    torch = pytest.importorskip("torch")
    from safetensors import safe_open

    out = tmp_path / "logits.safetensors"
    assert run_cli(*command_args("decode"), "--logits-dtype", dtype, "--dump-logits", out).exit_code == 0
    rows, tokens, _ = reference("decode", dtype)
    with safe_open(str(out), "pt") as f:
        logits = f.get_tensor("logits")
        assert logits.dtype == (torch.float32 if dtype == "fp32" else torch.bfloat16)
        bits = logits.view(torch.int32 if dtype == "fp32" else torch.int16).numpy().tobytes()
        assert bits == b"".join(rows)
        assert f.get_tensor("tokens").tolist() == tokens


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("command", COMMANDS)
def test_npy_dump_is_bit_exact(run_cli, tmp_path, command, dtype):
    out = tmp_path / "logits.npy"
    assert run_cli(*command_args(command), "--logits-dtype", dtype, "--dump-logits", out).exit_code == 0
    rows, tokens, positions = reference(command, dtype)
    arr = np.load(out, allow_pickle=False)
    assert arr.dtype == (np.float32 if dtype == "fp32" else np.uint16)  # bf16 as its bit patterns
    assert arr.shape == (len(rows), 300)
    assert arr.tobytes() == b"".join(rows)
    side = json.loads((tmp_path / "logits.npy.json").read_text())
    assert side["dtype"] == dtype and side["shape"] == [len(rows), 300] and side["vocab"] == 300
    assert side["tokens"] == tokens and side["positions"] == positions and side["command"] == command


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("command", COMMANDS)
def test_bin_dump_is_the_concatenated_rows(run_cli, tmp_path, command, dtype):
    out = tmp_path / "logits.bin"
    assert run_cli(*command_args(command), "--logits-dtype", dtype, "--dump-logits", out).exit_code == 0
    rows, tokens, _ = reference(command, dtype)
    assert out.read_bytes() == b"".join(rows)
    side = json.loads((tmp_path / "logits.bin.json").read_text())
    assert side["shape"] == [len(rows), 300] and side["dtype"] == dtype and side["tokens"] == tokens
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logits.bin", "logits.bin.json"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_dump_to_stdout_sends_the_report_to_stderr(run_cli, dtype):
    r = run_cli(*command_args("decode"), "--logits-dtype", dtype, "--dump-logits", "-")
    assert r.exit_code == 0
    rows, _, _ = reference("decode", dtype)
    assert r.stdout_bytes == b"".join(rows)
    assert json.loads(r.stderr)["command"] == "decode"


def test_speculative_dump_equals_plain_decode_dump(run_cli, tmp_path):
    """Speculative decoding produces the same tokens; its rows come from verify passes and must agree
    with the sequential ones in count, positions and (fp32, to rounding) values."""
    plain, spec = tmp_path / "plain.npy", tmp_path / "spec.npy"
    base = ["decode", "-m", LLAMA, "-t", "5 6 7 8 5 6 7 8 5 6 7", "--steps", 10, "--logits-dtype", "fp32"]
    assert run_cli(*base, "--dump-logits", plain).exit_code == 0
    assert run_cli(*base, "--draft-model", LLAMA, "--k", 3, "--dump-logits", spec).exit_code == 0
    a, b = np.load(plain), np.load(spec)
    assert a.shape == b.shape == (10, 300)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
    sa = json.loads((tmp_path / "plain.npy.json").read_text())
    sb = json.loads((tmp_path / "spec.npy.json").read_text())
    assert sa["tokens"] == sb["tokens"] and sa["positions"] == sb["positions"]


def reference_hidden(command: str) -> np.ndarray:
    """The hidden rows a --dump-hidden must hold, read after each pass exactly like reference()'s rows."""
    e = _engine("bf16")
    if command == "forward":
        e.prefill(PROMPT, all_logits=True)
        return e.copy_hidden_rows_to_host()
    e.prefill(PROMPT)
    rows = [e.copy_hidden_rows_to_host()]
    if command == "verify":
        e.verify(DRAFTS)
        return np.concatenate(rows + [e.copy_hidden_rows_to_host()])
    token = e.argmax_on_device(e.logits_buffer_ptr())
    for _ in range(STEPS - 1):
        e.decode(token)
        rows.append(e.copy_hidden_rows_to_host())
        token = e.argmax_on_device(e.decode_logits_ptr())
    return np.concatenate(rows)


def transformers_hidden(tokens: list[int]) -> np.ndarray:
    """transformers' post-final-norm hidden states [len(tokens), hidden] (fp32, eager, no cache)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(REPO / LLAMA, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_hidden_states=True, use_cache=False)
    return out.hidden_states[-1][0].numpy()  # the last entry is the final norm's output


def read_hidden(path: Path, ext: str) -> tuple[np.ndarray, list[int], list[int]]:
    """(rows, tokens, positions) of a hidden dump, read without dumps.py."""
    if ext == "safetensors":
        header, data = read_safetensors(path)
        shape = header["hidden"]["shape"]
        assert header["hidden"]["dtype"] == "F32" and header["__metadata__"]["format"] == "metrale-hidden"
        assert header["__metadata__"]["hidden_size"] == str(shape[1])
        n = shape[0] * shape[1] * 4
        return (np.frombuffer(data[:n], "<f4").reshape(shape), np.frombuffer(data[n:], "<i8").tolist(),
                json.loads(header["__metadata__"]["positions"]))
    side = json.loads(path.with_name(path.name + ".json").read_text())
    assert side["dtype"] == "fp32" and side["hidden_size"] == side["shape"][1] == 64
    if ext == "npy":
        rows = np.load(path, allow_pickle=False)
        assert side["storage"] == "float32"
    else:
        rows = np.frombuffer(path.read_bytes(), "<f4").reshape(side["shape"])
        assert side["storage"] == "raw little-endian fp32"
    return rows, side["tokens"], side["positions"]


@pytest.mark.parametrize("ext", ["safetensors", "npy", "bin"])
@pytest.mark.parametrize("command", COMMANDS)
def test_hidden_dump_has_every_row_in_the_logits_order(run_cli, tmp_path, command, ext):
    out, logits = tmp_path / f"hidden.{ext}", tmp_path / "logits.safetensors"
    r = run_cli(*command_args(command), "--dump-hidden", out, "--dump-logits", logits, "--hidden")
    assert r.exit_code == 0, r.stderr
    rows, tokens, positions = read_hidden(out, ext)
    want = reference_hidden(command)
    assert rows.dtype == np.float32 and rows.shape == want.shape == (len(positions), 64)
    assert rows.tobytes() == want.astype("<f4").tobytes()
    _, logit_tokens, logit_positions = reference(command, "bf16")
    assert tokens == logit_tokens and positions == logit_positions  # the logits dump's rows, one for one
    import hashlib

    assert json.loads(r.stdout)["hidden"]["sha256"] == hashlib.sha256(rows[-1].tobytes()).hexdigest()
    assert json.loads(read_safetensors(logits)[0]["__metadata__"]["positions"]) == positions
    if ext != "safetensors":
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, out.name + ".json", logits.name])


@pytest.mark.parametrize("command", COMMANDS + ["speculative", "forward-last"])
def test_hidden_dump_rows_equal_transformers(run_cli, tmp_path, command):
    """Each dumped row against transformers' final-norm output at that row's position, from the tokens."""
    out = tmp_path / "hidden.npy"
    args = {"speculative": command_args("decode") + ["--draft-model", LLAMA, "--k", 2],  # multi-row passes
            "forward-last": command_args("forward")[:-2]}.get(command) or command_args(command)
    r = run_cli(*args, "--dump-hidden", out)
    assert r.exit_code == 0, command
    rows, tokens, positions = read_hidden(out, "npy")
    import hashlib

    assert json.loads(r.stdout)["hidden"]["sha256"] == hashlib.sha256(rows[-1].tobytes()).hexdigest()
    ref = transformers_hidden(tokens)[positions]
    assert rows.shape == ref.shape and len(rows) == (1 if command == "forward-last" else len(positions))
    if command == "forward-last":
        assert positions == [len(PROMPT) - 1]
    np.testing.assert_allclose(rows, ref, rtol=0, atol=1e-5 * float(np.abs(ref).max()))


# -- the atomic writer ------------------------------------------------------------------------------------------------


def test_commit_replaces_atomically_and_leaves_no_temp(tmp_path):
    dest = tmp_path / "a.bin"
    dest.write_bytes(b"old")
    dumps.commit([(dest, [b"new ", b"bytes"])])
    assert dest.read_bytes() == b"new bytes"
    assert [p.name for p in tmp_path.iterdir()] == ["a.bin"]


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "full"), KeyboardInterrupt()])
def test_commit_failure_mid_write_removes_temp_and_keeps_destination(tmp_path, monkeypatch, failure):
    dest, side = tmp_path / "a.bin", tmp_path / "a.bin.json"
    dest.write_bytes(b"old")
    real, calls = os.write, []

    def write(fd, data):
        calls.append(fd)
        if len(calls) == 3:  # after the first file and part of the second
            raise failure
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    with pytest.raises(OutputError if isinstance(failure, OSError) else KeyboardInterrupt) as e:
        dumps.commit([(dest, [b"x" * 10, b"y" * 10]), (side, [b"{}", b"\n"])])
    if isinstance(failure, OSError):
        assert str(side) in str(e.value) and "no space left on device" in str(e.value)
    assert dest.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.bin"]


def test_interrupt_while_dumping_exits_130_and_leaves_nothing(run_cli, tmp_path, monkeypatch):
    real = os.write

    def write(fd, data):
        if fd > 2:
            raise KeyboardInterrupt
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    r = run_cli("decode", "-m", LLAMA, "-t", "1 2 3", "--dump-logits", tmp_path / "out.safetensors")
    assert r.exit_code == 130
    assert r.stderr == "metrale: interrupted: stopped by Ctrl-C (no partial output file is left)\n"
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_during_the_renames_is_held_until_they_are_done(tmp_path, monkeypatch):
    import signal

    dest = tmp_path / "a.bin"
    real_replace = os.replace

    def replace(src, dst):
        signal.raise_signal(signal.SIGINT)  # arrives in the middle of the commit
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        dumps.commit([(dest, [b"data"]), (tmp_path / "a.bin.json", [b"{}"])])
    assert dest.read_bytes() == b"data" and (tmp_path / "a.bin.json").read_bytes() == b"{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "a.bin.json"]


def test_check_dump_path(tmp_path):
    assert dumps.check_dump_path(str(tmp_path / "x.NPY"), "--dump-logits").kind == "npy"
    assert dumps.check_dump_path("-", "--dump-logits").to_stdout
    with pytest.raises(UsageError, match="unknown extension"):
        dumps.check_dump_path(str(tmp_path / "x"), "--dump-logits")
    with pytest.raises(UsageError, match="stdout"):
        dumps.check_dump_path("-", "--dump-hidden", dumps.HIDDEN_KINDS, stdout_ok=False)
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputError, match="not a directory"):
        dumps.check_dump_path(str(tmp_path / "file" / "x.npy"), "--dump-logits")
    assert dumps.DumpTarget("--dump-logits", tmp_path / "l.bin", "bin").sidecar == tmp_path / "l.bin.json"


def test_a_bf16_npy_dump_says_how_to_read_it(run_cli, tmp_path):
    """.npy has no bf16: the rows load as uint16 bit patterns, and the sidecar gives the float32 recipe,
    which gives the values the safetensors dump holds as a typed BF16 tensor."""
    npy = tmp_path / "rows.npy"
    args = ["forward", "-m", LLAMA, "-t", "1 2 3", "--rows", "all", "--logits-dtype", "bf16"]
    assert run_cli(*args, "--dump-logits", npy).exit_code == 0
    side = json.loads(npy.with_name("rows.npy.json").read_text())
    assert side["storage"] == "uint16 bf16 bit patterns" and np.load(npy).dtype == np.uint16
    values = eval(side["to_float32"], {"np": np, "PATH": npy})  # the recipe, as written
    fp32 = tmp_path / "fp32.npy"
    assert run_cli(*args[:-2], "--logits-dtype", "fp32", "--dump-logits", fp32).exit_code == 0
    assert values.dtype == np.float32 and np.abs(values - np.load(fp32)).max() <= np.abs(np.load(fp32)).max() / 128
    fp32_side = json.loads(fp32.with_name("fp32.npy.json").read_text())
    assert "to_float32" not in fp32_side
