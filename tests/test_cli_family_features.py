"""The CLI on the Gemma / Phi-3 fixtures: inspect names the new features, decode and verify run."""

from __future__ import annotations

import json

import numpy as np

from metrale_cli.config import load_config
from metrale_cli.random_weights import RandomTensors


def as_json(r):
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def test_inspect_reports_windows_softcaps_norms_and_rotary_fraction(run_cli):
    g2 = as_json(run_cli("inspect", "tests/fixtures/models/gemma2", "-f", "json"))
    assert g2["sliding_window"] == 8 and g2["sliding_layers"] == [0, 2]
    assert g2["attn_logit_softcapping"] == 4.0 and g2["final_logit_softcapping"] == 30.0
    assert g2["norm"] == "rmsnorm (1 + w)" and g2["post_norms"] and g2["activation"] == "gelu_tanh"
    assert g2["embed_scale"] == 8.0 and g2["attention_scale"] == 24 ** -0.5
    g3 = as_json(run_cli("inspect", "tests/fixtures/models/gemma3_text_4x", "-f", "json"))
    assert g3["sliding_layers"] == [0, 1, 2, 3, 4]
    assert g3["rope"] == {"theta": 1e6, "type": "linear", "scaling": {"factor": 8.0}, "rotary_fraction": 1.0}
    assert g3["sliding_rope"]["theta"] == 1e4 and g3["sliding_rope"]["type"] == "default"
    phi = as_json(run_cli("inspect", "tests/fixtures/models/phi4_mini", "-f", "json"))
    assert phi["rope"]["type"] == "longrope" and phi["rope"]["rotary_fraction"] == 0.75
    assert phi["rope"]["scaling"]["original_max_position_embeddings"] == 8 and phi["sliding_layers"] == []
    plain = run_cli("inspect", "tests/fixtures/models/gemma3_text", "-f", "plain").stdout
    assert "sliding_layers: 4 of 6: S S F repeated" in plain
    assert "final_logit_softcapping: 30\n" in plain and "attn_logit_softcapping: none\n" in plain
    assert "sliding_rope: theta 1000, default\n" in plain and "post_norms: yes\n" in plain
    assert "rope: theta 10000, longrope (original_max_position_embeddings 8" in \
        run_cli("inspect", "tests/fixtures/models/phi4_mini", "-f", "plain").stdout


def test_decode_and_verify_past_the_window(run_cli):
    """A context longer than the window is attended to, no longer refused."""
    r = run_cli("decode", "-m", "tests/fixtures/models/mistral_window", "-t", ",".join(map(str, range(20))),
                "--steps", 12, "--device", "cpu", "-f", "json")
    assert r.exit_code == 0, r.stderr
    assert len(json.loads(r.stdout)["steps"]) == 12
    r = run_cli("verify", "-m", "tests/fixtures/models/gemma2", "-t", ",".join(map(str, range(14))),
                "--draft", "self", "--k", 6, "--device", "cpu", "-f", "json")
    doc = as_json(r)
    assert doc["accepted"] == 6 and doc["max_abs_diff_vs_sequential"] < 1e-3


def test_random_weights_draw_gemma_norm_weights_around_zero():
    cfg = load_config("tests/fixtures/models/gemma2")
    w = RandomTensors(cfg).array("model.layers.0.input_layernorm.weight").astype(np.float32)
    assert abs(float(w.mean())) < 0.05  # the scale 1 + w is near 1, as a Llama norm weight is
    llama = RandomTensors(load_config("tests/fixtures/models/llama")).array("model.norm.weight").astype(np.float32)
    assert abs(float(llama.mean()) - 1.0) < 0.05
