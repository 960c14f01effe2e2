"""config.json of the Gemma 2 / 3 and Phi-3 families: both layouts, hub-style sparse configs, refusals."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from metrale_cli.config import parse_config
from metrale_cli.errors import ConfigError, DeviceError
from metrale_cli.models.weights import expected_tensors

S, F = "sliding_attention", "full_attention"
SHAPE = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 80, "num_hidden_layers": 6,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def windows(cfg) -> list:
    return [layer.mixer.window for layer in cfg.definition.layers]


def test_gemma2_defaults_and_layer_pattern():
    cfg = parse_config({**SHAPE, "model_type": "gemma2", "sliding_window": 8})
    assert windows(cfg) == [8, None] * 3  # even layers slide
    o, d = cfg.options, cfg.definition
    assert (o.query_pre_attn_scalar, o.attn_logit_softcapping, o.final_logit_softcapping) == (256.0, 50.0, 30.0)
    assert cfg.tie_word_embeddings and d.lm_head is None
    assert d.layers[0].mixer.scale == 256 ** -0.5 and d.layers[0].mixer.softcap == 50.0
    assert d.embed_scale == 8.0 and d.norm.offset == 1.0 and d.layers[0].mlp.activation == "gelu_tanh"
    assert {"attn_out_norm", "mlp_out_norm"} <= d.layers[0].keys()
    # an explicit null is "none", not the default
    none = parse_config({**SHAPE, "model_type": "gemma2", "final_logit_softcapping": None,
                         "attn_logit_softcapping": None})
    assert none.definition.final_logit_softcap is None and none.definition.layers[0].mixer.softcap is None


def test_gemma3_4x_and_5x_layouts_mean_the_same():
    v4 = parse_config({**SHAPE, "model_type": "gemma3_text", "torch_dtype": "bfloat16", "sliding_window": 8,
                       "rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window_pattern": 6,
                       "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    v5 = parse_config({**SHAPE, "model_type": "gemma3_text", "dtype": "bfloat16", "sliding_window": 8,
                       "layer_types": [S] * 5 + [F],
                       "rope_parameters": {F: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                           S: {"rope_type": "default", "rope_theta": 1e4}}})
    assert v4.definition == v5.definition
    layers = v5.definition.layers
    assert windows(v5) == [8] * 5 + [None]
    assert layers[0].mixer.rope.theta == 1e4 and layers[0].mixer.rope.linear_factor == 1.0
    assert layers[5].mixer.rope.theta == 1e6 and layers[5].mixer.rope.linear_factor == 8.0
    assert all(layer.mixer.qk_norm and layer.mixer.softcap is None for layer in layers)


def test_gemma3_multimodal_hub_config_reads_its_text_config_with_defaults():
    # the shape of google/gemma-3-4b-it's config.json: a sparse text_config, the rest left to defaults
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "torch_dtype": "bfloat16",
           "eos_token_id": [1, 106],
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"}}
    cfg = parse_config(raw)
    assert (cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (262208, 8, 4, 256)
    assert cfg.dtype == "bfloat16" and cfg.eos_token_ids == (1, 106) and cfg.tie_word_embeddings
    assert windows(cfg).count(None) == 5 and windows(cfg)[5] is None and windows(cfg)[0] == 1024
    full = cfg.definition.layers[5].mixer.rope
    assert (full.theta, full.linear_factor) == (1e6, 8.0)
    names = expected_tensors(cfg.definition)
    assert "language_model.model.layers.0.self_attn.q_norm.weight" in names
    assert cfg.definition.ignored_prefixes == ("vision_tower.", "multi_modal_projector.")


def test_phi3_longrope_layouts_and_attention_factor():
    short, long = [1.0] * 6, [2.0] * 6
    v4 = parse_config({**SHAPE, "model_type": "phi3", "max_position_embeddings": 131072,
                       "original_max_position_embeddings": 4096, "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                       "rope_scaling": {"type": "longrope", "short_factor": short, "long_factor": long}})
    v5 = parse_config({**SHAPE, "model_type": "phi3", "max_position_embeddings": 131072,
                       "original_max_position_embeddings": 4096,
                       "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.75,
                                           "short_factor": short, "long_factor": long}})
    assert v4.definition == v5.definition
    rope = v5.options.rope
    assert rope.dims == 12 and rope.longrope.original_max_position_embeddings == 4096
    assert rope.attention_scaling == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert not rope.uses_long(4096) and rope.uses_long(4097)
    assert (rope.inv_freq(True) * 2 == pytest.approx(rope.inv_freq(False)))  # long factors 2x the short
    su = parse_config({**SHAPE, "model_type": "phi3", "partial_rotary_factor": 0.75,
                       "rope_scaling": {"type": "su", "short_factor": short, "long_factor": long}})
    assert su.options.rope.longrope is not None  # the early name of longrope
    fused = v5.definition.layers[0].params
    assert [p.parts[0].name for p in fused if p.key in ("qkv", "gate_up")] == [
        "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"]


@pytest.mark.parametrize("raw, field", [
    ({"model_type": "gemma2", "hidden_activation": "gelu"}, "hidden_activation"),
    ({"model_type": "gemma2", "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"model_type": "gemma2", "layer_types": [S, "chunked_attention"] * 3}, "layer_types"),
    ({"model_type": "gemma2", "layer_types": [S, F]}, "layer_types"),
    ({"model_type": "gemma2", "query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
    ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"model_type": "gemma3_text", "rope_parameters": {"rope_type": "default"}}, "rope_parameters"),
    ({"model_type": "gemma3_text", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "rope_scaling.full_attention.rope_type"),
    ({"model_type": "gemma3", "text_config": {**SHAPE, "final_logit_softcapping": 30.0}},
     "text_config.final_logit_softcapping"),
    ({"model_type": "phi3", "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
    ({"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     "rope_scaling.short_factor"),
    ({"model_type": "phi3", "partial_rotary_factor": 0.5625}, "partial_rotary_factor"),  # 9 dims: odd
    ({"model_type": "phi3", "hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "mistral", "sliding_window": 0}, "sliding_window"),
])
def test_unsupported_options_are_refused_by_name(raw, field):
    with pytest.raises(ConfigError, match=f"unsupported {field} "):
        parse_config({**SHAPE, **raw} if raw["model_type"] != "gemma3" else raw)


def test_gemma3_multimodal_needs_a_text_config():
    with pytest.raises(ConfigError, match="missing required field 'text_config'"):
        parse_config({"model_type": "gemma3"})


@pytest.mark.parametrize("raw", [
    {"model_type": "gemma2"}, {"model_type": "gemma3_text"}, {"model_type": "mistral", "sliding_window": 16},
    {"model_type": "phi3", "partial_rotary_factor": 0.5},
    {"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}},
])
def test_cuda_engine_takes_every_family_feature(raw):
    from metrale_cli.backends.cuda.loading import unsupported_features

    assert unsupported_features(parse_config({**SHAPE, **raw}).definition) == []


def test_cuda_engine_refuses_a_block_it_does_not_know():
    """A weight its loop ops do not read (a family added on the CPU first; here a router in a dense layer)
    is refused by name, before CuPy is imported."""
    import dataclasses

    from metrale_cli.backends.cuda.loading import load_cuda_engine
    from metrale_cli.models.spec import Param
    from metrale_cli.random_weights import RandomTensors

    cfg = parse_config({**SHAPE, "model_type": "llama"})
    d = cfg.definition
    extra = Param.of("router", ("model.layers.0.mlp.gate.weight", (4, 64)))
    layers = (dataclasses.replace(d.layers[0], params=d.layers[0].params + (extra,)),) + d.layers[1:]
    cfg.__dict__["definition"] = dataclasses.replace(d, layers=layers)  # the cached_property's slot
    with pytest.raises(DeviceError, match="does not implement weight router"):
        load_cuda_engine(cfg, RandomTensors(cfg), 32)


def test_fixture_dirs_exist():
    root = Path(__file__).parent / "fixtures" / "models"
    for name in ("gemma2", "gemma3_text", "gemma3_text_4x", "gemma3_mm", "phi3", "phi3_longrope", "phi4_mini"):
        assert (root / name / "config.json").is_file()
