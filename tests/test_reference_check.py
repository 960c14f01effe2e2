"""`metrale compare --reference transformers`: run live against transformers (skipped without it).

Agreement on the embedded model and fixture families (a dense llama, qwen3, a mixture of experts, gemma2 with
its sandwich norms); a divergence planted in metrale's engine (both sides read the same checkpoint, so the
perturbation is a monkeypatched op) is reported with exit 9 and the first diverging layer named; the missing
extra is one line naming it; the JSON keys; the help's --reference examples run.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest

from metrale_cli.backends.numpy import engine as numpy_engine

pytestmark = pytest.mark.reference

FIXTURES = "tests/fixtures/models"
KEYS = {"command", "kind", "reference", "reference_version", "model", "device", "compute", "logits_dtype",
        "reference_device", "reference_dtype",
        "prompt_tokens", "steps", "positions", "reference_tokens", "metrale_tokens", "tokens_identical",
        "first_token_mismatch", "layers_selected", "tolerances", "logits", "layers", "passed", "failures"}


@pytest.fixture
def needs_transformers():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")


def _check(run_cli, model: str, vocab: int, *extra: str):
    prompt = np.random.default_rng().integers(0, vocab, 6).tolist()
    r = run_cli("compare", "--reference", "transformers", "--model", model, "--tokens", " ".join(map(str, prompt)),
                "--steps", "3", "--format", "json", *extra)
    return r, (json.loads(r.stdout) if r.stdout.strip() else None), prompt


@pytest.mark.parametrize("model", ["default", f"{FIXTURES}/llama", f"{FIXTURES}/qwen3", f"{FIXTURES}/qwen3_moe",
                                   f"{FIXTURES}/gemma2"])
def test_metrale_agrees_with_transformers(needs_transformers, run_cli, model):
    from metrale_cli.config import load_config
    from metrale_cli.model import model_dir

    vocab = load_config(model_dir(model)).vocab_size
    r, doc, prompt = _check(run_cli, model, vocab, "--layers", "all")
    assert r.exit_code == 0, (r.stdout, r.stderr)
    assert set(doc) == KEYS
    assert doc["kind"] == "reference" and doc["passed"] is True and doc["failures"] == []
    assert doc["prompt_tokens"] == prompt and doc["positions"] == list(range(9))  # every prompt and step row
    assert doc["tokens_identical"] and doc["metrale_tokens"] == doc["reference_tokens"]
    assert len(doc["reference_tokens"]) == 3
    assert (doc["device"], doc["compute"], doc["logits_dtype"]) == ("cpu", "fp32", "fp32")
    assert (doc["reference_device"], doc["reference_dtype"]) == ("cpu", "fp32")
    lg = doc["logits"]
    assert lg["rows"] == 9 and lg["top1"]["agree"] == 9
    assert lg["overall"]["rel_err"] < 1e-4
    assert [row["argmax_a"] for row in lg["row_stats"][5:8]] == doc["reference_tokens"]
    layers = doc["layers"]
    names = [t["name"] for t in layers["tensors"]]
    L = load_config(model_dir(model)).num_hidden_layers
    for i in range(L):  # every layer, its last one included (a module hook: not in hidden_states)
        assert f"model.layers.{i}" in names and f"model.layers.{i}.self_attn" in names and f"model.layers.{i}.mlp" in names
    assert names[0] == "model.embed_tokens" and names[-1] == "model.norm"
    assert layers["rows"] == 9 and layers["first_divergence"] is None
    assert max(t["rel_err"] for t in layers["tensors"]) < 1e-4


def _perturb(monkeypatch, tap_name: str, scale: float = 1e-2) -> None:
    """metrale's `tap_name` projection output gets a random relative error of `scale` (transformers does not)."""
    original = numpy_engine.NumpyPass.linear
    rng = np.random.default_rng()

    def linear(self, x, w, bias=None, *, out, norm=None, residual=None, tap=None, reduce=False):
        y = original(self, x, w, bias, out=out, norm=norm, residual=None, tap=None, reduce=reduce)
        if tap == tap_name:
            y = y + scale * np.abs(y).max() * rng.standard_normal(y.shape).astype(np.float32)
        if tap is not None:
            self.tap(tap, y)
        return y if residual is None else residual + y

    monkeypatch.setattr(numpy_engine.NumpyPass, "linear", linear)


