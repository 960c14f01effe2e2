"""Mixture-of-experts pieces on their own: config parsing and refusals, the definition's stacked params,
the checkpoint check, and the NumPy router and experts against plain per-token loops on fresh random data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from metrale_cli.backends.numpy import moe
from metrale_cli.backends.numpy import ops as np_ops
from metrale_cli.backends.numpy import routers as np_routers
from metrale_cli.backends.numpy.ops import silu
from metrale_cli.config import parse_config
from metrale_cli.engine.loop import tap_names
from metrale_cli.errors import CheckpointError, ConfigError
from metrale_cli.model import open_model
from metrale_cli.models.spec import MoeSpec
from metrale_cli.models.weights import split_param

FIXTURES = Path(__file__).parent / "fixtures" / "models"
BASE = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 80, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0}
QWEN3_MOE = {**BASE, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32}
QWEN2_MOE = {**QWEN3_MOE, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 48}
MIXTRAL = {**BASE, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}


# -- config ----------------------------------------------------------------------------------------------


def test_qwen_sparse_layer_placement():
    cfg = parse_config({**QWEN3_MOE, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert cfg.moe.sparse_layers == (1,)  # (i + 1) % 2 == 0 -> 1, 3; 3 is dense by mlp_only_layers
    assert [isinstance(layer.mlp, MoeSpec) for layer in cfg.definition.layers] == [False, True, False, False]
    assert parse_config({**QWEN3_MOE, "mlp_only_layers": [0, 1, 2, 3]}).moe is None  # every layer dense
    assert parse_config({**QWEN3_MOE, "num_experts": 0}).moe is None


def test_expert_count_key_of_both_layouts():
    """Hub configs write num_experts; transformers 5.x save_pretrained writes num_local_experts for qwen3_moe."""
    hub = parse_config(QWEN3_MOE)
    saved = {k: v for k, v in QWEN3_MOE.items() if k != "num_experts"} | {"num_local_experts": 8}
    assert parse_config(saved) == hub
    assert hub.moe.spec == MoeSpec(8, 2, 32, False, "silu", None)


def test_family_specifics():
    q2 = parse_config(QWEN2_MOE)
    assert q2.moe.spec.shared_expert_size == 48 and q2.attention_bias and not q2.o_proj_bias
    assert not parse_config({**QWEN2_MOE, "qkv_bias": False}).attention_bias
    mx = parse_config(MIXTRAL)
    assert mx.moe.spec == MoeSpec(8, 2, 80, True, "silu", None)  # experts of intermediate_size, renormalised
    assert mx.moe.sparse_layers == (0, 1, 2, 3)
    assert parse_config({**MIXTRAL, "sliding_window": 4096}).sliding_window == 4096
    assert parse_config({**QWEN3_MOE, "norm_topk_prob": True}).moe.spec.norm_topk_prob


@pytest.mark.parametrize("raw, field", [
    ({**QWEN3_MOE, "scoring_func": "sigmoid"}, "scoring_func"),
    ({**QWEN3_MOE, "n_group": 8, "topk_group": 4}, "n_group"),
    ({**QWEN2_MOE, "topk_method": "noaux_tc"}, "topk_method"),
    ({**MIXTRAL, "routed_scaling_factor": 2.5}, "routed_scaling_factor"),
    ({**MIXTRAL, "router_bias": True}, "router_bias"),
    ({**QWEN3_MOE, "num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({**QWEN3_MOE, "moe_intermediate_size": 0}, "moe_intermediate_size"),
    ({**QWEN3_MOE, "decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({**QWEN3_MOE, "mlp_only_layers": ["1"]}, "mlp_only_layers"),
    ({**QWEN2_MOE, "shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
    ({**MIXTRAL, "num_local_experts": -1}, "num_local_experts"),
    ({k: v for k, v in MIXTRAL.items() if k != "rope_theta"}, "rope_theta"),
    ({**MIXTRAL, "hidden_act": "gelu"}, "hidden_act"),
])
def test_unimplemented_routing_is_refused_with_the_field_named(raw, field):
    with pytest.raises(ConfigError, match=field):
        parse_config(raw)


def test_neutral_values_of_other_routing_options_are_accepted():
    cfg = parse_config({**QWEN3_MOE, "scoring_func": "softmax", "n_group": 1, "routed_scaling_factor": 1.0,
                        "router_jitter_noise": 0.1})  # jitter only applies in training
    assert cfg.moe.spec.top_k == 2


# -- the definition --------------------------------------------------------------------------------------


def test_stacked_params_and_their_inverse():
    cfg = parse_config(QWEN2_MOE)
    layer = cfg.definition.layers[0]
    p = {q.key: q for q in layer.params}
    assert p["experts_gate_up"].shape == (8, 64, 64) and p["experts_down"].shape == (8, 64, 32)
    assert p["router"].shape == (9, 64)  # 8 experts + the shared expert's gate row
    assert p["experts_gate_up"].parts[2].name == "model.layers.0.mlp.experts.1.gate_proj.weight"
    value = np.random.default_rng().standard_normal(p["experts_gate_up"].shape).astype(np.float32)
    parts = split_param(p["experts_gate_up"], value)
    np.testing.assert_array_equal(parts["model.layers.0.mlp.experts.5.up_proj.weight"], value[5, 32:])
    # parameter count: every expert, the router, the shared expert and its gate
    per_layer_moe = 8 * 3 * 32 * 64 + 8 * 64 + 3 * 48 * 64 + 64
    dense = parse_config({**BASE, "model_type": "qwen2"}).parameter_count()
    assert cfg.parameter_count() == dense + 4 * (per_layer_moe - 3 * 80 * 64)


def test_router_taps_are_named_in_forward_order():
    names = tap_names(parse_config({**QWEN3_MOE, "mlp_only_layers": [0]}).definition)
    assert names[1:3] == ["model.layers.0.self_attn", "model.layers.0.mlp"]
    assert names[4:9] == ["model.layers.1.self_attn", "model.layers.1.mlp.gate", "model.layers.1.mlp.gate.top_k_index",
                          "model.layers.1.mlp.gate.top_k_weights", "model.layers.1.mlp"]


# -- checkpoints -----------------------------------------------------------------------------------------


def _copy(name: str, tmp_path: Path) -> Path:
    d = tmp_path / name
    shutil.copytree(FIXTURES / name, d)
    return d


def _rewrite(path: Path, change) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors")


def test_missing_expert_is_named(tmp_path):
    d = _copy("mixtral", tmp_path)
    _rewrite(d, lambda t: t.pop("model.layers.1.block_sparse_moe.experts.6.w3.weight"))
    with pytest.raises(CheckpointError, match=r"missing 1: model\.layers\.1\.block_sparse_moe\.experts\.6\.w3\.weight"):
        open_model(d, device="cpu", max_context=16)


def test_router_bias_is_refused_as_unexpected(tmp_path):
    d = _copy("qwen3_moe", tmp_path)
    _rewrite(d, lambda t: t.__setitem__("model.layers.0.mlp.gate.bias", np.zeros(16, np.float32)))
    with pytest.raises(CheckpointError, match=r"unexpected 1: model\.layers\.0\.mlp\.gate\.bias"):
        open_model(d, device="cpu", max_context=16)


def test_fused_expert_layout_is_refused(tmp_path):
    """transformers' in-memory layout (save_pretrained(save_original_format=False)): one [E, 2I, H] tensor."""
    d = _copy("qwen3_moe", tmp_path)

    def fuse(t):
        p = "model.layers.0.mlp.experts."
        t[p + "gate_up_proj"] = np.stack([np.concatenate([t.pop(f"{p}{e}.gate_proj.weight"),
                                                          t.pop(f"{p}{e}.up_proj.weight")]) for e in range(16)])
    _rewrite(d, fuse)
    with pytest.raises(CheckpointError, match=r"missing 32: .*unexpected 1: model\.layers\.0\.mlp\.experts\.gate_up_proj"):
        open_model(d, device="cpu", max_context=16)


