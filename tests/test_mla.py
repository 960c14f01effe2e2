"""YaRN, DeepSeek-V2's group-limited router, the DeepSeek / GLM-4.5 configs (what is refused, by field), the
CUDA engine's refusals, and the latent-attention plumbing through the CLI (--mla, layer dumps, inspect,
the multi-token-prediction tensors), on fresh random inputs where there are inputs.

The families' numbers against transformers are tests/test_reference_mla.py (fixtures) and
tests/test_reference_live_mla.py (fresh draws)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from metrale_cli.backends.numpy import moe
from metrale_cli.config import load_config, parse_config
from metrale_cli.errors import ConfigError, DeviceError, UsageError
from metrale_cli.models.model_config import ConfigReader
from metrale_cli.models.rope_params import read_rope
from metrale_cli.models.spec import MlaIndexer, MoeSpec, RouterSpec

FIXTURES = Path(__file__).parent / "fixtures" / "models"
MODELS = ["deepseek_v3", "deepseek_v3_noq", "deepseek_v2", "glm4_moe", "glm4_moe_lite"]


def raw_config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


# -- YaRN ----------------------------------------------------------------------------------------------------

YARN_CASES = [
    dict(factor=4.0, original_max_position_embeddings=64, mscale=0.9, mscale_all_dim=0.8),
    dict(factor=32.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, truncate=False),
    dict(factor=40, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0),  # DeepSeek-V3
    dict(factor=8.0, attention_factor=1.3, beta_fast=16, beta_slow=2),
    dict(factor=None, original_max_position_embeddings=8192),  # factor from max_position_embeddings
    dict(factor=2.0, original_max_position_embeddings=1024, beta_fast=0, beta_slow=0),  # 0 means the default
]


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("case", range(len(YARN_CASES)))
def test_yarn_equals_transformers(case, partial):
    """inv_freq within an fp32 ulp of transformers' _compute_yarn_parameters, the same attention factor."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    params = {"rope_type": "yarn", "rope_theta": 150000.0, "partial_rotary_factor": partial, **YARN_CASES[case]}
    cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64,
                                   max_position_embeddings=131072, rope_parameters=dict(params))
    with torch.no_grad():
        inv, attention = _compute_yarn_parameters(cfg)
    r = ConfigReader({"max_position_embeddings": 131072, "rope_parameters": params}, "config.json")
    rotary = int(64 * partial)
    rope = read_rope(r, "rope_parameters", params, 150000.0, 64, ("yarn",), rotary_dim=rotary if rotary != 64 else None)
    np.testing.assert_allclose(rope.inv_freq(), inv.numpy(), rtol=2.4e-7, atol=0)
    assert math.isclose(rope.attention_scaling, attention, rel_tol=1e-12)


def test_yarn_softmax_mscale_equals_transformers():
    pytest.importorskip("torch")
    from transformers.modeling_rope_utils import yarn_apply_mscale

    for c in YARN_CASES[:3]:
        params = {"rope_type": "yarn", "rope_theta": 1e4, **c}
        r = ConfigReader({"max_position_embeddings": 131072, "rope_parameters": params}, "config.json")
        y = read_rope(r, "rope_parameters", params, 1e4, 64, ("yarn",)).yarn
        assert math.isclose(0.125 * y.softmax_mscale(), yarn_apply_mscale(params, 0.125), rel_tol=1e-12)


def test_yarn_cos_sin_carry_the_attention_factor():
    """The NumPy pass's cos/sin tables are the spec's, scaled by the attention factor (the CUDA kernels take
    the same inv_freq and attention_scaling from the spec)."""
    from metrale_cli.backends.numpy.engine import NumpyPass

    e = SimpleEngine()
    rope = load_config(FIXTURES / "deepseek_v3").definition.layers[0].mixer.rope
    cos, sin = NumpyPass(e, np.arange(5), None).cos_sin(rope)
    angles = np.arange(5, dtype=np.float32)[:, None] * rope.inv_freq()[None, :]
    np.testing.assert_allclose(cos, np.cos(angles) * np.float32(rope.attention_scaling), rtol=1e-6)
    np.testing.assert_allclose(sin, np.sin(angles) * np.float32(rope.attention_scaling), rtol=1e-6)
    assert rope.attention_scaling != 1.0