def test_a_row_routed_elsewhere_is_the_first_divergence(needs_transformers, run_cli, monkeypatch):
    """A router choice is compared as the experts each row goes to (0 / 1 per expert, either side's order): with
    one row of metrale's layer 1 routed to another expert, the first divergence is that router's choice at that
    row, before the layer's mlp; unplanted, the choices agree (glm4_moe's golden prompt: no near tie)."""
    prompt = np.load(Path(__file__).parent / "fixtures" / "golden" / "glm4_moe.npz")["prompt"].tolist()
    args = ("compare", "--reference", "transformers", "--model", f"{FIXTURES}/glm4_moe", "--tokens",
            " ".join(map(str, prompt)), "--steps", "2", "--format", "json", "--layers", "1")
    doc = json.loads(run_cli(*args).stdout)
    choice = {t["name"]: t["rel_err"] for t in doc["layers"]["tensors"] if t["name"].endswith("gate.top_k_index")}
    assert choice == {"model.layers.1.mlp.gate.top_k_index": 0.0} and doc["passed"]

    original = numpy_engine.NumpyPass.route

    def route(self, x, w_router, spec, **kw):
        r = original(self, x, w_router, spec, **kw)
        if self.t > 5 and spec.num_experts == 16:  # the prefill; row 5's first expert swapped for one it lacks
            spare = next(e for e in range(spec.num_experts) if e not in r.top_k_index[5])
            r.top_k_index[5, 0] = spare
        return r

    monkeypatch.setattr(numpy_engine.NumpyPass, "route", route)
    r = run_cli(*args)
    doc = json.loads(r.stdout)
    assert r.exit_code == 9
    first = doc["layers"]["first_divergence"]
    assert (first["name"], first["position"]) == ("model.layers.1.mlp.gate.top_k_index", 5), doc["layers"]["summary"]


def test_planted_divergence_exits_9_naming_the_layer(needs_transformers, run_cli, monkeypatch):
    _perturb(monkeypatch, "model.layers.1.mlp")
    r, doc, _ = _check(run_cli, f"{FIXTURES}/llama", 300, "--layers", "all")
    assert r.exit_code == 9, (r.stdout, r.stderr)
    assert doc["passed"] is False
    first = doc["layers"]["first_divergence"]
    assert first["name"] == "model.layers.1.mlp", doc["layers"]["summary"]
    assert first["before_max_rel_err"] < 1e-4  # everything before it agrees
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("metrale: outputs differ: ")
    assert "first divergence: model.layers.1.mlp" in err[0]


def test_planted_divergence_without_layers_fails_on_the_logits(needs_transformers, run_cli, monkeypatch):
    _perturb(monkeypatch, "model.layers.0.self_attn", scale=5e-2)
    r, doc, _ = _check(run_cli, f"{FIXTURES}/llama", 300)
    assert r.exit_code == 9, (r.stdout, r.stderr)
    assert doc["layers"] is None and doc["logits"]["overall"]["rel_err"] > 1e-3
    assert doc["failures"] and doc["failures"][0].startswith("logits: ")
    # a looser tolerance given on the command line replaces the default, and the check passes
    r2, doc2, _ = _check(run_cli, f"{FIXTURES}/llama", 300, "--max-rel-err", "10", "--max-kl", "100",
                         "--min-top1", "0")
    assert r2.exit_code == 0, (r2.stdout, r2.stderr)
    assert doc2["tolerances"]["max_rel_err"] == 10 and doc2["tolerances"]["rtol"] == 1e-3


def test_missing_extra_is_one_line_naming_it(run_cli, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    r = run_cli("compare", "--reference", "transformers", "--model", "default", "--tokens", "1 2 3")
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("metrale: missing dependency: "), r.stderr
    assert "pip install 'metrale[reference]'" in lines[0]
    assert r.stdout == ""


@pytest.mark.parametrize("args, words", [
    (["a.npy", "b.npy", "--reference", "transformers"], "give --model, not files A and B"),
    (["a.npy", "b.npy", "--steps", "3"], "--steps go with --reference"),
    (["--reference", "llama.cpp"], "--reference takes transformers"),
    (["--reference", "transformers", "--steps", "0"], "--steps"),
])
def test_usage_errors(run_cli, args, words):
    r = run_cli("compare", *args)
    assert r.exit_code == 2 and words in r.stderr, r.stderr


def test_plain_and_rich_reports(needs_transformers, run_cli):
    r = run_cli("compare", "--reference", "transformers", "--tokens", "4 5 6", "--steps", "2", "--layers", "-1",
                "--format", "plain")
    assert r.exit_code == 0, r.stderr
    out = r.stdout
    assert out.startswith("metrale compare --reference\n") and "tokens_identical: yes" in out
    assert "kind: layers" in out and "model.layers.4.mlp" in out and "model.layers.0." not in out
    assert out.rstrip().endswith("reference_check: passed")
    r = run_cli("compare", "--reference", "transformers", "--tokens", "4 5 6", "--steps", "2", "--format", "rich")
    assert r.exit_code == 0 and "reference check: passed" in r.stdout


def test_help_reference_examples_run(needs_transformers, run_cli, tmp_path, monkeypatch):
    """tests/test_help.py runs the examples of the commands it lists; these are compare's --reference ones."""
    from tests.test_help import examples_block, render_help

    lines = [line for line in examples_block(render_help("compare", 250)) if "--reference" in line]
    assert len(lines) == 2
    monkeypatch.chdir(tmp_path)
    for line in lines:
        r = run_cli(*shlex.split(line)[1:])
        assert r.exit_code == 0 and "passed" in r.stdout, (line, r.stdout, r.stderr)


# -- precision: like with like ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, mla", [("deepseek_v32", "naive"), ("deepseek_v32", "absorbed"),
                                       ("glm_moe_dsa", "naive")])
