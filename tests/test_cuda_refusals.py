"""What the CUDA engine does not compute is refused by name before anything is uploaded (a DeviceError:
exit 8 on the CLI), read from the model definition: no family is run on the GPU with a feature its
kernels lack. Every shipped family's features run in the kernels now (issue 13: Gemma 2/3, Phi-3 /
Phi-4-mini, sliding windows); what is refused is a definition the passes do not know (an unknown weight,
a gate activation the fused MLP lacks, a sparse layer with what the MoE kernels do not take)."""

from __future__ import annotations

import dataclasses

import pytest

from metrale_cli.backends.cuda.loading import load_cuda_engine, unsupported_features
from metrale_cli.config import load_config
from metrale_cli.errors import DeviceError
from metrale_cli.models.spec import MoeSpec, Norm, Param
from metrale_cli.random_weights import RandomTensors

FIXTURES = "tests/fixtures/models"

GPU_READY = ["llama", "llama3_rope", "llama_tied", "llama_bf16", "mistral", "qwen2", "qwen3", "qwen3_moe",
             "qwen2_moe", "mixtral", "gemma2", "gemma3_text", "gemma3_text_4x", "gemma3_mm", "phi3",
             "phi3_longrope", "phi4_mini", "mistral_window", "qwen3_window", "glm4_moe"]


def _cfg(helpers, name):
    return load_config(helpers.REPO / FIXTURES / name)


def _with_layer0(cfg, **changes):
    """cfg with layer 0 of its definition changed (set in the definition's cached_property slot)."""
    d = cfg.definition
    layers = (dataclasses.replace(d.layers[0], **changes),) + d.layers[1:]
    cfg.__dict__["definition"] = dataclasses.replace(d, layers=layers)
    return cfg


@pytest.mark.parametrize("name", GPU_READY)
def test_the_families_the_kernels_take_are_not_refused(helpers, name):
    assert unsupported_features(_cfg(helpers, name).definition) == []


def test_an_unknown_weight_is_refused_by_name(helpers):
    cfg = _cfg(helpers, "gemma2")
    layer = cfg.definition.layers[0]
    extra = Param.of("pre_gate_norm", ("model.layers.0.pre_gate_norm.weight", (cfg.hidden_size,)))
    cfg = _with_layer0(cfg, params=layer.params + (extra,))
    assert unsupported_features(cfg.definition) == ["weight pre_gate_norm"]
    with pytest.raises(DeviceError, match="does not implement weight pre_gate_norm yet") as e:
        load_cuda_engine(cfg, RandomTensors(cfg), 32)  # before CuPy is looked for
    assert "\n" not in str(e.value)  # the one line the CLI prints (exit 8)


def test_a_gate_activation_without_a_kernel_is_refused(helpers):
    cfg = _cfg(helpers, "llama")
    cfg = _with_layer0(cfg, mlp=dataclasses.replace(cfg.definition.layers[0].mlp, activation="relu"))
    assert unsupported_features(cfg.definition) == ["activation relu"]


def test_what_the_moe_kernels_do_not_take_is_refused(helpers):
    cfg = _cfg(helpers, "qwen3_moe")
    layer = cfg.definition.layers[0]
    assert isinstance(layer.mlp, MoeSpec)
    post = Param.of("mlp_out_norm", ("model.layers.0.post_feedforward_layernorm.weight", (cfg.hidden_size,)))
    cfg = _with_layer0(cfg, mlp=dataclasses.replace(layer.mlp, activation="gelu_tanh"),
                       norm=Norm(eps=layer.norm.eps, offset=1.0), params=layer.params + (post,))
    assert unsupported_features(cfg.definition) == [
        "mixture-of-experts activation gelu_tanh", "weight mlp_out_norm"]  # the (1 + w) norm: in the kernels



@pytest.mark.parametrize("name,head_dim", [("llama", 16), ("qwen3", 24)])
def test_a_head_dim_the_kernels_lack_is_refused_before_anything_loads(helpers, name, head_dim):
    """The attention kernels take head_dim 32, 64, 96, 128 and 256 (README: which real checkpoints that
    excludes); another is refused naming it, before CuPy is looked for or a tensor is read."""
    cfg = _cfg(helpers, name)
    assert cfg.head_dim == head_dim
    with pytest.raises(DeviceError, match=f"head_dim {head_dim} is not supported by the CUDA kernels "
                                          r"\(supported: 32, 64, 96, 128, 256\)"):
        load_cuda_engine(cfg, RandomTensors(cfg), 16)


