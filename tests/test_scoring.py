"""`metrale score`: the window plan (every token after the first scored once, with the promised context),
one row's log-probability/rank/top-k against torch, and perplexity against transformers' fp32
`model(ids, labels=ids).loss` on the embedded model and the random fixture checkpoints (<= 1e-4
relative), whole and chunked."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from metrale_cli.errors import InputError, UsageError
from metrale_cli.model import DEFAULT_MODEL_DIR, open_model
from metrale_cli.scoring import plan_windows, run_score, score_row

LLAMA = "tests/fixtures/models/llama"  # max_position_embeddings 256, vocab 300
TEXT = ("The for statement is used to iterate over the elements of a sequence (such as a string, tuple or list) "
        "or other iterable object. The expression list is evaluated once; it should yield an iterable object.")


@settings(max_examples=300, deadline=None)
@given(n=st.integers(2, 300), chunk=st.integers(2, 64), data=st.data())
def test_every_token_after_the_first_is_scored_once(n, chunk, data):
    stride = data.draw(st.integers(1, chunk - 1))
    windows = plan_windows(n, chunk, stride)
    scored = [j for w in windows for j in range(w.first_scored, w.end)]
    assert scored == list(range(1, n))
    for i, w in enumerate(windows):
        assert w.end - w.start <= chunk and w.start < w.first_scored <= w.end
        assert w.start == i * stride
        if i > 0:  # conditioned on at least chunk - stride tokens of its own window
            assert w.first_scored - w.start >= chunk - stride
    assert windows[-1].end == n


@pytest.mark.parametrize("n, chunk, stride, error, words", [
    (1, 4, 3, InputError, "at least 2 tokens"), (10, 1, 1, UsageError, "--chunk must be at least 2"),
    (10, 4, 4, UsageError, "--stride must be between 1 and --chunk - 1 = 3"), (10, 4, 0, UsageError, "--stride"),
])
def test_plan_windows_rejects(n, chunk, stride, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(")):
        plan_windows(n, chunk, stride)


def test_score_row_against_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(seed := int(np.random.default_rng().integers(2**31)))
    row = (rng.standard_normal(997) * 4).astype(np.float32)
    token = int(rng.integers(997))
    s = score_row(row, 12, token, 0, 5, lambda t: None)
    logp = torch.log_softmax(torch.from_numpy(row).double(), -1)
    assert s.logprob == pytest.approx(float(logp[token]), abs=1e-12), f"seed {seed}"
    assert s.rank == int((torch.from_numpy(row) > row[token]).sum()) + 1
    top = torch.topk(torch.from_numpy(row).double(), 5)
    assert [t.token for t in s.top_k] == top.indices.tolist()
    assert [t.prob for t in s.top_k] == pytest.approx(logp[top.indices].exp().tolist(), rel=1e-12)
    assert [t.logit for t in s.top_k] == row[top.indices.numpy()].tolist()
    argmax = int(np.argmax(row))
    assert score_row(row, 1, argmax, 0, 0, lambda t: None).rank == 1


def score_with_metrale(path, ids, **kw):
    lm = open_model(path, device="cpu", max_context=kw.get("chunk", len(ids)), fp32_logits=True)
    try:
        return run_score(lm.engine, ids, chunk=kw.get("chunk", len(ids)), stride=kw.get("stride", len(ids) - 1))
    finally:
        lm.close()


def hf_model(path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    return torch, model


@pytest.mark.reference
@pytest.mark.parametrize("name", ["default", "llama", "llama_tied", "llama3_rope", "mistral", "qwen2", "qwen3",
                                  "llama_bf16"])
def test_perplexity_equals_transformers(name, helpers):
    path = DEFAULT_MODEL_DIR if name == "default" else helpers.REPO / "tests" / "fixtures" / "models" / name
    torch, model = hf_model(path)
    if name == "default":
        lm = open_model(path, device="cpu", max_context=8)
        ids = lm.tokenizer.encode(TEXT)
        lm.close()
    else:
        ids = [int(t) for t in np.random.default_rng().integers(0, model.config.vocab_size, 60)]
    r = score_with_metrale(path, ids)
    with torch.no_grad():
        t = torch.tensor([ids])
        out = model(t, labels=t)
        ref_logp = torch.log_softmax(out.logits[0].double(), -1)
    ref_ppl = math.exp(out.loss.item())
    print(f"{name}: {len(ids)} tokens, perplexity {r.perplexity:.6f} vs transformers {ref_ppl:.6f}")
    assert abs(r.perplexity / ref_ppl - 1) <= 1e-4, (ids, r.perplexity, ref_ppl)
    want = [float(ref_logp[j - 1, ids[j]]) for j in range(1, len(ids))]
    assert [s.position for s in r.scored] == list(range(1, len(ids)))
    assert np.abs(np.array([s.logprob for s in r.scored]) - want).max() <= 1e-4


@pytest.mark.reference
@pytest.mark.parametrize("chunk, stride", [(16, 15), (16, 8), (20, 3)])
def test_chunked_score_equals_transformers_windows(helpers, chunk, stride):
    """Each window is an independent transformers forward; the tokens it scores are the ones the plan gives."""
    path = helpers.REPO / LLAMA
    torch, model = hf_model(path)
    ids = [int(t) for t in np.random.default_rng().integers(0, 300, 70)]
    r = score_with_metrale(path, ids, chunk=chunk, stride=stride)
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(ids), stride):
            window = ids[start:start + chunk]
            logp = torch.log_softmax(model(torch.tensor([window])).logits[0].double(), -1)
            first = 1 if start == 0 else min(len(ids), start - stride + chunk)  # the previous window's end
            total += sum(float(logp[j - 1 - start, ids[j]]) for j in range(first, start + len(window)))
            if start + chunk >= len(ids):
                break
    assert len(r.scored) == len(ids) - 1 and len(r.windows) > 1
    assert r.total_logprob == pytest.approx(total, rel=1e-5)
    whole = score_with_metrale(path, ids)
    # the windows do change the context, far beyond fp32 rounding. Measured per token, not on the total: over 120
    # fresh draws the largest per-token difference was 3.4 .. 6+ nats, against 6.5e-6 between the same tokens scored
    # with the same context (the first window's); the totals' differences partly cancel (down to 1.1e-4 relative
    # there, 5.2e-7 once in CI, which failed the bound this replaces)
    diff = np.abs(np.array([s.logprob for s in whole.scored]) - np.array([s.logprob for s in r.scored]))
    assert diff[:chunk - 1].max() <= 1e-4 < 1e-3 < diff.max()


# -- the command ---------------------------------------------------------------------------------------------------


def test_cli_json_is_what_run_score_computes(run_cli, helpers):
    r = run_cli("score", "-m", LLAMA, "-t", "3 1 4 1 5 9 2 6", "--top-k", 2, "-f", "json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    direct = score_with_metrale(helpers.REPO / LLAMA, [3, 1, 4, 1, 5, 9, 2, 6])
    assert doc["command"] == "score" and doc["logits_dtype"] == "fp32"
    assert doc["prompt_tokens"] == [3, 1, 4, 1, 5, 9, 2, 6]
    assert doc["chunk"] == 8 and doc["stride"] == 7 and doc["windows"] == [{"start": 0, "end": 8, "first_scored": 1}]
    assert [s["token"] for s in doc["scored"]] == [1, 4, 1, 5, 9, 2, 6]
    assert doc["perplexity"] == pytest.approx(direct.perplexity, rel=1e-5) and doc["scored_tokens"] == 7
    assert doc["total_logprob"] == pytest.approx(-7 * doc["mean_nll"], rel=1e-5)
    assert all(len(s["top_k"]) == 2 and s["rank"] >= 1 for s in doc["scored"])
    plain = run_cli("score", "-m", LLAMA, "-t", "3 1 4 1 5 9 2 6", "-f", "plain")
    assert plain.exit_code == 0 and f"perplexity: {direct.perplexity:.6g}" in plain.stdout
    assert run_cli("score", "-m", LLAMA, "-t", "3 1 4", "-f", "rich").exit_code == 0


def test_cli_text_longer_than_the_context_is_chunked(run_cli):
    ids = " ".join(str(t) for t in np.random.default_rng().integers(0, 300, 300))
    doc = json.loads(run_cli("score", "-m", LLAMA, "-t", ids, "-f", "json", "--top-k", 0).stdout)
    assert doc["chunk"] == 256 and doc["stride"] == 255 and len(doc["windows"]) == 2
    assert doc["scored_tokens"] == 299 and [s["position"] for s in doc["scored"]] == list(range(1, 300))
    doc = json.loads(run_cli("score", "-m", LLAMA, "-t", ids, "-f", "json", "--chunk", 100, "--stride", 50).stdout)
    assert [w["start"] for w in doc["windows"]] == [0, 50, 100, 150, 200] and doc["scored_tokens"] == 299


def test_cli_text_file_scores_like_the_prompt(run_cli, tok_model, tmp_path):
    text = "The for statement is in the class"
    f = tmp_path / "t.txt"
    f.write_text(text, "utf-8")
    by_file = json.loads(run_cli("score", "-m", tok_model, "--text-file", f, "-f", "json").stdout)
    by_prompt = json.loads(run_cli("score", "-m", tok_model, "--prompt", text, "-f", "json").stdout)
    assert by_file["text_file"] == str(f) and by_file["prompt"] is None
    assert by_file["scored"] == by_prompt["scored"] and by_file["perplexity"] == by_prompt["perplexity"]
    stdin = json.loads(run_cli("score", "-m", tok_model, "--text-file", "-", "-f", "json", input=text).stdout)
    assert stdin["scored"] == by_prompt["scored"]


def test_cli_bf16_logits_are_scored_when_asked(run_cli):
    a = json.loads(run_cli("score", "-m", LLAMA, "-t", "1 2 3 4 5", "-f", "json").stdout)
    b = json.loads(run_cli("score", "-m", LLAMA, "-t", "1 2 3 4 5", "-f", "json", "--logits-dtype", "bf16").stdout)
    assert b["logits_dtype"] == "bf16" and a["perplexity"] != b["perplexity"]
    assert b["perplexity"] == pytest.approx(a["perplexity"], rel=5e-2)  # bf16: <= 2^-9 relative per logit


@pytest.mark.parametrize("args, code, words", [
    (["-t", "5"], 5, "at least 2 tokens"),
    (["-t", "1 2 3", "--stride", "3"], 2, "--stride must be between 1 and --chunk - 1 = 2"),
    (["-t", "1 2 3", "--chunk", "300"], 5, "--chunk 300 exceeds"),
    (["-t", "1 2 3", "--chunk", "8", "--max-context", "4"], 5, "--chunk 8 exceeds --max-context 4"),
    (["-t", "1 2 3", "--text-file", "x.txt"], 2, "exclusive"),
    (["--text-file", "/nonexistent/t.txt"], 2, "no such file"),
    (["-t", "1 2 3", "--top-k", "-1"], 2, "--top-k"),
])
def test_cli_errors(run_cli, args, code, words):
    r = run_cli("score", "-m", LLAMA, *args)
    assert r.exit_code == code, r.stderr
    assert words in r.stderr and r.stderr.count("\n") == 1


def test_score_help_has_examples(run_cli):
    r = run_cli("score", "--help")
    assert r.exit_code == 0 and "metrale score" in r.stdout.split("Examples:")[1]
