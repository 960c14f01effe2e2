"""ModelLogits on the NumPy engine: argmax semantics, row copies, bf16 rounding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from metrale_cli.errors import InputError, NonFiniteLogitsError
from metrale_cli.logits import (DevicePtr, ModelLogits, bf16_bits, bf16_bits_to_fp32, fp32_to_bf16,
                                fp32_to_bf16_bits)
from metrale_cli.model import open_model

MODEL = Path(__file__).parent / "fixtures" / "models" / "llama"


@pytest.fixture(params=[False, True], ids=["bf16", "fp32"])
def eng(request):
    return open_model(MODEL, device="cpu", max_context=32, fp32_logits=request.param).engine


def load_rows(e, rows: np.ndarray) -> DevicePtr:
    """Put rows into the engine's logits buffer (as a verify pass would: fp32, or bf16 bit patterns)
    and return its pointer."""
    e._logits = rows.astype(np.float32) if e._fp32_logits else fp32_to_bf16_bits(rows)
    e._n_rows = rows.shape[0]
    return e.logits_buffer_ptr()


def stored(e) -> np.ndarray:
    """The engine's logits buffer as fp32 values."""
    return bf16_bits_to_fp32(e._logits) if e._logits.dtype == np.uint16 else np.asarray(e._logits, np.float32)


def test_engine_implements_the_protocol(eng):
    assert isinstance(eng, ModelLogits)
    assert eng.vocab_size() == 300
    assert eng.decode_logits_fp32() == eng.logits_ptr_is_fp32(eng.decode_logits_ptr())


def test_argmax_matches_numpy_on_fresh_random_rows(eng):
    rng = np.random.default_rng()
    rows = rng.standard_normal((6, eng.vocab_size())).astype(np.float32) * 4
    ptr = load_rows(eng, rows)
    as_stored = stored(eng)
    assert eng.argmax_batch(ptr, 6) == [int(i) for i in np.argmax(as_stored, axis=1)]
    for i in range(6):
        assert eng.argmax_on_device(ptr.row_ptr(i)) == int(np.argmax(as_stored[i]))


def test_argmax_ties_go_to_the_lowest_index(eng):
    rng = np.random.default_rng()
    rows = rng.uniform(-1, 1, (3, eng.vocab_size())).astype(np.float32)
    cols = sorted(rng.choice(eng.vocab_size(), 3, replace=False))
    rows[:, cols] = 5.0
    ptr = load_rows(eng, rows)
    assert eng.argmax_batch(ptr, 3) == [cols[0]] * 3


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_row_is_an_error_not_an_answer(eng, bad):
    rng = np.random.default_rng()
    rows = rng.standard_normal((4, eng.vocab_size())).astype(np.float32)
    rows[2, int(rng.integers(eng.vocab_size()))] = bad
    ptr = load_rows(eng, rows)
    assert eng.argmax_on_device(ptr.row_ptr(1)) == int(np.argmax(stored(eng)[1]))
    with pytest.raises(NonFiniteLogitsError) as info:
        eng.argmax_batch(ptr, 4)
    assert info.value.row == 2


def test_copy_logits_to_host_sizes_and_bytes(eng):
    rng = np.random.default_rng()
    rows = rng.standard_normal((3, eng.vocab_size())).astype(np.float32)
    ptr = load_rows(eng, rows)
    width = 4 if eng.logits_ptr_is_fp32(ptr) else 2
    dst = bytearray(eng.vocab_size() * width)
    eng.copy_logits_to_host(ptr.row_ptr(2), dst)
    assert bytes(dst) == np.ascontiguousarray(eng._logits[2]).tobytes()
    for wrong in (len(dst) - 1, len(dst) + 2, eng.vocab_size() * (6 - width)):
        with pytest.raises(InputError, match="bytes"):
            eng.copy_logits_to_host(ptr.row_ptr(0), bytearray(wrong))
    with pytest.raises(InputError, match="read-only"):
        eng.copy_logits_to_host(ptr.row_ptr(0), bytes(len(dst)))


def test_device_ptr_rows():
    buf = np.zeros((4, 10), np.float32)
    p = DevicePtr(buf, 0, 4)
    assert p.row_ptr(3).row == 3 and p.row_ptr(3).rows == 1
    assert p.take(2).rows == 2
    with pytest.raises(IndexError):
        p.row_ptr(4)


def test_fp32_to_bf16_matches_torch_bit_for_bit():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    with np.errstate(over="ignore", invalid="ignore"):
        x = _mixed_inputs(rng)
    ours = bf16_bits(fp32_to_bf16(x))
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(ours[~nan], theirs[~nan])
    # NaN stays NaN (payload bits may differ between libraries)
    assert np.all((ours[nan] & 0x7F80) == 0x7F80) and np.all(ours[nan] & 0x007F)


def test_integer_bf16_rounding_equals_ml_dtypes_bit_for_bit():
    """The CPU engine rounds logits to bf16 without ml_dtypes (too slow to import); same bits, NaN too."""
    rng = np.random.default_rng()
    with np.errstate(over="ignore", invalid="ignore"):
        x = _mixed_inputs(rng)
        ours = fp32_to_bf16_bits(x)
        assert np.array_equal(ours, bf16_bits(fp32_to_bf16(x)))
    assert np.array_equal(fp32_to_bf16_bits(x[:700].reshape(100, 7)), ours[:700].reshape(100, 7))  # keeps shape


def test_bf16_bits_to_fp32_is_exact_for_every_pattern():
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    ours = bf16_bits_to_fp32(every)
    theirs = every.view(fp32_to_bf16(np.zeros(1)).dtype).astype(np.float32)
    assert ours.dtype == np.float32 and np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_bf16_engine_rows_are_the_rounded_fp32_rows():
    """Same prompt on both logits dtypes: the bf16 rows are exactly the fp32 rows rounded."""
    rows = {}
    prompt = [int(t) for t in np.random.default_rng().integers(0, 300, 6)]
    for fp32 in (False, True):
        e = open_model(MODEL, device="cpu", max_context=32, fp32_logits=fp32).engine
        n = e.prefill(prompt, all_logits=True)
        rows[fp32] = np.array(e._logits[:n])
    assert rows[False].dtype == np.uint16 and np.array_equal(rows[False], fp32_to_bf16_bits(rows[True]))


def _mixed_inputs(rng):
    return np.concatenate([
        rng.standard_normal(100_000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 100_000),
        rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32).view(np.float32),  # any bits
        # exact halfway cases: low 16 bits 0x8000, both parities of the kept bit
        ((rng.integers(0, 2**16, 1000, dtype=np.uint32) << 16) | np.uint32(0x8000)).view(np.float32),
        np.array([np.inf, -np.inf, np.nan, -0.0, 0.0, 3.4e38, 1e-45], np.float32),
    ]).astype(np.float32)
