"""4-bit weights (NVFP4: ModelOpt and compressed-tensors; compressed-tensors' symmetric int4) through the CUDA engine's
Python side on the CPU (backends/cuda/w4.py: upload as padded words and scales, fused parts, the rows path with
its norm / SwiGLU fused in the GEMV, the prefill path's dequantization, NVFP4's e4m3 scales and row factors), with the
4-bit kernels (qgemv.cu) replaced by NumPy implementations of their documented contracts and test_cuda_plumbing's
stand-ins for the rest. The kernels themselves are tested on a GPU (tests/gpu/test_w4.py); their module compiles with
nvcc in tests/test_cuda_module_sources.py.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from metrale_cli.model import open_model

pytest.importorskip("metrale_cli.backends.cuda.kernels")
from metrale_cli.backends.cuda import w4 as cuda_w4  # noqa: E402
from metrale_cli.backends.cuda.kernels import w4 as w4_kernels  # noqa: E402

from test_extension_points import cuda_plumbing, fake_cuda_engine, host_rows, rel  # noqa: E402
from test_cuda_fp8_plumbing import quantized_gemv  # noqa: E402
from test_quantized_compressed import FIXTURES, edited, modelopt_llama  # noqa: E402

# The engine's stand-ins (bf16 activations, KV cache, norms and lm_head) against the fp32 NumPy engine, as in
# test_cuda_fp8_plumbing; the uploaded weights themselves are checked bit for bit below.
TOL = 3e-2
# One decode row after a trim is noisier than the prefill's rows (its own max |logit| the scale): over 80 draws each,
# modelopt reached 1.0e-2, ct_nvfp4 1.8e-2 and ct_w4a16 3.5e-2 (beyond 3e-2 in 2 of about 90 runs, 4.4e-2 the
# largest seen); a wiring error is O(1).
DECODE_TOL = 6e-2
GATE = "projections read as stored by the quantized GEMV (FP8, NVFP4, int4)"


class NumpyW4Kernels:
    """The 4-bit kernels' contracts in NumPy (the same signatures as kernels/w4.W4Kernels)."""

    calls: list[tuple] = []

    @staticmethod
    def values(w, scale, group: int, code: str, scales: str, factor, k: int) -> np.ndarray:
        """fp32 [N, K]: code k of a row in bits 4 (k % 8) of word k / 8 (the padding words past K / 8 unread),
        e2m1 or q - 8, times scale[n, k / group] (fp32, or fp32(e4m3) times / over factor[n])."""
        from metrale_cli.models.quantized.mxfp4 import E2M1

        words = np.asarray(w)
        assert words.dtype == np.uint32 and words.shape[1] == -(-k // 32) * 4 and k % 8 == 0 and group % 8 == 0
        nib = (words[:, :k // 8, None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
        nib = nib.reshape(words.shape[0], k)
        v = E2M1[nib] if code == "e2m1" else (nib.astype(np.int32) - 8).astype(np.float32)
        assert np.asarray(scale).shape == (words.shape[0], -(-k // group))
        if scales == "f32":
            s = np.asarray(scale, np.float32)
        else:
            e = np.asarray(scale).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
            f = np.asarray(factor, np.float32)[:, None]
            s = e * f if scales == "e4m3_mul" else e / f
        return v * np.repeat(s, group, axis=1)[:, :k]

    def gemv(self, x, w, scale, group, code, scales, factor, out, bias=None, *, accumulate=False, swiglu=False,
             norm_weight=None, eps=1e-6, norm_offset=0.0, activation="silu", stream=None):
        assert 1 <= x.shape[0] <= 16
        self.calls.append(("gemv", code, group))
        quantized_gemv(x, self.values(w, scale, group, code, scales, factor, x.shape[1]), out, bias, accumulate,
                       swiglu, norm_weight, eps, norm_offset, activation)

    def dequant_bf16(self, w, scale, group, code, scales, factor, out, *, stream=None):
        self.calls.append(("dequant", code, group))
        values = self.values(w, scale, group, code, scales, factor, out.shape[1])
        out[...] = np.asarray(values.astype(ml_dtypes.bfloat16)).view(np.uint16)


def test_the_stand_ins_take_the_real_signatures():
    def shape(f):  # names, kinds and defaults; annotations aside
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]

    for name in ("gemv", "dequant_bf16"):
        assert shape(getattr(NumpyW4Kernels, name)) == shape(getattr(w4_kernels.W4Kernels, name)), name


@pytest.fixture
def fake_w4(monkeypatch):
    NumpyW4Kernels.calls = []
    monkeypatch.setattr(cuda_w4, "_kernels", lambda kern: NumpyW4Kernels())
    return NumpyW4Kernels


def _random_codes(name: str):
    """Fixture `name`'s packed codes redrawn (fresh weights under the fixture's scales)."""
    rng = np.random.default_rng()

    def edit(tensors, qc):
        for n in [n for n in tensors if n.endswith("weight_packed")]:
            a = tensors[n]
            tensors[n] = rng.integers(np.iinfo(a.dtype).min, np.iinfo(a.dtype).max, a.shape, dtype=a.dtype,
                                      endpoint=True)

    return edit


def _checkpoint(kind: str, tmp_path: Path) -> Path:
    if kind == "modelopt":
        return modelopt_llama(tmp_path, np.random.default_rng())[0]
    name = {"ct_nvfp4": "llama_ct_nvfp4", "ct_w4a16": "llama_ct_w4a16"}[kind]
    return edited(tmp_path, name, _random_codes(name))


@pytest.mark.parametrize("kind,code", [("modelopt", "e2m1"), ("ct_nvfp4", "e2m1"), ("ct_w4a16", "int4")])
@pytest.mark.parametrize("rows_path", ["rows", "fused"])
def test_w4_weights_run_through_the_cuda_engine(tmp_path, fake_w4, kind, code, rows_path, monkeypatch):
    plumbing = cuda_plumbing()
    from metrale_cli.backends.cuda.projections import Projections

    monkeypatch.setattr(Projections, "gemm_bf16", plumbing._fake_gemm)
    rng = np.random.default_rng()
    path = _checkpoint(kind, tmp_path)
    ids = rng.integers(0, 300, 24).tolist()
    cpu = open_model(path, device="cpu", max_context=40, fp32_logits=True).engine
    e = fake_cuda_engine(plumbing, path, 40, rows_path)
    qkv = e.w.layers[0]["qkv"]
    assert isinstance(qkv, cuda_w4.W4Weight) and qkv.data.dtype == np.uint32 and qkv.code == code  # kept packed
    assert qkv.shape == (128, 64) and qkv.data.shape == (128, 8)  # q, k, v fused: 64 + 32 + 32 rows, 8 words each
    down = e.w.layers[0]["down"]
    assert down.shape == (64, 80) and down.data.shape == (64, 12)  # 10 words a row, padded to 16 bytes
    for run in (lambda x: x.prefill(ids[:20], all_logits=True), lambda x: x.verify(ids[20:24])):
        run(cpu), run(e)
        assert rel(host_rows(e, e.logits_buffer_ptr()), host_rows(cpu, cpu.logits_buffer_ptr())) < TOL
    cpu.trim(21), e.trim(21)
    cpu.decode(5), e.decode(5)
    derr = rel(host_rows(e, e.decode_logits_ptr()), host_rows(cpu, cpu.decode_logits_ptr()))
    print(f"{kind} ({rows_path}): decode after trim {derr:.2e}")
    assert derr < DECODE_TOL
    assert {c[0] for c in fake_w4.calls} == {"gemv", "dequant"}  # the rows path's GEMV and the prefill's dequant
    assert {c[1] for c in fake_w4.calls} == {code}


@pytest.mark.parametrize("kind", ["modelopt", "ct_nvfp4", "ct_w4a16"])
def test_uploaded_w4_weights_are_the_formats_exact_values(tmp_path, kind):
    """Every weight kept as stored, fused parts included, decodes (qgemv.cu's contract) to the format's dequantized
    fp32 values bit for bit (signed zeros too); the size check counts what the device holds: the words, padding
    included, and fp32 scales, the rest bf16."""
    from metrale_cli.backends.cuda import loading
    from metrale_cli.checkpoint import Checkpoint
    from metrale_cli.config import load_config
    from metrale_cli.models import formats

    path = _checkpoint(kind, tmp_path)
    cfg = load_config(path)
    kern = cuda_plumbing().FakeKernels()
    with Checkpoint.open(path) as ckpt:
        w = loading.upload_weights(cfg, ckpt, kern)
        held, checked = 0, 0
        for i, layer in enumerate(cfg.definition.layers):
            for p in layer.params:
                got = w.layers[i][p.key]
                if not (p.format and loading.kept_as_stored(p)):
                    held += int(np.asarray(got).nbytes)
                    continue
                assert isinstance(got, cuda_w4.W4Weight), (i, p.key)
                want = np.concatenate(formats.dequantize(p, lambda n: ckpt.array(n, bf16_bits=True)))
                values = NumpyW4Kernels.values(got.data, got.scale, got.group, got.code, got.scales, got.factor,
                                               got.shape[1])
                assert np.array_equal(values.view(np.uint32), want.astype(np.float32).view(np.uint32)), (i, p.key)
                held += int(got.data.nbytes + got.scale.nbytes + (0 if got.factor is None else got.factor.nbytes))
                checked += 1
    assert checked >= 6
    in_layers = {id(p) for layer in cfg.definition.layers for p in layer.params}
    rest = [p for p in cfg.definition.params() if id(p) not in in_layers]  # embedding, final norm, lm_head: bf16
    assert rest and not any(p.format for p in rest)
    held += sum(2 * int(np.prod(t.shape)) for p in rest for t in p.parts)
    assert loading.device_weight_bytes(cfg.definition) == held


def test_the_quantized_projections_are_gated_until_their_gpu_tests_pass(tmp_path, monkeypatch):
    """Kept as stored and named by the unverified-CUDA gate (loading.UNVERIFIED): --device cuda refuses them unless
    METRALE_CUDA_UNVERIFIED=1 (the 4-bit and FP8 projections, all read by qgemv.cu); 8-bit or asymmetric
    pack-quantized weights, dequantized to bf16 at load, are not gated."""
    from metrale_cli.backends.cuda import loading
    from metrale_cli.config import load_config
    from metrale_cli.errors import DeviceError

    paths = [FIXTURES / "models" / "llama_ct_nvfp4", FIXTURES / "models" / "llama_ct_w4a16",
             modelopt_llama(tmp_path, np.random.default_rng())[0]]
    for path in paths:
        d = load_config(path).definition
        assert loading.unsupported_features(d) == [] and loading.unverified_features(d) == [GATE], path.name
        assert {p.key for p in d.params() if loading.kept_as_stored(p)} >= {"qkv", "o", "gate_up", "down"}
    for name, stored in (("llama_fp8_block", True), ("qwen3_ct_fp8_tensor", False), ("llama_ct_fp8_channel", False)):
        d = load_config(FIXTURES / "models" / name).definition  # compressed-tensors FP8: dequantized to bf16 at load
        assert any(loading.kept_as_stored(p) for p in d.params()) == stored, name
        assert loading.unverified_features(d) == ([GATE] if stored else []), name
    monkeypatch.delenv(loading.UNVERIFIED_ENV, raising=False)
    with pytest.raises(DeviceError, match=re.escape(f"{GATE} have not passed their GPU tests")):
        loading.load_cuda_engine(load_config(paths[0]), None, 32)


@pytest.mark.parametrize("params,takes", [
    ({"bits": 4, "asym": False, "strategy": "group", "group": 128}, True),
    ({"bits": 4, "asym": False, "strategy": "channel", "group": 0}, True),
    ({"bits": 4, "asym": False, "strategy": "tensor", "group": 0}, True),
    ({"bits": 4, "asym": False, "strategy": "group", "group": 12}, False),  # a word would straddle two groups
    ({"bits": 4, "asym": True, "strategy": "group", "group": 128}, False),
    ({"bits": 8, "asym": False, "strategy": "group", "group": 128}, False),
])
def test_which_pack_quantized_schemes_the_int4_gemv_takes(params, takes):
    from metrale_cli.backends.cuda.formats import cuda_format

    cuda_format("fp8_block")  # imports the built-in entries
    from metrale_cli.backends.cuda.formats import _FORMATS

    assert _FORMATS["ct_pack"].accepts(params) is takes


def test_an_input_width_the_w4_gemv_cannot_take_is_refused():
    from types import SimpleNamespace

    from metrale_cli.models.spec import Tensor

    p = SimpleNamespace(key="down", parts=(Tensor("model.layers.0.mlp.down_proj.weight", (64, 84)),))
    assert cuda_w4._refuses(p) == "down in 4 bits with an input width of 84 (the 4-bit GEMV takes multiples of 8)"
    assert cuda_w4._refuses(SimpleNamespace(key="down", parts=(Tensor("w", (64, 88)),))) is None


def test_words_pad_each_row_to_16_bytes_and_keep_the_nibble_order():
    rng = np.random.default_rng()
    for k in (8, 32, 48, 96):
        codes = rng.integers(0, 16, (5, k)).astype(np.uint8)
        nvfp4 = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)  # two a byte, the low nibble first
        packed = np.zeros((5, k // 8), np.uint32)
        for i in range(8):  # value i at bit 4 i of its word
            packed |= codes[:, i::8].astype(np.uint32) << np.uint32(4 * i)
        for stored in (nvfp4, packed.view(np.int32)):
            w = cuda_w4.words(stored, k)
            assert w.dtype == np.uint32 and w.shape == (5, -(-k // 32) * 4)
            assert not w[:, k // 8:].any()
            got = ((w[:, :k // 8, None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF).reshape(5, k)
            assert np.array_equal(got, codes)


@pytest.mark.parametrize("preset,low,high", [("llama-3.1-8b-nvfp4", 0.35, 0.38), ("llama-3.1-8b-w4a16", 0.35, 0.37)])
def test_the_4_bit_presets_are_counted_in_the_bytes_the_device_holds(preset, low, high):
    """The size check and the bench's GPU floor count the 4-bit projections as held: half a byte a value and a scale
    per group (NVFP4: an e4m3 byte per 16 values and a 4-byte factor a row; the W4A16 preset: fp32 per 128), the
    embedding and lm_head in bf16; an 8B model then holds under half its bf16 bytes. The floor is the same bytes but
    the embedding table (one row read a step)."""
    from types import SimpleNamespace

    from metrale_cli.backends.cuda import loading
    from metrale_cli.bench import preset_path
    from metrale_cli.floors import weight_bytes
    from metrale_cli.config import load_config

    cfg = load_config(preset_path(preset))
    d = cfg.definition
    stored = [p for p in d.params() if loading.kept_as_stored(p)]
    assert {p.key for p in stored} == {"qkv", "o", "gate_up", "down"}
    values = sum(int(np.prod(t.shape)) for p in stored for t in p.parts)
    rows = sum(t.shape[0] for p in stored for t in p.parts)
    scales = values // 16 + 4 * rows if preset.endswith("nvfp4") else 4 * values // 128
    assert sum(loading.stored_param_bytes(p) for p in stored) == values // 2 + scales
    held = loading.device_weight_bytes(d)
    assert low < held / (2 * d.parameter_count()) < high
    floor, _ = weight_bytes(SimpleNamespace(), cfg, 2)
    assert held - floor == 2 * cfg.vocab_size * cfg.hidden_size
