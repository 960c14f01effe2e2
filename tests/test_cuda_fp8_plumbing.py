"""FP8 weights through the CUDA engine's Python side on the CPU (backends/cuda/fp8.py: upload, fused parts' scales,
the rows path with its norm / SwiGLU fused in the GEMV, the prefill path's dequantization), with the FP8 kernels
(qgemv.cu, fp8.cu) replaced by NumPy implementations of their documented contracts and test_cuda_plumbing's
stand-ins for the rest. The kernels themselves are tested on a GPU (tests/gpu/test_fp8.py); their module compiles
with nvcc in tests/test_cuda_module_sources.py.
"""

from __future__ import annotations

import inspect

import ml_dtypes
import numpy as np
import pytest

from metrale_cli.model import open_model

pytest.importorskip("metrale_cli.backends.cuda.kernels")
from metrale_cli.backends.cuda import fp8 as cuda_fp8  # noqa: E402
from metrale_cli.backends.cuda.kernels import fp8 as fp8_kernels  # noqa: E402

from test_extension_points import cuda_plumbing, fake_cuda_engine, host_rows, rel  # noqa: E402
from test_quantized_fp8 import FIXTURES, quantize_llama  # noqa: E402

# The engine's stand-ins (bf16 activations, KV cache, norms and lm_head) against the fp32 NumPy engine on these
# random models: about 1.2e-2 (a wiring error, a scale applied to the wrong block, is O(1)). The fused weights
# themselves are checked exactly below.
TOL = 3e-2


def quantized_gemv(x, w, out, bias, accumulate, swiglu, norm_weight, eps, norm_offset, activation) -> None:
    """qgemv.cu's contract in NumPy on the dequantized weight w f32 [N, K]: the RMSNorm of x first (norm_weight
    bf16 bits, norm_offset added), then x @ w.T (+ bias); with swiglu act(gate) * up of w's two halves."""
    x = np.asarray(x, np.float32)
    if norm_weight is not None:
        nw = (np.asarray(norm_weight).astype(np.uint32) << 16).view(np.float32) + np.float32(norm_offset)
        x = x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + np.float32(eps)) * nw
    y = x @ w.T
    if bias is not None:
        y += (np.asarray(bias).astype(np.uint32) << 16).view(np.float32)
    if swiglu:
        g, u = np.split(y, 2, axis=1)
        act = (g / (1 + np.exp(-g)) if activation == "silu"
               else 0.5 * g * (1 + np.tanh(0.7978845608 * (g + 0.044715 * g ** 3))))
        y = act * u
    out[...] = y + out if accumulate else y


class NumpyFp8Kernels:
    """The FP8 kernels' contracts in NumPy (the same signatures as kernels/fp8.Fp8Kernels)."""

    calls: list[tuple[str, int, int]] = []
    quantized: list = []  # act_quant's outputs, in order

    @staticmethod
    def _weight(w, scale, srow, bk) -> np.ndarray:
        q = np.asarray(w).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        s = np.repeat(np.repeat(np.asarray(scale), srow, 0)[:q.shape[0]], bk, 1)[:, :q.shape[1]]
        return q * s

    def gemv(self, x, w, scale, srow, bk, out, bias=None, *, accumulate=False, swiglu=False, norm_weight=None,
             eps=1e-6, norm_offset=0.0, activation="silu", stream=None):
        assert 1 <= x.shape[0] <= 16 and w.shape[1] % 16 == 0 and bk % 16 == 0
        self.calls.append(("gemv", srow, bk, any(x is q for q in self.quantized[-1:])))
        quantized_gemv(x, self._weight(w, scale, srow, bk), out, bias, accumulate, swiglu, norm_weight, eps,
                       norm_offset, activation)

    def dequant_bf16(self, w, scale, srow, bk, out, *, stream=None):
        self.calls.append(("dequant", srow, bk))
        out[...] = np.asarray(self._weight(w, scale, srow, bk).astype(ml_dtypes.bfloat16)).view(np.uint16)

    def act_quant(self, x, group, ue8m0, static_scale, out, *, stream=None):
        from metrale_cli.models.quantized import activations

        self.calls.append(("act_quant", group, ue8m0 if static_scale is None else float(np.asarray(static_scale)[0])))
        x = np.asarray(x, np.float32)
        out[...] = (activations.e4m3_groups(x, group, ue8m0) if static_scale is None
                    else activations.e4m3_static(x, np.asarray(static_scale, np.float32)[0]))
        self.quantized.append(out)


