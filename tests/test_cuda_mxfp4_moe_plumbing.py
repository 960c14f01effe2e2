"""MXFP4 experts read as stored by the CUDA MoE kernels (issue 41), on the CPU: gpt-oss's `_blocks` / `_scales` are
uploaded as the checkpoint's bytes (backends/cuda/mxfp4.Mxfp4Experts; gate and up de-interleaved by reordering rows),
the rows path hands them to the experts kernels' MXFP4 policy (kernels/moe.py checks their operands and passes the .cu
signature's arguments), the prefill dequantizes the chosen experts to bf16; the size check and bench's floor count
the stored bytes; the gate of unverified CUDA code names them.  The MoE kernels are replaced by NumPy implementations
of their contracts (test_cuda_moe_plumbing's FakeMoeKernels); the arithmetic the kernels do (e2m1.cu, moe.cu's
MoeMxfp4) is emulated bit for bit in NumPy here and tested on a GPU by tests/gpu/test_moe_mxfp4_cuda.py."""

from __future__ import annotations

import json
from math import prod
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

moe_kernels = pytest.importorskip("metrale_cli.backends.cuda.kernels.moe")
from metrale_cli.backends.cuda import loading  # noqa: E402
from metrale_cli.backends.cuda import mxfp4 as cuda_mxfp4  # noqa: E402
from metrale_cli.backends.cuda.projections import Projections  # noqa: E402
from metrale_cli.models.quantized import mxfp4  # noqa: E402

from test_cuda_fp8_moe_plumbing import (TOL, _buffers, _compare, _moe, _moe_params, exact_experts,  # noqa: E402
                                       record_dequantized)
from test_cuda_launch_args import FakeArray, KIND_OK, kern  # noqa: E402,F401 (a fixture)
from test_cuda_moe_plumbing import FakeMoeKernels, expert_f32  # noqa: E402
from test_extension_points import cuda_plumbing  # noqa: E402

GATE = "MXFP4 experts read as stored by the MoE kernels"
CONFIG = dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], vocab_size=300, hidden_size=64,
              intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_local_experts=8, num_experts_per_tok=4, sliding_window=4, max_position_embeddings=256,
              rms_norm_eps=1e-5, attention_bias=True, hidden_act="silu", tie_word_embeddings=False,
              layer_types=["sliding_attention", "full_attention"], swiglu_limit=7.0, swiglu_alpha=1.702,
              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "original_max_position_embeddings": 64, "truncate": False},
              quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
                  "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
              dtype="bfloat16")


def write_gpt_oss_mxfp4(path: Path, rng, **changes) -> Path:
    """A random gpt-oss checkpoint as shipped: MXFP4 experts (the format's own draw: any code, scales near fan_in^-0.5),
    every other tensor bf16."""
    from metrale_cli.config import parse_config
    from metrale_cli.random_weights import RandomTensors

    raw = {**CONFIG, **changes}
    src = RandomTensors(parse_config(dict(raw)), seed=int(rng.integers(1 << 30)))
    tensors = {n: src.array(n) if n in src.formatted else np.asarray(src.array(n), np.float32).astype(ml_dtypes.bfloat16)
               for n in src.tensor_names()}
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(raw))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def deinterleaved(a: np.ndarray) -> np.ndarray:
    """Rows [E, 2I, ...] of gate 0, up 0, gate 1, ... as [all gate; all up] (models/weights.deinterleave)."""
    n = a.shape[1]
    return a[:, np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])]


