"""Helpers of the goldens-based parity tests (a fixture checkpoint against transformers' outputs saved by a fixture
script): reading a golden, building the NumPy engine, reading logits rows back through ModelLogits, and the three
checks every family and format runs (prefill, 32 greedy steps, verify == sequential decode then trim)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine_rows import decoded_and_verified, rows  # rows: also this module's importers'
from metrale_cli import decoding
from metrale_cli.model import open_model

FIXTURES = Path(__file__).parent / "fixtures"


def golden(name: str):
    return np.load(FIXTURES / "golden" / f"{name}.npz")


def engine(path: Path | str, ctx: int = 64):
    path = FIXTURES / "models" / path if isinstance(path, str) else path
    return open_model(path, device="cpu", max_context=ctx, fp32_logits=True).engine


def rel_err(out, ref) -> float:
    return float(np.max(np.abs(np.asarray(out, np.float64) - ref)) / np.max(np.abs(ref)))


def check_prefill(name: str, tol: float = 1e-5) -> float:
    """Every prefill row and the post-norm hidden state against the golden; returns the logits' error."""
    g = golden(name)
    e = engine(name)
    n = e.prefill(g["prompt"], all_logits=True)
    err = rel_err(rows(e, e.logits_buffer_ptr(), n), g["prefill_logits"])
    print(f"{name}: prefill max|diff|/max|ref| = {err:.2e}")
    assert err <= tol
    assert rel_err(e.copy_hidden_to_host(), g["hidden_after_norm"]) <= tol
    return err


def check_greedy(name: str, tol: float = 1e-5) -> None:
    """32 greedy tokens equal transformers' generate, their rows within tol."""
    g = golden(name)
    res = decoding.run_decode(engine(name), list(g["prompt"]), 32, keep_rows=True)
    assert [s.token for s in res.steps] == list(g["greedy_tokens"])
    assert rel_err(res.rows.array(), g["greedy_logits"]) <= tol


def check_verify_and_trim(name: str, k: int, tol: float = 1e-5, open_engine=None) -> None:
    """k fresh random drafts verified in one pass give the rows of decoding them one by one; a trim to a random
    kept count then decodes as a fresh run of the kept tokens. `open_engine()` makes a fresh engine of the fixture
    (default: `engine(name)`)."""
    open_engine = open_engine or (lambda: engine(name))
    rng = np.random.default_rng()
    prompt = list(golden(name)["prompt"])
    e = open_engine()
    drafts = [int(t) for t in rng.integers(0, e.vocab_size(), k)]  # fresh random drafts each run
    seq, ver = decoded_and_verified(e, prompt, drafts)
    assert rel_err(ver, seq) <= tol
    keep = int(rng.integers(0, k + 1))
    e.trim(len(prompt) + keep)
    e.decode(7)
    fresh = open_engine()
    fresh.prefill(prompt + drafts[:keep])
    fresh.decode(7)
    assert rel_err(rows(e, e.decode_logits_ptr(), 1)[0], rows(fresh, fresh.decode_logits_ptr(), 1)[0]) <= tol


def emulated_errors(name: str, reference, count: int, length: int) -> list[float]:
    """Relative errors of the `--activation-quant emulate` engine's prefill logits against `reference(prompt)` on
    `count` fresh prompts of `length` tokens; on every one the plain engine (unquantized inputs) must be far off,
    so that each prompt tests the emulation. Quantizing is a step function, so callers ask for a majority."""
    e = open_model(FIXTURES / "models" / name, device="cpu", max_context=32, fp32_logits=True,
                   activation_quant="emulate").engine
    plain = engine(name)
    errs = []
    for _ in range(count):
        prompt = [int(t) for t in np.random.default_rng().integers(0, 300, length)]
        want = reference(prompt)
        for which in (e, plain):
            which.trim(0)
            which.prefill(prompt, all_logits=True)
        errs.append(rel_err(rows(e, e.logits_buffer_ptr(), length), want))
        assert rel_err(rows(plain, plain.logits_buffer_ptr(), length), want) > 1e-4  # the emulation matters
    print(f"{name}: emulate vs reference, {count} prompts:", ", ".join(f"{x:.1e}" for x in errs))
    return errs
