"""Latent attention (the "mla" mixer kind), YaRN and DeepSeek / GLM-4.5 routing on the NumPy engine against
golden outputs of transformers (fp32, CPU).

Fixtures (scripts/make_reference_fixtures.py + scripts/mla_reference_specs.py, tests/fixtures/README.md):
deepseek_v3 (q_lora, interleaved rope, YaRN), deepseek_v3_noq (q_proj, rotate_half rope, YaRN without
truncation), deepseek_v2 (group-limited softmax routing), glm4_moe (GQA, q/k/v bias, q/k norm, partial
rotary), glm4_moe_lite (GLM-4.7-Flash: DeepSeek-V3's blocks, sparse layers from mlp_layer_types), deepseek_v32
(V3 with the sparse attention indexer choosing 5 positions of the 12-token prompt's later rows), glm_moe_dsa
(GLM-5: the indexer's rope interleaved, layers 1 and 3 sharing the choice of layers 0 and 2); every sparse
layer routes within topk_group < n_group groups, the sigmoid routers with a nonzero correction bias, and a layer
is dense (layer 0; deepseek_v3_noq: 0 and 1; glm4_moe_lite: layer 1 between sparse ones). Both MLA algebras are checked: the
naive form (the default, transformers' own) and the absorbed form.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from engine_rows import rows
from golden_parity import check_verify_and_trim
from metrale_cli import decoding
from metrale_cli.backends.numpy.engine import load_numpy_engine
from metrale_cli.checkpoint import Checkpoint
from metrale_cli.config import load_config
from metrale_cli.engine.observe import tapping
from metrale_cli.models.spec import MlpSpec, MoeSpec

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = ["deepseek_v3", "deepseek_v3_noq", "deepseek_v2", "glm4_moe", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa",
          "deepseek_v3_fp8_block"]
MLA_MODELS = ["deepseek_v3", "deepseek_v3_noq", "deepseek_v2", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa",
              "deepseek_v3_fp8_block"]
DSA_MODELS = ["deepseek_v32", "glm_moe_dsa"]  # with the sparse attention indexer
# naive vs absorbed: the same sums in another order; over these fixtures the logits differ by ~1e-6 relative
# (measured over fresh prompts: 6e-7 to 1.2e-6 on prefill and decode rows)
FORMS_TOL = 1e-5


def golden(name: str):
    return np.load(FIXTURES / "golden" / f"{name}.npz")


def engine(name: str, ctx: int = 64, mla: str = "naive", cfg=None):
    cfg = cfg or load_config(FIXTURES / "models" / name)
    return load_numpy_engine(cfg, Checkpoint.open(FIXTURES / "models" / name), ctx, fp32_logits=True, mla=mla)


def rel_err(out, ref) -> float:
    return float(np.max(np.abs(np.asarray(out, np.float64) - ref)) / np.max(np.abs(ref)))


def prefill_rows(e, prompt) -> np.ndarray:
    n = e.prefill(list(prompt), all_logits=True)
    return rows(e, e.logits_buffer_ptr(), n)


@pytest.mark.parametrize("mla", ["naive", "absorbed"])
@pytest.mark.parametrize("name", MODELS)
def test_prefill_logits_match_transformers(name, mla):
    g = golden(name)
    err = rel_err(prefill_rows(engine(name, mla=mla), g["prompt"]), g["prefill_logits"])
    print(f"{name} ({mla}): prefill max|diff|/max|ref| = {err:.2e}")
    assert err <= 1e-5


@pytest.mark.parametrize("name", MODELS)
def test_hidden_after_norm_matches_transformers(name):
    g = golden(name)
    e = engine(name)
    e.prefill(list(g["prompt"]))
    assert rel_err(e.copy_hidden_to_host(), g["hidden_after_norm"]) <= 1e-5


@pytest.mark.parametrize("mla", ["naive", "absorbed"])
@pytest.mark.parametrize("name", MODELS)
def test_32_greedy_steps_match_generate(name, mla):
    g = golden(name)
    res = decoding.run_decode(engine(name, mla=mla), list(g["prompt"]), 32, keep_rows=True)
    assert [s.token for s in res.steps] == list(g["greedy_tokens"])
    err = rel_err(res.rows.array(), g["greedy_logits"])
    print(f"{name} ({mla}): 32 greedy rows max|diff|/max|ref| = {err:.2e}")
    assert err <= 1e-5


@pytest.mark.parametrize("mla", ["naive", "absorbed"])
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("k", [1, 3, 8])
def test_verify_rows_equal_sequential_decode_and_trim(name, k, mla):
    check_verify_and_trim(name, k, open_engine=lambda: engine(name, mla=mla))


@pytest.mark.parametrize("name", MLA_MODELS)
def test_naive_and_absorbed_forms_agree_within_fp32_rounding(name):
    """The two algebras over one latent cache, on a fresh random prompt and decode steps."""
    rng = np.random.default_rng()
    prompt = [int(t) for t in rng.integers(0, 300, 20)]
    steps = [int(t) for t in rng.integers(0, 300, 8)]
    a, b = engine(name, mla="naive"), engine(name, mla="absorbed")
    err = rel_err(prefill_rows(b, prompt), prefill_rows(a, prompt))
    rows_a, rows_b = [], []
    for t in steps:
        a.decode(t), b.decode(t)
        rows_a.append(rows(a, a.decode_logits_ptr(), 1)[0])
        rows_b.append(rows(b, b.decode_logits_ptr(), 1)[0])
    derr = rel_err(np.stack(rows_b), np.stack(rows_a))
    print(f"{name}: absorbed vs naive max|diff|/max|naive| prefill {err:.2e}, decode {derr:.2e}")
    assert 0 < max(err, derr) <= FORMS_TOL  # different roundings, the same values


def observed(e, tokens) -> dict[str, np.ndarray]:
    taps: dict[str, np.ndarray] = {}
    with tapping(e, lambda key, value: taps.__setitem__(key, np.array(value))):
        e.prefill(list(tokens))
    return taps


@pytest.mark.parametrize("name", MODELS)
def test_router_taps_match_transformers(name):
    """Router logits, chosen experts (as a set: DeepSeek's router takes torch.topk(sorted=False)), their
    weights and the sparse block's output per sparse layer, against transformers' hooks."""
    g = golden(name)
    taps = observed(engine(name), g["prompt"])
    for j, i in enumerate(g["moe_layers"]):
        p = f"model.layers.{i}.mlp"
        assert rel_err(taps[f"{p}.gate"], g["router_logits"][j]) <= 1e-5
        mine, ref = _by_expert(taps[f"{p}.gate.top_k_index"], taps[f"{p}.gate.top_k_weights"]), \
            _by_expert(g["top_k_index"][j], g["top_k_weights"][j])
        np.testing.assert_array_equal(mine[0], ref[0])
        assert np.abs(mine[1] - ref[1]).max() <= 1e-5 * max(1.0, np.abs(ref[1]).max())
        assert rel_err(taps[p], g["moe_output"][j]) <= 1e-5


def _by_expert(index, weights):
    order = np.argsort(index, axis=-1)
    return np.take_along_axis(index, order, -1), np.take_along_axis(weights, order, -1)


@pytest.mark.parametrize("name", MLA_MODELS)
def test_latent_tap_matches_transformers(name):
    """model.layers.{i}.self_attn.kv_a_layernorm (the normed latent) against transformers' hook."""
    g = golden(name)
    taps = observed(engine(name), g["prompt"])
    for i, ref in enumerate(g["kv_a_layernorm"]):
        assert rel_err(taps[f"model.layers.{i}.self_attn.kv_a_layernorm"], ref) <= 1e-5


def test_the_fixtures_exercise_what_they_claim():
    """Dense first layers, groups with topk_group < n_group, both rope layouts, q_lora both ways, YaRN."""
    layers = {name: load_config(FIXTURES / "models" / name).definition.layers for name in MODELS}
    assert [type(x.mlp) for x in layers["deepseek_v3"]] == [MlpSpec, MoeSpec, MoeSpec]
    assert [type(x.mlp) for x in layers["deepseek_v3_noq"]] == [MlpSpec, MlpSpec, MoeSpec]
    assert [type(x.mlp) for x in layers["glm4_moe_lite"]] == [MoeSpec, MlpSpec, MoeSpec]
    for name in MODELS:
        r = layers[name][-1].mlp.router
        assert 1 <= r.topk_group < r.n_group, name
    v3, noq = layers["deepseek_v3"][0].mixer, layers["deepseek_v3_noq"][0].mixer
    assert (v3.q_lora_rank, v3.rope_interleave, noq.q_lora_rank, noq.rope_interleave) == (48, True, None, False)
    assert v3.rope.yarn.truncate and not noq.rope.yarn.truncate
    assert v3.rope.attention_scaling != 1.0 and v3.scale != v3.qk_head_dim ** -0.5  # cos/sin and softmax mscale
    glm = layers["glm4_moe"][0].mixer
    assert glm.rope.dims == glm.head_dim // 2 and glm.qk_norm


@pytest.mark.parametrize("mla", ["naive", "absorbed"])
@pytest.mark.parametrize("name", DSA_MODELS)
def test_the_indexers_choice_matches_transformers(name, mla):
    """model.layers.{i}.self_attn.indexer (the positions each query attends to) of each layer with its own indexer
    against transformers' indexer, as sets; row s < index_topk sees all its s + 1 positions (transformers pads its
    choice with later ones, the golden and metrale's tap with -1)."""
    g = golden(name)
    taps = observed(engine(name, mla=mla), g["prompt"])
    layers = load_config(FIXTURES / "models" / name).definition.layers
    own = [i for i, x in enumerate(layers) if not x.mixer.indexer.shared]  # GLM-5's shared layers tap no choice
    assert len(own) == len(g["indexer_topk"])
    assert [i for i in range(len(layers)) if f"model.layers.{i}.self_attn.indexer" in taps] == own
    for i, ref in zip(own, g["indexer_topk"]):
        def as_sets(x):  # sorted, the -1 fill last
            return np.sort(np.where(np.asarray(x) < 0, np.iinfo(np.int32).max, x), -1)

        got = taps[f"model.layers.{i}.self_attn.indexer"]
        np.testing.assert_array_equal(as_sets(got), as_sets(ref), err_msg=f"layer {i}")


@pytest.mark.parametrize("name", DSA_MODELS)
def test_the_indexer_changes_the_numbers(name):
    """With index_topk past the prompt's length (every position seen) the logits move: the choice matters; GLM-5's
    with its indexer's rope rotate_half (not interleaved), too."""
    g = golden(name)

    def with_indexer(**change):
        cfg = load_config(FIXTURES / "models" / name)
        layers = tuple(dataclasses.replace(x, mixer=dataclasses.replace(
            x.mixer, indexer=dataclasses.replace(x.mixer.indexer, **change))) for x in cfg.definition.layers)
        cfg.__dict__["definition"] = dataclasses.replace(cfg.definition, layers=layers)
        return rel_err(prefill_rows(engine(name, cfg=cfg), g["prompt"]), g["prefill_logits"])

    err = with_indexer(topk=10 ** 6)
    print(f"{name} without the indexer's choice: {err:.2e} from transformers")
    assert err > 1e-2
    if name == "glm_moe_dsa":
        assert with_indexer(interleave=False) > 1e-3


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe", "glm4_moe_lite", "deepseek_v32"])
def test_the_correction_bias_changes_the_choice(name):
    """Zeroing e_score_correction_bias changes some token's experts: the golden choice depends on it."""
    g = golden(name)
    e = engine(name)
    for lw in e.w.layers:
        if "router_correction" in lw:
            lw["router_correction"] = np.zeros_like(lw["router_correction"])
    taps = observed(e, g["prompt"])
    changed = [not np.array_equal(np.sort(taps[f"model.layers.{i}.mlp.gate.top_k_index"], -1),
                                  np.sort(g["top_k_index"][j], -1)) for j, i in enumerate(g["moe_layers"])]
    assert any(changed)


@pytest.mark.parametrize("feature", ["rope_interleave", "yarn", "softmax_mscale"])
def test_each_rope_feature_matters(feature):
    """Turning a feature off moves the logits far beyond the 1e-5 the goldens are matched to."""
    g = golden("deepseek_v3")
    cfg = load_config(FIXTURES / "models" / "deepseek_v3")
    d = cfg.definition
    m = d.layers[0].mixer
    if feature == "rope_interleave":
        m2 = dataclasses.replace(m, rope_interleave=False)
    elif feature == "yarn":
        m2 = dataclasses.replace(m, rope=dataclasses.replace(m.rope, yarn=None))
    else:
        m2 = dataclasses.replace(m, scale=m.qk_head_dim ** -0.5)
    layers = tuple(dataclasses.replace(x, mixer=m2) for x in d.layers)
    cfg.__dict__["definition"] = dataclasses.replace(d, layers=layers)
    assert rel_err(prefill_rows(engine("deepseek_v3", cfg=cfg), g["prompt"]), g["prefill_logits"]) > 1e-3


def test_the_cache_holds_the_latent_only():
    """One row of kv_lora_rank + qk_rope_head_dim floats per position and layer, whatever the heads."""
    e = engine("deepseek_v3", ctx=40)
    m = e.cfg.definition.layers[0].mixer
    assert m.latent_size == 32 + 8
    assert e.states["mla"].nbytes == 3 * 40 * (32 + 8) * 4