# -- the NumPy router and experts against per-token loops ------------------------------------------------


def _naive(h, w_router, w_gate_up, w_down, spec):
    """Per token: softmax in float64, sorted choice, weighted sum of the experts (float64 throughout)."""
    h, w_router, w_gate_up, w_down = (np.asarray(a, np.float64) for a in (h, w_router, w_gate_up, w_down))
    y = np.zeros_like(h)
    chosen = []
    for t in range(h.shape[0]):
        logits = w_router[:spec.num_experts] @ h[t]
        p = np.exp(logits - logits.max())
        p /= p.sum()
        idx = sorted(range(spec.num_experts), key=lambda e: (-p[e], e))[:spec.top_k]
        wt = p[idx] / (p[idx].sum() if spec.norm_topk_prob else 1.0)
        chosen.append(idx)
        for e, we in zip(idx, wt):
            gu = w_gate_up[e] @ h[t]
            i = len(gu) // 2
            a = gu[:i] / (1 + np.exp(-gu[:i])) * gu[i:]
            y[t] += we * (w_down[e] @ a)
    return np.array(chosen), y


@pytest.mark.parametrize("experts, k, norm", [(8, 2, False), (8, 8, True), (16, 4, True), (60, 4, False)])
def test_router_and_experts_match_a_per_token_loop(experts, k, norm):
    rng = np.random.default_rng()
    spec = MoeSpec(experts, k, 24, norm)
    t, hdim = 37, 32
    h = rng.standard_normal((t, hdim)).astype(np.float32)
    w_router = (rng.standard_normal((experts, hdim)) / np.sqrt(hdim)).astype(np.float32)
    w_gate_up = (rng.standard_normal((experts, 48, hdim)) / np.sqrt(hdim)).astype(np.float32)
    w_down = (rng.standard_normal((experts, hdim, 24)) / np.sqrt(24)).astype(np.float32)
    r = moe.route(h, w_router, spec)
    chosen, y_ref = _naive(h, w_router, w_gate_up, w_down, spec)
    np.testing.assert_array_equal(r.top_k_index, chosen)
    sums = r.top_k_weights.sum(axis=-1)
    assert np.allclose(sums, 1.0, atol=1e-6) if norm or k == experts else np.all(sums < 1.0)
    y = moe.experts(h, r, w_gate_up, w_down, np_ops.glu('silu'))
    assert np.max(np.abs(y - y_ref)) / np.max(np.abs(y_ref)) <= 1e-5


