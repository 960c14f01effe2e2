"""A new mixer kind and a new weight format added through the public extension points only, as a family
module would add them (docs/ADDING_AN_ARCHITECTURE.md):

- a toy mixer kind, "uniform attention" (every visible position weighs the same: the output at position
  p is the mean of v over positions 0..p), registered with engine.mixers.register_mixer, with a NumPy
  implementation and its own cache state; checked against a plain NumPy forward written here, through
  prefill, decode, verify and trim;
- a toy weight format, "row_scaled" (a BF16 weight stored divided by a per-row F32 scale, the scale
  beside it as `<name>_row_scale`), registered with formats.register_format and a quant_method; a
  checkpoint stored that way must give exactly the logits of the same weights stored dense in F32, and a
  mis-shaped scale is refused before anything loads.

The same two run through the CUDA engine's Python side in tests/test_cuda_plumbing.py's stand-ins.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
from safetensors.numpy import save_file

from engine_rows import rel, rows

from metrale_cli.models import formats
from metrale_cli.backends.numpy.ops import as_fp32
from metrale_cli.checkpoint import Checkpoint
from metrale_cli.engine.ops import sublayer_out
from metrale_cli.engine.mixers import MixerKind, register_mixer
from metrale_cli.config import load_config
from metrale_cli.errors import CheckpointError
from metrale_cli.logits import bf16_bits, bf16_bits_to_fp32, fp32_to_bf16
from metrale_cli.model import open_model
from metrale_cli.models import FAMILIES, llama
from metrale_cli.models.model_config import Family
from metrale_cli.models.spec import Param, Tensor

# ---- the toy mixer kind ------------------------------------------------------------------------------


@dataclass(frozen=True)
class UniformSpec:
    kind: ClassVar[str] = "uniform_test"
    width: int  # v's width


def uniform_forward(ops, i, layer, lw, x):
    # v is hidden-wide in this toy, so the CUDA rows path can hold it in its `h` activation buffer
    v = ops.linear(x, lw["v"], out="h", norm=(lw["input_norm"], layer.norm))  # [T, width]
    y = ops.mixer(i).mean(v, i)
    return sublayer_out(ops, y, lw["o"], None, None, layer.norm, x, f"model.layers.{i}.self_attn", "")


class UniformState:
    """Every v row written so far, per layer (the kind's cache); a trim keeps the first rows."""

    def __init__(self, engine, layers):
        width = engine.cfg.definition.layers[layers[0]].mixer.width
        self.v = {i: np.zeros((engine.max_context, width), np.float32) for i in layers}
        self.nbytes = sum(a.nbytes for a in self.v.values())

    def reset(self):
        pass

    def trim(self, length):
        pass  # positions past the engine's length are overwritten by the next pass


class NumpyUniform:
    """The kind's NumPy implementation (what MixerKind.backends["numpy"] names)."""

    state = UniformState

    class ops:
        def __init__(self, p, state):
            self.p, self.state = p, state

        def mean(self, v, layer):
            start, t = self.p.start, self.p.t
            rows = self.state.v[layer]
            rows[start:start + t] = v
            return np.cumsum(rows[:start + t], axis=0)[start:] / np.arange(start + 1, start + t + 1, dtype=np.float32)[:, None]


class CudaUniform:
    """The kind's CUDA implementation (MixerKind.backends["cuda"]), in CuPy array ops: every pass type has the
    rows' positions on the device (`pass_.pos`), so the same code serves the rows, fused and prefill passes."""

    WEIGHT_KEYS = {"input_norm", "v", "o"}

    class state:
        def __init__(self, engine, layers):
            cp, width = engine.cp, engine.cfg.definition.layers[layers[0]].mixer.width
            self.v = {i: cp.zeros((engine.max_context, width), cp.float32) for i in layers}
            self.nbytes = sum(int(a.nbytes) for a in self.v.values())

        def reset(self):
            pass

        def trim(self, length):
            pass

    class ops:
        def __init__(self, p, state):
            self.p, self.state = p, state

        def mean(self, v, layer):
            cp, pos = self.p.e.cp, self.p.pos  # positions [m] (int32, on the device)
            rows = self.state.v[layer]
            rows[pos] = v
            seen = (cp.arange(rows.shape[0])[None, :] <= pos[:, None]).astype(cp.float32)  # [m, ctx]
            return (seen @ rows) / (pos[:, None] + 1).astype(cp.float32)


UNIFORM = register_mixer(MixerKind("uniform_test", uniform_forward, lambda p, layer: [f"{p}.self_attn"],
                                   backends={"numpy": NumpyUniform, "cuda": CudaUniform}))


def uniform_define(cfg):
    """llama's block with the uniform mixer in place of attention: v_proj and o_proj, no q/k."""
    base = llama.define(cfg)
    width, h = cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size
    layers = []
    for i, layer in enumerate(base.layers):
        s = f"model.layers.{i}.self_attn."
        params = tuple(p for p in layer.params if p.key != "qkv") + (Param.of("v", (s + "v_proj.weight", (width, h))),)
        layers.append(replace(layer, mixer=UniformSpec(width), params=params))
    return replace(base, layers=tuple(layers))


FAMILIES["uniform_test"] = Family("uniform_test", "-", llama.parse, uniform_define, "a test's toy mixer kind")


def bf16_round(x):
    return bf16_bits(fp32_to_bf16(np.asarray(x, np.float32)))


def write_checkpoint(path: Path, config: dict, tensors: dict[str, np.ndarray]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


CONFIG = dict(model_type="uniform_test", vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5, max_position_embeddings=64,
              tie_word_embeddings=False, torch_dtype="float32")


def uniform_weights(rng) -> dict[str, np.ndarray]:
    h, i, v, w = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"], 32
    out = {"model.embed_tokens.weight": rng.standard_normal((v, h)), "model.norm.weight": 1 + 0.1 * rng.standard_normal(h),
           "lm_head.weight": rng.standard_normal((v, h)) * 0.3}
    for layer in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out |= {p + "input_layernorm.weight": 1 + 0.1 * rng.standard_normal(h),
                p + "post_attention_layernorm.weight": 1 + 0.1 * rng.standard_normal(h),
                p + "self_attn.v_proj.weight": rng.standard_normal((w, h)) * 0.3,
                p + "self_attn.o_proj.weight": rng.standard_normal((h, w)) * 0.3,
                p + "mlp.gate_proj.weight": rng.standard_normal((i, h)) * 0.3,
                p + "mlp.up_proj.weight": rng.standard_normal((i, h)) * 0.3,
                p + "mlp.down_proj.weight": rng.standard_normal((h, i)) * 0.3}
    return {k: np.asarray(a, np.float32) for k, a in out.items()}


def plain_forward(w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """The toy model written out in NumPy (the independent reference): logits [T, V]."""
    def norm(x, g):
        return g * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(1e-5)))

    x = w["model.embed_tokens.weight"][ids]
    n = np.arange(1, len(ids) + 1, dtype=np.float32)[:, None]
    for layer in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        v = norm(x, w[p + "input_layernorm.weight"]) @ w[p + "self_attn.v_proj.weight"].T
        x = x + (np.cumsum(v, axis=0) / n) @ w[p + "self_attn.o_proj.weight"].T
        hn = norm(x, w[p + "post_attention_layernorm.weight"])
        g, u = hn @ w[p + "mlp.gate_proj.weight"].T, hn @ w[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
    return norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def host_rows(engine, ptr) -> np.ndarray:
    """The fp32 rows of a logits region, read through the ModelLogits interface."""
    return rows(engine, ptr, ptr.rows)


def test_a_toy_mixer_kind_runs_prefill_decode_verify_and_trim(tmp_path):
    rng = np.random.default_rng(5)
    w = uniform_weights(rng)
    model = open_model(write_checkpoint(tmp_path / "uniform", CONFIG, w), device="cpu", max_context=32,
                       fp32_logits=True)
    e = model.engine
    ids = rng.integers(0, CONFIG["vocab_size"], 12).tolist()
    want = plain_forward(w, ids)
    assert e.prefill(ids[:7], all_logits=True) == 7
    np.testing.assert_allclose(host_rows(e, e.logits_buffer_ptr()), want[:7], rtol=2e-5, atol=2e-5)
    e.decode(ids[7])
    np.testing.assert_allclose(host_rows(e, e.decode_logits_ptr())[0], want[7], rtol=2e-5, atol=2e-5)
    e.verify(ids[8:12])  # k draft tokens in one pass
    np.testing.assert_allclose(host_rows(e, e.logits_buffer_ptr()), want[8:12], rtol=2e-5, atol=2e-5)
    e.trim(9)  # reject the last three drafts, then take another path
    other = ids[:9] + [3, 4]
    e.verify(other[9:])
    np.testing.assert_allclose(host_rows(e, e.logits_buffer_ptr()), plain_forward(w, other)[9:], rtol=2e-5, atol=2e-5)
    model.close()


# ---- the toy weight format ---------------------------------------------------------------------------


def _row_scale_of(t: Tensor) -> tuple[Tensor, ...]:
    return (Tensor(t.name + "_row_scale", (t.shape[0],)),)


ROW_SCALED = formats.register_format(formats.WeightFormat(
    "row_scaled_test", companions=_row_scale_of, dtypes=(("BF16",), ("F32",)),
    dequantize=lambda stored, scale: bf16_bits_to_fp32(stored) * scale[:, None].astype(np.float32)))
PROJECTIONS = {"qkv", "o", "gate_up", "down"}
formats.register_quant_method(formats.QuantMethod(
    "row_scaled_test", lambda qc, p: "row_scaled_test" if p.key in PROJECTIONS else None))


def row_scaled_checkpoints(tmp_path: Path, rng) -> tuple[Path, Path]:
    """The llama fixture's weights stored row-scaled, and the very same values stored dense in F32."""
    src = Path(__file__).parent / "fixtures" / "models" / "llama"
    config = json.loads((src / "config.json").read_text())
    with Checkpoint.open(src) as ckpt:
        dense = {k: as_fp32(ckpt.array(k, bf16_bits=True)) for k in ckpt.tensor_names()}
    scaled, exact = {}, {}
    for name, a in dense.items():
        if name.endswith(("proj.weight",)):
            s = np.exp(rng.uniform(-2, 2, a.shape[0])).astype(np.float32)
            q = fp32_to_bf16(a / s[:, None])
            scaled[name], scaled[name + "_row_scale"] = q, s
            exact[name] = bf16_bits_to_fp32(bf16_bits(q)) * s[:, None]
        else:
            scaled[name] = exact[name] = a
    quantized = write_checkpoint(tmp_path / "scaled", {**config, "quantization_config": {"quant_method": "row_scaled_test"}},
                                 scaled)
    return quantized, write_checkpoint(tmp_path / "exact", config, exact)


def test_a_toy_weight_format_gives_the_logits_of_its_dequantized_weights(tmp_path):
    rng = np.random.default_rng(9)
    quantized, exact = row_scaled_checkpoints(tmp_path, rng)
    ids = rng.integers(0, 100, 9).tolist()
    rows = []
    for path in (quantized, exact):
        model = open_model(path, device="cpu", max_context=16, fp32_logits=True)
        model.engine.prefill(ids, all_logits=True)
        rows.append(host_rows(model.engine, model.engine.logits_buffer_ptr()))
        model.close()
    np.testing.assert_array_equal(rows[0], rows[1])  # the same fp32 weights, the same sums
    # and the format matters: read as if the scales were all 1, the logits change
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not np.allclose(exact_tensor(quantized, name), exact_tensor(exact, name), rtol=0.1)


def exact_tensor(path: Path, name: str) -> np.ndarray:
    with Checkpoint.open(path) as ckpt:
        return as_fp32(ckpt.array(name, bf16_bits=True))


def test_a_misshaped_scale_is_refused_naming_it_before_anything_loads(tmp_path):
    from safetensors.numpy import load_file

    quantized, _ = row_scaled_checkpoints(tmp_path, np.random.default_rng(1))
    tensors = load_file(str(quantized / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight_row_scale"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, str(quantized / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"wrong shape 1: {name}"):
        open_model(quantized, device="cpu")


def test_an_unknown_quant_method_is_refused(tmp_path):
    src = Path(__file__).parent / "fixtures" / "models" / "llama"
    config = json.loads((src / "config.json").read_text())
    path = tmp_path / "q"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "awq_v9"}}))
    with pytest.raises(CheckpointError, match="quant_method 'awq_v9'"):
        open_model(path, device="cpu")


