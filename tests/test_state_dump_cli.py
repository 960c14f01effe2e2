"""`--dump-state PATH` (forward, decode): the linear-attention layers' recurrent and conv states after the run,
as safetensors, equal to transformers' cache contents (the fixture's golden), refused by name where it
cannot apply; and the layer dumps tap `model.layers.{i}.linear_attn`."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from safetensors.numpy import load_file

from metrale_cli.model import open_model

MODEL = "tests/fixtures/models/qwen3_next"
GOLDEN = Path(__file__).parent / "fixtures" / "golden" / "qwen3_next.npz"


def rel_err(out, ref) -> float:
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def test_forward_dump_state_equals_transformers_cache(run_cli, tmp_path):
    g = np.load(GOLDEN)
    out = tmp_path / "state.safetensors"
    tokens = " ".join(str(t) for t in g["prompt"])
    r = run_cli("forward", "--model", MODEL, "--tokens", tokens, "--dump-state", out, "--format", "json")
    assert r.exit_code == 0, r.stderr
    dump = load_file(out)
    assert len(dump) == 2 * len(g["linear_layers"])
    for j, i in enumerate(g["linear_layers"]):
        assert rel_err(dump[f"model.layers.{i}.linear_attn.conv_state"], g["conv_state"][j][:, 1:]) <= 1e-5
        assert rel_err(dump[f"model.layers.{i}.linear_attn.recurrent_state"], g["recurrent_state"][j]) <= 1e-5
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically: no temp file left


def test_decode_dump_state_is_the_state_after_the_last_token_run(run_cli, tmp_path):
    rng = np.random.default_rng()
    prompt = [int(t) for t in rng.integers(0, 300, 9)]
    out = tmp_path / "s.safetensors"
    r = run_cli("decode", "--model", MODEL, "--tokens", " ".join(map(str, prompt)), "--steps", "4",
                "--dump-state", out, "--format", "json")
    assert r.exit_code == 0, r.stderr
    import json

    produced = [s["token"] for s in json.loads(r.stdout)["steps"]]
    e = open_model(MODEL, device="cpu", max_context=32, fp32_logits=True).engine
    e.prefill(prompt + produced[:-1])  # the last produced token is not run
    dump = load_file(out)
    for name, value in e.states["linear_attention"].tensors().items():
        assert rel_err(dump[name], value) <= 1e-5, name


def test_dump_state_is_refused_where_it_cannot_apply(run_cli, tmp_path):
    r = run_cli("forward", "--model", "tests/fixtures/models/llama", "--tokens", "1 2 3", "--dump-state",
                tmp_path / "s.safetensors")
    assert r.exit_code == 2 and "llama has no recurrent state" in r.stderr
    r = run_cli("forward", "--model", MODEL, "--tokens", "1 2 3", "--dump-state", tmp_path / "s.npy")
    assert r.exit_code == 2 and "--dump-state writes .safetensors" in r.stderr
    assert not (tmp_path / "s.safetensors").exists()


def test_layer_dump_taps_the_linear_attention_output(run_cli, tmp_path):
    out = tmp_path / "layers.safetensors"
    r = run_cli("forward", "--model", MODEL, "--tokens", "5 6 7 8", "--rows", "all", "--dump-layers", out)
    assert r.exit_code == 0, r.stderr
    dump = load_file(out)
    for i in (0, 1, 2, 4):
        a = dump[f"model.layers.{i}.linear_attn"]
        assert a.shape == (4, 64) and np.abs(a).max() > 0
    assert "model.layers.3.self_attn" in dump


def test_inspect_reports_the_state_bytes_per_sequence(run_cli):
    import json

    r = run_cli("inspect", MODEL, "--format", "json")
    assert r.exit_code == 0, r.stderr
    info = json.loads(r.stdout)["linear_attention"]
    e = open_model(MODEL, device="cpu", max_context=8, fp32_logits=True).engine
    assert info["layers"] == [0, 1, 2, 4]
    assert info["state_bytes_per_sequence"] == e.states["linear_attention"].nbytes == 32256
    r = run_cli("inspect", "tests/fixtures/models/llama", "--format", "json")
    assert "linear_attention" not in json.loads(r.stdout)  # only models that have the layers


def test_what_the_linear_layers_do_not_have_yet_is_refused_by_name(run_cli):
    r = run_cli("forward", "--model", MODEL, "--tokens", "1 2 3", "--compute", "bf16")
    assert r.exit_code == 2 and "--compute bf16 is not implemented for linear-attention layers" in r.stderr
    r = run_cli("forward", "--model", MODEL, "--tokens", "1 2 3", "--tp", "2", "--device", "cpu")
    assert r.exit_code == 2 and "layers of kind 'linear_attention' have no tensor-parallel split" in r.stderr


def test_verify_self_drafts_roll_the_state_back(run_cli):
    """verify --draft self decodes k steps, trims back k positions and verifies: the state's kept copies
    make the trim possible, and every self draft is accepted."""
    import json

    r = run_cli("verify", "--model", MODEL, "--tokens", "3 1 4 1 5", "--k", "6", "--format", "json")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["accepted"] == 6 and out["max_abs_diff_vs_sequential"] <= 1e-4