def test_ties_go_to_the_lowest_expert_index():
    probs = np.array([[0.1, 0.3, 0.1, 0.3, 0.3, 0.0], [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]], np.float32)
    np.testing.assert_array_equal(np_routers.top_k(probs, 2), [[1, 3], [0, 1]])
    np.testing.assert_array_equal(np_routers.top_k(probs, 4), [[1, 3, 4, 0], [0, 1, 2, 3]])
    # equal router logits: every expert equally likely, the first k are chosen
    spec = MoeSpec(8, 3, 4, True)
    r = moe.route(np.ones((2, 4), np.float32), np.ones((8, 4), np.float32), spec)
    np.testing.assert_array_equal(r.top_k_index, [[0, 1, 2], [0, 1, 2]])
    np.testing.assert_allclose(r.top_k_weights, 1 / 3, rtol=1e-6)


def test_ties_differ_from_torch_topk_only_in_which_tied_expert():
    """The issue asked whether torch.topk on CPU breaks ties by the lowest index, as metrale does.  It does not: its
    partial sort returns tied experts in no fixed order (top-2 of [0.1, 0.3, 0.1, 0.3, 0.3, 0] is experts 1, 4 in
    torch 2.13, 1, 3 in metrale).  metrale keeps the lowest index (deterministic, the same on both engines);
    against torch the chosen probabilities are the same, in the same order, so only which of exactly tied experts
    is taken may differ (measure zero with real or random weights)."""
    torch = pytest.importorskip("torch")
    q = np.random.default_rng().integers(0, 4, (200, 128)).astype(np.float32)  # exact ties everywhere
    ours = np_routers.top_k(q, 8)
    theirs = torch.topk(torch.from_numpy(q), 8).indices.numpy()
    np.testing.assert_array_equal(np.take_along_axis(q, ours, -1), np.take_along_axis(q, theirs, -1))
    np.testing.assert_array_equal(ours, np.argsort(-q, axis=-1, kind="stable")[:, :8])  # lowest index first