# ---- both through the CUDA engine's Python side (tests/test_cuda_plumbing.py's stand-in kernels) -----------


class RowScaledWeight:
    """A row_scaled_test weight on the device: bf16 bits [N, K] and fp32 scales [N]."""

    format = "row_scaled_test"

    def __init__(self, data, scale):
        self.data, self.scale = data, scale
        self.shape = data.shape


def _row_scaled_upload(p, read, kern):
    cp = kern.cp
    return [RowScaledWeight(cp.asarray(np.ascontiguousarray(read(t.name)).view(np.uint16)),
                            cp.asarray(np.asarray(read(t.name + "_row_scale"), np.float32))) for t in p.parts]


def _row_scaled_concat(parts, cp):
    return RowScaledWeight(cp.concatenate([p.data for p in parts]), cp.concatenate([p.scale for p in parts]))


def _row_scaled_linear(proj, x, w, out, bias=None, *, accumulate=False, swiglu=False, norm_weight=None, eps=1e-6,
                       norm_offset=0.0, activation="silu"):
    """The bf16 GEMV of the stored rows, then the rows' scales (and the bias, the gate activation) on its output."""
    cp = proj.cp
    y = cp.empty((x.shape[0], w.shape[0]), cp.float32)
    proj.linear(x, w.data, y, None, norm_weight=norm_weight, eps=eps, norm_offset=norm_offset)
    y *= w.scale[None, :]
    if bias is not None:
        b = cp.empty(bias.shape, cp.float32)
        proj.kern.bf16_to_f32(bias, b, stream=proj.stream)
        y += b
    if swiglu:
        proj.kern.swiglu(y, out, activation=activation, stream=proj.stream)
    elif accumulate:
        out += y
    else:
        out[...] = y


