"""FP8 weights on the GPU: the quantized GEMV (qgemv.cu with its e4m3 policy; its fused RMSNorm and gate activation)
and bf16 dequantization against their definitions, and the CUDA engine on FP8 checkpoints against the NumPy engine
(which dequantizes them exactly and computes in fp32).

Each test draws fresh weights. The checkpoints use [128, 128] blocks (DeepSeek / Qwen3-FP8's) over sizes that are
not multiples of 128 (partial edge blocks; a fused qkv whose parts do not align to the blocks) and per-tensor
scales."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from metrale_cli import decoding
from metrale_cli.model import open_model

from gpu_helpers import fused_gemv_case, graph_and_eager_decodes, rel, rows, tokens_agree, verify_against_decode

pytestmark = pytest.mark.gpu


def e4m3(rng, shape) -> np.ndarray:
    return rng.uniform(-448, 448, shape).astype(ml_dtypes.float8_e4m3fn)


def expanded(scale: np.ndarray, srow: int, bk: int, n: int, k: int) -> np.ndarray:
    return np.repeat(np.repeat(scale, srow, 0)[:n], bk, 1)[:, :k]


@pytest.fixture(scope="module")
def fp8k(kernels):
    from metrale_cli.backends.cuda.kernels.fp8 import Fp8Kernels

    return Fp8Kernels(kernels)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k,srow,bk", [(300, 4096, 128, 128), (257, 208, 1, 128), (64, 96, 16, 16)])
def test_gemv_matches_the_definition(cp, fp8k, rng, m, n, k, srow, bk):
    q = e4m3(rng, (n, k))
    scale = np.exp(rng.uniform(-12, -6, (-(-n // srow), -(-k // bk)))).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(ml_dtypes.bfloat16)
    w = q.astype(np.float64) * expanded(scale, srow, bk, n, k)
    want = x.astype(np.float64) @ w.T + bias.astype(np.float64)
    out = cp.asarray(rng.standard_normal((m, n)).astype(np.float32))
    start = out.get()
    dq, ds, dx = cp.asarray(q.view(np.uint8)), cp.asarray(scale), cp.asarray(x)
    db = cp.asarray(bias.view(np.uint16))
    fp8k.gemv(dx, dq, ds, srow, bk, out, db)
    assert rel(out.get(), want) < 1e-5
    fp8k.gemv(dx, dq, ds, srow, bk, out, None, accumulate=True)  # += x @ w.T
    assert rel(out.get(), want + x.astype(np.float64) @ w.T) < 1e-5
    assert not np.array_equal(out.get(), start)


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("swiglu,norm,activation", [(False, True, "silu"), (True, False, "silu"), (True, True, "silu"),
                                                    (True, True, "gelu_tanh")])
def test_gemv_fuses_the_norm_and_the_gate_activation(cp, fp8k, rng, m, swiglu, norm, activation):
    """qgemv.cu's RMSNorm prologue (x un-normalised, Gemma's +1 offset) and SwiGLU / GeGLU epilogue against float64,
    over [128, 128] blocks with a partial edge (a fused [gate, up] of 2 x 300 rows)."""
    n, k, srow, bk = 600, 1280, 128, 128
    q = e4m3(rng, (n, k))
    scale = np.exp(rng.uniform(-12, -6, (-(-n // srow), -(-k // bk)))).astype(np.float32)
    w = q.astype(np.float64) * expanded(scale, srow, bk, n, k)
    x = (rng.standard_normal((m, k)) * 3).astype(np.float32)
    kw, want = fused_gemv_case(rng, x, w, swiglu, norm, activation)
    if norm:
        kw["norm_weight"] = cp.asarray(kw["norm_weight"])
    out = cp.full((m, n // 2 if swiglu else n), np.nan, cp.float32)
    fp8k.gemv(cp.asarray(x), cp.asarray(q.view(np.uint8)), cp.asarray(scale), srow, bk, out, **kw)
    assert rel(out.get(), want) < 1e-5


def test_gemv_replays_in_a_cuda_graph(cp, fp8k, rng):
    n, k = 512, 1024
    q, scale = e4m3(rng, (n, k)), np.exp(rng.uniform(-10, -6, (4, 8))).astype(np.float32)
    dq, ds = cp.asarray(q.view(np.uint8)), cp.asarray(scale)
    x = cp.asarray(rng.standard_normal((2, k)).astype(np.float32))
    eager, replayed = cp.zeros((2, n), cp.float32), cp.zeros((2, n), cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        fp8k.gemv(x, dq, ds, 128, 128, eager, stream=stream)
        stream.begin_capture()
        fp8k.gemv(x, dq, ds, 128, 128, replayed, stream=stream)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    assert np.array_equal(eager.get(), replayed.get())


@pytest.mark.parametrize("srow,bk", [(128, 128), (1, 16)])
def test_dequant_bf16_is_bit_exact(cp, fp8k, rng, srow, bk):
    n, k = 300, 208
    q = e4m3(rng, (n, k))
    scale = np.exp(rng.uniform(-12, 0, (-(-n // srow), -(-k // bk)))).astype(np.float32)
    out = cp.empty((n, k), cp.uint16)
    fp8k.dequant_bf16(cp.asarray(q.view(np.uint8)), cp.asarray(scale), srow, bk, out)
    want = (q.astype(np.float32) * expanded(scale, srow, bk, n, k)).astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.array_equal(out.get(), want)


# ---- the engine ---------------------------------------------------------------------------------------------

BASE = dict(vocab_size=1003, hidden_size=256, intermediate_size=352, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
            dtype="bfloat16")
MODELS = {  # name: (config, weight_block_size or None)
    "llama_block128": (dict(model_type="llama", head_dim=64), [128, 128]),
    "llama_block128_q160": (dict(model_type="llama", num_attention_heads=5, num_key_value_heads=1, head_dim=32,
                                 hidden_size=160, intermediate_size=208), [128, 128]),
    "qwen3_tensor": (dict(model_type="qwen3", head_dim=128), None),
}


def write_fp8(path: Path, arch: dict, block, rng) -> Path:
    cfg = {**BASE, **arch}
    from metrale_cli.config import parse_config
    from metrale_cli.random_weights import RandomTensors

    dense = parse_config(dict(cfg))
    src = RandomTensors(dense, seed=int(rng.integers(1 << 30)))
    tensors = {}
    for name in src.tensor_names():
        a = src.array(name).astype(np.float32)
        if name.endswith("proj.weight"):
            if block is None:
                s = np.array(np.abs(a).max() / 448, np.float32)
                full = s
            else:
                grid = (-(-a.shape[0] // block[0]), -(-a.shape[1] // block[1]))
                s = np.empty(grid, np.float32)
                for i in range(grid[0]):
                    for j in range(grid[1]):
                        s[i, j] = np.abs(a[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]).max() / 448
                full = expanded(s, block[0], block[1], *a.shape)
            tensors[name], tensors[name + "_scale_inv"] = (a / full).astype(ml_dtypes.float8_e4m3fn), s
        else:
            tensors[name] = a.astype(ml_dtypes.bfloat16)
    path.mkdir(parents=True)
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": block}
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("name", list(MODELS))
def test_the_cuda_engine_on_fp8_checkpoints_matches_the_numpy_engine(cp, tmp_path, rng, name):
    arch, block = MODELS[name]
    path = write_fp8(tmp_path / name, arch, block, rng)
    cpu = open_model(path, device="cpu", max_context=96).engine
    gpu = open_model(path, device="cuda", max_context=96, fp32_logits=True).engine
    assert type(gpu.w.layers[0]["qkv"]).__name__ == "Fp8Weight"  # kept as FP8 on the device
    prompt = [int(t) for t in rng.integers(0, BASE["vocab_size"], 40)]
    n = cpu.prefill(prompt, all_logits=True)
    gpu.prefill(prompt, all_logits=True)
    err = rel(rows(gpu, gpu.logits_buffer_ptr(), n), rows(cpu, cpu.logits_buffer_ptr(), n))
    print(f"{name}: prefill rel {err:.2e}")
    assert err < 2e-2
    cpu.reset(), gpu.reset()
    a = decoding.run_decode(cpu, prompt[:8], 24, keep_rows=True)
    b = decoding.run_decode(gpu, prompt[:8], 24, keep_rows=True)
    n = tokens_agree([s.token for s in a.steps], [s.token for s in b.steps], a.rows.array())
    assert rel(b.rows.array()[:n], a.rows.array()[:n]) < 2e-2  # past a near-tie split the rows differ
    # verify == the same tokens decoded one by one, on the GPU (rows path, graphs on)
    assert verify_against_decode(gpu, prompt[:8], [s.token for s in b.steps[:6]]) < 1e-3


def test_fp8_weights_the_gemv_cannot_take_run_dequantized_to_bf16(cp, tmp_path, rng):
    """8-wide blocks (the GEMV's 16-byte loads would span two scales): every FP8 weight is dequantized exactly and
    rounded to bf16 at load (loading.kept_as_stored), as the MoE experts are; the engine matches the NumPy one."""
    path = write_fp8(tmp_path / "llama_block8", dict(model_type="llama", head_dim=64), [8, 8], rng)
    cpu = open_model(path, device="cpu", max_context=96).engine
    gpu = open_model(path, device="cuda", max_context=96, fp32_logits=True).engine
    assert type(gpu.w.layers[0]["qkv"]).__name__ != "Fp8Weight"  # bf16 bits on the device
    prompt = [int(t) for t in rng.integers(0, BASE["vocab_size"], 40)]
    n = cpu.prefill(prompt, all_logits=True)
    gpu.prefill(prompt, all_logits=True)
    err = rel(rows(gpu, gpu.logits_buffer_ptr(), n), rows(cpu, cpu.logits_buffer_ptr(), n))
    cpu.reset(), gpu.reset()
    a = decoding.run_decode(cpu, prompt[:8], 16, keep_rows=True)
    b = decoding.run_decode(gpu, prompt[:8], 16, keep_rows=True)
    k = tokens_agree([s.token for s in a.steps], [s.token for s in b.steps], a.rows.array())
    derr = rel(b.rows.array()[:k], a.rows.array()[:k])
    print(f"llama_block8 (dequantized to bf16 at load): prefill rel {err:.2e}, decode rows {derr:.2e}")
    assert err < 2e-2 and derr < 2e-2


def test_graph_replay_equals_eager_on_fp8(cp, tmp_path, rng):
    path = write_fp8(tmp_path / "m", MODELS["llama_block128"][0], [128, 128], rng)
    prompt = [int(t) for t in rng.integers(0, BASE["vocab_size"], 12)]
    assert np.array_equal(*graph_and_eager_decodes(path, prompt))


@pytest.mark.parametrize("m,k,group,ue8m0", [(1, 4096, 128, False), (5, 4096, 128, True), (3, 200, 128, False),
                                             (16, 2880, 2880, False)])
def test_act_quant_equals_the_definition_bit_for_bit(cp, fp8k, rng, m, k, group, ue8m0):
    """fp8_act_quant_kernel against models/quantized/activations.e4m3_groups (the NumPy engine's emulation, itself
    tested against transformers / DeepSeek's definition): equal bit for bit, a partial last group and an all-zero
    group included, in place too; and the static scale against e4m3_static, values past +-448 s clipped."""
    from metrale_cli.models.quantized import activations

    x = (rng.standard_normal((m, k)) * np.exp(rng.uniform(-6, 6, (m, 1)))).astype(np.float32)
    x[0, :min(group, k)] = 0.0  # an all-zero group stays zero
    want = activations.e4m3_groups(x, group, ue8m0)
    dx, out = cp.asarray(x), cp.empty((m, k), cp.float32)
    fp8k.act_quant(dx, group, ue8m0, None, out)
    got = out.get()
    print(f"act_quant m={m} k={k} group={group} ue8m0={ue8m0}: {int((got != want).sum())} of {got.size} differ")
    assert np.array_equal(got, want)
    fp8k.act_quant(dx, group, ue8m0, None, dx)  # in place
    assert np.array_equal(dx.get(), want)
    s = np.float32(np.abs(x).max() / 300)  # some |x / s| above 448: clipped
    fp8k.act_quant(cp.asarray(x), group, False, cp.asarray(np.array([s], np.float32)), out)
    assert np.array_equal(out.get(), activations.e4m3_static(x, s))


def test_activation_quant_emulate_on_the_gpu(cp, tmp_path, rng):
    """`--activation-quant emulate` on the CUDA engine (FP8 weights' inputs quantized per token and 128 columns before
    the GEMV and the prefill GEMM; the kernel is exact above, the wiring is tested on the CPU). Quantizing is a step
    function, so the GPU's bf16 roundings upstream move some inputs across e4m3 rounding boundaries and its logits
    cannot be compared with the NumPy engine's emulation tightly; what is checked here: emulation changes the GPU's
    logits by about what it changes the NumPy engine's (printed; within 3x either way), and the scales are per row:
    verify rows equal the same tokens decoded one at a time."""
    path = write_fp8(tmp_path / "m", MODELS["llama_block128"][0], [128, 128], rng)
    engines = {(dev, aq): open_model(path, device=dev, max_context=96, fp32_logits=True, activation_quant=aq).engine
               for dev in ("cpu", "cuda") for aq in ("none", "emulate")}
    assert engines["cuda", "emulate"].w.layers[0]["qkv"].input_quant.group == 128
    prompt = [int(t) for t in rng.integers(0, BASE["vocab_size"], 40)]
    got = {}
    for key, e in engines.items():
        n = e.prefill(prompt, all_logits=True)
        got[key] = rows(e, e.logits_buffer_ptr(), n)
    cpu, gpu = rel(got["cpu", "emulate"], got["cpu", "none"]), rel(got["cuda", "emulate"], got["cuda", "none"])
    print(f"emulation changes the logits by {cpu:.2e} on the CPU, {gpu:.2e} on the GPU; emulated GPU vs emulated "
          f"CPU {rel(got['cuda', 'emulate'], got['cpu', 'emulate']):.2e}")
    assert cpu / 3 < gpu < cpu * 3
    drafts = [int(t) for t in rng.integers(0, BASE["vocab_size"], 6)]
    err = verify_against_decode(engines["cuda", "emulate"], prompt[:8], drafts)
    print(f"emulated verify of 6 rows vs 6 decode steps: {err:.2e}")
    assert err < 1e-2  # a shared scale would move rows by about the emulation's effect; 1e-6 noise flips rarely