def test_softmax_matches_torch():
    torch = pytest.importorskip("torch")
    x = (np.random.default_rng().standard_normal((50, 128)) * 4).astype(np.float32)
    ref = torch.softmax(torch.from_numpy(x), dim=-1, dtype=torch.float).numpy()
    np.testing.assert_allclose(np_ops.softmax(x), ref, rtol=2e-6, atol=0)  # a few ulps of each probability



# -- inspect and the CLI ---------------------------------------------------------------------------------


def test_inspect_shows_experts_and_routing(run_cli):
    r = run_cli("inspect", "tests/fixtures/models/qwen3_moe", "-f", "json")
    assert r.exit_code == 0, r.stderr
    x = json.loads(r.stdout)["experts"]
    assert x["count"] == 16 and x["top_k"] == 8 and x["intermediate"] == 40 and x["norm_topk_prob"] is True
    assert x["sparse_layers"] == [0, 2] and x["shared_expert_intermediate"] is None
    assert x["active_parameters"] == json.loads(r.stdout)["parameters"] - 2 * 8 * 3 * 40 * 64
    plain = run_cli("inspect", "tests/fixtures/models/qwen2_moe", "-f", "plain").stdout
    assert ("experts: 8 of intermediate 40, top-2 (softmax in fp32, not renormalised) + a shared expert of "
            "intermediate 56 (sigmoid gate); sparse layers all 2;") in plain
    plain = run_cli("inspect", "tests/fixtures/models/qwen3_moe", "-f", "plain").stdout
    assert "sparse layers 0, 2 (dense: 1); 234,576 active parameters per token" in plain
    dense = json.loads(run_cli("inspect", "tests/fixtures/models/llama", "-f", "json").stdout)
    assert dense["experts"] is None


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_decode_runs_from_the_cli(run_cli, name):
    r = run_cli("decode", "-m", f"tests/fixtures/models/{name}", "--tokens", "1,2,3", "-n", "4", "-f", "json")
    assert r.exit_code == 0, r.stderr
    assert len(json.loads(r.stdout)["steps"]) == 4


@pytest.mark.parametrize("raw, why", [
    ({**QWEN3_MOE, "num_experts": 1100}, "1100 experts \\(the router kernels take at most 1024\\)"),
    ({**QWEN3_MOE, "num_experts": 64, "num_experts_per_tok": 20}, "num_experts_per_tok 20"),
    ({**QWEN3_MOE, "moe_intermediate_size": 36}, "expert size 36"),
    ({**QWEN2_MOE, "shared_expert_intermediate_size": 44}, "expert size 44"),
])
def test_cuda_engine_refuses_sizes_its_moe_kernels_do_not_take(raw, why, monkeypatch):
    """No GPU needed: the refusal comes before CuPy is imported (past the gate of the unverified kernels)."""
    from metrale_cli.backends.cuda.loading import UNVERIFIED_ENV, load_cuda_engine
    from metrale_cli.errors import DeviceError
    from metrale_cli.random_weights import RandomTensors

    cfg = parse_config(raw)
    monkeypatch.setenv(UNVERIFIED_ENV, "1")
    with pytest.raises(DeviceError, match=f"the CUDA MoE kernels do not take .*{why}"):
        load_cuda_engine(cfg, RandomTensors(cfg), 16)