def _row_scaled_gemm(proj, x, w, bias=None, accumulate_into=None):
    y = proj.gemm(x, w.data) * w.scale[None, :]
    if bias is not None:  # after the scales
        b = proj.cp.empty(bias.shape, proj.cp.float32)
        proj.kern.bf16_to_f32(bias, b, stream=proj.stream)
        y += b
    if accumulate_into is None:
        return y
    accumulate_into += y
    return accumulate_into


def cuda_plumbing():
    return pytest.importorskip("test_cuda_plumbing")


def fake_cuda_engine(plumbing, path: Path, ctx: int, rows_path: str = "rows", activation_quant: str = "none"):
    """The CUDA engine over `path` with the stand-in kernels (graphs off), on rows path `rows_path`."""
    from metrale_cli.backends.cuda import loading
    from metrale_cli.backends.cuda.engine import CudaEngine
    from metrale_cli.backends.cuda.formats import CudaFormat, register_cuda_format

    register_cuda_format(CudaFormat("row_scaled_test", _row_scaled_upload,
                                    _row_scaled_concat, _row_scaled_linear, _row_scaled_gemm))
    cfg = load_config(path)
    assert loading.unsupported_features(cfg.definition) == []
    kern = plumbing.FakeKernels()
    with Checkpoint.open(path) as ckpt:
        weights = loading.upload_weights(cfg, ckpt, kern, activation_quant=activation_quant)
    engine = CudaEngine(cfg, weights, kern, ctx, fp32_logits=True, use_graphs=False)
    if rows_path != engine.path:
        engine.set_path(rows_path)
    return engine