def test_the_sparse_attention_indexer_agrees_with_transformers(needs_transformers, run_cli, name, mla):
    """DeepSeek-V3.2 and GLM-5 on their golden prompts (every indexer and router choice clear of a tie): the
    indexer's tap (its chosen positions) compares with transformers' indexer output, normalised alike, and nothing
    diverges."""
    prompt = np.load(Path(__file__).parent / "fixtures" / "golden" / f"{name}.npz")["prompt"].tolist()
    r = run_cli("compare", "--reference", "transformers", "--model", f"{FIXTURES}/{name}", "--tokens",
                " ".join(map(str, prompt)), "--steps", "3", "--format", "json", "--layers", "all", "--mla", mla)
    doc = json.loads(r.stdout) if r.stdout.strip() else None
    assert r.exit_code == 0 and doc["passed"], (r.stdout, r.stderr)
    assert any(t["name"].endswith("self_attn.indexer") for t in doc["layers"]["tensors"])


@pytest.mark.parametrize("model", ["default", f"{FIXTURES}/gemma2", f"{FIXTURES}/gemma3_text", f"{FIXTURES}/qwen3",
                                   f"{FIXTURES}/phi3"])
def test_bf16_compute_passes_with_its_default_tolerances(needs_transformers, run_cli, model):
    """metrale's bf16 compute against transformers' bf16 forward, on dense models where the two round apart
    (by ~1e-2, scripts/measure_reference_margins.py): within the default bf16 tolerances, no option given.
    Seeded prompts: a mixture of experts in bf16 may route a near tie differently (reference_check.py)."""
    from metrale_cli.config import load_config
    from metrale_cli.model import model_dir
    from metrale_cli.reference_check import DEFAULT_TOLERANCES

    prompt = np.random.default_rng(0).integers(0, load_config(model_dir(model)).vocab_size, 6).tolist()
    r = run_cli("compare", "--reference", "transformers", "--model", model, "--tokens", " ".join(map(str, prompt)),
                "--steps", "3", "--format", "json", "--compute", "bf16", "--layers", "all")
    doc = json.loads(r.stdout) if r.stdout.strip() else None
    assert r.exit_code == 0, (r.stdout, r.stderr)
    assert (doc["compute"], doc["logits_dtype"], doc["reference_dtype"], doc["reference_device"]) == \
        ("bf16", "bf16", "bf16", "cpu")
    t = DEFAULT_TOLERANCES["bf16"]
    assert doc["tolerances"] == {"max_kl": t.max_kl, "max_rel_err": t.max_rel_err, "min_top1": t.min_top1,
                                 "rtol": t.rtol}
    assert doc["logits"]["rows"] == 9 and doc["passed"]


def test_logits_dtype_bf16_pairs_bf16_compute_and_says_so(needs_transformers, run_cli):
    r = run_cli("compare", "--reference", "transformers", "--tokens", "4 5 6", "--steps", "2", "--logits-dtype",
                "bf16", "--format", "plain")
    assert r.exit_code == 0, r.stderr
    assert "reference: transformers " in r.stdout
    assert ": bf16 weights, compute and logits, on cpu\n" in r.stdout
    assert "metrale: bf16 weights and compute, bf16 logits, on cpu\n" in r.stdout


@pytest.mark.parametrize("device, compute, logits, expected", [
    ("cpu", None, None, ("fp32", "fp32", "fp32", "cpu")),
    ("cpu", None, "bf16", ("bf16", "bf16", "bf16", "cpu")),
    ("cpu", "bf16", None, ("bf16", "bf16", "bf16", "cpu")),
    ("cpu", "bf16", "fp32", ("bf16", "fp32", "bf16", "cpu")),
    ("cpu", "fp32", "bf16", ("fp32", "bf16", "fp32", "cpu")),
    ("cuda", None, None, ("bf16", "bf16", "bf16", "cuda")),
    ("cuda", None, "fp32", ("bf16", "fp32", "bf16", "cuda")),
])
def test_precision_pairs_like_with_like(device, compute, logits, expected):
    from metrale_cli.reference_check import pair_precision

    p = pair_precision(device, compute, logits)
    assert (p.compute, p.logits, p.reference, p.reference_device) == expected
    assert p.tolerance_key == ("fp32" if expected[:2] == ("fp32", "fp32") else "bf16")


def test_cuda_refuses_fp32_compute():
    from metrale_cli.errors import UsageError
    from metrale_cli.model import check_compute
    from metrale_cli.reference_check import pair_precision

    with pytest.raises(UsageError, match="the CUDA engine computes with bf16 weights"):
        check_compute("fp32", "cuda")
    with pytest.raises(UsageError, match="the CUDA engine computes with bf16 weights"):
        pair_precision("cuda", "fp32", None)
    assert check_compute(None, "cuda") == "bf16" and check_compute(None, "cpu") == "fp32"
    with pytest.raises(UsageError, match="--compute must be one of fp32, bf16"):
        check_compute("fp16", "cpu")
