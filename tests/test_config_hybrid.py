"""Hybrid linear / full attention configs (qwen3_next, qwen3_5*): both transformers layouts mean the same
definition, every field metrale does not implement is refused by name, and each feature of the block
matters (turning it off changes the logits of the fixture)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from metrale_cli.config import parse_config
from metrale_cli.errors import ConfigError
from metrale_cli.model import open_model
from metrale_cli.models.spec import LinearAttentionSpec

FIXTURES = Path(__file__).parent / "fixtures" / "models"
BASE = {"model_type": "qwen3_next", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 80,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 24, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 40,
        "shared_expert_intermediate_size": 56}


def test_4x_and_5x_layouts_mean_the_same():
    v5 = parse_config({**BASE, "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
                       + ["full_attention"], "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                                 "partial_rotary_factor": 0.25}})
    v4 = parse_config({**BASE, "full_attention_interval": 4, "rope_theta": 1e6, "partial_rotary_factor": 0.25,
                       "rope_scaling": None})
    assert v4.definition == v5.definition
    kinds = [layer.mixer.kind for layer in v4.definition.layers]
    assert kinds == ["linear_attention"] * 3 + ["attention"] + ["linear_attention"] * 3 + ["attention"]
    full = v4.definition.layers[3].mixer
    assert full.rope.dims == 8 and full.output_gate and full.qk_norm  # partial rotary 0.25 of head_dim 32
    assert v4.moe.spec.norm_topk_prob and v4.moe.spec.shared_expert_size == 56  # qwen3_next's defaults


def test_transformers_defaults_fill_what_a_config_leaves_out():
    cfg = parse_config({k: v for k, v in BASE.items() if not k.startswith("linear_") and k != "head_dim"})
    lin = cfg.definition.layers[0].mixer
    assert isinstance(lin, LinearAttentionSpec)
    assert (lin.num_k_heads, lin.num_v_heads, lin.k_head_dim, lin.v_head_dim, lin.conv_kernel) == (16, 32, 128, 128, 4)
    assert cfg.head_dim == 256 and cfg.definition.layers[3].mixer.rope.dims == 64


@pytest.mark.parametrize("change,field", [
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"layer_types": ["linear_attention", "sliding_attention"] * 4}, "layer_types"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_parameters.rope_type"),
    ({"partial_rotary_factor": 0.1}, "partial_rotary_factor"),
    ({"scoring_func": "sigmoid"}, "scoring_func"),
])
def test_what_is_not_implemented_is_refused_by_name(change, field):
    with pytest.raises(ConfigError, match=f"unsupported {field} "):
        parse_config({**BASE, **change})


@pytest.mark.parametrize("change,field", [({"norm_topk_prob": False}, "norm_topk_prob"),
                                          ({"mlp_only_layers": [1]}, "mlp_only_layers"),
                                          ({"decoder_sparse_step": 2}, "decoder_sparse_step")])
def test_qwen3_5_moe_refuses_what_transformers_ignores(change, field):
    with pytest.raises(ConfigError, match=f"unsupported {field} "):
        parse_config({**BASE, "model_type": "qwen3_5_moe_text", **change})


def test_qwen3_5_multimodal_reads_its_text_config():
    raw = json.loads((FIXTURES / "qwen3_5" / "config.json").read_text())
    cfg = parse_config(raw)
    assert raw["model_type"] == "qwen3_5" and "text_config" in raw
    names = [t.name for p in cfg.definition.params() for t in p.parts]
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in names
    assert not cfg.definition.layers[0].mixer.grouped and cfg.moe is None
    sparse = parse_config({**BASE, "model_type": "qwen3_5_moe_text"})
    assert sparse.moe.sparse_layers == tuple(range(8)) and sparse.moe.spec.norm_topk_prob


def _logits(name: str, tokens, change=None) -> np.ndarray:
    e = open_model(FIXTURES / name, device="cpu", max_context=80, fp32_logits=True).engine
    if change is not None:
        d = e.cfg.definition
        e.cfg.__dict__["definition"] = dataclasses.replace(d, layers=tuple(change(layer) for layer in d.layers))
    e.prefill(tokens)
    buf = bytearray(e.row_nbytes(e.logits_buffer_ptr()))
    e.copy_logits_to_host(e.logits_buffer_ptr(), buf)
    return np.frombuffer(buf, np.float32)


@pytest.mark.parametrize("feature", ["output_gate", "grouped", "norm_offset", "partial_rotary"])
def test_each_feature_matters(feature, monkeypatch):
    rng = np.random.default_rng()
    tokens = [int(t) for t in rng.integers(0, 300, 70)]
    base = _logits("qwen3_next", tokens)

    def change(layer):
        m = layer.mixer
        if feature == "grouped" and m.kind == "linear_attention":  # read in_proj_qkvz as if flat
            return dataclasses.replace(layer, mixer=dataclasses.replace(m, grouped=False))
        if feature == "norm_offset":
            return dataclasses.replace(layer, norm=dataclasses.replace(layer.norm, offset=0.0))
        if feature == "partial_rotary" and m.kind == "attention":  # rotate 16 of 32 dims instead of 8
            return dataclasses.replace(layer, mixer=dataclasses.replace(m, rope=dataclasses.replace(m.rope, rotary_dim=16)))
        return layer

    if feature == "output_gate":  # the gate multiplies by 1 instead of sigmoid(gate)
        from metrale_cli.backends.numpy import attention

        monkeypatch.setattr(attention.AttentionOps, "output_gate", lambda self, y, qkv, a: y)
        changed = _logits("qwen3_next", tokens)
    else:
        changed = _logits("qwen3_next", tokens, change)
    assert np.abs(changed - base).max() > 1e-3 * np.abs(base).max(), feature
