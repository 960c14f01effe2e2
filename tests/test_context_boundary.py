"""The KV cache a job needs, at its exact boundary: decode feeds back every produced token but the last, so a
prompt of n tokens and --steps S need n + S - 1 positions (plain and speculative, with a draft model or
prompt lookup); verify runs all k drafts (n + k), its draft model all but the last (n + k - 1)."""

from __future__ import annotations

import json

import pytest

PROMPT = "1 2 3 4 5"  # 5 tokens of the embedded default model
N = 5


def _tokens(r) -> list[int]:
    assert r.exit_code == 0, r.stderr
    return [s["token"] for s in json.loads(r.stdout)["steps"]]


@pytest.mark.parametrize("draft", [[], ["--draft", "ngram", "--k", "3"], ["--draft-model", "default-draft", "--k", "3"]])
def test_decode_needs_prompt_plus_steps_minus_one(run_cli, draft):
    steps = 4
    at = run_cli("decode", "-t", PROMPT, "--steps", steps, "--max-context", N + steps - 1, *draft, "-f", "json")
    roomy = run_cli("decode", "-t", PROMPT, "--steps", steps, "--max-context", 32, "-f", "json")
    assert _tokens(at) == _tokens(roomy) and len(_tokens(at)) == steps  # 8 positions suffice for 5 + 4
    below = run_cli("decode", "-t", PROMPT, "--steps", steps, "--max-context", N + steps - 2, *draft)
    assert below.exit_code == 5 and below.stdout == ""
    assert ("--max-context 7 is smaller than prompt (5 tokens) + --steps 4 - 1 (the last token is not run) = 8 "
            "positions") in below.stderr


def test_verify_needs_prompt_plus_k(run_cli):
    k = 3
    ok = run_cli("verify", "-t", PROMPT, "--k", k, "--max-context", N + k, "-f", "json")
    assert ok.exit_code == 0, ok.stderr
    assert json.loads(ok.stdout)["accepted"] == k
    ok = run_cli("verify", "-t", PROMPT, "--k", k, "--draft-model", "default-draft", "--max-context", N + k)
    assert ok.exit_code == 0, ok.stderr
    below = run_cli("verify", "-t", PROMPT, "--k", k, "--max-context", N + k - 1)
    assert below.exit_code == 5 and "--max-context 7 is smaller than prompt (5 tokens) + --k 3 = 8" in below.stderr


def test_a_model_limit_counts_the_same_positions(run_cli, helpers, tmp_path):
    """max_position_embeddings bounds n + steps - 1 as --max-context does."""
    model = helpers.random_llama(tmp_path / "m", vocab=512, max_positions=8)
    assert run_cli("decode", "-m", model, "-t", PROMPT, "--steps", 4, "--ignore-eos").exit_code == 0
    over = run_cli("decode", "-m", model, "-t", PROMPT, "--steps", 5)
    assert over.exit_code == 5 and "= 9 positions exceed" in over.stderr