class SimpleEngine:
    length = 0

    def inv_freq(self, rope, long=False):
        return rope.inv_freq(long)


# -- DeepSeek-V2's group-limited router --------------------------------------------------------------------------

@pytest.mark.parametrize("method,n_group,topk_group,k", [("greedy", 1, 1, 6), ("group_limited_greedy", 4, 2, 6),
                                                          ("group_limited_greedy", 8, 3, 4)])
def test_deepseek_v2_router(method, n_group, topk_group, k):
    torch = pytest.importorskip("torch")
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    rng = np.random.default_rng()
    e, h, t, scale = 32, 24, 40, 1.7
    cfg = DeepseekV2Config(hidden_size=h, num_attention_heads=4, n_routed_experts=e, num_experts_per_tok=k,
                           n_group=n_group, topk_group=topk_group, topk_method=method, routed_scaling_factor=scale)
    ref = DeepseekV2TopkRouter(cfg)
    w = rng.standard_normal((e, h), dtype=np.float32) * 0.5
    x = rng.standard_normal((t, h), dtype=np.float32)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(w))
        logits, ref_w, ref_idx = ref(torch.from_numpy(x))
    kind = "softmax_group_limited" if method == "group_limited_greedy" else "softmax_topk"
    spec = MoeSpec(e, k, 8, False, router=RouterSpec(kind, n_group=n_group, topk_group=topk_group,
                                                     routed_scaling_factor=scale))
    r = moe.route(x, w, spec)
    np.testing.assert_allclose(r.logits, logits.numpy(), rtol=1e-5, atol=1e-6)
    for row in range(t):  # as sets: transformers takes torch.topk(sorted=False)
        a = dict(zip(r.top_k_index[row].tolist(), r.top_k_weights[row].tolist()))
        b = dict(zip(ref_idx[row].tolist(), ref_w[row].tolist()))
        assert a.keys() == b.keys()
        np.testing.assert_allclose([a[i] for i in sorted(a)], [b[i] for i in sorted(a)], rtol=5e-6, atol=1e-7)


# -- configs -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,change,field", [
    ("deepseek_v3", {"model_type": "deepseek_v4"}, "model_type"),
    ("deepseek_v3", {"index_topk": 2048}, "index_topk"),
    ("deepseek_v3", {"topk_method": "group_limited_greedy"}, "topk_method"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func"),
    ("deepseek_v3", {"attention_bias": True}, "attention_bias"),
    ("deepseek_v3", {"num_key_value_heads": 2}, "num_key_value_heads"),
    ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq"),
    ("deepseek_v3", {"n_group": 3}, "n_group"),
    ("deepseek_v3", {"topk_group": 5}, "topk_group"),
    ("deepseek_v3", {"hidden_act": "gelu"}, "hidden_act"),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "rope_parameters.rope_type"),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4,
                                         "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method"),
    ("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob"),
    ("deepseek_v2", {"scoring_func": "sigmoid"}, "scoring_func"),
    ("deepseek_v2", {"mlp_bias": True}, "mlp_bias"),
    ("deepseek_v2", {"rope_interleave": False}, "rope_interleave"),
    ("glm4_moe", {"scoring_func": "softmax"}, "scoring_func"),
    ("glm4_moe", {"n_shared_experts": 0}, "n_shared_experts"),
    ("glm4_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("glm4_moe_lite", {"topk_method": "greedy"}, "topk_method"),
    ("glm4_moe_lite", {"n_group": 5}, "n_group"),
    ("glm4_moe_lite", {"attention_bias": True}, "attention_bias"),
    ("glm4_moe_lite", {"mlp_layer_types": ["sparse", "dense"]}, "mlp_layer_types"),
    ("glm4_moe_lite", {"mlp_layer_types": ["sparse", "moe", "sparse"]}, "mlp_layer_types"),
    ("glm4_moe_lite", {"first_k_dense_replace": 1}, "first_k_dense_replace"),
    ("deepseek_v32", {"q_lora_rank": None}, "q_lora_rank"),
    ("deepseek_v32", {"rope_interleave": False}, "rope_interleave"),
    ("deepseek_v32", {"index_head_dim": 4}, "index_head_dim"),
    ("deepseek_v32", {"index_topk": 0}, "index_topk"),
    ("deepseek_v32", {"mlp_layer_types": ["dense", "dense", "sparse"]}, "first_k_dense_replace"),
    ("deepseek_v32", {"scoring_func": "softmax"}, "scoring_func"),
    ("glm_moe_dsa", {"indexer_types": ["shared", "full", "full", "shared"]}, "indexer_types"),
    ("glm_moe_dsa", {"indexer_types": ["full", "shared"]}, "indexer_types"),
    ("glm_moe_dsa", {"indexer_types": None, "index_topk_pattern": "FXFS"}, "index_topk_pattern"),
])
def test_what_is_not_implemented_is_refused_by_field(name, change, field):
    raw = {**raw_config(name), **change}
    with pytest.raises(ConfigError, match=rf"unsupported {field} "):
        parse_config(raw)