def test_mxfp4_experts_are_uploaded_as_the_checkpoints_bytes(tmp_path):
    """Each layer's experts are the checkpoint's `_blocks` and `_scales` bytes, unchanged but for gate/up's rows put in
    the engine's [all gate; all up] order (their scales with them): the device holds exactly the stored bytes, and
    they decode (the kernels' contract) to the NumPy engine's exact values."""
    from metrale_cli.checkpoint import Checkpoint
    from metrale_cli.config import load_config
    from metrale_cli.models.formats import stored_tensors

    path = write_gpt_oss_mxfp4(tmp_path / "oss", np.random.default_rng())
    cfg = load_config(path)
    d = cfg.definition
    assert loading.unsupported_features(d) == [] and loading.unverified_features(d) == [GATE]
    stacked = [p for p in d.params() if p.format == "mxfp4"]
    assert len(stacked) == 4 and all(loading.kept_as_stored(p) and not p.experts for p in stacked)
    fake = cuda_plumbing().FakeKernels()
    with Checkpoint.open(path) as ckpt:
        w = loading.upload_weights(cfg, ckpt, fake)
        e, inter, hidden = cfg.moe.spec.num_experts, cfg.moe.spec.intermediate_size, cfg.hidden_size
        held = 0
        for i, lw in enumerate(w.layers):
            for key, (n, k) in (("experts_gate_up", (2 * inter, hidden)), ("experts_down", (hidden, inter))):
                got = lw[key]
                assert isinstance(got, cuda_mxfp4.Mxfp4Experts) and moe_kernels.expert_format(got) == "mxfp4"
                assert got.shape == (e, n, k) and (got.srow, got.bk) == (1, 32)
                assert got.data.dtype == np.uint8 and got.data.shape == (e, n, k // 2)
                assert got.scale.dtype == np.uint8 and got.scale.shape == (e, n, k // 32)
                name = next(p for p in d.layers[i].params if p.key == key).parts[0].name
                blocks, scales = ckpt.array(name + "_blocks"), ckpt.array(name + "_scales")
                order = deinterleaved if key == "experts_gate_up" else (lambda a: a)
                assert np.array_equal(got.data, order(blocks).reshape(e, n, k // 2))
                assert np.array_equal(got.scale, order(scales))
                assert np.array_equal(np.stack([expert_f32(got, x) for x in range(e)]),
                                      order(exact_experts(cfg, path, i, key)))
                held += got.data.nbytes + got.scale.nbytes
        stored = sum(ckpt.info(t.name).nbytes for p in stacked for t in stored_tensors(p))
    assert held == stored == sum(loading.stored_param_bytes(p) for p in stacked)


@pytest.mark.parametrize("plen", [12, 20])  # the rows path (<= 16 rows) and the prefill path
@pytest.mark.parametrize("rows_path", ["rows", "fused"])
def test_mxfp4_experts_run_through_the_cuda_engine(tmp_path, monkeypatch, plen, rows_path):
    """The rows path's gate_up / down take the MXFP4 experts as stored; the prefill dequantizes only the experts its
    rows chose (MoeKernels.dequant_bf16, once per chosen expert); the logits match the NumPy engine's."""
    path = write_gpt_oss_mxfp4(tmp_path / "oss", np.random.default_rng())
    dequantized = record_dequantized(monkeypatch, cuda_mxfp4.Mxfp4Experts)  # per prefill layer and weight
    err, derr, calls = _compare(path, plen, 6, rows_path, monkeypatch, dequantized.clear)
    print(f"gpt-oss MXFP4 T={plen} ({rows_path}): prefill {err:.2e}, decode {derr:.2e}")
    assert err < TOL and derr < TOL
    experts = [a for n, a in calls if n in ("gate_up", "down")]
    assert all(moe_kernels.expert_format(a["w_gate_up" if "w_gate_up" in a else "w_down"]) == "mxfp4"
               for a in experts)
    assert all(a["bias"] is not None for a in experts)
    if plen <= 16:  # every row through the kernels' MXFP4 policy: no expert dequantized
        assert {n for n, _ in calls} >= {"route", "gate_up", "down"} and not dequantized
    else:
        per_expert = [a["expert"] for n, a in calls if n == "dequant_bf16"]
        assert len(dequantized) == 2 * 2 and all(0 < len(x) <= 8 and x == sorted(set(x)) for x in dequantized)
        assert per_expert == [x for layer in dequantized for x in layer]


def test_the_prefill_dequantizes_only_the_chosen_mxfp4_experts():
    """Projections.experts_bf16: the listed experts bf16(exact value), the others zeros, through the engine's one
    MoeKernels (moe_passes.moe_kernels, cached on its Kernels)."""
    from metrale_cli.backends.cuda import moe_passes

    rng = np.random.default_rng()
    e, n, k = 5, 48, 64
    blocks = rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(118, 130, (e, n, k // 32), dtype=np.uint8)
    w = cuda_mxfp4.Mxfp4Experts("mxfp4", blocks.reshape(e, n, k // 2), scales, (e, n, k))
    fake = cuda_plumbing().FakeKernels()
    orig = moe_passes.MoeKernels
    moe_passes.MoeKernels = FakeMoeKernels
    try:
        proj = Projections(fake.cp, fake, None, None, None)
        got = proj.experts_bf16(w, [1, 3])
        assert moe_passes.moe_kernels(fake) is fake._moe_kernels  # one instance per engine
    finally:
        moe_passes.MoeKernels = orig
    want = mxfp4.dequantize(blocks, scales).astype(ml_dtypes.bfloat16).view(np.uint16)
    assert got.dtype == np.uint16 and np.array_equal(got[[1, 3]], want[[1, 3]])
    assert not np.asarray(got)[[0, 2, 4]].any()


def _kernel_values(word: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """moe.cu's MoeMxfp4::widen in NumPy, bit for bit: e2m1.cu's e2m1x8<1> (each code's three low bits in bits 9..11
    of a half and its sign in bit 15, times 2^15 in half precision: twice the value) times 2^(s - 128) built from
    the scale byte's bits; [..., 8] fp32 of uint32 words [...] and scale bytes [...]."""
    out = np.empty(word.shape + (8,), np.float32)
    for i in range(4):
        t = word >> np.uint32(4 * i)
        h = ((t << np.uint32(9)) & np.uint32(0x0E000E00)) | ((t << np.uint32(12)) & np.uint32(0x80008000))
        for j, half in ((i, h & np.uint32(0xFFFF)), (i + 4, h >> np.uint32(16))):
            out[..., j] = (half.astype(np.uint16).view(np.float16) * np.float16(2 ** 15)).astype(np.float32)
    s = scale.astype(np.uint32)
    bits = np.where(s >= 2, (s - np.uint32(1)) << np.uint32(23), np.uint32(0x00200000) << np.minimum(s, 1))
    with np.errstate(over="ignore"):
        return out * bits.astype(np.uint32).view(np.float32)[..., None]


def test_the_kernels_mxfp4_arithmetic_is_the_exact_dequantization():
    """Every code at every position of a word, under every one of the 256 scale bytes (the subnormal 2^-127 and
    2^-128 and 2^128, whose products may overflow, included), gives mxfp4.dequantize's value bit for bit."""
    codes = np.arange(16, dtype=np.uint32)
    words = np.stack([np.roll(codes, -r)[:8] @ (np.uint32(16) ** np.arange(8, dtype=np.uint32)) for r in range(16)])
    words = np.concatenate([words, np.random.default_rng().integers(0, 2 ** 32, 200, dtype=np.uint64)])
    chunks = words.astype(np.uint32).reshape(-1, 4)  # 16-byte chunks: one MXFP4 block of 32 codes each
    scale = np.arange(256, dtype=np.uint8)
    got = np.concatenate([_kernel_values(chunks[:, None, j], scale[None, :]) for j in range(4)], -1)  # [c, 256, 32]
    blocks = np.broadcast_to(chunks.view(np.uint8)[:, None, None, :], (len(chunks), 256, 1, 16))
    with np.errstate(over="ignore"):
        want = mxfp4.dequantize(blocks, np.broadcast_to(scale[None, :, None], (len(chunks), 256, 1)))
    assert np.isinf(want).any() and (want[:, :2] != 0).any()  # overflowing and subnormal products are in the test
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_the_gpt_oss_presets_hold_their_mxfp4_bytes():
    """gpt-oss-20b holds 13,761,267,840 bytes (its experts the checkpoint's 10.15 GB of codes and E8M0 scales; 41.8 GB
    with bf16 experts), gpt-oss-120b 60.8 GiB: one 80 GB card each; bench's floor counts those bytes (the embedding
    table left out) and 17 / 32 of a byte an expert parameter."""
    from metrale_cli.bench import preset_path
    from metrale_cli.config import load_config
    from metrale_cli.floors import expert_params, weight_bytes
    from metrale_cli.models.formats import stored_nbytes

    oss = load_config(preset_path("gpt-oss-20b"))
    d = oss.definition
    experts = [p for p in d.params() if p.format]
    assert {p.key for p in experts} == {"experts_gate_up", "experts_down"} and all(map(loading.kept_as_stored, experts))
    assert sum(loading.stored_param_bytes(p) for p in experts) == sum(map(stored_nbytes, experts)) == 10_152_345_600
    assert loading.device_weight_bytes(d) == 13_761_267_840
    bf16 = sum(2 * prod(p.shape) if p.key not in loading.FP32_KEYS else 4 * prod(p.shape) for p in d.params())
    assert round(bf16 / 1e9, 1) == 41.8  # what it held with its experts dequantized at load
    loading.check_fits(oss, 78 << 30, 80 << 30)
    assert loading.unverified_features(d) == [GATE]
    streamed, xb = weight_bytes(object(), oss, 2)  # a GPU engine's floor (no NumPy weights)
    sinks = 24 * 64  # fp32 on the device, 2 bytes each in the floor
    assert streamed == 12_602_997_888 == 13_761_267_840 - 2 * oss.vocab_size * oss.hidden_size - 2 * sinks
    assert xb == 17 / 32 and expert_params(oss)[1] * xb == 10_152_345_600
    big = load_config(preset_path("gpt-oss-120b"))
    assert round(loading.device_weight_bytes(big.definition) / 2**30, 1) == 60.8
    loading.check_fits(big, 78 << 30, 80 << 30)


def test_mxfp4_experts_are_gated_until_their_gpu_tests_pass(tmp_path, monkeypatch):
    """Refused by name (one line, before anything loads) unless METRALE_CUDA_UNVERIFIED=1; weight-only, so
    `--activation-quant emulate` has nothing of theirs to quantize."""
    from metrale_cli.backends.cuda.loading import load_cuda_engine
    from metrale_cli.config import load_config
    from metrale_cli.errors import DeviceError
    from metrale_cli.random_weights import RandomTensors

    cfg = load_config(write_gpt_oss_mxfp4(tmp_path / "oss", np.random.default_rng(), head_dim=64))
    monkeypatch.delenv(loading.UNVERIFIED_ENV, raising=False)
    with pytest.raises(DeviceError, match=f"gpt_oss: the CUDA engine's {GATE} have not passed their GPU tests yet; "
                                          "use --device cpu") as e:
        load_cuda_engine(cfg, RandomTensors(cfg), 32)
    assert "\n" not in str(e.value)
    monkeypatch.setenv(loading.UNVERIFIED_ENV, "1")
    with pytest.raises(DeviceError) as e:  # past the gate: on this machine, CuPy is what is missing
        load_cuda_engine(cfg, RandomTensors(cfg), 32)
    assert "have not passed their GPU tests" not in str(e.value)
    loading.check_activation_quant(cfg.definition)  # no UsageError


# ---- the wrappers' checks and launch arguments (no CUDA: test_cuda_launch_args's recorded launches) -----------

def _mx(shape, data_shape=None, scale_shape=None, scale_dtype=np.uint8, bk=32):
    *lead, n, k = shape
    w = cuda_mxfp4.Mxfp4Experts("mxfp4", FakeArray(data_shape or (*lead, n, k // 2), np.uint8),
                                FakeArray(scale_shape or (*lead, n, k // 32), scale_dtype), tuple(shape))
    w.bk = bk
    return w


@pytest.mark.parametrize("m", [1, 3, 16])
def test_the_mxfp4_experts_launches_pass_the_kernels_arguments(kern, m):  # noqa: F811
    E, H, I, k = 8, 64, 96, 4  # noqa: E741, N806
    mk, b = _moe(kern), _buffers(k, H)
    act = FakeArray((16 * k, I), np.float32)
    out = FakeArray((m, H), np.float32)
    mk.gate_up(m, _mx((E, 2 * I, H)), b, act, bias=FakeArray((E, 2 * I), np.uint16), activation="swiglu_oai",
               limit=7.0)
    mk.down(m, _mx((E, H, I)), b, act, out, accumulate=True, bias=FakeArray((E, H), np.uint16))
    mk.down(m, _mx((E, H, I)), b, act, out, accumulate=False, shared=(FakeArray((H, 32), np.uint16),
                                                                      FakeArray((m, 32), np.float32)))
    mk.dequant_bf16(_mx((E, H, I)), 5, FakeArray((H, I), np.uint16))
    params = _moe_params()
    mt = next(t for t in moe_kernels.MOE_MTS if t >= m)
    assert [c[0] for c in kern.calls] == [moe_kernels.gate_up_name(mt, "mxfp4")] + [
        moe_kernels.down_name(mt, "mxfp4")] * 2 + ["moe_dequant_bf16_kernel<MoeMxfp4>"]
    for name, args in kern.calls:
        kinds = params[name.split("<")[0]]
        assert len(args) == len(kinds), f"{name}: {len(args)} arguments, the kernel takes {len(kinds)}"
        for i, (a, kind) in enumerate(zip(args, kinds)):
            assert KIND_OK[kind](a), f"{name}: argument {i} is {type(a).__name__}, the kernel takes {kind}"
    gate_up = kern.calls[0][1]
    assert [int(a) for a in gate_up[3:7]] == [2 * I, 1, 32, H // 32]  # SB, srow, bk, KB: a scale byte a chunk
    assert [int(kern.calls[i][1][18]) for i in (1, 2)] == [0, 0]  # s_fmt: a bf16 shared expert
    assert int(kern.calls[3][1][6]) == 5  # the expert the dequantization reads


def test_the_mxfp4_experts_wrappers_refuse_what_the_kernels_cannot_read(kern):  # noqa: F811
    E, H, I, k = 8, 64, 96, 4  # noqa: E741, N806
    mk, b = _moe(kern), _buffers(k, H)
    act = FakeArray((16 * k, I), np.float32)
    out = FakeArray((1, H), np.float32)
    with pytest.raises(ValueError, match="multiples of 32"):
        mk.down(1, _mx((E, H, 48)), b, FakeArray((16 * k, 48), np.float32), out, accumulate=False)
    with pytest.raises(ValueError, match=r"blocks of 1 x 32"):
        mk.gate_up(1, _mx((E, 2 * I, H), bk=64, scale_shape=(E, 2 * I, 1)), b, act)
    with pytest.raises(ValueError, match="w_gate_up: expected shape"):
        mk.gate_up(1, _mx((E, 2 * I, H), data_shape=(E, 2 * I, H)), b, act)  # one byte a weight, not two codes
    with pytest.raises(ValueError, match="scale: expected uint8"):
        mk.gate_up(1, _mx((E, 2 * I, H), scale_dtype=np.float32), b, act)
    with pytest.raises(ValueError, match="an MXFP4 shared expert takes MXFP4 experts"):
        mk.down(1, FakeArray((E, H, I), np.uint16), b, act, out, accumulate=False,
                shared=(_mx((H, 64)), FakeArray((1, 64), np.float32)))
    with pytest.raises(ValueError, match="no dequantization kernel for bf16 experts"):
        mk.dequant_bf16(FakeArray((E, H, I), np.uint16), 0, FakeArray((H, I), np.uint16))
    with pytest.raises(ValueError, match="expert 8 of 8"):
        mk.dequant_bf16(_mx((E, H, I)), 8, FakeArray((H, I), np.uint16))
    assert not kern.calls
