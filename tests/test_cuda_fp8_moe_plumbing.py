"""FP8 block experts read as stored by the CUDA MoE kernels (issue 41) on the CPU: the loader keeps them as e4m3 bytes
and fp32 block scales stacked [E, N, K] (backends/cuda/fp8.Fp8Experts), the rows path hands them to the kernels' FP8
variants (kernels/moe.py checks their operands and passes the .cu signature's arguments), the prefill dequantizes the
chosen experts to bf16 for the batched GEMMs; the size check counts them as stored.  The MoE and FP8 kernels are
replaced by NumPy implementations of their contracts (test_cuda_moe_plumbing's FakeMoeKernels, test_cuda_fp8_plumbing's
NumpyFp8Kernels); the kernels themselves are tested on a GPU (tests/gpu/test_moe_cuda.py's FP8 tests)."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from metrale_cli.model import open_model

moe_kernels = pytest.importorskip("metrale_cli.backends.cuda.kernels.moe")
from metrale_cli.backends.cuda import fp8 as cuda_fp8  # noqa: E402
from metrale_cli.backends.cuda import loading  # noqa: E402
from metrale_cli.backends.cuda.projections import Projections  # noqa: E402

from test_cuda_fp8_plumbing import NumpyFp8Kernels, fake_fp8  # noqa: E402,F401 (a fixture)
from test_cuda_launch_args import SIGNATURE, FakeArray, KIND_OK, Recorder, _param_kinds, kern  # noqa: E402,F401
from test_cuda_moe_plumbing import expert_f32, fake_moe, first_flip, routing  # noqa: E402
from test_extension_points import cuda_plumbing, fake_cuda_engine, host_rows, rel  # noqa: E402

TOL = 3e-2  # test_cuda_plumbing's: the stand-ins' bf16 KV cache and GEMM activations
PROJECTIONS, EXPERTS, OVER_256, MXFP4 = (name for name, _ in loading.UNVERIFIED)  # qgemv.cu, FP8 / > 256 / MXFP4 experts

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
            moe_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
            dtype="bfloat16")
MODELS = {
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=3, norm_topk_prob=True),
    # a gated shared expert: its FP8 down weight goes to the FP8 down kernel beside the experts
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                      shared_expert_intermediate_size=32, qkv_bias=True),
}


def write_moe_fp8(path: Path, arch: dict, block: list[int], rng) -> Path:
    """A random MoE checkpoint whose Linear weights (experts and shared expert included; not the router) are e4m3
    with `block` scales: each block's amax / 448 times a random factor in [1, 2), so every block's scale differs."""
    from metrale_cli.config import parse_config
    from metrale_cli.random_weights import RandomTensors

    cfg = {**BASE, **arch}
    src = RandomTensors(parse_config(dict(cfg)), seed=int(rng.integers(1 << 30)))
    tensors = {}
    for name in src.tensor_names():
        a = src.array(name).astype(np.float32)
        if name.endswith("proj.weight"):
            grid = (-(-a.shape[0] // block[0]), -(-a.shape[1] // block[1]))
            s = np.empty(grid, np.float32)
            for i in range(grid[0]):
                for j in range(grid[1]):
                    amax = np.abs(a[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]).max()
                    s[i, j] = max(amax, 1e-6) / 448 * rng.uniform(1, 2)
            full = np.repeat(np.repeat(s, block[0], 0)[:a.shape[0]], block[1], 1)[:, :a.shape[1]]
            tensors[name], tensors[name + "_scale_inv"] = (a / full).astype(ml_dtypes.float8_e4m3fn), s
        else:
            tensors[name] = a.astype(ml_dtypes.bfloat16)
    path.mkdir(parents=True)
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def exact_experts(cfg, path: Path, layer: int, key: str) -> np.ndarray:
    """The NumPy engine's exact values of a stacked experts param: [E, N, K] fp32."""
    from metrale_cli.checkpoint import Checkpoint
    from metrale_cli.models import formats

    p = next(p for p in cfg.definition.layers[layer].params if p.key == key)
    with Checkpoint.open(path) as ckpt:
        parts = formats.dequantize(p, lambda n: ckpt.array(n, bf16_bits=True))
    return np.concatenate(parts).reshape(p.shape)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("block", [[16, 16], [32, 32]])  # 32: 48-row gate / up parts, partial 48-wide blocks