def test_glm4_moe_lite_reads_its_layer_types():
    """GLM-4.7-Flash: sparse where mlp_layer_types says (absent: all but layer 0, as transformers defaults); a
    first_k_dense_replace that agrees with the layer types is accepted; GLM's defaults for the latent sizes."""
    raw = raw_config("glm4_moe_lite")
    assert parse_config(raw).moe.sparse_layers == (0, 2)
    no_types = {k: v for k, v in raw.items() if k != "mlp_layer_types"}
    assert parse_config(no_types).moe.sparse_layers == (1, 2)
    assert parse_config({**no_types, "first_k_dense_replace": 1}).moe.sparse_layers == (1, 2)
    defaults = {k: v for k, v in raw.items() if k not in ("q_lora_rank", "qk_nope_head_dim", "v_head_dim")}
    mla = parse_config(defaults).definition.layers[0].mixer
    assert (mla.q_lora_rank, mla.qk_nope_head_dim, mla.v_head_dim) == (768, 192, 256)


def test_deepseek_v32_reads_its_indexer_and_the_cuda_engine_refuses_it():
    """DeepSeek-V3.2: the indexer's sizes on every layer, the sparse layers from first_k_dense_replace when the layer
    types are absent; --device cuda names the indexer (before CuPy is looked for)."""
    from metrale_cli.backends.cuda.loading import unsupported_features

    raw = raw_config("deepseek_v32")
    cfg = parse_config(raw)
    assert {x.mixer.indexer for x in cfg.definition.layers} == {MlaIndexer(8, 16, 5)}
    no_types = {k: v for k, v in raw.items() if k != "mlp_layer_types"}
    assert parse_config({**no_types, "first_k_dense_replace": 2}).moe.sparse_layers == (2,)
    assert unsupported_features(cfg.definition) == ["DeepSeek sparse attention's indexer (index_topk)"]


@pytest.mark.parametrize("fields, shared", [
    ({"indexer_types": None}, (1, 3)),  # from index_topk_pattern "FSFS"
    ({"indexer_types": None, "index_topk_pattern": ["full", "full", "shared", "full"]}, (2,)),
    ({"indexer_types": None, "index_topk_pattern": None}, ()),  # freq 1: every layer full
    ({"indexer_types": None, "index_topk_pattern": None, "index_topk_freq": 2, "index_skip_topk_offset": 2}, (2,)),
])
def test_glm_moe_dsa_derives_its_indexer_types_as_transformers_does(fields, shared):
    """GLM-5: indexer_types, else index_topk_pattern, else index_topk_freq / index_skip_topk_offset (layer i full
    when max(i - offset + 1, 0) % freq == 0: with freq 2 and offset 2, layers 0, 1, 3 full)."""
    transformers = pytest.importorskip("transformers")
    raw = {**raw_config("glm_moe_dsa"), **fields}
    raw = {k: v for k, v in raw.items() if v is not None}
    got = tuple(i for i, x in enumerate(parse_config(raw).definition.layers) if x.mixer.indexer.shared)
    assert got == shared
    hf = transformers.GlmMoeDsaConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
    assert tuple(i for i, t in enumerate(hf.indexer_types) if t == "shared") == shared


def test_kimi_k2_reads_as_deepseek_v3():
    a = parse_config(raw_config("deepseek_v3")).definition
    b = parse_config({**raw_config("deepseek_v3"), "model_type": "kimi_k2"}).definition
    assert a.layers == b.layers and b.family == "kimi_k2"