@pytest.fixture
def fake_gemm(monkeypatch):
    plumbing = cuda_plumbing()
    from metrale_cli.backends.cuda.projections import Projections

    monkeypatch.setattr(Projections, "gemm_bf16", plumbing._fake_gemm)
    return plumbing


TOL = 1e-2  # the CUDA engine's bf16 weights, activations and KV cache against fp32 on bf16-rounded weights


@pytest.mark.parametrize("rows_path", ["rows", "fused"])
def test_the_toy_mixer_kind_runs_through_the_cuda_engine(tmp_path, fake_gemm, rows_path):
    rng = np.random.default_rng(21)
    w = uniform_weights(rng)
    path = write_checkpoint(tmp_path / "uniform", CONFIG, w)
    rounded = {k: bf16_bits_to_fp32(bf16_bits(fp32_to_bf16(a))) for k, a in w.items()}  # what the GPU holds
    e = fake_cuda_engine(fake_gemm, path, 40, rows_path)
    ids = rng.integers(0, CONFIG["vocab_size"], 24).tolist()
    want = plain_forward(rounded, ids)
    e.prefill(ids[:20], all_logits=True)  # more than 16 rows: the prefill pass
    assert rel(host_rows(e, e.logits_buffer_ptr()), want[:20]) < TOL
    e.decode(ids[20])  # the rows pass
    assert rel(host_rows(e, e.decode_logits_ptr())[0], want[20]) < TOL
    e.verify(ids[21:24])
    assert rel(host_rows(e, e.logits_buffer_ptr()), want[21:24]) < TOL
    e.trim(22)
    e.verify([7, 8])
    assert rel(host_rows(e, e.logits_buffer_ptr()), plain_forward(rounded, ids[:22] + [7, 8])[22:]) < TOL


