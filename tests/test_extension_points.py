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

from metrale_cli.models import formats
from metrale_cli.backends.numpy.ops import as_fp32
from metrale_cli.checkpoint import Checkpoint
from metrale_cli.engine.loop import sublayer_out
from metrale_cli.engine.mixers import MixerKind, register_mixer
from metrale_cli.errors import CheckpointError
from metrale_cli.logits import bf16_bits, bf16_bits_to_fp32, fp32_to_bf16
from metrale_cli.model import open_model
from metrale_cli.models import FAMILIES, llama
from metrale_cli.models.family import Family
from metrale_cli.models.spec import Param, Tensor

# ---- the toy mixer kind ------------------------------------------------------------------------------


@dataclass(frozen=True)
class UniformSpec:
    kind: ClassVar[str] = "uniform_test"
    width: int  # v's width


def uniform_forward(ops, i, layer, lw, x):
    v = ops.linear(x, lw["v"], out="qkv", norm=(lw["input_norm"], layer.norm))  # [T, width]
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


UNIFORM = register_mixer(MixerKind("uniform_test", uniform_forward, lambda p, layer: [f"{p}.self_attn"],
                                   backends={"numpy": NumpyUniform}))


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
    out = np.empty((ptr.rows, engine.vocab_size()), np.float32)
    for i in range(ptr.rows):
        engine.copy_logits_to_host(ptr.row_ptr(i), out[i])
    return out


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
