"""The CPU engine's stored weights (backends/numpy/stored.py): products with BF16 / F16 weights read as stored
equal NumPy's fp32 products on the widened weights up to summation order, with numba's kernels and without."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from metrale_cli.backends.numpy import kernels, stored
from metrale_cli.backends.numpy.engine import load_numpy_engine, read_weights
from metrale_cli.backends.numpy.ops import round_bf16
from metrale_cli.backends.numpy.stored import StoredWeight, matmul, rows, widen
from metrale_cli.checkpoint import Checkpoint
from metrale_cli.config import load_config
from metrale_cli.errors import UsageError
from metrale_cli.logits import fp32_to_bf16_bits
from metrale_cli.models.spec import Tensor

FIXTURES = Path(__file__).parent / "fixtures" / "models"


def draw(rng, n: int, k: int, kind: str) -> tuple[StoredWeight, np.ndarray]:
    """A random stored weight [n, k] and the exact fp32 values it stands for."""
    values = rng.standard_normal((n, k), dtype=np.float32) * np.float32(k ** -0.5)
    data = fp32_to_bf16_bits(values) if kind == "bf16" else values.astype(np.float16)
    w = StoredWeight(data, kind)
    exact = (data.astype(np.uint32) << 16).view(np.float32) if kind == "bf16" else data.astype(np.float32)
    return w, exact


def check_product(y: np.ndarray, x: np.ndarray, exact: np.ndarray) -> None:
    """y equals x @ exact.T in fp32 up to the order of the sums: within a few fp32 roundings of the sum of |terms|."""
    reference = x.astype(np.float64) @ exact.T.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(exact).T.astype(np.float64)
    assert y.dtype == np.float32 and y.shape == reference.shape
    assert np.all(np.abs(y - reference) <= 4 * x.shape[1] * np.finfo(np.float32).eps * scale + 1e-30)
    fp32 = x @ exact.T  # NumPy's fp32 product: the same quantity, its own order
    np.testing.assert_allclose(y, fp32, rtol=0, atol=float(8 * x.shape[1] * np.finfo(np.float32).eps * scale.max()))


@pytest.fixture(params=["numba", "numpy"])
def engine_path(request, monkeypatch):
    """Each test once with the compiled kernels and once with the NumPy fallback."""
    if request.param == "numba" and not kernels.AVAILABLE:
        pytest.skip("numba is not installed")
    if request.param == "numpy":
        monkeypatch.setattr(kernels, "AVAILABLE", False)
    else:
        monkeypatch.setattr(kernels, "FUSED_MIN", 0)  # the small test weights go through the kernels too
    return request.param


@pytest.mark.parametrize("kind", ["bf16", "f16"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 16, 17, 70])
def test_matmul_equals_the_fp32_product(engine_path, kind, m):
    rng = np.random.default_rng([m, len(kind)])
    for n, k in [(37, 70), (300, 513), (1030, 256), (33, 16)]:
        w, exact = draw(rng, n, k, kind)
        x = rng.standard_normal((m, k), dtype=np.float32)
        check_product(matmul(x, w), x, exact)


def test_matmul_of_views_and_experts(engine_path):
    """A row slice, a column slice and one expert of a stacked weight multiply as their fp32 values."""
    rng = np.random.default_rng(5)
    w, exact = draw(rng, 96, 80, "bf16")
    x = rng.standard_normal((2, 80), dtype=np.float32)
    check_product(matmul(x, w[10:50]), x, exact[10:50])
    check_product(matmul(x[:, :33], w[:, 7:40]), x[:, :33], exact[:, 7:40])
    stacked = w.reshape(4, 24, 80)
    assert stacked.shape == (4, 24, 80)
    check_product(matmul(x, stacked[2]), x, exact[48:72])


@pytest.mark.parametrize("m", [1, 2, 3, 5, 16, 17])
def test_joined_parts_multiply_as_their_concatenation(engine_path, monkeypatch, m):
    """A fused projection of bf16 parts (q | k | v: rows of each an odd count, so blocks end inside a pair)
    is one kernel call over every part, equal to the product with the concatenated fp32 weight."""
    rng = np.random.default_rng([m, 11])
    parts = [draw(rng, n, 96, "bf16") for n in (53, 17, 40)]
    joined = StoredWeight.of(stored.join([w.data for w, _ in parts]))  # as the loader keeps it
    exact = np.concatenate([e for _, e in parts])
    calls = []
    if engine_path == "numba":
        compiled = kernels.compiled()
        original = compiled.gemm_bf16
        monkeypatch.setattr(compiled, "gemm_bf16", lambda *a: (calls.append(len(a[1])), original(*a)))
    x = rng.standard_normal((m, 96), dtype=np.float32)
    check_product(matmul(x, joined), x, exact)
    assert calls == ([3] if engine_path == "numba" and m <= stored.SMALL_M else [])


def test_rows_and_array_are_the_exact_values():
    rng = np.random.default_rng(6)
    for kind in ("bf16", "f16"):
        w, exact = draw(rng, 50, 24, kind)
        ids = rng.integers(0, 50, 9)
        np.testing.assert_array_equal(rows(w, ids), exact[ids])
        np.testing.assert_array_equal(np.asarray(w), exact)
        np.testing.assert_array_equal(widen(w.data, kind), exact)
    # a plain memory-mapped bf16 table (uint16 bits) and an fp32 one
    bits = fp32_to_bf16_bits(rng.standard_normal((20, 8), dtype=np.float32))
    np.testing.assert_array_equal(rows(bits, np.array([3, 3, 0])), widen(bits[[3, 3, 0]], "bf16"))
    f32 = rng.standard_normal((20, 8), dtype=np.float32)
    np.testing.assert_array_equal(rows(f32, np.array([1, 19])), f32[[1, 19]])
    np.testing.assert_array_equal(matmul(f32[:2], f32), f32[:2] @ f32.T)


@pytest.mark.parametrize("fused_min", [0, None])
def test_bf16_checkpoint_keeps_its_projections_stored(monkeypatch, fused_min):
    """llama_bf16: every projection the kernels take stays BF16 (a single-part one memory-mapped, no copy; a fused
    one its mapped parts side by side); weights as small as this test model's (under FUSED_MIN elements) are
    widened to fp32 once at load instead; norms are fp32."""
    if fused_min is not None:
        monkeypatch.setattr(kernels, "FUSED_MIN", fused_min)
    cfg = load_config(FIXTURES / "llama_bf16")
    ckpt = Checkpoint.open(FIXTURES / "llama_bf16")
    w = read_weights(cfg, ckpt)
    layer = w.layers[0]
    if fused_min is None:
        for key in ("o", "down", "qkv", "gate_up"):
            assert isinstance(layer[key], np.ndarray) and layer[key].dtype == np.float32, key
    else:
        for key in ("o", "down"):
            assert isinstance(layer[key], StoredWeight) and layer[key].data.dtype == np.uint16, key
            assert not layer[key].data.flags.owndata  # a view of the checkpoint's memory map
        for key in ("qkv", "gate_up"):  # fused: the parts side by side, each still the mapped tensor
            assert isinstance(layer[key], stored.JoinedWeight), key
            assert all(isinstance(p, StoredWeight) and not p.data.flags.owndata for p in layer[key].parts)
    qkv = np.concatenate([widen(ckpt.array(f"model.layers.0.self_attn.{n}_proj.weight", bf16_bits=True), "bf16")
                          for n in "qkv"])
    np.testing.assert_array_equal(np.asarray(layer["qkv"]), qkv)
    assert isinstance(layer["input_norm"], np.ndarray) and layer["input_norm"].dtype == np.float32
    o = ckpt.array("model.layers.0.self_attn.o_proj.weight", bf16_bits=True)
    np.testing.assert_array_equal(np.asarray(layer["o"]), widen(o, "bf16"))


@pytest.mark.parametrize("fused_min", [0, None])
def test_bf16_compute_rounds_f32_projections_to_stored_bf16(monkeypatch, fused_min):
    """Kept as BF16 where the kernels take the weight, widened once to fp32 where it is small: the same values."""
    if fused_min is not None:
        monkeypatch.setattr(kernels, "FUSED_MIN", fused_min)
    cfg = load_config(FIXTURES / "llama")
    ckpt = Checkpoint.open(FIXTURES / "llama")
    w = read_weights(cfg, ckpt, compute="bf16")
    down = w.layers[1]["down"]
    if fused_min is None:
        assert type(down) is np.ndarray and down.dtype == np.float32
    else:
        assert isinstance(down, StoredWeight) and down.kind == "bf16"
    exact = ckpt.array("model.layers.1.mlp.down_proj.weight").astype(np.float32)
    np.testing.assert_array_equal(np.asarray(down), round_bf16(exact))
    fp32 = read_weights(cfg, ckpt)  # fp32 compute: F32 projections stay plain fp32 arrays
    assert type(fp32.layers[1]["down"]) is np.ndarray


def test_threads_must_be_positive():
    cfg = load_config(FIXTURES / "llama")
    with pytest.raises(UsageError, match="--threads"):
        load_numpy_engine(cfg, Checkpoint.open(FIXTURES / "llama"), 16, threads=0)


def test_threads_on_the_command_line(run_cli):
    one = run_cli("forward", "--model", str(FIXTURES / "llama_bf16"), "--tokens", "1 5 9", "--threads", "1",
                  "-f", "json")
    two = run_cli("forward", "--model", str(FIXTURES / "llama_bf16"), "--tokens", "1 5 9", "--threads", "2",
                  "-f", "json")
    assert one.exit_code == 0 and two.exit_code == 0, one.output + two.output
    assert '"argmax"' in one.stdout and one.stdout == two.stdout  # same rows (the order of each sum is fixed)


def test_no_cache_location_compiles_for_the_run(monkeypatch):
    """A read-only install without a writable cache directory: numba refuses cache=True; the kernel is
    then compiled for this run only instead of failing."""
    if not kernels.AVAILABLE:
        pytest.skip("numba is not installed")
    calls = []

    def njit(**kw):
        calls.append(kw.get("cache"))
        if kw.get("cache"):
            raise RuntimeError("cannot cache function: no locator available")
        return lambda fn: fn

    compiled = kernels.compiled()
    monkeypatch.setattr(compiled.numba, "njit", njit)
    fn = compiled._jit(parallel=True)(lambda: 3)
    assert fn() == 3 and calls == [True, None]


def test_small_and_large_products_choose_their_path(monkeypatch):
    """Up to SMALL_M rows the compiled kernel runs; more rows widen blocks for BLAS (both tested above); a weight
    under FUSED_MIN elements is multiplied by NumPy."""
    if not kernels.AVAILABLE:
        pytest.skip("numba is not installed")
    used = []
    compiled = kernels.compiled()
    original = compiled.gemm_bf16
    monkeypatch.setattr(compiled, "gemm_bf16", lambda *a: (used.append(len(a[0])), original(*a)))
    monkeypatch.setattr(kernels, "FUSED_MIN", 0)
    rng = np.random.default_rng(8)
    w, exact = draw(rng, 40, 64, "bf16")
    for m in (1, stored.SMALL_M, stored.SMALL_M + 1):
        x = rng.standard_normal((m, 64), dtype=np.float32)
        check_product(matmul(x, w), x, exact)
    assert used == [1, stored.SMALL_M]
    monkeypatch.setattr(kernels, "FUSED_MIN", 40 * 64 + 1)
    check_product(matmul(x[:1], w), x[:1], exact)
    assert used == [1, stored.SMALL_M]


def fp8_weight(rng, n: int, k: int, name: str, scale_shape: tuple[int, ...]):
    import ml_dtypes

    from metrale_cli.models.formats import weight_format

    bits = rng.integers(0, 256, (n, k), dtype=np.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0x10  # no NaN codes
    w = bits.view(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.5, 2.0, scale_shape).astype(np.float32) * np.float32(k ** -0.5)
    fmt = weight_format(name)
    return fmt, (w, scale), fmt.dequantize(w, scale)


@pytest.mark.parametrize("m", [1, 5, 40])
def test_fp8_products_equal_the_dequantized_fp32_product(m):
    """FP8 with partial edge blocks (37 x 70 in 16 x 16 blocks) and per tensor: as formats.py's dequantization."""
    from metrale_cli.models.quantized.fp8 import block_format, tensor_format

    rng = np.random.default_rng([m, 8])
    x = rng.standard_normal((m, 70), dtype=np.float32)
    for name, scale_shape in [(block_format(16, 16), (3, 5)), (tensor_format(), ())]:
        fmt, tensors, exact = fp8_weight(rng, 37, 70, name, scale_shape)
        w = stored.FormattedWeight(fmt, tensors, (37, 70))
        check_product(matmul(x, w), x, exact)
        np.testing.assert_array_equal(np.asarray(w), exact)
        np.testing.assert_array_equal(w.rows_fp32(16, 37), exact[16:])


