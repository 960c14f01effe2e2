"""gpt-oss specifics beyond the goldens of tests/test_quantized_fp8.py (prefill, 32 greedy tokens, verify and
trim on both fixtures): the MXFP4 experts equal transformers' dequantization, the sinks change the result, the
layout the loader undoes (interleaved gate/up, transposed dense experts), what inspect says, and the CUDA
engine's gate on its not yet GPU-tested code."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from metrale_cli.checkpoint import Checkpoint
from metrale_cli.config import load_config
from metrale_cli.models import formats

from golden_parity import FIXTURES, engine, golden, rel_err, rows

MXFP4 = FIXTURES / "models" / "gpt_oss_mxfp4"


def test_mxfp4_experts_equal_transformers_dequantization_bit_for_bit():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers loads an MXFP4 checkpoint through it
    model = transformers.AutoModelForCausalLM.from_pretrained(
        MXFP4, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True))
    state = model.state_dict()
    cfg = load_config(MXFP4)
    compared = 0
    with Checkpoint.open(MXFP4) as ckpt:
        for p in cfg.definition.params():
            if p.format == "mxfp4":
                (mine,) = formats.dequantize(p, lambda n: ckpt.array(n))
                theirs = state[p.parts[0].name].numpy().swapaxes(-1, -2)  # transformers holds [E, in, out]
                assert np.array_equal(mine, theirs), p.parts[0].name
                compared += 1
    assert compared == 2 * cfg.num_hidden_layers


def test_the_definition_reads_the_shipped_layouts():
    cfg = load_config(MXFP4)
    layer = {p.key: p for p in cfg.definition.layers[0].params}
    assert layer["experts_gate_up"].format == "mxfp4" and layer["experts_gate_up"].interleaved
    assert layer["qkv"].format is None and layer["router"].format is None  # modules_to_not_convert
    assert [t.name for t in formats.stored_tensors(layer["experts_down"])] == [
        "model.layers.0.mlp.experts.down_proj_blocks", "model.layers.0.mlp.experts.down_proj_scales"]
    dense = {p.key: p for p in load_config(FIXTURES / "models" / "gpt_oss").definition.layers[0].params}
    e, two_i, h = dense["experts_gate_up"].shape
    assert formats.stored_tensors(dense["experts_gate_up"])[0].shape == (e, h, two_i)  # stored [E, in, out]
    assert [a.window for a in (layer.mixer for layer in cfg.definition.layers)] == [4, None, 4, None]


def test_the_sinks_change_the_logits(tmp_path):
    """A copy with every sink at -inf-like (-1e4: exp underflows to 0) must differ from the fixture: the sinks
    are read and used, not ignored."""
    src = FIXTURES / "models" / "gpt_oss"
    dst = tmp_path / "nosinks"
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    for k in [k for k in tensors if k.endswith("self_attn.sinks")]:
        tensors[k] = np.full_like(tensors[k], -1e4)
    save_file(tensors, str(dst / "model.safetensors"))
    prompt = list(golden("gpt_oss")["prompt"])
    a, b = engine("gpt_oss"), engine(dst)
    a.prefill(prompt, all_logits=True), b.prefill(prompt, all_logits=True)
    assert rel_err(rows(b, b.logits_buffer_ptr(), len(prompt)), rows(a, a.logits_buffer_ptr(), len(prompt))) > 1e-2


def test_the_cuda_engine_takes_gpt_oss():
    """The CUDA kernels take every gpt-oss feature (nothing unsupported; tests/gpu/test_gpt_oss_cuda.py passed on an
    H100 in session 18); its MXFP4 experts are read as stored by the MoE kernels, gated until
    tests/gpu/test_moe_mxfp4_cuda.py passes."""
    from metrale_cli.backends.cuda.loading import kept_as_stored, unsupported_features, unverified_features

    definition = load_config(MXFP4).definition
    assert unsupported_features(definition) == []
    assert unverified_features(definition) == ["MXFP4 experts read as stored by the MoE kernels"]
    assert all(kept_as_stored(p) for p in definition.params() if p.format == "mxfp4")


def test_inspect_names_the_format_sinks_and_windows():
    from typer.testing import CliRunner

    from metrale_cli.cli import app

    res = CliRunner().invoke(app, ["inspect", str(MXFP4), "--format", "json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    assert info["weight_formats"] == {"quant_method": "mxfp4", "params": {"dense": 47, "mxfp4": 8},
                                      "activation_quant": {"mxfp4": "none (weight-only)"}}
    assert info["sliding_window"] == 4 and info["model_type"] == "gpt_oss"
