"""What the CUDA engine does not compute yet is refused by name before anything is uploaded (exit 7 on the
CLI), read from the model definition: no family is run on the GPU with a feature its kernels lack."""

from __future__ import annotations

import pytest

from metrale_cli.backends.cuda.engine import unsupported_features
from metrale_cli.config import load_config

FIXTURES = "tests/fixtures/models"

GPU_READY = ["llama", "llama3_rope", "llama_tied", "llama_bf16", "mistral", "qwen2", "qwen3", "qwen3_moe",
             "qwen2_moe", "mixtral"]
REFUSED = {
    "gemma2": {"a scaled embedding", "final-logit softcapping", "(1 + w) RMSNorm", "sliding-window attention",
               "attention softcapping", "activation gelu_tanh", "weight attn_out_norm", "weight mlp_out_norm"},
    "gemma3_text": {"a scaled embedding", "(1 + w) RMSNorm", "sliding-window attention", "activation gelu_tanh"},
    "phi3_longrope": {"longrope"},
    "phi4_mini": {"partial rotary"},
    "mistral_window": {"sliding-window attention"},
    "qwen3_window": {"sliding-window attention"},
}


@pytest.mark.parametrize("name", GPU_READY)
def test_the_families_the_kernels_take_are_not_refused(helpers, name):
    assert unsupported_features(load_config(helpers.REPO / FIXTURES / name).definition) == []


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_each_missing_kernel_feature_is_named(helpers, name):
    found = set(unsupported_features(load_config(helpers.REPO / FIXTURES / name).definition))
    assert REFUSED[name] <= found, found


def test_the_cli_refuses_with_the_features_named(run_cli, helpers, monkeypatch):
    """Before CuPy is even looked for: the refusal reads the definition only."""
    r = run_cli("forward", "-m", f"{FIXTURES}/gemma2", "-t", "1 2 3", "--device", "cuda")
    assert r.exit_code != 0 and r.stderr.count("\n") == 1
    assert "does not implement" in r.stderr or "CuPy" in r.stderr or "GPU" in r.stderr, r.stderr
