"""Speculative decoding emits exactly the target's greedy tokens, whatever the drafts.

On the shipped target/draft pair (real acceptance) and with prompt lookup, for several prompts and
k = 1..8, with a KV cache sized to the job and one with no spare room (drafts get cut near the end).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from metrale_cli import decoding
from metrale_cli.model import DEFAULT_MODEL_DIR, open_model

DRAFT_DIR = Path(DEFAULT_MODEL_DIR).parent / "default-draft"
PROMPTS = ["The for statement", "The while statement", "A class definition defines", "import"]
STEPS = 40


@pytest.fixture(scope="module")
def pair():
    target = open_model(DEFAULT_MODEL_DIR, device="cpu", max_context=128)
    draft = open_model(DRAFT_DIR, device="cpu", max_context=128)
    return target, draft


@pytest.fixture(scope="module")
def plain(pair):
    target, _ = pair
    out = {}
    for p in PROMPTS:
        ids = target.tokenizer.encode(p)
        out[p] = (ids, [s.token for s in decoding.run_decode(target.engine, ids, STEPS).steps])
    return out


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_speculative_tokens_equal_greedy(pair, plain, k, drafter):
    target, draft = pair
    accepted = 0
    for p in PROMPTS:
        ids, want = plain[p]
        d = decoding.ModelDrafter(draft.engine) if drafter == "model" else decoding.NgramDrafter()
        res = decoding.speculative_decode(target.engine, d, ids, STEPS, k)
        assert [s.token for s in res.steps] == want, (p, k, drafter)
        st = res.stats
        assert st.drafted == sum(st.drafted_at) and st.accepted == sum(st.accepted_at)
        assert all(a <= d_ for a, d_ in zip(st.accepted_at, st.drafted_at))
        accepted += st.accepted
    if drafter == "model":
        assert accepted > 0  # the trained draft does get tokens accepted


@pytest.mark.parametrize("k", [1, 4, 8])
def test_no_spare_cache_room(pair, plain, k):
    """A cache of exactly prompt + steps positions: the last passes must draft fewer than k tokens."""
    target, draft = pair
    ids, want = plain["The while statement"]
    t = open_model(DEFAULT_MODEL_DIR, device="cpu", max_context=len(ids) + STEPS).engine
    dr = open_model(DRAFT_DIR, device="cpu", max_context=len(ids) + STEPS).engine
    res = decoding.speculative_decode(t, decoding.ModelDrafter(dr), ids, STEPS, k)
    assert [s.token for s in res.steps] == want
    assert t.length <= len(ids) + STEPS