def test_fp8_experts_are_uploaded_as_stored_and_dequantize_to_the_exact_values(tmp_path, name, block):
    from metrale_cli.checkpoint import Checkpoint
    from metrale_cli.config import load_config

    path = write_moe_fp8(tmp_path / name, MODELS[name], block, np.random.default_rng())
    cfg = load_config(path)
    assert loading.unsupported_features(cfg.definition) == []
    assert loading.unverified_features(cfg.definition) == [PROJECTIONS, EXPERTS]
    kern = cuda_plumbing().FakeKernels()
    with Checkpoint.open(path) as ckpt:
        w = loading.upload_weights(cfg, ckpt, kern)
    e, inter, hidden = cfg.moe.spec.num_experts, cfg.moe.spec.intermediate_size, cfg.hidden_size
    srow = block[0] if inter % block[0] == 0 else 1  # gate and up fused: their scales expanded per row unless aligned
    for i in range(cfg.num_hidden_layers):
        gu, down = w.layers[i]["experts_gate_up"], w.layers[i]["experts_down"]
        assert isinstance(gu, cuda_fp8.Fp8Experts) and isinstance(down, cuda_fp8.Fp8Experts)
        assert gu.data.dtype == np.uint8 and gu.data.shape == (e, 2 * inter, hidden)
        assert (gu.srow, gu.bk) == (srow, block[1])
        assert gu.scale.shape == (e, -(-2 * inter // srow), -(-hidden // block[1]))
        assert down.data.shape == (e, hidden, inter) and down.srow == block[0]
        assert down.scale.shape == (e, -(-hidden // block[0]), -(-inter // block[1]))
        for key, got in (("experts_gate_up", gu), ("experts_down", down)):
            want = exact_experts(cfg, path, i, key)
            assert np.array_equal(np.stack([expert_f32(got, x) for x in range(e)]), want), (i, key)
            assert np.array_equal(NumpyFp8Kernels._weight(got[3].data, got[3].scale, got.srow, got.bk), want[3])
        if "shared_down" in w.layers[i]:
            assert isinstance(w.layers[i]["shared_down"], cuda_fp8.Fp8Weight)


def _compare(path: Path, plen: int, steps: int, rows_path: str, monkeypatch, on_attempt=lambda: None
             ) -> tuple[float, float, list]:
    """(prefill rel err, decode rel err over the steps before the first routing flip, the MoE kernels' calls) of the
    stand-in CUDA engine against the NumPy engine (exact FP8 values, fp32); a prompt is redrawn until one routes
    alike on every row and in at least its first decode step (the stand-ins' bf16 activations flip a near tie in about
    one prompt in six); `on_attempt()` runs before each prompt."""
    plumbing = cuda_plumbing()
    monkeypatch.setattr(Projections, "gemm_bf16", plumbing._fake_gemm)
    rng = np.random.default_rng()
    for _ in range(24):
        on_attempt()
        prompt = [int(t) for t in rng.integers(0, 300, plen)]
        cpu = open_model(path, device="cpu", max_context=64, fp32_logits=True).engine
        with fake_moe():
            gpu = fake_cuda_engine(plumbing, path, 64, rows_path)
            ra = routing(gpu, lambda: gpu.prefill(prompt, all_logits=True))
            rb = routing(cpu, lambda: cpu.prefill(prompt, all_logits=True))
            if first_flip(ra, rb) < plen:
                continue
            err = rel(host_rows(gpu, gpu.logits_buffer_ptr()), host_rows(cpu, cpu.logits_buffer_ptr()))
            a, b = [], []
            for t in [int(t) for t in rng.integers(0, 300, steps)]:
                ga = routing(gpu, lambda: gpu.decode(t))
                ca = routing(cpu, lambda: cpu.decode(t))
                if first_flip(ga, ca) == 0:
                    break
                a.append(host_rows(cpu, cpu.decode_logits_ptr())[0])
                b.append(host_rows(gpu, gpu.decode_logits_ptr())[0])
            if a:
                return err, rel(np.stack(b), np.stack(a)), list(gpu.moe.kern.calls)
    raise AssertionError("24 prompts in a row routed differently on some row or in their first decode step")


def record_dequantized(monkeypatch, kind) -> list[list[int]]:
    """The experts Projections.experts_bf16 dequantizes to bf16 for the prefill, one list per call on weights of type
    `kind` (experts kept as stored), in call order."""
    dequantized = []
    real = Projections.experts_bf16

    def recording(self, w, experts):
        if isinstance(w, kind):
            dequantized.append(list(experts))
        return real(self, w, experts)

    monkeypatch.setattr(Projections, "experts_bf16", recording)
    return dequantized


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("plen", [12, 20])  # the rows path (<= 16 rows) and the prefill path
def test_fp8_experts_run_through_the_cuda_engine(tmp_path, fake_fp8, monkeypatch, name, plen):  # noqa: F811
    path = write_moe_fp8(tmp_path / name, MODELS[name], [16, 16], np.random.default_rng())
    dequantized = record_dequantized(monkeypatch, cuda_fp8.Fp8Experts)
    err, derr, calls = _compare(path, plen, 6, "rows", monkeypatch, dequantized.clear)
    print(f"{name} T={plen}: prefill {err:.2e}, decode {derr:.2e}")
    assert err < TOL and derr < TOL
    experts = [a for n, a in calls if n in ("gate_up", "down")]
    assert all(moe_kernels.is_fp8(a["w_gate_up" if "w_gate_up" in a else "w_down"]) for a in experts)
    downs = [a for n, a in calls if n == "down"]
    if name == "qwen2_moe":  # the FP8 shared expert's down weight beside the FP8 experts (a prefill of 20 rows calls
        # no down kernel, and its decode steps are not run when a near tie flipped a prefill row's routing)
        assert (downs or plen > 16) and all(moe_kernels.is_fp8(a["shared"][0]) for a in downs)
    if plen <= 16:  # every row through the kernels' FP8 variants: no expert dequantized
        assert {n for n, _ in calls} >= {"route", "gate_up", "down"} and not dequantized
    else:  # the prefill: the experts some row chose, gate_up and down of each sparse layer
        assert "topk_rows" in {n for n, _ in calls}
        assert len(dequantized) == 2 * 2 and all(0 < len(x) <= 8 and x == sorted(set(x)) for x in dequantized)


def test_fp8_experts_on_the_fused_rows_path(tmp_path, fake_fp8, monkeypatch):  # noqa: F811
    path = write_moe_fp8(tmp_path / "q", MODELS["qwen2_moe"], [32, 32], np.random.default_rng())
    err, derr, calls = _compare(path, 8, 6, "fused", monkeypatch)
    assert err < TOL and derr < TOL and any(n == "gate_up" for n, _ in calls)


def test_the_prefill_dequantizes_only_the_chosen_experts(tmp_path, fake_fp8, monkeypatch):  # noqa: F811
    """Projections.experts_bf16: the listed experts bf16(e4m3 * scale) bit for bit (fp8.cu's dequantization), the
    others zeros; bf16 experts as they are."""
    from metrale_cli.backends.cuda.kernels.launch import Kernels  # noqa: F401 (the real module is importable)

    rng = np.random.default_rng()
    e, n, k, srow, bk = 5, 48, 64, 1, 32
    q = rng.uniform(-448, 448, (e, n, k)).astype(ml_dtypes.float8_e4m3fn)
    scale = np.exp(rng.uniform(-8, 0, (e, n, k // bk))).astype(np.float32)
    w = cuda_fp8.Fp8Experts("fp8_block32x32", q.view(np.uint8), scale, srow, bk)
    proj = Projections(cuda_plumbing().FakeKernels().cp, object(), None, None, None)
    got = proj.experts_bf16(w, [1, 3])
    want = (q.astype(np.float32) * np.repeat(scale, bk, 2)).astype(ml_dtypes.bfloat16).view(np.uint16)
    assert got.dtype == np.uint16 and np.array_equal(got[[1, 3]], want[[1, 3]])
    assert not got[[0, 2, 4]].any()
    plain = np.zeros((2, 8, 16), np.uint16)
    assert proj.experts_bf16(plain, [0]) is plain


def test_the_size_check_counts_fp8_experts_as_stored():
    """glm-4.5-air-fp8 and qwen3-next-80b-a3b-fp8 hold their experts as e4m3 with 128 x 128 fp32 scales (about one
    byte a weight; the embedding, lm_head, norms and routers stay bf16): GLM-4.5-Air's 100.7 GiB fit one H200 (141 GB)
    and take --tp 2 on 80 GB (193.5 GiB with its experts in bf16); Qwen3-Next-80B's 74.8 GiB pass the size check of
    an 80 GB card (its 512 experts gated too, tests/test_cuda_linear_plumbing.py)."""
    from metrale_cli.bench import preset_path
    from metrale_cli.config import load_config
    from metrale_cli.errors import DeviceError

    glm = load_config(preset_path("glm-4.5-air-fp8"))
    assert {p.key for p in glm.definition.params() if p.format and not loading.kept_as_stored(p)} == set()
    assert round(loading.device_weight_bytes(glm.definition) / 2**30, 1) == 100.7
    loading.check_fits(glm, 139 << 30, 141 << 30)  # one H200
    with pytest.raises(DeviceError, match=r"the weights need 100\.7 GiB .* --tp 2 "):
        loading.check_fits(glm, 78 << 30, 80 << 30)
    assert loading.unverified_features(glm.definition) == [PROJECTIONS, EXPERTS]
    nxt = load_config(preset_path("qwen3-next-80b-a3b-fp8"))
    assert round(loading.device_weight_bytes(nxt.definition) / 2**30, 1) == 74.8
    loading.check_fits(nxt, 78 << 30, 80 << 30)
    assert loading.unverified_features(nxt.definition) == [PROJECTIONS, EXPERTS, OVER_256]


def test_what_the_moe_kernels_cannot_read_as_stored_falls_back_to_bf16(tmp_path):
    """Experts whose input width is not a multiple of 16 (the fixture's 40-wide down_proj) are dequantized to bf16 at
    load, as are 8-wide blocks; a shared expert kept FP8 beside bf16 experts is refused by name (the FP8 down kernel
    reads both); `--activation-quant emulate` refuses FP8 experts (the MoE kernels do not quantize their inputs)."""
    from metrale_cli.config import load_config
    from metrale_cli.errors import UsageError

    src = Path(__file__).parent / "fixtures" / "models" / "qwen3_moe_fp8_block"
    d = load_config(src).definition
    assert not any(loading.kept_as_stored(p) for p in d.params())  # 8x8 blocks
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [16, 16]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    sixteen = load_config(tmp_path).definition
    kept = {p.key for p in sixteen.params() if loading.kept_as_stored(p)}
    assert {"experts_gate_up", "qkv"} <= kept and "experts_down" not in kept  # down_proj's input: 40 wide
    assert loading.unsupported_features(sixteen) == []
    assert loading.unverified_features(sixteen) == [PROJECTIONS, EXPERTS]
    with pytest.raises(UsageError, match="experts.0.gate_proj.weight .* is read by the MoE kernels, which do not "
                                         "quantize their inputs"):
        loading.check_activation_quant(sixteen)
    mixed = write_moe_fp8(tmp_path / "mixed", {**MODELS["qwen2_moe"], "moe_intermediate_size": 40}, [16, 16],
                          np.random.default_rng())
    assert loading.unsupported_features(load_config(mixed).definition) == [
        "a shared expert in FP8 with experts in bf16"]


# ---- the wrappers' checks and launch arguments (no CUDA: test_cuda_launch_args's recorded launches) -----------

def _moe_params() -> dict[str, list[str]]:
    from metrale_cli.backends.cuda.kernels import nvrtc

    return {name: _param_kinds(params) for name, params in SIGNATURE.findall((nvrtc._CUDA_DIR / "moe.cu").read_text())}


def _moe(kern):  # noqa: F811
    mk = object.__new__(moe_kernels.MoeKernels)
    mk.k, mk._cp, mk._np = kern, kern._cp, np
    mk._fn = {n: Recorder(n, kern.calls) for n in moe_kernels.name_expressions()}
    return mk


def _buffers(k: int, hidden: int):
    u = min(8, 16 * k)
    return moe_kernels.RouteBuffers(FakeArray((16, k), np.int32), FakeArray((16, k), np.float32),
                                    FakeArray((16,), np.float32), FakeArray((16, hidden), np.float32),
                                    FakeArray((1,), np.int32), FakeArray((u,), np.int32),
                                    FakeArray((u,), np.uint32), FakeArray((u, 16), np.int32))


def _fp8(shape, srow, bk, scale_shape=None):
    n, k = shape[-2:]
    scale_shape = scale_shape or shape[:-2] + (-(-n // srow), -(-k // bk))
    return cuda_fp8.Fp8Weight("fp8", FakeArray(shape, np.uint8), FakeArray(scale_shape, np.float32), srow, bk)


@pytest.mark.parametrize("m", [1, 3, 16])
def test_the_fp8_experts_launches_pass_the_kernels_arguments(kern, m):  # noqa: F811
    E, H, I, S, k = 8, 64, 48, 32, 2  # noqa: E741, N806
    mk, b = _moe(kern), _buffers(k, H)
    act = FakeArray((16 * k, I), np.float32)
    mk.gate_up(m, _fp8((E, 2 * I, H), 1, 32), b, act)
    mk.gate_up(m, _fp8((E, 2 * I, H), 16, 16), b, act, bias=FakeArray((E, 2 * I), np.uint16),
               activation="swiglu_oai", limit=7.0)
    out = FakeArray((m, H), np.float32)
    act_s = FakeArray((m, S), np.float32)
    mk.down(m, _fp8((E, H, I), 32, 16), b, act, out, accumulate=True)
    mk.down(m, _fp8((E, H, I), 32, 16), b, act, out, shared=(_fp8((H, S), 16, 32), act_s), accumulate=False)
    mk.down(m, _fp8((E, H, I), 32, 16), b, act, out, shared=(FakeArray((H, S), np.uint16), act_s), accumulate=True,
            bias=FakeArray((E, H), np.uint16))
    mk.down(m, FakeArray((E, H, I), np.uint16), b, act, out, accumulate=True)  # bf16 experts: their kernel
    params = _moe_params()
    mt = next(t for t in moe_kernels.MOE_MTS if t >= m)
    assert [c[0] for c in kern.calls] == [moe_kernels.gate_up_name(mt, "fp8")] * 2 + [moe_kernels.down_name(mt, "fp8")] * 3 + [
        moe_kernels.down_name(mt)]
    for name, args in kern.calls:
        kinds = params[name.split("<")[0]]
        assert len(args) == len(kinds), f"{name}: {len(args)} arguments, the kernel takes {len(kinds)}"
        for i, (a, kind) in enumerate(zip(args, kinds)):
            assert KIND_OK[kind](a), f"{name}: argument {i} is {type(a).__name__}, the kernel takes {kind}"
    assert [int(kern.calls[i][1][18]) for i in (2, 3, 4)] == [0, 1, 0]  # s_fmt: the shared expert's weight in FP8


def test_the_fp8_experts_wrappers_refuse_what_the_kernels_cannot_read(kern):  # noqa: F811
    E, H, I, k = 8, 64, 48, 2  # noqa: E741, N806
    mk, b = _moe(kern), _buffers(k, H)
    act = FakeArray((16 * k, I), np.float32)
    out = FakeArray((1, H), np.float32)
    with pytest.raises(ValueError, match="multiples of 16"):
        mk.gate_up(1, _fp8((E, 2 * I, H), 1, 8), b, act)  # 8-wide blocks: a chunk would span two scales
    with pytest.raises(ValueError, match="multiples of 16"):
        mk.down(1, _fp8((E, H, 40), 1, 16), b, FakeArray((16 * k, 40), np.float32), out, accumulate=False)
    with pytest.raises(ValueError, match="scale: expected shape"):
        mk.gate_up(1, _fp8((E, 2 * I, H), 16, 16, scale_shape=(E, 5, 4)), b, act)
    with pytest.raises(ValueError, match="uint8"):
        mk.gate_up(1, cuda_fp8.Fp8Weight("fp8", FakeArray((E, 2 * I, H), np.uint16),
                                         FakeArray((E, 6, 4), np.float32), 16, 16), b, act)
    with pytest.raises(ValueError, match="FP8 shared expert takes FP8 experts"):
        mk.down(1, FakeArray((E, H, I), np.uint16), b, act, out, accumulate=False,
                shared=(_fp8((H, 32), 16, 16), FakeArray((1, 32), np.float32)))
    with pytest.raises(ValueError, match="w_shared: expected shape"):
        mk.down(1, _fp8((E, H, I), 16, 16), b, act, out, accumulate=False,
                shared=(_fp8((H + 16, 32), 16, 16), FakeArray((1, 32), np.float32)))
    assert not kern.calls
