"""The NumPy engine on the mixture-of-experts families against golden outputs of transformers (fp32, CPU).

Fixtures (scripts/make_reference_fixtures.py, tests/fixtures/README.md): qwen3_moe (top-8 of 16 experts,
renormalised, layer 1 dense via mlp_only_layers), qwen2_moe (top-2 of 8, not renormalised, shared expert),
mixtral (top-2 of 8, renormalised). Their goldens add the router's view of the prompt per sparse layer,
which the engine's taps (engine/loop.py) are checked against.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine_rows import rows
from golden_parity import check_verify_and_trim
from metrale_cli import decoding
from metrale_cli.model import open_model
from metrale_cli.models.spec import MlpSpec, MoeSpec
from metrale_cli.engine.observe import tapping

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = ["qwen3_moe", "qwen2_moe", "mixtral"]


def golden(name: str):
    return np.load(FIXTURES / "golden" / f"{name}.npz")


def engine(name: str, ctx: int = 64):
    return open_model(FIXTURES / "models" / name, device="cpu", max_context=ctx, fp32_logits=True).engine


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(out, np.float64) - ref)) / np.max(np.abs(ref)))


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
    res = decoding.run_decode(engine(name), list(g["prompt"]), 32, keep_rows=True)
    assert [s.token for s in res.steps] == list(g["greedy_tokens"])
    err = rel_err(res.rows.array(), g["greedy_logits"])
    print(f"{name}: 32 greedy rows max|diff|/max|ref| = {err:.2e}")
    assert err <= 1e-5


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_verify_rows_equal_sequential_decode_and_trim(name, k):
    check_verify_and_trim(name, k)


def observed(name: str, tokens) -> dict[str, np.ndarray]:
    taps: dict[str, np.ndarray] = {}
    e = engine(name)
    with tapping(e, lambda key, value: taps.__setitem__(key, np.array(value))):
        e.prefill(list(tokens))
    return taps


@pytest.mark.parametrize("name", MODELS)
def test_router_taps_match_transformers(name):
    """Router logits, chosen experts (same experts, same order), their weights and the sparse block's
    output per sparse layer, against transformers' hooks on mlp.gate and mlp."""
    g = golden(name)
    taps = observed(name, g["prompt"])
    for j, i in enumerate(g["moe_layers"]):
        p = f"model.layers.{i}.mlp"
        assert rel_err(taps[f"{p}.gate"], g["router_logits"][j]) <= 1e-5
        np.testing.assert_array_equal(taps[f"{p}.gate.top_k_index"], g["top_k_index"][j])
        assert rel_err(taps[f"{p}.gate.top_k_weights"], g["top_k_weights"][j]) <= 1e-5
        assert rel_err(taps[p], g["moe_output"][j]) <= 1e-5


@pytest.mark.parametrize("name", MODELS)
def test_fixture_routing_is_not_degenerate(name):
    """The prompt's tokens spread over the experts: the checks above exercise routing, not one expert."""
    g = golden(name)
    spec = next(layer.mlp for layer in engine(name).cfg.definition.layers if isinstance(layer.mlp, MoeSpec))
    for index in g["top_k_index"]:
        assert len(np.unique(index)) >= min(spec.num_experts, 2 * spec.top_k)
        assert len({tuple(sorted(row)) for row in index}) > 1  # rows choose different expert sets


def test_qwen3_moe_dense_layer_in_the_middle():
    e = engine("qwen3_moe")
    kinds = [type(layer.mlp) for layer in e.cfg.definition.layers]
    assert kinds == [MoeSpec, MlpSpec, MoeSpec]
    assert list(golden("qwen3_moe")["moe_layers"]) == [0, 2]
    w = e.w.layers
    assert w[0]["experts_gate_up"].shape == (16, 80, 64) and w[0]["experts_down"].shape == (16, 64, 40)
    assert w[1]["gate_up"].shape == (160, 64) and "router" not in w[1]


def test_stacked_experts_hold_each_expert_tensor():
    """experts_gate_up[e] = [gate_e; up_e] and experts_down[e] = down_e, read back from the safetensors."""
    from safetensors.numpy import load_file

    tensors = load_file(FIXTURES / "models" / "mixtral" / "model.safetensors")
    w = engine("mixtral").w.layers[1]
    p = "model.layers.1.block_sparse_moe."
    for j in range(8):
        gate, up, down = (tensors[f"{p}experts.{j}.{n}.weight"] for n in ("w1", "w3", "w2"))
        np.testing.assert_array_equal(w["experts_gate_up"][j], np.concatenate([gate, up]))
        np.testing.assert_array_equal(w["experts_down"][j], down)
    np.testing.assert_array_equal(w["router"], tensors[p + "gate.weight"])


def test_qwen2_moe_router_carries_the_shared_expert_gate():
    from safetensors.numpy import load_file

    tensors = load_file(FIXTURES / "models" / "qwen2_moe" / "model.safetensors")
    w = engine("qwen2_moe").w.layers[0]
    p = "model.layers.0.mlp."
    assert w["router"].shape == (9, 64)
    np.testing.assert_array_equal(w["router"][:8], tensors[p + "gate.weight"])
    np.testing.assert_array_equal(w["router"][8:], tensors[p + "shared_expert_gate.weight"])
    assert w["shared_gate_up"].shape == (112, 64) and w["shared_down"].shape == (64, 56)
