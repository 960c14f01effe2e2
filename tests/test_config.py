"""config.json parsing: both transformers layouts, every supported family, and clear refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from metrale_cli.config import load_config, parse_config
from metrale_cli.errors import ConfigError

FIXTURES = Path(__file__).parent / "fixtures" / "models"

BASE = {
    "model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 80,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
}


def test_fixture_families():
    kinds = {p.name: load_config(p) for p in FIXTURES.iterdir()}
    assert kinds["qwen2"].attention_bias and not kinds["qwen2"].o_proj_bias
    assert kinds["qwen3"].qk_norm and kinds["qwen3"].head_dim == 24
    assert kinds["mistral"].head_dim == 32 and kinds["mistral"].q_size == 128
    assert kinds["llama_tied"].tie_word_embeddings and not kinds["llama"].tie_word_embeddings
    assert kinds["llama3_rope"].rope_scaling is not None
    assert kinds["llama_bf16"].dtype == "bfloat16"
    assert kinds["llama"].n_rep == 2


def test_4x_and_5x_layouts_mean_the_same():
    rope = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}
    v5 = parse_config({**BASE, "dtype": "bfloat16",
                       "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **rope}})
    v4 = parse_config({**BASE, "torch_dtype": "bfloat16", "rope_theta": 500000.0,
                       "rope_scaling": {"rope_type": "llama3", **rope}})
    v4_old_key = parse_config({**BASE, "torch_dtype": "bfloat16", "rope_theta": 500000.0,
                               "rope_scaling": {"type": "llama3", **rope}})
    assert v5 == v4 == v4_old_key
    assert v5.rope_theta == 500000.0 and v5.dtype == "bfloat16"


def test_llama3_scaling_changes_low_frequencies_only():
    plain = parse_config({**BASE, "rope_theta": 10000.0})
    scaled = parse_config({**BASE, "rope_theta": 10000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}})
    a, b = plain.inv_freq(), scaled.inv_freq()
    assert a[0] == b[0]  # the highest frequency is kept
    assert b[-1] == pytest.approx(a[-1] / 8, rel=1e-6)  # the lowest is divided by the factor


def test_inv_freq_matches_transformers():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = json.loads((FIXTURES / "llama3_rope" / "config.json").read_text())
    hf = LlamaConfig(**raw)
    inv, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, torch.device("cpu"))
    ours = load_config(FIXTURES / "llama3_rope").inv_freq()
    np.testing.assert_allclose(ours, inv.numpy(), rtol=1e-6)


@pytest.mark.parametrize("patch, culprit", [
    ({"model_type": "gpt2"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type"),
    ({"dtype": "float8_e4m3fn"}, "float8_e4m3fn"),
    ({"torch_dtype": "int8"}, "int8"),
    ({"hidden_size": 66}, "not divisible by num_attention_heads"),
    ({"num_key_value_heads": 3}, "not divisible by num_key_value_heads"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"num_hidden_layers": "2"}, "num_hidden_layers"),
    ({"hidden_size": True}, "hidden_size"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"head_dim": 15}, "head_dim"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
])
def test_unsupported_or_inconsistent_fields_are_refused(patch, culprit):
    with pytest.raises(ConfigError, match=culprit):
        parse_config({**BASE, **patch})


@pytest.mark.parametrize("field", ["model_type", "hidden_size", "vocab_size", "num_attention_heads",
                                   "intermediate_size", "num_hidden_layers"])
def test_missing_required_field(field):
    raw = {k: v for k, v in BASE.items() if k != field}
    with pytest.raises(ConfigError, match=f"missing required field '{field}'"):
        parse_config(raw)


def test_bad_files(tmp_path):
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{ not json")
    with pytest.raises(ConfigError, match="invalid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path)


def test_sliding_window_is_per_layer_not_a_context_bound():
    cfg = parse_config({**BASE, "model_type": "mistral", "sliding_window": 100, "max_position_embeddings": 4096})
    assert cfg.max_context == 4096  # the window is attended to, not a limit on the context
    assert [layer.mixer.window for layer in cfg.definition.layers] == [100, 100]
    q = parse_config({**BASE, "model_type": "qwen2", "sliding_window": 100, "use_sliding_window": False})
    assert q.sliding_window is None and all(layer.mixer.window is None for layer in q.definition.layers)
    # qwen: with use_sliding_window, only the layers from max_window_layers on slide (transformers 5)
    q = parse_config({**BASE, "model_type": "qwen3", "num_hidden_layers": 4, "sliding_window": 100,
                      "use_sliding_window": True, "max_window_layers": 3})
    assert [layer.mixer.window for layer in q.definition.layers] == [None, None, None, 100]
