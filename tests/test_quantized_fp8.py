"""Quantized checkpoints on the NumPy engine: FP8 (quant_method "fp8": e4m3 weights with block or per-tensor
scales), and gpt-oss as shipped (MXFP4 experts) and as exported in bf16.

Goldens: scripts/make_quantized_fixtures.py (transformers loading the quantized checkpoint on the CPU,
dequantized to fp32). Partial edge blocks, which transformers refuses to dequantize ("not divisible by
scale grid") and real DeepSeek checkpoints have, are checked against a dequantization written here from the
format's definition, and end to end against the same values stored dense.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from metrale_cli.checkpoint import Checkpoint
from metrale_cli.config import load_config
from metrale_cli.errors import CheckpointError
from metrale_cli.model import open_model

from golden_parity import check_greedy, check_prefill, check_verify_and_trim, engine, rows
from metrale_cli.models import formats

FIXTURES = Path(__file__).parent / "fixtures"
FP8_MODELS = ["llama_fp8_block", "qwen3_moe_fp8_block", "qwen3_fp8_tensor", "deepseek_v3_fp8_block"]
MODELS = FP8_MODELS + ["gpt_oss", "gpt_oss_mxfp4"]  # gpt-oss: its bf16 export and its shipped MXFP4 experts






def test_fixtures_store_fp8_weights_with_scales():
    """The fixtures are what they claim: e4m3 Linear weights, a scale grid beside each, dense the rest."""
    for name, scale_dtype in (("llama_fp8_block", "F32"), ("qwen3_moe_fp8_block", "BF16"),
                              ("qwen3_fp8_tensor", "F32"), ("deepseek_v3_fp8_block", "F32")):
        with Checkpoint.open(FIXTURES / "models" / name) as ckpt:
            dtypes = {n: ckpt.info(n).dtype for n in ckpt.tensor_names()}
        fp8 = [n for n, d in dtypes.items() if d == "F8_E4M3"]
        assert fp8 and all(dtypes[n + "_scale_inv"] == scale_dtype for n in fp8)
        assert dtypes["model.embed_tokens.weight"] == "F32"
    cfg = load_config(FIXTURES / "models" / "qwen3_moe_fp8_block")
    by_key = {(i, p.key): p.format for i, layer in enumerate(cfg.definition.layers) for p in layer.params}
    assert by_key[(0, "experts_gate_up")] == "fp8_block8x8" and by_key[(0, "qkv")] == "fp8_block8x8"
    assert by_key[(1, "gate_up")] is None  # modules_to_not_convert: model.layers.1.mlp stays dense
    assert by_key[(0, "router")] is None and by_key[(0, "input_norm")] is None
    cfg = load_config(FIXTURES / "models" / "deepseek_v3_fp8_block")  # MLA: every projection, the latent's too
    by_key = {(i, p.key): p.format for i, layer in enumerate(cfg.definition.layers) for p in layer.params}
    for key in ("q_a", "q_b", "kv_a", "kv_b", "o"):
        assert by_key[(1, key)] == "fp8_block8x8", key
    assert by_key[(0, "gate_up")] == by_key[(1, "experts_gate_up")] == by_key[(1, "shared_gate_up")] == "fp8_block8x8"
    assert by_key[(1, "router")] is None


@pytest.mark.parametrize("name", MODELS)
def test_prefill_logits_match_transformers(name):
    check_prefill(name)


@pytest.mark.parametrize("name", MODELS)
def test_32_greedy_steps_match_generate(name):
    check_greedy(name)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("k", [1, 3, 8])
def test_verify_rows_equal_sequential_decode_and_trim(name, k):
    check_verify_and_trim(name, k)


@pytest.mark.parametrize("name", FP8_MODELS)
def test_dequantized_weights_equal_transformers_bit_for_bit(name):
    """metrale's fp32 value of every stored FP8 weight == transformers' dequantized parameter."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers loads an FP8 checkpoint through it
    import sys

    sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
    import make_quantized_fixtures as mq

    path = FIXTURES / "models" / name
    model = mq.load_dequantized(path)
    state = {k: v.detach().to(torch.float32).numpy() for k, v in model.state_dict().items()}
    cfg = load_config(path)
    compared = 0
    with Checkpoint.open(path) as ckpt:
        for p in cfg.definition.params():
            if p.format is None:
                continue
            for t, value in zip(p.parts, formats.dequantize(p, lambda n: ckpt.array(n, bf16_bits=True))):
                assert np.array_equal(value, mq.transformers_weight(state, t.name)), t.name
                compared += 1
    assert compared >= 6