def test_fp8_blocks_of_rows_follow_the_scale_blocks(monkeypatch):
    """A product in many small row blocks (each a whole number of scale blocks) equals one in a single block."""
    from metrale_cli.models.quantized.fp8 import block_format

    rng = np.random.default_rng(9)
    fmt, tensors, exact = fp8_weight(rng, 100, 64, block_format(8, 32), (13, 2))
    x = rng.standard_normal((3, 64), dtype=np.float32)
    monkeypatch.setattr(stored, "BLOCK_BYTES", 4 * 64 * 12)  # 12 rows a block -> 8 (a multiple of 8)
    check_product(matmul(x, stored.FormattedWeight(fmt, tensors, (100, 64))), x, exact)


def test_mxfp4_experts_interleaved_and_joined():
    """MXFP4 stacked experts: one expert, the loader's de-interleaving of its rows, and fused parts joined."""
    from metrale_cli.models.formats import weight_format

    rng = np.random.default_rng(10)
    fmt = weight_format("mxfp4")
    blocks = rng.integers(0, 256, (3, 12, 2, 16), dtype=np.uint8)  # 3 experts, 12 rows, K = 64
    scales = rng.integers(120, 130, (3, 12, 2), dtype=np.uint8)
    exact = fmt.dequantize(blocks, scales)  # [3, 12, 64]
    w = stored.FormattedWeight(fmt, (blocks, scales), (3, 12, 64))
    order = np.concatenate([np.arange(0, 12, 2), np.arange(1, 12, 2)])
    w = w[..., order, :]
    x = rng.standard_normal((2, 64), dtype=np.float32)
    for e in range(3):
        check_product(matmul(x, w[e]), x, exact[e][order])
    np.testing.assert_array_equal(np.asarray(w), exact[:, order])
    joined = stored.join([w[0], w[2]])
    check_product(matmul(x, joined), x, np.concatenate([exact[0][order], exact[2][order]]))
    stacked = stored.join([w[0], w[1], w[2], w[0]]).reshape(2, 24, 64)
    check_product(matmul(x, stacked[1]), x, np.concatenate([exact[2][order], exact[0][order]]))