def _linear_dims(cfg, k_head_dim):
    """cfg with every linear-attention layer's key head dim set to k_head_dim."""
    d = cfg.definition
    layers = tuple(dataclasses.replace(layer, mixer=dataclasses.replace(layer.mixer, k_head_dim=k_head_dim))
                   if layer.mixer.kind == "linear_attention" else layer for layer in d.layers)
    cfg.__dict__["definition"] = dataclasses.replace(d, layers=layers)
    return cfg


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5", "qwen3_5_moe_text"])
def test_linear_attention_runs_on_the_kernels_key_head_dims_only(helpers, name):
    """The Gated DeltaNet layers, the attention output gate and the (1 + w) norms of the sparse layers run on the
    GPU; a key head dim the recurrent kernel has no instance for (the fixtures' 16) is refused by name, before
    CuPy is looked for."""
    cfg = _cfg(helpers, name)
    assert unsupported_features(cfg.definition) == ["linear-attention key head dim 16"]
    with pytest.raises(DeviceError, match="does not implement linear-attention key head dim 16") as e:
        load_cuda_engine(cfg, RandomTensors(cfg), 32)
    assert "\n" not in str(e.value)
    for dk in (64, 128, 256):
        assert unsupported_features(_linear_dims(_cfg(helpers, name), dk).definition) == []
    assert any(getattr(layer.mixer, "output_gate", False) for layer in cfg.definition.layers)

def test_cuda_code_not_yet_run_on_a_gpu_is_refused_unless_asked(helpers, monkeypatch):
    """The gate for CUDA code that has not passed its GPU tests (loading.UNVERIFIED, empty since session 18): a model
    using an entry is refused by the entry's name unless METRALE_CUDA_UNVERIFIED=1, before anything loads."""
    from metrale_cli.backends.cuda import loading

    cfg = _linear_dims(_cfg(helpers, "qwen3_5_moe_text"), 64)  # sizes the kernels take: only the gate refuses it
    assert loading.unverified_features(cfg.definition) == []
    monkeypatch.setattr(loading, "UNVERIFIED", (("a test's new kernel", lambda d: any(
        layer.mixer.kind == "linear_attention" for layer in d.layers)),))
    assert loading.unverified_features(cfg.definition) == ["a test's new kernel"]
    monkeypatch.delenv(loading.UNVERIFIED_ENV, raising=False)
    with pytest.raises(DeviceError, match="a test's new kernel have not passed their GPU tests yet; use --device cpu"):
        load_cuda_engine(cfg, RandomTensors(cfg), 32)
    monkeypatch.setenv(loading.UNVERIFIED_ENV, "1")
    with pytest.raises(DeviceError) as e:  # past the gate: on this machine, CuPy is what is missing
        load_cuda_engine(cfg, RandomTensors(cfg), 32)
    assert "have not passed their GPU tests" not in str(e.value)


@pytest.mark.parametrize("name", ["qwen3_next", "deepseek_v3", "deepseek_v2", "glm4_moe", "gpt_oss"])
def test_the_families_that_passed_their_gpu_tests_are_not_gated(helpers, name):
    from metrale_cli.backends.cuda.loading import unverified_features

    assert unverified_features(_cfg(helpers, name).definition) == []


@pytest.mark.parametrize("name", ["gpt_oss", "gpt_oss_mxfp4"])
def test_gpt_oss_runs_on_the_kernels(helpers, name, monkeypatch):
    """Sinks, topk_softmax routing with its bias and the clamped-SwiGLU experts with biases are in the kernels (the
    fixture's head_dim 16 is what they refuse; MXFP4 experts read as stored pass the gate of unverified code here,
    tests/test_cuda_mxfp4_moe_plumbing.py tests it); --tp > 1 still refuses the sinks."""
    from metrale_cli.backends.cuda.loading import UNVERIFIED_ENV
    from metrale_cli.errors import UsageError
    from metrale_cli.parallel.sharding import check_tp

    monkeypatch.setenv(UNVERIFIED_ENV, "1")
    cfg = _cfg(helpers, name)
    assert unsupported_features(cfg.definition) == []
    with pytest.raises(DeviceError) as e:
        load_cuda_engine(cfg, RandomTensors(cfg), 32)
    assert "head_dim 16" in str(e.value)
    with pytest.raises(UsageError, match="attention sinks have no tensor-parallel split"):
        check_tp(cfg.definition, 2)