def reference_block_dequant(q: np.ndarray, scale: np.ndarray, bn: int, bk: int) -> np.ndarray:
    """The format's definition, block by block: w[i, j] = e4m3(q[i, j]) * scale[i // bn, j // bk]."""
    out = np.empty(q.shape, np.float32)
    for bi in range(scale.shape[0]):
        for bj in range(scale.shape[1]):
            blk = (slice(bi * bn, (bi + 1) * bn), slice(bj * bk, (bj + 1) * bk))
            out[blk] = q[blk].astype(np.float32) * np.float32(scale[bi, bj])
    return out


@pytest.mark.parametrize("shape,block", [((300, 200), (128, 128)), ((7, 129), (128, 128)), ((96, 80), (48, 32))])
def test_partial_edge_blocks_dequantize_by_the_definition(shape, block):
    rng = np.random.default_rng()
    grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    q = rng.uniform(-448, 448, shape).astype(ml_dtypes.float8_e4m3fn)  # every finite e4m3 range
    scale = np.exp(rng.uniform(-8, 0, grid)).astype(np.float32)
    from metrale_cli.models.quantized import fp8

    fmt = formats.weight_format(fp8.block_format(*block))
    got = fmt.dequantize(q, scale)
    assert got.dtype == np.float32
    assert np.array_equal(got, reference_block_dequant(q, scale, *block))
    bf16_scale = scale.astype(ml_dtypes.bfloat16)  # BF16 scales arrive as their uint16 bits
    assert np.array_equal(fmt.dequantize(q, bf16_scale.view(np.uint16)),
                          reference_block_dequant(q, bf16_scale.astype(np.float32), *block))