def test_quantized_checkpoints_keep_their_formats():
    """The FP8 and MXFP4 fixtures' projections stay as stored (their engines' parity is tested elsewhere)."""
    cases = [("llama_fp8_block", "o"), ("qwen3_moe_fp8_block", "experts_down"), ("gpt_oss_mxfp4", "experts_down")]
    for name, key in cases:
        w = read_weights(load_config(FIXTURES / name), Checkpoint.open(FIXTURES / name)).layers[0][key]
        assert isinstance(w, (stored.FormattedWeight, stored.JoinedWeight)), (name, type(w))


@pytest.mark.parametrize("name", ["llama_ct_fp8_channel", "qwen3_ct_fp8_tensor", "llama_ct_fp8_block", "llama_ct_nvfp4",
                                  "qwen3_ct_mixed", "llama_ct_w4a16"])
def test_compressed_tensors_weights_stay_stored_and_multiply_by_row_blocks(monkeypatch, name):
    """compressed-tensors FP8 / int8 / NVFP4 / symmetric pack-quantized weights stay as stored (asymmetric
    pack-quantized ones, whose zero points are packed down the rows, are dequantized at load); a product in row blocks of a few rows each
    (whole scale blocks for the 32 x 32 block fixture) equals the product with the whole dequantized weight."""
    from metrale_cli.models import formats

    cfg = load_config(FIXTURES / name)
    ckpt = Checkpoint.open(FIXTURES / name)
    w = read_weights(cfg, ckpt)
    monkeypatch.setattr(stored, "BLOCK_BYTES", 4 * 80 * 8)  # 8 rows of 80 a block (32 for the block fixture)
    rng = np.random.default_rng()
    kept = 0
    for i, layer in enumerate(cfg.definition.layers):
        for p in layer.params:
            if p.format is None:
                continue
            fmt = formats.weight_format(p.format)
            weight = w.layers[i][p.key]
            if fmt.kind == "ct_pack" and fmt.params["asym"]:  # zero points packed down the rows: dequantized
                assert type(weight) is np.ndarray, (p.format, type(weight))
                continue
            assert isinstance(weight, (stored.FormattedWeight, stored.JoinedWeight)), (p.format, type(weight))
            exact = np.concatenate(formats.dequantize(p, lambda n: ckpt.array(n, bf16_bits=True)))
            x = rng.standard_normal((3, exact.shape[-1]), dtype=np.float32)
            check_product(matmul(x, weight), x, exact.reshape(-1, exact.shape[-1]))
            kept += 1
    assert kept >= 2


