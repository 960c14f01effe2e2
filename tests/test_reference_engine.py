"""The NumPy engine against golden outputs of Hugging Face transformers (fp32, CPU).

Goldens come from scripts/make_reference_fixtures.py; tests/test_reference_live.py repeats the
comparison live when transformers is importable.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine_rows import rows
from golden_parity import check_verify_and_trim
from metrale_cli import decoding
from metrale_cli.model import open_model

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = ["llama", "llama_tied", "llama3_rope", "mistral", "qwen2", "qwen3", "llama_bf16"]


def golden(name: str):
    return np.load(FIXTURES / "golden" / f"{name}.npz")


def engine(name: str, fp32: bool = True, ctx: int = 64):
    return open_model(FIXTURES / "models" / name, device="cpu", max_context=ctx, fp32_logits=fp32).engine


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(out.astype(np.float64) - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("name", MODELS)
def test_prefill_logits_match_transformers(name):
    g = golden(name)
    e = engine(name)
    n = e.prefill(g["prompt"], all_logits=True)
    err = rel_err(rows(e, e.logits_buffer_ptr(), n), g["prefill_logits"])
    print(f"{name}: prefill max|diff|/max|ref| = {err:.2e}")
    assert err <= 1e-5


@pytest.mark.parametrize("name", MODELS)
def test_hidden_after_norm_matches_transformers(name):
    g = golden(name)
    e = engine(name)
    e.prefill(g["prompt"])
    assert rel_err(e.copy_hidden_to_host(), g["hidden_after_norm"]) <= 1e-5


@pytest.mark.parametrize("name", MODELS)
def test_32_greedy_steps_match_generate(name):
    g = golden(name)
    e = engine(name)
    res = decoding.run_decode(e, list(g["prompt"]), 32, keep_rows=True)
    assert [s.token for s in res.steps] == list(g["greedy_tokens"])
    # The rows that chose each token match transformers' generate logits too.
    assert rel_err(res.rows.array(), g["greedy_logits"]) <= 1e-5


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("k", range(1, 9))
def test_verify_rows_equal_sequential_decode(name, k):
    """k single decode steps over fresh drafts equal one verify pass; a trim back to an accepted prefix then decodes
    as a fresh run (golden_parity.check_verify_and_trim)."""
    check_verify_and_trim(name, k)


@pytest.mark.parametrize("name", MODELS)
def test_bf16_rows_bit_identical_to_torch_rounding(name):
    g = golden(name)
    e = engine(name, fp32=False)
    n = e.prefill(g["prompt"], all_logits=True)
    ptr = e.logits_buffer_ptr()
    assert not e.logits_ptr_is_fp32(ptr)
    bits = []
    for i in range(n):
        buf = bytearray(e.vocab_size() * 2)
        e.copy_logits_to_host(ptr.row_ptr(i), buf)
        bits.append(np.frombuffer(buf, np.uint16))
    ours = np.stack(bits)
    # 1. Our rounding rule equals torch's on transformers' own fp32 logits, bit for bit.
    assert np.array_equal(_bf16(g["prefill_logits"]), g["bf16_prefill_logits"])
    # 2. The engine's bf16 rows are that rounding of its fp32 rows.
    e32 = engine(name, fp32=True)
    e32.prefill(g["prompt"], all_logits=True)
    assert np.array_equal(ours, _bf16(rows(e32, e32.logits_buffer_ptr(), n)))


def _bf16(x: np.ndarray) -> np.ndarray:
    from metrale_cli.logits import bf16_bits, fp32_to_bf16

    return bf16_bits(fp32_to_bf16(x))


def test_tied_model_has_no_lm_head_and_shares_embedding():
    e = engine("llama_tied")
    assert e.w.lm_head is e.w.embed