def quantize_llama(tmp_path: Path, block, rng, edit=None) -> tuple[Path, Path]:
    """The llama fixture's Linear weights as FP8 with `block` scales (random scales, so every block differs),
    and the same values stored dense in F32; `edit(tensors, config)` changes the FP8 one before it is written."""
    src = FIXTURES / "models" / "llama"
    tensors = load_file(str(src / "model.safetensors"))
    q_t, dense = {}, {}
    for name, a in tensors.items():
        a = a.astype(np.float32)
        if name.endswith("proj.weight"):
            grid = (-(-a.shape[0] // block[0]), -(-a.shape[1] // block[1]))
            s = (np.abs(a).max() / 448 * np.exp(rng.uniform(0, 1, grid))).astype(np.float32)
            full = np.repeat(np.repeat(s, block[0], 0)[:a.shape[0]], block[1], 1)[:, :a.shape[1]]
            q = (a / full).astype(ml_dtypes.float8_e4m3fn)
            q_t[name], q_t[name + "_scale_inv"] = q, s
            dense[name] = reference_block_dequant(q, s, *block)
        else:
            q_t[name] = dense[name] = a
    config = json.loads((src / "config.json").read_text())
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    q_config = {**config, "quantization_config": qc}
    if edit is not None:
        edit(q_t, q_config)
    return write(tmp_path / "fp8", q_config, q_t), write(tmp_path / "dense", config, dense)


def write(path: Path, config: dict, tensors: dict) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_partial_blocks_end_to_end_equal_the_dense_values(tmp_path):
    """[48, 32] blocks over 64- and 80-wide weights (partial at the edges): the FP8 checkpoint's logits are
    those of its exact values stored dense, bit for bit, through prefill, decode and verify."""
    fp8, dense = quantize_llama(tmp_path, (48, 32), np.random.default_rng())
    prompt = list(np.random.default_rng().integers(0, 300, 9))
    a, b = engine(fp8), engine(dense)
    for e in (a, b):
        e.prefill(prompt, all_logits=True)
    assert np.array_equal(rows(a, a.logits_buffer_ptr(), 9), rows(b, b.logits_buffer_ptr(), 9))
    for e in (a, b):
        e.verify([5, 17, 250])
    assert np.array_equal(rows(a, a.logits_buffer_ptr(), 3), rows(b, b.logits_buffer_ptr(), 3))


def hostile(tmp_path: Path, edit) -> Path:
    return quantize_llama(tmp_path, (32, 32), np.random.default_rng(3), edit)[0]


def refusal(path: Path) -> str:
    with pytest.raises(CheckpointError) as e:
        open_model(path, device="cpu", max_context=16)
    return str(e.value)


def test_a_misshaped_scale_is_refused_with_the_tensor_named(tmp_path):
    name = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    msg = refusal(hostile(tmp_path, lambda t, c: t.__setitem__(name, np.ones((3, 2), np.float32))))
    assert "wrong shape" in msg and name in msg and "[2, 2]" in msg


def test_a_missing_scale_or_a_dense_weight_where_fp8_is_expected_is_refused(tmp_path):
    name = "model.layers.1.mlp.down_proj.weight"
    msg = refusal(hostile(tmp_path / "a", lambda t, c: t.pop(name + "_scale_inv")))
    assert "missing 1" in msg and name + "_scale_inv" in msg
    msg = refusal(hostile(tmp_path / "b", lambda t, c: t.__setitem__(name, t[name].astype(np.float32))))
    assert "wrong dtype" in msg and f"{name} F32 (expected F8_E4M3)" in msg


def test_a_scale_beside_a_weight_the_config_keeps_dense_is_refused(tmp_path):
    msg = refusal(hostile(tmp_path, lambda t, c: c["quantization_config"].__setitem__(
        "modules_to_not_convert", ["model.layers.0.mlp"])))
    assert "model.layers.0.mlp.down_proj.weight_scale_inv" in msg and "unexpected" in msg


@pytest.mark.parametrize("field,value,words", [
    ("weight_block_size", [128], "two positive integers"),
    ("activation_scheme", "per_token", "is not dynamic or static"),
    ("modules_to_not_convert", ["model.layers.0.self_attn.q_proj"], "skips part of qkv"),
])
def test_quantization_configs_metrale_does_not_run_are_refused_by_field(tmp_path, field, value, words):
    msg = refusal(hostile(tmp_path, lambda t, c: c["quantization_config"].__setitem__(field, value)))
    assert f"quantization_config.{field}" in msg and words in msg


def test_cli_exit_code_for_a_bad_fp8_checkpoint(tmp_path):
    from typer.testing import CliRunner

    from metrale_cli.cli import app

    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    path = hostile(tmp_path, lambda t, c: t.__setitem__(name, np.ones((1,), np.float32)))
    res = CliRunner().invoke(app, ["forward", "-m", str(path), "-t", "1,2,3"])
    assert res.exit_code == 3, res.output
    assert name in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("name", ["llama_fp8_block", "qwen3_moe_fp8_block", "qwen3_fp8_tensor", "deepseek_v3_fp8_block",
                                  "gpt_oss_mxfp4"])
def test_the_compiled_kernels_match_transformers_end_to_end(monkeypatch, name):
    """These fixtures' weights are too small for the compiled FP8 / MXFP4 kernels; with the size threshold at 0
    every few-row product (the prompt, each decode step) goes through them: prefill and 32 greedy steps still
    match transformers."""
    from metrale_cli.backends.numpy import kernels

    if not kernels.AVAILABLE:
        pytest.skip("numba is not installed")
    monkeypatch.setattr(kernels, "FUSED_MIN", 0)
    check_prefill(name)
    check_greedy(name)