def test_a_small_model_never_imports_numba():
    """numba's import takes about a second: the embedded model's weights are under FUSED_MIN, so a decode on it
    (and --help) runs without it."""
    import subprocess
    import sys

    code = ("import sys\nfrom metrale_cli.cli import main\ntry:\n    main(['decode', '--steps', '2', '-f', 'plain'])\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\nprint('numba' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent, capture_output=True, text=True,
                       timeout=120, env={**__import__("os").environ, "METRALE_DISABLE_CUDA": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False"


def test_threads_on_score_and_bench(run_cli):
    score = run_cli("score", "--model", str(FIXTURES / "llama_bf16"), "--tokens", "1 5 9 3", "--threads", "1",
                    "-f", "json")
    assert score.exit_code == 0 and '"perplexity"' in score.stdout, score.output
    bench = run_cli("bench", "--device", "cpu", "--preset", "tiny-llama", "--context", 16, "--prefill", 16, "--ks", 1,
                    "--repeats", 1, "--no-transformers", "--threads", 1, "-f", "plain")
    assert bench.exit_code == 0 and "decode step" in bench.stdout, bench.output
    bad = run_cli("score", "--model", str(FIXTURES / "llama_bf16"), "--tokens", "1 5 9 3", "--threads", "0")
    assert bad.exit_code != 0 and "--threads must be 1 or more" in bad.output


@pytest.mark.parametrize("m", [1, 3, 16])
def test_compiled_fp8_and_mxfp4_products_equal_the_dequantized_product(monkeypatch, m):
    """Up to SMALL_M rows, FP8 (block with partial edges, ue8m0-free F32 and BF16 scales, per tensor) and MXFP4
    weights go through the compiled kernels, which form each weight value as the dequantization does: the
    product equals x @ dequantized.T up to the order of the sums."""
    if not kernels.AVAILABLE:
        pytest.skip("numba is not installed")
    from metrale_cli.models.formats import weight_format
    from metrale_cli.models.quantized.fp8 import block_format, tensor_format

    monkeypatch.setattr(kernels, "FUSED_MIN", 0)
    used = []
    compiled = kernels.compiled()
    for name in ("gemm_fp8", "gemm_mxfp4"):
        original = getattr(compiled, name)
        monkeypatch.setattr(compiled, name, lambda *a, f=original, n=name: (used.append(n), f(*a)))
    rng = np.random.default_rng([m, 12])
    x = rng.standard_normal((m, 70), dtype=np.float32)
    for fmt_name, scale_shape in [(block_format(16, 16), (3, 5)), (tensor_format(), ())]:
        fmt, tensors, exact = fp8_weight(rng, 37, 70, fmt_name, scale_shape)
        check_product(matmul(x, stored.FormattedWeight(fmt, tensors, (37, 70))), x, exact)
        bf16_scale = fp32_to_bf16_bits(tensors[1])  # a BF16 scale, as Qwen3-FP8 stores it
        exact = fmt.dequantize(tensors[0], bf16_scale)
        check_product(matmul(x, stored.FormattedWeight(fmt, (tensors[0], bf16_scale), (37, 70))), x, exact)
    fmt = weight_format("mxfp4")
    blocks = rng.integers(0, 256, (2, 21, 2, 16), dtype=np.uint8)  # 2 experts, 21 rows, K = 64
    scales = rng.integers(118, 132, (2, 21, 2), dtype=np.uint8)
    w = stored.FormattedWeight(fmt, (blocks, scales), (2, 21, 64))
    x = rng.standard_normal((m, 64), dtype=np.float32)
    for e in range(2):
        check_product(matmul(x, w[e]), x, fmt.dequantize(blocks[e], scales[e]))
    assert used == ["gemm_fp8"] * 4 + ["gemm_mxfp4"] * 2
    monkeypatch.setattr(kernels, "FUSED_MIN", 10 ** 9)  # too small for the kernels: the row-block path
    check_product(matmul(x, w[1]), x, fmt.dequantize(blocks[1], scales[1]))
    assert len(used) == 6


def test_compiled_rows_for_many_rows_of_x(monkeypatch):
    """More than SMALL_M rows: the compiled kernels dequantize blocks of weight rows (FP8 in 16-row scale blocks,
    partial at the edge; MXFP4) for BLAS, the values the dequantization gives."""
    if not kernels.AVAILABLE:
        pytest.skip("numba is not installed")
    from metrale_cli.models.formats import weight_format
    from metrale_cli.models.quantized.fp8 import block_format

    monkeypatch.setattr(kernels, "FUSED_MIN", 0)
    monkeypatch.setattr(stored, "BLOCK_BYTES", 4 * 70 * 16)  # 16 rows a block: 37 rows in 3 blocks
    used = []
    compiled = kernels.compiled()
    for name in ("rows_fp8", "rows_mxfp4"):
        original = getattr(compiled, name)
        monkeypatch.setattr(compiled, name, lambda *a, f=original, n=name: (used.append(n), f(*a)))
    rng = np.random.default_rng(13)
    fmt, tensors, exact = fp8_weight(rng, 37, 70, block_format(16, 16), (3, 5))
    x = rng.standard_normal((stored.SMALL_M + 9, 70), dtype=np.float32)
    check_product(matmul(x, stored.FormattedWeight(fmt, tensors, (37, 70))), x, exact)
    mx = weight_format("mxfp4")
    blocks = rng.integers(0, 256, (37, 2, 16), dtype=np.uint8)
    scales = rng.integers(118, 132, (37, 2), dtype=np.uint8)
    x = rng.standard_normal((stored.SMALL_M + 9, 64), dtype=np.float32)
    check_product(matmul(x, stored.FormattedWeight(mx, (blocks, scales), (37, 64))), x, mx.dequantize(blocks, scales))
    assert used.count("rows_fp8") == 3 and used.count("rows_mxfp4") >= 2


def _recording_compiled(monkeypatch, names: tuple[str, ...]) -> tuple:
    """The compiled kernels' module with FUSED_MIN 0 (every weight takes them) and blocks of 8 weight rows of 80
    for more than SMALL_M rows of x, and the list the kernels `names` append their name to when called."""
    if not kernels.AVAILABLE:
        pytest.skip("numba is not installed")
    monkeypatch.setattr(kernels, "FUSED_MIN", 0)
    monkeypatch.setattr(stored, "BLOCK_BYTES", 4 * 80 * 8)
    used: list[str] = []
    compiled = kernels.compiled()
    for name in names:
        original = getattr(compiled, name)
        monkeypatch.setattr(compiled, name, lambda *a, f=original, n=name: (used.append(n), f(*a)))
    return compiled, used


def _fixture_weights(name: str, family: str) -> list:
    """Layer 0's o and down weights of fixture `name`, kept as stored in `family`."""
    layer = read_weights(load_config(FIXTURES / name), Checkpoint.open(FIXTURES / name)).layers[0]
    weights = [layer["o"], layer["down"]]
    assert all(isinstance(w, stored.FormattedWeight) and w.fmt.family == family for w in weights)
    return weights


def _check_compiled(compiled, rows_kernel: str, weights: list, rng, m: int) -> None:
    """Each weight's values from the rows kernel equal its format's dequantization bit for bit, and its product
    with m fresh rows of x equals x @ dequantized.T up to the order of the sums."""
    for w in weights:
        exact = w.fmt.dequantize(*w.tensors)
        assert exact.shape == w.shape
        rows = np.empty(w.shape, np.float32)
        getattr(compiled, rows_kernel)(*stored.COMPILED[w.fmt.family].operands(w), 0, rows)
        np.testing.assert_array_equal(rows, exact)
        x = rng.standard_normal((m, w.shape[1]), dtype=np.float32)
        check_product(matmul(x, w), x, exact)


@pytest.mark.parametrize("m", [1, 3, 25])
def test_compiled_nvfp4_products_equal_the_dequantized_product(monkeypatch, m):
    """NVFP4 weights (compressed-tensors' from the fixture checkpoint, ModelOpt's drawn by its format) go through
    the compiled kernels, which form each value as the format's dequantization does: up to SMALL_M rows of x the
    fused product, more the rows kernel and BLAS."""
    from metrale_cli.models.formats import weight_format
    from metrale_cli.models.quantized import modelopt

    compiled, used = _recording_compiled(monkeypatch, ("gemm_nvfp4", "rows_nvfp4"))
    rng = np.random.default_rng([m, 14])
    weights = _fixture_weights("llama_ct_nvfp4", "ct_nvfp4")
    mo, shape = weight_format("modelopt_nvfp4"), (37, 64)
    tensors = tuple(modelopt.draw(rng, i, t.shape, shape) for i, t in enumerate(mo.tensors(Tensor("w.weight", shape))))
    weights.append(stored.FormattedWeight(mo, tensors, shape))
    _check_compiled(compiled, "rows_nvfp4", weights, rng, m)
    fused = m <= stored.SMALL_M
    assert used.count("gemm_nvfp4") == (3 if fused else 0) and used.count("rows_nvfp4") >= (3 if fused else 6)


@pytest.mark.parametrize("m", [1, 3, 25])
def test_compiled_packed_int_products_equal_the_dequantized_product(monkeypatch, m):
    """Symmetric pack-quantized weights (the W4A16 fixture's int4 groups of 16; int8 per channel and int4 per tensor
    packed here, with a partial last word) go through the compiled kernels, whose values equal the package's
    dequantization bit for bit."""
    from metrale_cli.models.formats import weight_format
    from metrale_cli.models.quantized import compressed_tensors as ct

    compiled, used = _recording_compiled(monkeypatch, ("gemm_packed", "rows_packed"))
    rng = np.random.default_rng([m, 15])
    weights = _fixture_weights("llama_ct_w4a16", "ct_pack")
    for scheme, n, k in ((ct.Scheme("pack", "channel", 8), 19, 44), (ct.Scheme("pack", "tensor", 4), 21, 60)):
        fmt = weight_format(ct.scheme_format(scheme))
        words = rng.integers(-2**31, 2**31, (n, -(-k * scheme.bits // 32)), dtype=np.int64).astype(np.int32)
        scale = rng.uniform(0.01, 0.1, (n, 1) if scheme.strategy == "channel" else (1,)).astype(np.float32)
        weights.append(stored.FormattedWeight(fmt, (words, scale, np.array([n, k], np.int64)), (n, k)))
    _check_compiled(compiled, "rows_packed", weights, rng, m)
    fused = m <= stored.SMALL_M
    assert used.count("gemm_packed") == (4 if fused else 0) and used.count("rows_packed") >= (4 if fused else 8)