@pytest.mark.parametrize("experts, top_k", [(512, 10), (1024, 16)])
def test_cuda_engine_takes_up_to_1024_experts(experts, top_k, monkeypatch):
    """Qwen3-Next's 512 experts, top-10, up to the router kernels' bound: gated as unverified until their GPU tests
    pass (loading.UNVERIFIED), then past the MoE kernels' checks the tiny config is refused for its head_dim (the next
    check), before CuPy is imported."""
    from metrale_cli.backends.cuda import loading
    from metrale_cli.errors import DeviceError
    from metrale_cli.random_weights import RandomTensors

    cfg = parse_config({**QWEN3_MOE, "num_experts": experts, "num_experts_per_tok": top_k})
    assert loading.unverified_features(cfg.definition) == ["MoE route kernels over more than 256 experts"]
    assert loading.unverified_features(parse_config({**QWEN3_MOE, "num_experts": 256}).definition) == []
    monkeypatch.delenv(loading.UNVERIFIED_ENV, raising=False)
    with pytest.raises(DeviceError, match="more than 256 experts have not passed their GPU tests"):
        loading.load_cuda_engine(cfg, RandomTensors(cfg), 16)
    monkeypatch.setenv(loading.UNVERIFIED_ENV, "1")
    with pytest.raises(DeviceError, match="head_dim 16 is not supported"):
        loading.load_cuda_engine(cfg, RandomTensors(cfg), 16)


def test_the_route_kernels_take_the_fewest_slots_that_hold_the_experts():
    """A lane holds NS of a row's logits (moe.cu's moe_choose_row): the instance of a launch is the smallest of
    MOE_SLOTS with 32 NS >= E, so a model with up to 256 experts keeps the instances it had before 512 fit."""
    from metrale_cli.backends.cuda.kernels import moe as k

    assert [k.route_name(e) for e in (8, 32, 33, 128, 160, 256, 257, 512, 513, 1024)] == [
        f"moe_route_kernel<{ns}>" for ns in (1, 1, 4, 4, 8, 8, 16, 16, 32, 32)]
    assert k.topk_rows_name(512) == "moe_topk_rows_kernel<16>"
    assert k.MOE_MAX_EXPERTS == 1024 and set(map(k.route_name, range(1, 1025))) <= set(k.name_expressions())
    assert k.route_smem(16, 1025) == 16 * 1025 * 4  # opted in at load: more than the default 48 KiB


def test_nonfinite_search_names_the_router():
    from metrale_cli.engine.observe import NonFinite

    hit = NonFinite("model.layers.2.mlp.gate", 1, 3, 0)
    assert "(layer 2 router logits)" in hit.describe([5, 6])
    assert "(layer 2 router top k weights)" in NonFinite("model.layers.2.mlp.gate.top_k_weights", 0, 1, 0).describe([5])


# -- bench -----------------------------------------------------------------------------------------------


def test_bench_floor_counts_only_the_chosen_experts(tmp_path):
    from metrale_cli.bench import run_bench

    raw = {**QWEN2_MOE, "num_experts": 16, "num_experts_per_tok": 4, "mlp_only_layers": [1]}
    (tmp_path / "tiny-moe.json").write_text(json.dumps(raw))
    r = run_bench(str(tmp_path / "tiny-moe.json"), device="cpu", context=16, ks=(4,), prefill_tokens=16, repeats=2)
    # one row chooses exactly top_k of the experts in each sparse layer
    assert r.get("experts read by the decode step").value == pytest.approx(100 * 4 / 16)
    share = r.get("experts read by the verify k=4").value
    assert 100 * 4 / 16 <= share <= 100  # the union of 4 rows' choices
    assert r.get("verify k=4 floor").value >= r.get("decode floor").value
    # below the floor of reading every weight (streamed_bytes counts all experts), in ms
    assert r.get("decode floor").value < (r.streamed_bytes + r.kv_bytes) / (r.get("read bandwidth").value * 1e9) * 1e3
    assert r.get("decode step").target == "<= 1.3 x floor"