def test_the_stand_ins_take_the_real_signatures():
    def shape(f):  # names, kinds and defaults; annotations aside
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]

    for name in ("gemv", "dequant_bf16", "act_quant"):
        assert shape(getattr(NumpyFp8Kernels, name)) == shape(getattr(fp8_kernels.Fp8Kernels, name)), name


@pytest.fixture
def fake_fp8(monkeypatch):
    NumpyFp8Kernels.calls, NumpyFp8Kernels.quantized = [], []
    monkeypatch.setattr(cuda_fp8, "_kernels", lambda kern: NumpyFp8Kernels())
    return NumpyFp8Kernels


@pytest.mark.parametrize("block", [(16, 16), (48, 32)])
@pytest.mark.parametrize("rows_path", ["rows", "fused"])
def test_fp8_weights_run_through_the_cuda_engine(tmp_path, fake_fp8, block, rows_path, monkeypatch):
    plumbing = cuda_plumbing()
    from metrale_cli.backends.cuda.projections import Projections

    monkeypatch.setattr(Projections, "gemm_bf16", plumbing._fake_gemm)
    rng = np.random.default_rng()
    path, _ = quantize_llama(tmp_path, block, rng)
    ids = rng.integers(0, 300, 24).tolist()
    cpu = open_model(path, device="cpu", max_context=40, fp32_logits=True).engine
    e = fake_cuda_engine(plumbing, path, 40, rows_path)
    qkv = e.w.layers[0]["qkv"]
    assert isinstance(qkv, cuda_fp8.Fp8Weight) and qkv.data.dtype == np.uint8  # kept as e4m3 bytes
    # 48-row blocks do not divide q's 64 rows: the fused qkv's scales are expanded to one per row
    assert qkv.srow == (1 if block[0] == 48 else block[0]) and qkv.scale.shape == (-(-128 // qkv.srow), 64 // block[1])
    for run in (lambda x: x.prefill(ids[:20], all_logits=True), lambda x: x.verify(ids[20:24])):
        run(cpu), run(e)
        assert rel(host_rows(e, e.logits_buffer_ptr()), host_rows(cpu, cpu.logits_buffer_ptr())) < TOL
    cpu.trim(21), e.trim(21)
    cpu.decode(5), e.decode(5)
    assert rel(host_rows(e, e.decode_logits_ptr()), host_rows(cpu, cpu.decode_logits_ptr())) < TOL
    # the fused qkv / gate_up as uploaded (scales concatenated or expanded) == each part's exact dequantization
    from metrale_cli.checkpoint import Checkpoint
    from metrale_cli.config import load_config
    from metrale_cli.models import formats

    cfg = load_config(path)
    with Checkpoint.open(path) as ckpt:
        for p in cfg.definition.layers[1].params:
            if p.format is not None:
                w = e.w.layers[1][p.key]
                want = np.concatenate(formats.dequantize(p, lambda n: ckpt.array(n, bf16_bits=True)))
                assert np.array_equal(NumpyFp8Kernels._weight(w.data, w.scale, w.srow, w.bk), want), p.key
    kinds = {c[0] for c in fake_fp8.calls}
    assert kinds == {"gemv", "dequant"}  # the rows path's GEMV and the prefill's dequantization both ran


def test_what_the_fp8_gemv_cannot_take_is_dequantized_to_bf16():
    """A projection in a block width the FP8 GEMV cannot take (8-wide blocks: a 16-byte load would span two scales)
    is dequantized and rounded to bf16 at load instead (run on an H100 in session 18: not gated)."""
    from metrale_cli.backends.cuda.loading import kept_as_stored, unsupported_features, unverified_features
    from metrale_cli.config import load_config

    d = load_config(FIXTURES / "models" / "qwen3_moe_fp8_block").definition
    assert unsupported_features(d) == [] and unverified_features(d) == []
    assert not any(kept_as_stored(p) for p in d.params())  # 8x8 blocks: every FP8 weight dequantized at load
    for name in ("llama_fp8_block", "qwen3_fp8_tensor"):  # every projection through the FP8 GEMV
        d = load_config(FIXTURES / "models" / name).definition
        assert unsupported_features(d) == [] and all(kept_as_stored(p) for p in d.params() if p.format)


def test_fp8_experts_the_moe_kernels_cannot_read_are_uploaded_as_their_exact_values_rounded_to_bf16(tmp_path):
    """Experts whose input width is not a multiple of 16 (here down_proj's 40) are dequantized exactly (formats.py) and
    rounded to bf16 once at load; gate/up (64 wide) stay FP8 for the MoE kernels' FP8 variants
    (tests/test_cuda_fp8_moe_plumbing.py), the projections FP8 for the GEMV."""
    import json

    from metrale_cli.backends.cuda import loading
    from metrale_cli.checkpoint import Checkpoint
    from metrale_cli.config import load_config
    from metrale_cli.logits import fp32_to_bf16_bits
    from metrale_cli.models import formats

    src = FIXTURES / "models" / "qwen3_moe_fp8_block"
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [16, 16]
    for f in src.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config = load_config(tmp_path)
    assert loading.unsupported_features(config.definition) == []
    stored = {p.key for p in config.definition.params() if loading.kept_as_stored(p)}
    assert {"qkv", "o", "experts_gate_up"} <= stored and "experts_down" not in stored
    kern = cuda_plumbing().FakeKernels()
    with Checkpoint.open(tmp_path) as ckpt:
        w = loading.upload_weights(config, ckpt, kern)
        checked = 0
        for i, layer in enumerate(config.definition.layers):
            for p in layer.params:
                if p.format is None:
                    continue
                got = w.layers[i][p.key]
                if loading.kept_as_stored(p):
                    assert isinstance(got, (cuda_fp8.Fp8Weight, cuda_fp8.Fp8Experts)), p.key
                    continue
                want = np.stack(formats.dequantize(p, lambda n: ckpt.array(n, bf16_bits=True)))
                assert np.array_equal(np.asarray(got).reshape(want.shape), fp32_to_bf16_bits(want)), (i, p.key)
                checked += 1
    assert checked >= 2


def test_an_fp8_input_width_the_gemv_cannot_take_is_refused(tmp_path):
    import json

    from metrale_cli.backends.cuda.loading import unsupported_features
    from metrale_cli.config import load_config

    cfg = json.loads((FIXTURES / "models" / "llama_fp8_block" / "config.json").read_text())
    cfg["intermediate_size"] = 88  # down_proj's input: not a multiple of 16
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    found = unsupported_features(load_config(tmp_path).definition)
    assert found == ["down in FP8 with an input width of 88 (the FP8 GEMV takes multiples of 16)"]


@pytest.mark.parametrize("scheme", ["dynamic", "ue8m0", "static"])
def test_activation_quant_emulate_runs_on_the_cuda_engine(tmp_path, fake_fp8, monkeypatch, scheme):
    """`--activation-quant emulate` on the CUDA engine: each FP8 weight's input is quantized as its scheme says (per
    token and 16 columns, rounded up to powers of two under ue8m0, or the checkpoint's static activation_scale: the
    largest of a fused weight's parts), and what the rows path's GEMV and the prefill's GEMM multiply is that
    quantized input. The logits are checked only loosely against the NumPy engine's emulation: quantizing is a
    step function, so the stand-ins' bf16 roundings upstream move some values across an e4m3 rounding boundary
    (measured 5-6e-2 relative on these models, against 1e-2 without emulation; the wiring errors this catches
    are O(1)); the kernel's values are tested exactly on a GPU (tests/gpu/test_fp8.py)."""
    plumbing = cuda_plumbing()
    from metrale_cli.backends.cuda.projections import Projections

    gemm_inputs = []

    def gemm(proj, x, w, bias=None, accumulate_into=None):
        gemm_inputs.append(any(x is q for q in NumpyFp8Kernels.quantized[-1:]))
        return plumbing._fake_gemm(proj, x, w, bias, accumulate_into)

    monkeypatch.setattr(Projections, "gemm_bf16", gemm)
    rng = np.random.default_rng()
    scales = {}

    def edit(tensors, config):
        if scheme == "ue8m0":
            config["quantization_config"]["scale_fmt"] = "ue8m0"
        if scheme == "static":
            config["quantization_config"]["activation_scheme"] = "static"
            for name in [n for n in tensors if n.endswith("proj.weight")]:
                scales[name] = np.float32(rng.uniform(0.005, 0.02))
                tensors[name.removesuffix("weight") + "activation_scale"] = np.array(scales[name], np.float32)

    path, _ = quantize_llama(tmp_path, (16, 16), rng, edit)
    ids = rng.integers(0, 300, 24).tolist()
    cpu = open_model(path, device="cpu", max_context=40, fp32_logits=True, activation_quant="emulate").engine
    e = fake_cuda_engine(plumbing, path, 40, "rows", activation_quant="emulate")
    for run in (lambda x: x.prefill(ids[:20], all_logits=True), lambda x: x.verify(ids[20:24])):
        run(cpu), run(e)
        assert rel(host_rows(e, e.logits_buffer_ptr()), host_rows(cpu, cpu.logits_buffer_ptr())) < 0.2
    quant = [c for c in fake_fp8.calls if c[0] == "act_quant"]
    gemvs = [c for c in fake_fp8.calls if c[0] == "gemv"]
    dequants = [c for c in fake_fp8.calls if c[0] == "dequant"]
    assert len(quant) == len(gemvs) + len(dequants) and gemvs and dequants  # every FP8 product, both paths
    assert all(c[3] for c in gemvs)  # each GEMV multiplies the quantized input ...
    assert sum(gemm_inputs) == len(dequants)  # ... and so does each FP8 GEMM (the bf16 lm_head's input is not)
    if scheme == "static":
        qkv = max(scales[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
        assert ("act_quant", 64, qkv) in quant  # hidden 64: one group, the fused parts' largest scale
    else:
        assert {c[1:] for c in quant} == {(16, scheme == "ue8m0")}
    none = fake_cuda_engine(plumbing, path, 40, "rows")
    fake_fp8.calls.clear()
    none.prefill(ids[:20])
    assert not any(c[0] == "act_quant" for c in fake_fp8.calls)


def test_activation_quant_emulate_on_cuda_refuses_what_it_cannot_quantize():
    """Weights the CUDA engine dequantizes to bf16 at load (here compressed-tensors FP8 per channel; FP8 experts)
    lose their scheme: `--activation-quant emulate` on cuda names the first one (exit 2) instead of running them
    unquantized; formats without an input scheme (weight-only) need nothing."""
    from metrale_cli.backends.cuda.loading import check_activation_quant
    from metrale_cli.config import load_config
    from metrale_cli.errors import UsageError

    for name, tensor in (("llama_ct_fp8_channel", "model.layers.0.self_attn.q_proj.weight"),
                         ("qwen3_moe_fp8_block", "model.layers.0.self_attn.q_proj.weight")):
        with pytest.raises(UsageError, match=rf"--activation-quant emulate: {tensor} \(.*\) is dequantized to bf16"):
            check_activation_quant(load_config(FIXTURES / "models" / name).definition)
    for name in ("llama_fp8_block", "qwen3_fp8_tensor"):
        check_activation_quant(load_config(FIXTURES / "models" / name).definition)
    with pytest.raises(UsageError, match="does not run under --tp"):
        open_model(FIXTURES / "models" / "llama_fp8_block", device="cpu", tp=2, activation_quant="emulate")