def test_defaults_and_null_q_lora():
    """q_lora_rank null means q_proj; Hub-style configs (4.x rope_scaling with `type`) read alike."""
    raw = raw_config("deepseek_v3")
    rope = raw.pop("rope_parameters")
    legacy = {**raw, "rope_theta": rope.pop("rope_theta"), "rope_scaling": {**rope, "type": rope.pop("rope_type")}}
    a, b = parse_config(raw_config("deepseek_v3")).definition, parse_config(legacy).definition
    assert a.layers == b.layers
    no_q_lora = parse_config({**raw_config("deepseek_v3"), "q_lora_rank": None})
    assert no_q_lora.definition.layers[0].mixer.q_lora_rank is None


# -- the CUDA engine ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_the_cuda_engine_takes_these_families(name):
    """Latent attention and the grouped routers run on the CUDA engine: nothing is refused (before CuPy is looked
    for, on any machine); a latent size the kernels cannot take is refused by name."""
    import dataclasses

    from metrale_cli.backends.cuda.loading import check_sizes, unsupported_features

    cfg = load_config(FIXTURES / name)
    assert unsupported_features(cfg.definition) == []
    check_sizes(cfg)  # the fixtures' head_dim 8 is no attention kernel's, and no attention layer asks for one
    if name != "glm4_moe":
        layer = cfg.definition.layers[0]
        big = dataclasses.replace(layer.mixer, kv_lora_rank=1024)
        cfg.__dict__["definition"] = dataclasses.replace(
            cfg.definition, layers=(dataclasses.replace(layer, mixer=big),) + cfg.definition.layers[1:])
        with pytest.raises(DeviceError, match="the CUDA mla kernels do not take kv_lora_rank 1024"):
            check_sizes(cfg)


def test_tensor_parallelism_refuses_latent_attention():
    from metrale_cli.parallel.sharding import check_tp

    for n in (1, 2):
        with pytest.raises(UsageError, match="layers of kind 'mla' have no tensor-parallel split"):
            check_tp(load_config(FIXTURES / "deepseek_v3").definition, n)


# -- the CLI -----------------------------------------------------------------------------------------------------

def test_mla_option_picks_the_algebra(run_cli):
    rng = np.random.default_rng()
    tokens = ",".join(str(t) for t in rng.integers(0, 300, 9))
    out = {}
    for form in ("naive", "absorbed"):
        r = run_cli("forward", "-m", "tests/fixtures/models/deepseek_v2", "--tokens", tokens, "--rows", "all",
                    "--mla", form, "-f", "json")
        assert r.exit_code == 0, r.stderr
        out[form] = json.loads(r.stdout)["rows"]
    logits = np.array([[x["logit"] for x in out[f]] for f in out])  # each row's largest logit
    assert np.abs(logits[0] - logits[1]).max() <= 1e-4 * np.abs(logits).max()
    same = [x["argmax"] == y["argmax"] for x, y in zip(out["naive"], out["absorbed"])]
    assert sum(same) >= len(same) - 1  # a differing argmax only at a near tie of the top two (fp32 rounding)
    r = run_cli("verify", "-m", "tests/fixtures/models/deepseek_v3", "--tokens", tokens, "--mla", "sideways")
    assert r.exit_code == 2 and "--mla must be one of naive, absorbed" in r.stderr


def test_layer_dump_holds_the_normed_latent(run_cli, tmp_path):
    from safetensors.numpy import load_file

    path = tmp_path / "layers.safetensors"
    r = run_cli("forward", "-m", "tests/fixtures/models/deepseek_v3", "--tokens", "5 17 42 8",
                "--dump-layers", str(path), "--rows", "all", "--mla", "absorbed")
    assert r.exit_code == 0, r.stderr
    d = load_file(path)
    assert d["model.layers.1.self_attn.kv_a_layernorm"].shape == (4, 32)
    assert {"model.layers.0.self_attn", "model.layers.1.mlp.gate.top_k_index"} <= set(d)


