"""NaN/Inf in a run (issue 11, item 2): the requested dumps of the rows produced are written, then exit 6.

NaN is planted in a copy of the llama fixture: in model.norm.weight (every row is NaN), or in the
embedding row of one token (the rows before that token is fed stay finite, and must be bit-identical
to the same rows of the clean model). Prompts and drafts are drawn fresh for each run.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from metrale_cli.decoding import rows as decoding_rows
from metrale_cli.logits import bf16_bits_to_fp32

VOCAB = 300


def rows_of(path) -> np.ndarray:
    """A .npy logits dump (fp32, or bf16 bit patterns) as fp32 values [rows, vocab]."""
    rows = np.load(path)
    return bf16_bits_to_fp32(rows) if rows.dtype == np.uint16 else rows


def sidecar(path) -> dict:
    return json.loads(path.with_name(path.name + ".json").read_text())


def one_line(stderr: str) -> str:
    assert stderr.count("\n") == 1, stderr
    return stderr.strip()


def greedy(run_cli, model, prompt: list[int], steps: int = 3) -> list[int]:
    r = run_cli("decode", "-m", model, "-t", " ".join(map(str, prompt)), "--steps", steps, "--ignore-eos",
                "-f", "json")
    assert r.exit_code == 0, r.stderr
    return [s["token"] for s in json.loads(r.stdout)["steps"]]


@pytest.fixture
def nan_norm(tmp_path, helpers):
    d = helpers.copy_model(tmp_path / "nan_norm")

    def plant(t):
        t["model.norm.weight"][int(np.random.default_rng().integers(64))] = np.nan

    helpers.edit_tensors(d, plant)
    return d


@pytest.fixture
def poisoned(tmp_path, helpers, run_cli):
    """poisoned(token) -> a copy of the fixture whose embedding row `token` is NaN (untied: the logits
    of the other rows are unaffected)."""
    def make(token: int):
        d = helpers.copy_model(tmp_path / f"nan_embed_{token}")

        def plant(t):
            t["model.embed_tokens.weight"][token] = np.nan

        helpers.edit_tensors(d, plant)
        return d

    return make


def prompt_and_first_token(run_cli, helpers, rng, repeat: int = 1) -> tuple[list[int], int]:
    """A fresh random prompt (4 tokens, `repeat` times) and the clean model's greedy token after it,
    which the prompt lacks."""
    for _ in range(50):
        prompt = [int(t) for t in rng.integers(0, VOCAB, 4)] * repeat
        first = greedy(run_cli, helpers.LLAMA, prompt, 1)[0]
        if first not in prompt:
            return prompt, first
    raise AssertionError("no prompt without its own greedy token")


def test_forward_all_rows_dumps_every_row_then_exits_6(run_cli, nan_norm, tmp_path):
    dump, hidden = tmp_path / "d" / "nan.npy", tmp_path / "d" / "h.npy"
    dump.parent.mkdir()
    prompt = [int(t) for t in np.random.default_rng().integers(0, VOCAB, 3)]
    r = run_cli("forward", "-m", nan_norm, "-t", " ".join(map(str, prompt)), "--rows", "all",
                "--dump-logits", dump, "--dump-hidden", hidden)
    assert r.exit_code == 6
    assert one_line(r.stderr) == (f"metrale: non-finite logits: the logits row for position 0 holds NaN or Inf; "
                                  f"first non-finite values in model.norm (the final norm), token {prompt[0]} at "
                                  f"position 0: 3 NaN, 0 Inf; written anyway: {dump} (3 rows), {hidden}")
    rows = rows_of(dump)
    assert rows.shape == (3, VOCAB) and np.isnan(rows).all()
    meta = sidecar(dump)
    assert meta["tokens"] == prompt and meta["positions"] == [0, 1, 2] and meta["command"] == "forward"
    h = np.load(hidden)  # the final norm's NaN weight makes that one component of every row NaN
    assert h.shape == (3, 64) and (np.isnan(h).sum(axis=1) == 1).all()


def test_forward_to_stdout_writes_the_rows_too(run_cli, nan_norm, tmp_path):
    r = run_cli("forward", "-m", nan_norm, "-t", "5 6", "--rows", "all", "--dump-logits", "-", "--logits-dtype", "bf16")
    assert r.exit_code == 6
    rows = bf16_bits_to_fp32(np.frombuffer(r.stdout_bytes, np.uint16).reshape(-1, VOCAB))
    assert rows.shape == (2, VOCAB) and np.isnan(rows).all()
    assert "written anyway: - (2 rows)" in r.stderr


def test_without_dumps_nothing_is_written(run_cli, nan_norm, tmp_path):
    r = run_cli("forward", "-m", nan_norm, "-t", "1 2 3", "--rows", "all")
    assert r.exit_code == 6
    assert one_line(r.stderr) == ("metrale: non-finite logits: the logits row for position 0 holds NaN or Inf; "
                                  "first non-finite values in model.norm (the final norm), token 1 at position 0: "
                                  "3 NaN, 0 Inf")


def test_decode_dumps_the_finite_rows_and_the_first_non_finite_one(run_cli, helpers, poisoned, tmp_path):
    prompt, first = prompt_and_first_token(run_cli, helpers, np.random.default_rng())
    ids = " ".join(map(str, prompt))
    clean, bad = tmp_path / "clean.npy", tmp_path / "bad.npy"
    assert run_cli("decode", "-m", helpers.LLAMA, "-t", ids, "--steps", 3, "--ignore-eos",
                   "--dump-logits", clean).exit_code == 0
    r = run_cli("decode", "-m", poisoned(first), "-t", ids, "--steps", 3, "--ignore-eos", "--dump-logits", bad,
                "-f", "plain")
    assert r.exit_code == 6
    # the position is the input position of the row, as in the dump: the poisoned token's
    n = len(prompt)
    assert one_line(r.stderr).endswith(
        f"position {n} holds NaN or Inf; first non-finite values in model.embed_tokens (the embedding rows), "
        f"token {first} at position {n}: 64 NaN, 0 Inf; written anyway: {bad} (2 rows)")
    rows = rows_of(bad)
    assert rows.shape == (2, VOCAB)
    assert np.array_equal(np.load(bad)[0], np.load(clean)[0])  # the prefill row, bit for bit
    assert np.isfinite(rows[0]).all() and np.isnan(rows[1]).all()
    meta = sidecar(bad)
    assert meta["tokens"] == prompt + [first] and meta["positions"] == [len(prompt) - 1, len(prompt)]
    assert str(first) in r.stdout.split("position")[-1]  # the step produced before the failure is reported


def test_speculative_decode_dumps_up_to_the_failing_verify_pass(run_cli, helpers, poisoned, tmp_path):
    # a repeated prompt gives the n-gram drafter something to propose
    prompt, first = prompt_and_first_token(run_cli, helpers, np.random.default_rng(), repeat=2)
    bad = tmp_path / "bad.npy"
    r = run_cli("decode", "-m", poisoned(first), "-t", " ".join(map(str, prompt)), "--steps", 6, "--ignore-eos",
                "--draft", "ngram", "--dump-logits", bad)
    assert r.exit_code == 6, r.stderr
    rows, meta = rows_of(bad), sidecar(bad)
    n = len(prompt)
    assert len(rows) >= 2 and np.isfinite(rows[0]).all() and np.isnan(rows[1:]).all()
    assert meta["positions"] == list(range(n - 1, n - 1 + len(rows)))
    assert meta["tokens"][:n + 1] == prompt + [first]


def test_verify_with_draft_ids_dumps_the_prefill_row_and_every_verify_row(run_cli, helpers, poisoned, tmp_path):
    """The poisoned token is the first draft: every verify row is NaN (a NaN value vector reaches even
    the rows before it in the same pass: masked weights are 0, and 0 x NaN is NaN, as in transformers)."""
    rng = np.random.default_rng()
    bad_token = int(rng.integers(VOCAB))
    others = [int(t) for t in rng.choice(np.setdiff1d(np.arange(VOCAB), [bad_token]), 6, replace=False)]
    prompt, drafts = others[:4], [bad_token, others[4], others[5]]
    args = ("-t", " ".join(map(str, prompt)), "--draft", " ".join(map(str, drafts)))
    clean, bad = tmp_path / "clean.npy", tmp_path / "bad.npy"
    assert run_cli("verify", "-m", helpers.LLAMA, *args, "--dump-logits", clean).exit_code == 0
    r = run_cli("verify", "-m", poisoned(bad_token), *args, "--dump-logits", bad)
    assert r.exit_code == 6
    assert one_line(r.stderr).endswith(
        f"position {len(prompt)} holds NaN or Inf; first non-finite values in model.embed_tokens (the embedding "
        f"rows), token {bad_token} at position {len(prompt)}: 64 NaN, 0 Inf; written anyway: {bad} (4 rows)")
    rows = rows_of(bad)
    assert np.array_equal(np.load(bad)[0], np.load(clean)[0])  # the prefill row, bit for bit
    assert np.isnan(rows[1:]).all()
    assert sidecar(bad)["tokens"] == prompt + drafts and sidecar(bad)["positions"] == [3, 4, 5, 6]


def test_verify_self_drafts_dump_the_sequential_rows_up_to_the_failure(run_cli, helpers, poisoned, tmp_path):
    prompt, first = prompt_and_first_token(run_cli, helpers, np.random.default_rng())
    ids = " ".join(map(str, prompt))
    clean, bad = tmp_path / "clean.npy", tmp_path / "bad.npy"
    assert run_cli("verify", "-m", helpers.LLAMA, "-t", ids, "--k", 3, "--dump-logits", clean).exit_code == 0
    r = run_cli("verify", "-m", poisoned(first), "-t", ids, "--k", 3, "--dump-logits", bad, "--hidden")
    assert r.exit_code == 6
    rows = rows_of(bad)
    assert rows.shape == (2, VOCAB) and np.array_equal(np.load(bad)[0], np.load(clean)[0])
    assert np.isnan(rows[1]).all()
    assert sidecar(bad)["tokens"] == prompt + [first] and sidecar(bad)["positions"] == [3, 4]


def test_the_engines_diagnosis_is_appended_to_the_message(run_cli, nan_norm, monkeypatch):
    """describe_nonfinite is the one hook for naming the first layer with NaN/Inf; its text ends the line."""
    seen = []

    def diagnosis(engine, tokens):
        seen.append(list(tokens))
        return "first non-finite values: final norm"

    monkeypatch.setattr(decoding_rows, "describe_nonfinite", diagnosis)
    r = run_cli("forward", "-m", nan_norm, "-t", "7 8 9")
    assert r.exit_code == 6
    assert one_line(r.stderr).endswith("holds NaN or Inf; first non-finite values: final norm")
    assert seen == [[7, 8, 9]]


def test_describe_nonfinite_names_the_first_tensor_with_nan(helpers, poisoned, run_cli):
    """The diagnosis reruns the tokens with every tap on: the poisoned embedding row, at its position; a
    clean model's pass is finite in every tapped tensor; tokens beyond the cache are not rerun."""
    from metrale_cli.model import open_model

    rng = np.random.default_rng()
    tokens = [int(t) for t in rng.choice(VOCAB, 5, replace=False)]
    at = int(rng.integers(5))
    bad = open_model(poisoned(tokens[at]), device="cpu", max_context=8).engine
    assert decoding_rows.describe_nonfinite(bad, tokens) == (
        f"first non-finite values in model.embed_tokens (the embedding rows), token {tokens[at]} at position "
        f"{at}: 64 NaN, 0 Inf")
    assert decoding_rows.describe_nonfinite(bad, tokens * 2) is None  # 10 tokens, a cache of 8
    clean = open_model(helpers.REPO / helpers.LLAMA, device="cpu", max_context=8).engine
    assert decoding_rows.describe_nonfinite(clean, tokens).startswith("every layer's output and the final norm are finite")