def test_moe_presets_parse_to_their_published_sizes():
    from metrale_cli.bench import preset_path
    from metrale_cli.config import load_config

    q = load_config(preset_path("qwen3-30b-a3b"))
    assert q.moe.spec == MoeSpec(128, 8, 768, True, "silu", None) and len(q.moe.sparse_layers) == 48
    assert round(q.parameter_count() / 1e9, 1) == 30.5
    m = load_config(preset_path("mixtral-8x7b"))
    assert m.moe.spec == MoeSpec(8, 2, 14336, True, "silu", None)
    assert round(m.parameter_count() / 1e9, 1) == 46.7


def test_moe_kernel_source_is_common_cu_then_moe_cu():
    """The MoE module's NVRTC source (no GPU needed): the shared helpers, then every MoE kernel, with the
    standalone-nvcc instances left to nvcc (METRALE_NVRTC) and one name per compiled instance."""
    from metrale_cli.backends.cuda.kernels.moe import module_source, name_expressions

    src = module_source()
    assert src.index("METRALE_COMMON_CU") < src.index("moe_route_kernel")
    lines = [ln.strip() for ln in src.splitlines()]
    assert not any(ln.startswith("#include \"") for ln in lines) and "#ifndef METRALE_NVRTC" in src
    for conversions in ("METRALE_E4M3_CU", "METRALE_E2M1_CU"):  # e4m3.cu's and e2m1.cu's conversions, then moe.cu
        assert src.index(conversions) < src.index("struct MoeBf16") < src.index("moe_gate_up_kernel(")
    for name in name_expressions():
        assert name.split("<")[0] in src
    # route and top-k rows for 5 slot counts; gate_up and down for bf16, FP8 and MXFP4 experts, 5 row bounds each;
    # MXFP4's prefill dequantization
    assert len(set(name_expressions())) == 10 + 31


def test_moe_py_constants_match_moe_cu():
    """The launch geometry the host assumes is the one moe.cu compiles (a mismatch reads out of bounds)."""
    import re

    from metrale_cli.backends.cuda.kernels import moe

    defines = dict(re.findall(r"^#define (MOE_\w+) (\d+)", moe.module_source(), re.M))
    for name in ("MOE_MAX_EXPERTS", "MOE_MAX_ROWS", "MOE_MAX_K", "MOE_DOWN_WARPS", "MOE_DOWN_ITEMS", "MOE_TOPK_WARPS"):
        assert int(defines[name]) == getattr(moe, name), name
    # each experts weight format's policy: the weights a 16-byte chunk holds (the wrappers' size checks) and its scales
    policies = dict(re.findall(r"struct (Moe\w+) \{\s*static constexpr int V = (\d+)", moe.module_source()))
    scales = dict(re.findall(r"struct (Moe\w+) \{.*?typedef (\w+(?: \w+)?) Scale;", moe.module_source(), re.S))
    assert set(policies) == {f.policy for f in moe.EXPERT_FORMATS.values()}
    for f in moe.EXPERT_FORMATS.values():
        assert int(policies[f.policy]) == f.chunk, f.policy
        assert f.scale is None or scales[f.policy] == {"float32": "float", "uint8": "unsigned char"}[f.scale], f.policy


# -- the CUDA prefill's layout of (token, expert) pairs (pure host code, checked here without a GPU) -----


@pytest.mark.parametrize("t, k, experts, skew", [(1, 2, 8, 0), (37, 2, 8, 0), (200, 8, 128, 0), (64, 4, 60, 0),
                                                 (300, 4, 16, 3)])
