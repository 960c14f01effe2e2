"""The block loop's taps: where non-finite values start, and captured layers equal the pass's numbers."""

from __future__ import annotations

import numpy as np
import pytest

from metrale_cli.engine.observe import capture, describe_nonfinite, first_nonfinite
from metrale_cli.model import open_model


def _poisoned(tmp_path, helpers, name, index, value=np.nan):
    d = helpers.copy_model(tmp_path / "m")

    def edit(t):
        w = t[name].copy()
        w[index] = value
        t[name] = w

    helpers.edit_tensors(d, edit)
    return open_model(d, device="cpu")


@pytest.mark.parametrize("tensor, index, expect", [
    ("model.embed_tokens.weight", (7, 3), "model.embed_tokens"),
    ("model.layers.0.self_attn.v_proj.weight", (2, 1), "model.layers.0.self_attn"),
    ("model.layers.1.mlp.up_proj.weight", (4, 9), "model.layers.1.mlp"),
    ("model.norm.weight", (5,), "model.norm"),
])
def test_first_nonfinite_names_the_first_tensor(tmp_path, helpers, tensor, index, expect):
    m = _poisoned(tmp_path, helpers, tensor, index)
    tokens = [3, 9, 7, 11]  # token 7 (row 2) is the one whose embedding row is poisoned
    hit = first_nonfinite(m.engine, tokens)
    assert hit is not None and hit.name == expect
    if expect == "model.embed_tokens":
        assert hit.row == 2 and "token 7" in hit.describe(tokens)
    else:
        assert hit.row == 0  # every row reads a poisoned weight
    assert expect in describe_nonfinite(m.engine, tokens)


def test_inf_in_lm_head_is_reported_past_the_final_norm(tmp_path, helpers):
    m = _poisoned(tmp_path, helpers, "lm_head.weight", (5, 2), np.inf)
    assert first_nonfinite(m.engine, [1, 2, 3]) is None
    assert "lm_head" in describe_nonfinite(m.engine, [1, 2, 3])


def test_capture_equals_the_pass(helpers):
    m = open_model(helpers.REPO / helpers.LLAMA, device="cpu", fp32_logits=True)
    rng = np.random.default_rng()
    tokens = rng.integers(0, m.config.vocab_size, 9).tolist()
    m.engine.prefill(tokens, all_logits=True)
    hidden = m.engine.copy_hidden_to_host()
    layers = capture(m.engine, tokens, lambda name: True)
    assert list(layers)[0] == "model.embed_tokens" and list(layers)[-1] == "model.norm"
    assert all(v.shape[0] == len(tokens) for v in layers.values())
    np.testing.assert_array_equal(layers["model.norm"][-1], hidden.reshape(-1))
    # the residual stream: embedding + every attention and MLP output, in order
    x = layers["model.embed_tokens"].astype(np.float64)
    for i in range(m.config.num_hidden_layers):
        x = x + layers[f"model.layers.{i}.self_attn"] + layers[f"model.layers.{i}.mlp"]
        np.testing.assert_allclose(x, layers[f"model.layers.{i}"], rtol=1e-5, atol=1e-5)