def test_a_kind_without_a_cuda_implementation_is_refused(tmp_path):
    from metrale_cli.backends.cuda.loading import unsupported_features

    register_mixer(MixerKind("uniform_cpu_only_test", uniform_forward, lambda p, layer: [], {"numpy": NumpyUniform}))
    cfg = open_cfg(tmp_path)
    layers = tuple(replace(layer, mixer=CpuOnlySpec(layer.mixer.width)) for layer in cfg.definition.layers)
    assert unsupported_features(replace(cfg.definition, layers=layers)) == ["layer kind uniform_cpu_only_test"]


@dataclass(frozen=True)
class CpuOnlySpec:
    kind: ClassVar[str] = "uniform_cpu_only_test"
    width: int


def open_cfg(tmp_path):
    return load_config(write_checkpoint(tmp_path / "cfg", CONFIG, uniform_weights(np.random.default_rng(0))))


def test_tensor_parallelism_refuses_a_kind_without_a_split(tmp_path):
    from metrale_cli.errors import UsageError
    from metrale_cli.parallel.sharding import check_tp

    with pytest.raises(UsageError, match="uniform_test"):
        check_tp(open_cfg(tmp_path).definition, 2)


@pytest.mark.parametrize("rows_path", ["rows", "fused"])
def test_the_toy_weight_format_runs_through_the_cuda_engine(tmp_path, fake_gemm, rows_path):
    rng = np.random.default_rng(13)
    quantized, _ = row_scaled_checkpoints(tmp_path, rng)
    ids = rng.integers(0, 100, 24).tolist()
    cpu = open_model(quantized, device="cpu", max_context=40, fp32_logits=True).engine
    e = fake_cuda_engine(fake_gemm, quantized, 40, rows_path)
    for run in (lambda x: x.prefill(ids[:20], all_logits=True), lambda x: x.verify(ids[20:24])):
        run(cpu), run(e)
        assert rel(host_rows(e, e.logits_buffer_ptr()), host_rows(cpu, cpu.logits_buffer_ptr())) < TOL
    cpu.trim(21), e.trim(21)
    cpu.decode(5), e.decode(5)
    assert rel(host_rows(e, e.decode_logits_ptr()), host_rows(cpu, cpu.decode_logits_ptr())) < TOL


def test_a_format_without_a_cuda_implementation_runs_dequantized_to_bf16(tmp_path, fake_gemm):
    """A format with no CUDA entry needs nothing of the CUDA engine: its weights are dequantized exactly and rounded
    to bf16 at load (what the kernels read; the path FP8 in 8-wide blocks and MXFP4 experts took on an H100);
    the engine's logits are the NumPy engine's within bf16."""
    from metrale_cli.backends.cuda.loading import unsupported_features, unverified_features

    formats.register_format(replace(ROW_SCALED, name="row_scaled_cpu_only_test"))
    formats.register_quant_method(formats.QuantMethod(
        "row_scaled_cpu_only_test", lambda qc, p: "row_scaled_cpu_only_test" if p.key in PROJECTIONS else None))
    rng = np.random.default_rng(14)
    path, _ = row_scaled_checkpoints(tmp_path, rng)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method":
                                                                                  "row_scaled_cpu_only_test"}}))
    definition = load_config(path).definition
    assert unsupported_features(definition) == []
    assert unverified_features(definition) == []
    ids = rng.integers(0, 100, 20).tolist()
    cpu = open_model(path, device="cpu", max_context=40, fp32_logits=True).engine
    e = fake_cuda_engine(fake_gemm, path, 40)
    assert getattr(e.w.layers[0]["qkv"], "format", None) is None  # bf16 bits, as a dense checkpoint's
    cpu.prefill(ids, all_logits=True), e.prefill(ids, all_logits=True)
    assert rel(host_rows(e, e.logits_buffer_ptr()), host_rows(cpu, cpu.logits_buffer_ptr())) < TOL