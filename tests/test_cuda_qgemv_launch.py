"""The quantized-weight GEMV's wrappers (kernels/qgemv.py through fp8.py and w4.py) on a machine without a GPU: each
launch passes the arguments qgemv.cu's signature declares (test_cuda_launch_args's recorded launches), picks the
instance for its rows and options, and the wrappers refuse operands the kernels cannot take. It checks no numbers:
tests/gpu/test_fp8.py and test_w4.py do."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("metrale_cli.backends.cuda.kernels")
from metrale_cli.backends.cuda.kernels import fp8 as fp8_kernels  # noqa: E402
from metrale_cli.backends.cuda.kernels import nvrtc, qgemv  # noqa: E402
from metrale_cli.backends.cuda.kernels import w4 as w4_kernels  # noqa: E402

from test_cuda_launch_args import SIGNATURE, FakeArray, KIND_OK, Recorder, _param_kinds, kern  # noqa: E402,F401


def _params() -> dict[str, list[str]]:
    out = {}
    for f in ("qgemv.cu", "fp8.cu"):
        out.update({n: _param_kinds(p) for n, p in SIGNATURE.findall((nvrtc._CUDA_DIR / f).read_text())})
    return out


def _wrapper(cls, module, kern):  # noqa: F811
    q = object.__new__(cls)
    q.k, q._cp, q._np = kern, kern._cp, np
    q._fn = {n: Recorder(n, kern.calls) for n in module.instance_names() + getattr(module, "PLAIN", ())}
    return q


def _check_args(calls) -> None:
    params = _params()
    for name, args in calls:
        kinds = params[name.split("<")[0]]
        assert len(args) == len(kinds), f"{name}: {len(args)} arguments, the kernel takes {len(kinds)}"
        for i, (a, kind) in enumerate(zip(args, kinds)):
            assert KIND_OK[kind](a), f"{name}: argument {i} is {type(a).__name__}, the kernel takes {kind}"


@pytest.mark.parametrize("m", [1, 4, 5, 16])
def test_fp8_gemv_launches(kern, m):  # noqa: F811
    K, N = 256, 96  # noqa: N806
    f = _wrapper(fp8_kernels.Fp8Kernels, fp8_kernels, kern)
    w, scale = FakeArray((N, K), np.uint8), FakeArray((-(-N // 32), K // 128), np.float32)
    x, out = FakeArray((m, K), np.float32), FakeArray((m, N), np.float32)
    f.gemv(x, w, scale, 32, 128, out, FakeArray((N,), np.uint16), accumulate=True)
    f.gemv(x, w, scale, 32, 128, out, norm_weight=FakeArray((K,), np.uint16), eps=1e-5, norm_offset=1.0)
    half = FakeArray((m, N // 2), np.float32)
    f.gemv(x, w, scale, 32, 128, half, swiglu=True, norm_weight=FakeArray((K,), np.uint16), activation="gelu_tanh")
    f.dequant_bf16(w, scale, 32, 128, FakeArray((N, K), np.uint16))
    f.act_quant(x, 128, True, None, x)
    pair = fp8_kernels.PAIR
    assert [c[0] for c in kern.calls] == [qgemv.gemv_name(pair, m, False)] * 2 + [
        qgemv.gemv_name(pair, m, True), qgemv.dequant_name(pair), "fp8_act_quant_kernel"]
    _check_args(kern.calls)
    norm_flag = [c[1][14] for c in kern.calls[:3]]  # has_norm
    assert norm_flag == [np.int32(0), np.int32(1), np.int32(1)]
    grid = (-(-N // (qgemv.QGEMV_WARPS * qgemv.rows_per_warp(m, False))),)
    assert f._fn[qgemv.gemv_name(pair, m, False)].last[0] == grid


@pytest.mark.parametrize("code,scales", list(w4_kernels.PAIRS))
def test_w4_gemv_launches(kern, code, scales):  # noqa: F811
    K, N, m = 200, 64, 3  # noqa: N806  (K: a padded last chunk)
    f = _wrapper(w4_kernels.W4Kernels, w4_kernels, kern)
    w = FakeArray((N, w4_kernels.padded_words(K)), np.uint32)
    scale = FakeArray((N, K // 8), np.float32 if scales == "f32" else np.uint8)
    factor = None if scales == "f32" else FakeArray((N,), np.float32)
    x, out = FakeArray((m, K), np.float32), FakeArray((m, N // 2), np.float32)
    f.gemv(x, w, scale, 8, code, scales, factor, out, swiglu=True)
    f.dequant_bf16(w, scale, 8, code, scales, factor, FakeArray((N, K), np.uint16))
    pair = w4_kernels.PAIRS[(code, scales)]
    assert [c[0] for c in kern.calls] == [qgemv.gemv_name(pair, m, True), qgemv.dequant_name(pair)]
    _check_args(kern.calls)
    want = factor if factor is not None else kern._dummy  # the rows' factors (a placeholder for fp32 scales)
    assert kern.calls[0][1][3] is want and kern.calls[1][1][2] is want


def test_the_wrappers_refuse_what_the_kernels_cannot_take(kern):  # noqa: F811
    f = _wrapper(fp8_kernels.Fp8Kernels, fp8_kernels, kern)
    w, scale = FakeArray((64, 128), np.uint8), FakeArray((1, 1), np.float32)
    x = FakeArray((2, 128), np.float32)
    with pytest.raises(ValueError, match="swiglu"):
        f.gemv(x, w, scale, 64, 128, FakeArray((2, 32), np.float32), FakeArray((64,), np.uint16), swiglu=True)
    with pytest.raises(ValueError, match="out"):
        f.gemv(x, w, scale, 64, 128, FakeArray((2, 64), np.float32), swiglu=True)  # out needs N / 2 columns
    with pytest.raises(ValueError, match="1 to 16"):
        f.gemv(FakeArray((17, 128), np.float32), w, scale, 64, 128, FakeArray((17, 64), np.float32))
    with pytest.raises(ValueError, match="multiples of 16"):
        f.gemv(FakeArray((2, 120), np.float32), FakeArray((64, 120), np.uint8), scale, 64, 128,
               FakeArray((2, 64), np.float32))
    g = _wrapper(w4_kernels.W4Kernels, w4_kernels, kern)
    with pytest.raises(ValueError, match="16-byte chunks"):  # a row one word short
        g.gemv(x, FakeArray((64, 3), np.uint32), FakeArray((64, 16), np.float32), 8, "int4", "f32", None,
               FakeArray((2, 64), np.float32))
    with pytest.raises(ValueError, match="the kernels take"):
        g.gemv(x, FakeArray((64, 16), np.uint32), FakeArray((64, 16), np.float32), 8, "e3m0", "f32", None,
               FakeArray((2, 64), np.float32))
    with pytest.raises(ValueError, match="factors"):  # e4m3 scales without their rows' factors
        g.gemv(x, FakeArray((64, 16), np.uint32), FakeArray((64, 16), np.uint8), 8, "e2m1", "e4m3_mul", None,
               FakeArray((2, 64), np.float32))
    with pytest.raises(ValueError, match="uint8"):  # fp32 scales declared e4m3
        g.gemv(x, FakeArray((64, 16), np.uint32), FakeArray((64, 16), np.float32), 8, "e2m1", "e4m3_div",
               FakeArray((64,), np.float32), FakeArray((2, 64), np.float32))
    assert kern.calls == []


def test_the_group_index_by_a_high_multiply_is_exact():
    """qgemv.cu's k / group = umulhi(k, ceil(2^32 / group)) (the magic the wrapper passes), for every eight-value
    start k below MAX_K and groups of 8 to 4096 (every multiple of 8) and a few up to MAX_K."""
    k = np.arange(0, qgemv.MAX_K, 8, dtype=np.uint64)
    for group in list(range(8, 4097, 8)) + [5000, 12288, 40000, qgemv.MAX_K]:
        magic = -(-(1 << 32) // group)
        assert magic < 1 << 31  # passed as an int
        assert np.array_equal((k * np.uint64(magic)) >> np.uint64(32), k // np.uint64(group)), group


def test_each_pair_compiles_on_its_first_launch(kern):  # noqa: F811
    """A model's weights use one or two (value, scale) pairs: W4Kernels compiles a module for a pair only when one of
    its kernels first launches, and FP8's activation quantization comes with its one pair's module."""
    from types import SimpleNamespace

    compiled = []

    class Module:
        def __init__(self, code, options, name_expressions):
            compiled.append(tuple(name_expressions))
            self.names = name_expressions

        def get_function(self, n):
            return Recorder(n, kern.calls)

    kern._cp = SimpleNamespace(RawModule=Module, ndarray=FakeArray)
    g = w4_kernels.W4Kernels(kern)
    assert compiled == []
    K, N = 64, 32  # noqa: N806
    w, scale = FakeArray((N, w4_kernels.padded_words(K)), np.uint32), FakeArray((N, K // 16), np.uint8)
    for _ in range(2):
        g.gemv(FakeArray((1, K), np.float32), w, scale, 16, "e2m1", "e4m3_div", FakeArray((N,), np.float32),
               FakeArray((1, N), np.float32))
    assert compiled == [qgemv.name_expressions((w4_kernels.PAIRS[("e2m1", "e4m3_div")],))]
    f = fp8_kernels.Fp8Kernels(kern)
    f.act_quant(FakeArray((1, K), np.float32), 64, False, None, FakeArray((1, K), np.float32))
    assert compiled[1] == qgemv.name_expressions((fp8_kernels.PAIR,)) and len(compiled) == 2