def test_expert_groups_place_every_pair_once_in_its_experts_rows(t, k, experts, skew):
    """skew > 0 makes a few experts popular, so some of them overflow the main block."""
    from metrale_cli.backends.cuda.moe_passes import ExpertGroups

    rng = np.random.default_rng()
    p = np.exp(skew * rng.standard_normal(experts))
    idx = np.stack([rng.choice(experts, k, replace=False, p=p / p.sum()) for _ in range(t)])
    g = ExpertGroups(idx, experts)
    rows = g.row_of_pair.reshape(t, k)
    assert len(set(rows.ravel().tolist())) == t * k and rows.max() < g.total  # one row per pair
    counts = np.bincount(idx.ravel(), minlength=experts)
    chosen = counts[counts > 0]
    assert g.rows % 8 == 0 and np.sum(chosen > g.rows) <= 0.1 * len(chosen) + 1  # the 90th percentile
    over = {ex: (first, n) for first, n, ex in g.overflow}
    assert sorted(over) == [e for e in range(experts) if counts[e] > g.rows]
    main = experts * g.rows
    for ex in range(experts):
        toks = [tt for tt in range(t) if ex in idx[tt]]  # increasing: the sort is stable
        n_main = min(len(toks), g.rows)
        lo = ex * g.rows
        assert list(g.source[lo:lo + n_main]) == toks[:n_main]
        assert not g.source[lo + n_main:lo + g.rows].any()  # padding reads token 0
        if ex in over:
            first, n = over[ex]
            assert first >= main and n == len(toks) - g.rows and list(g.source[first:first + n]) == toks[g.rows:]
        for tt in toks:
            r = rows[tt, list(idx[tt]).index(ex)]
            assert g.source[r] == tt and (lo <= r < lo + g.rows or (ex in over and r >= main))
    assert g.total == main + sum(n for _, n, _ in g.overflow)


def test_expert_groups_of_a_tensor_parallel_rank():
    """PrefillMoe on a rank holding experts [lo, hi): pairs keep their local index, every other pair goes to
    the extra expert hi - lo, whose rows no GEMM computes (used(hi - lo) leaves it out)."""
    from metrale_cli.backends.cuda.moe_passes import ExpertGroups

    rng = np.random.default_rng()
    experts, k, t, lo, hi = 16, 4, 50, 4, 8
    idx = np.stack([rng.choice(experts, k, replace=False) for _ in range(t)])
    local = np.where((idx >= lo) & (idx < hi), idx - lo, hi - lo)
    g = ExpertGroups(local, hi - lo + 1)
    used = g.used(hi - lo)
    assert [e for e, _ in used] == sorted(set((idx[(idx >= lo) & (idx < hi)] - lo).tolist()))
    assert all(n == min(int(np.sum(idx == e + lo)), g.rows) for e, n in used)
    assert len(g.used()) == len(used) + 1  # the others' pairs, grouped as one more expert


def test_moe_kernels_compile_with_nvcc(tmp_path):
    """moe.cu with every template instance the runtime asks NVRTC for compiles with nvcc (sm_90, PTX; skipped
    without nvcc): the route kernel's norm offset ((1 + w) norms, qwen3_next) changed its signature."""
    import re
    import subprocess

    from metrale_cli.backends.cuda.kernels.moe import module_source, name_expressions

    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").is_file() else None)
    if nvcc is None:
        pytest.skip("nvcc not found")
    table = ",\n".join(f"    (void*)&{n}" for n in name_expressions())
    src = tmp_path / "moe_module.cu"
    src.write_text(module_source() + f"\nvoid* const metrale_instances[] = {{\n{table}\n}};\n")
    r = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-ptx", "-o", str(tmp_path / "m.ptx"), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    entries = re.findall(r"^\s*(?:\.visible\s+)?\.entry\s+(\w+)", (tmp_path / "m.ptx").read_text(), re.M)
    assert len(entries) == len(name_expressions())