def test_inspect_shows_latent_attention_and_the_unrun_mtp_layers(run_cli):
    r = run_cli("inspect", "tests/fixtures/models/deepseek_v3", "-f", "json")
    assert r.exit_code == 0, r.stderr
    x = json.loads(r.stdout)
    assert x["latent_attention"]["cache_floats_per_token"] == 3 * (32 + 8)
    assert x["latent_attention"]["q_lora_rank"] == 48 and x["rope"]["type"] == "yarn"
    assert x["notes"] and "num_nextn_predict_layers 1" in x["notes"][0]
    assert x["experts"]["router"] == "sigmoid_biased_grouped" and x["experts"]["shared_expert_gated"] is False
    plain = run_cli("inspect", "tests/fixtures/models/glm4_moe", "-f", "plain").stdout
    assert "sigmoid with correction bias, within the best 2 of 4 groups, renormalised, times 2.5" in plain
    assert "(ungated)" in plain and "latent_attention" not in plain


def test_mtp_layer_tensors_are_ignored(tmp_path):
    """A checkpoint with its multi-token-prediction layer (model.layers.{L}...) loads and runs the same."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from metrale_cli.model import open_model

    src = FIXTURES / "deepseek_v3"
    shutil.copytree(src, tmp_path / "m")
    tensors = load_file(src / "model.safetensors")
    rng = np.random.default_rng()
    extra = {k.replace("model.layers.2.", "model.layers.3."): rng.standard_normal(v.shape).astype(v.dtype)
             for k, v in tensors.items() if k.startswith("model.layers.2.")}
    extra["model.layers.3.eh_proj.weight"] = rng.standard_normal((64, 128)).astype(np.float32)
    save_file({**tensors, **extra}, str(tmp_path / "m" / "model.safetensors"))
    a = open_model(src, device="cpu", max_context=16, fp32_logits=True).engine
    b = open_model(tmp_path / "m", device="cpu", max_context=16, fp32_logits=True).engine
    ids = [int(t) for t in rng.integers(0, 300, 6)]
    a.prefill(ids), b.prefill(ids)
    np.testing.assert_array_equal(a.copy_hidden_to_host(), b.copy_hidden_to_host())


def test_yarn_runs_through_the_cuda_engine_plumbing(monkeypatch):
    """The CUDA engine's rope takes inv_freq and the cos/sin factor from the spec: a yarn rope on an attention
    model runs through its Python side (stand-in kernels) as the NumPy engine computes it."""
    import dataclasses

    plumbing = pytest.importorskip("test_cuda_plumbing")
    from metrale_cli.models.spec import Yarn

    yarn = Yarn(factor=4.0, original_max_position_embeddings=8, attention_factor=1.2, beta_fast=8, beta_slow=1)
    real = plumbing.load_config

    def with_yarn(path, yarn=yarn):
        cfg = real(path)
        d = cfg.definition
        layers = tuple(dataclasses.replace(x, mixer=dataclasses.replace(x.mixer, rope=dataclasses.replace(
            x.mixer.rope, yarn=yarn))) for x in d.layers)
        cfg.__dict__["definition"] = dataclasses.replace(d, layers=layers)
        return cfg

    rng = np.random.default_rng()
    prompt = [int(t) for t in rng.integers(0, 300, 12)]
    monkeypatch.setattr(plumbing, "load_config", with_yarn)
    cpu = plumbing.cpu_engine("phi3")
    with plumbing.fake_engine("phi3") as gpu:
        gpu.prefill(prompt, all_logits=True), cpu.prefill(prompt, all_logits=True)
        gpu.decode(5), cpu.decode(5)
        err = plumbing.rel(plumbing.rows(gpu, gpu.decode_logits_ptr(), 1),
                           plumbing.rows(cpu, cpu.decode_logits_ptr(), 1))
    monkeypatch.setattr(plumbing, "load_config", lambda path: with_yarn(path, None))
    plain = plumbing.cpu_engine("phi3")
    plain.prefill(prompt), plain.decode(5)
    off = plumbing.rel(plumbing.rows(plain, plain.decode_logits_ptr(), 1),
                       plumbing.rows(cpu, cpu.decode_logits_ptr(), 1))
    print(f"yarn through the CUDA plumbing: {err:.2e} (without yarn: {off:.2e})")
    assert err < plumbing.TOL < off
