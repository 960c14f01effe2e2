"""Tensor parallelism checked on the CPU: N ranks' shards, partial sums all-reduced, equal the whole model.

Every family's fixture checkpoint, and a random model with 8 query heads and 2 KV heads so N = 2 splits
KV heads, N = 4 and 8 replicate them (N > num_key_value_heads), and a vocabulary that 8 does not divide.
Mixture-of-experts: the qwen3_moe (16 experts, top 8, a dense layer), qwen2_moe (8 experts, the gated
shared expert) and mixtral fixtures at N = 2 and 4, and a random qwen2_moe with 8 heads at N = 8 (one
expert per rank).
"""

from __future__ import annotations

import numpy as np
import pytest

from metrale_cli.errors import UsageError
from metrale_cli.model import open_model
from metrale_cli.parallel.reference import SimulatedTensorParallel
from metrale_cli.parallel.sharding import check_tp, layout

FAMILY_FIXTURES = ["llama", "llama_tied", "llama3_rope", "mistral", "qwen2", "qwen3", "llama_bf16",
                   # issue 13 (phi4_mini left out: its decode steps cross the longrope switch, where the
                   # engine recomputes its cache and the simulation does not)
                   "gemma2", "gemma3_text", "gemma3_mm", "phi3", "phi3_longrope", "mistral_window", "qwen3_window",
                   # issue 17: experts split over the ranks
                   "qwen3_moe", "qwen2_moe", "mixtral"]


def _compare(model_dir, n: int) -> float:
    m = open_model(model_dir, device="cpu", fp32_logits=True, max_context=64)
    e = m.engine
    rng = np.random.default_rng()
    prompt = rng.integers(0, m.config.vocab_size, 7).tolist()
    sim = SimulatedTensorParallel(m.config.definition, e.w, n, 64)
    e.prefill(prompt, all_logits=True)
    rows = e.logits_buffer_ptr()
    want = np.stack([np.frombuffer(_row(e, rows.row_ptr(i)), np.float32) for i in range(len(prompt))])
    got = sim.forward(prompt)
    worst = float(np.abs(got - want).max() / np.abs(want).max())
    for token in rng.integers(0, m.config.vocab_size, 3).tolist():  # decode steps: the sharded KV caches
        e.decode(token)
        want_row = np.frombuffer(_row(e, e.decode_logits_ptr()), np.float32)
        worst = max(worst, float(np.abs(sim.forward([token])[0] - want_row).max() / np.abs(want_row).max()))
    return worst


def _row(e, ptr) -> bytes:
    buf = bytearray(e.row_nbytes(ptr))
    e.copy_logits_to_host(ptr, buf)
    return bytes(buf)


@pytest.fixture
def wide_model(tmp_path, helpers):
    return helpers.random_llama(tmp_path / "wide", hidden=128, heads=8, kv_heads=2, intermediate=96, vocab=301)


def _wide_moe(dest, helpers, experts: int):
    """A random qwen2_moe: 8 query heads, 2 KV heads, `experts` experts (top 2) and a shared expert of 64
    on layers 0 and 2, layer 1 dense (mlp_only_layers)."""
    raw = {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 64,
           "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 48,
           "moe_intermediate_size": 24, "num_experts": experts, "num_experts_per_tok": 2,
           "shared_expert_intermediate_size": 64, "mlp_only_layers": [1], "decoder_sparse_step": 1,
           "norm_topk_prob": False, "qkv_bias": True, "vocab_size": 203, "max_position_embeddings": 256,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "dtype": "float32"}
    return helpers.random_checkpoint(dest, raw)


@pytest.mark.parametrize("name", FAMILY_FIXTURES)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_sharded_families_equal_the_whole_model(helpers, name, n):
    assert _compare(helpers.REPO / "tests/fixtures/models" / name, n) < 1e-5


@pytest.mark.parametrize("n", [2, 4, 8])
def test_more_ranks_than_kv_heads(wide_model, n):
    assert _compare(wide_model, n) < 1e-5


@pytest.mark.parametrize("n", [2, 8])
def test_experts_split_over_eight_ranks(tmp_path, helpers, n):
    assert _compare(_wide_moe(tmp_path / "moe", helpers, 8), n) < 1e-5


def test_expert_ranges_and_shards(helpers):
    from metrale_cli.parallel.sharding import rank_definition, shard_weights

    m = open_model(helpers.REPO / "tests/fixtures/models/qwen2_moe", device="cpu")  # 8 experts, shared 56
    d, w = m.config.definition, m.engine.w
    for r in range(4):
        spec = rank_definition(d, r, 4).layers[0].mlp
        assert (spec.num_experts, spec.held, spec.shared_expert_size) == (8, range(2 * r, 2 * r + 2), 14)
        lw = shard_weights(d, w, r, 4).layers[0]
        np.testing.assert_array_equal(lw["experts_down"], w.layers[0]["experts_down"][2 * r:2 * r + 2])
        np.testing.assert_array_equal(lw["router"], w.layers[0]["router"])  # [9, H]: replicated
        assert lw["shared_gate_up"].shape == (28, 64) and lw["shared_down"].shape == (64, 14)


def test_indivisible_experts_are_a_usage_error(tmp_path, helpers):
    cfg = open_model(_wide_moe(tmp_path / "moe", helpers, 12), device="cpu").config
    check_tp(cfg.definition, 4)
    with pytest.raises(UsageError, match="--tp 8 does not divide the 12 experts"):
        check_tp(cfg.definition, 8)


def test_kv_heads_replicated_beyond_their_count(wide_model):
    cfg = open_model(wide_model, device="cpu").config
    a = cfg.definition.layers[0].mixer
    heads = [layout(a, r, 8) for r in range(8)]
    assert [list(h.q_heads) for h in heads] == [[r] for r in range(8)]
    assert [h.kv_heads.start for h in heads] == [0, 0, 0, 0, 1, 1, 1, 1]  # query head r reads KV head r // 4


def test_indivisible_degree_is_a_usage_error(helpers):
    cfg = open_model(helpers.REPO / helpers.LLAMA, device="cpu").config  # 4 heads
    with pytest.raises(UsageError, match="num_attention_heads 4"):
        check_tp(cfg.definition, 8)
