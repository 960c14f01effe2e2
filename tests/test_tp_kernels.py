"""The tensor-parallel kernels (kernels/tp.cu) on a machine without a GPU: their module compiles with nvcc
(sm_90, PTX; skipped without nvcc) and each launch wrapper passes the parameters the .cu signature
declares (test_cuda_launch_args' recording stand-ins). tests/gpu/test_tp_cuda.py checks the numbers."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from metrale_cli.backends.cuda.kernels import nvrtc, tp
from test_cuda_launch_args import KIND_OK, SIGNATURE, Recorder, _param_kinds, bf16, f32, i32, kern  # noqa: F401
from test_cuda_sources import ARCH, _nvcc


def test_the_module_compiles(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    src = tmp_path / "tp_module.cu"
    src.write_text(tp.module_source())
    r = subprocess.run([nvcc, ARCH, *nvrtc.COMPILE_OPTIONS, "-ptx", "-o", str(tmp_path / "tp.ptx"), str(src)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    ptx = (tmp_path / "tp.ptx").read_text()
    assert all(f".entry {name}" in ptx for name in tp.PLAIN)


def test_launches_pass_the_declared_parameters(kern):  # noqa: F811
    t = object.__new__(tp.TpKernels)
    t.k, t._cp, t._np = kern, kern._cp, np
    t._fn = {n: Recorder(n, kern.calls) for n in tp.PLAIN}
    t.vocab_embedding(i32(3), bf16(20, 64), f32(3, 64), 40, scale=8.0)
    t.argmax_pairs(f32(2, 20), i32(2), f32(2, 2), 40)
    t.argmax_pairs(bf16(2, 20), i32(2), f32(2, 2), 40)
    params = {name: _param_kinds(p) for name, p in SIGNATURE.findall((nvrtc._CUDA_DIR / "tp.cu").read_text())}
    assert [c[0] for c in kern.calls] == list(tp.PLAIN)
    for name, args in kern.calls:
        assert len(args) == len(params[name]), name
        assert all(KIND_OK[k](a) for a, k in zip(args, params[name])), name
    with pytest.raises(ValueError, match="exact"):
        t.argmax_pairs(f32(1, 20), i32(1), f32(1, 2), 1 << 24)


def test_moe_launches_pass_the_declared_parameters(kern):  # noqa: F811
    """The MoE kernels' wrappers (kernels/moe.py) against moe.cu's parameter lists, with a rank's held experts
    (route's range, gate_up / down's first expert: the expert-parallel split of --tp)."""
    from metrale_cli.backends.cuda.kernels import moe

    m = object.__new__(moe.MoeKernels)
    m.k, m._cp, m._np = kern, kern._cp, np
    m._fn = {n: Recorder(n, kern.calls) for n in moe.name_expressions()}
    E, k, H, inter, rows = 16, 4, 64, 32, moe.MOE_MAX_ROWS
    u = min(E, rows * k)
    b = moe.RouteBuffers(i32(rows, k), f32(rows, k), f32(rows), f32(rows, H), i32(1), i32(u), i32(u), i32(u, rows))
    m.route(f32(3, E), f32(3, H), bf16(H), 1e-6, E, k, True, False, b, held=range(8, 12))
    m.gate_up(3, bf16(4, 2 * inter, H), b, f32(rows * k, inter), first=8)
    m.down(3, bf16(4, H, inter), b, f32(rows * k, inter), f32(3, H), shared=(bf16(H, 16), f32(3, 16)),
           accumulate=True, first=8)
    m.topk_rows(f32(5, E), E, k, True, False, i32(5, k), f32(5, k), f32(5))
    params = {name: _param_kinds(p) for name, p in SIGNATURE.findall((nvrtc._CUDA_DIR / "moe.cu").read_text())}
    assert len(kern.calls) == 4
    for name, args in kern.calls:
        kinds = params[name.split("<")[0].strip()]
        assert len(args) == len(kinds), f"{name}: {len(args)} arguments, the kernel takes {len(kinds)}"
        assert all(KIND_OK[kd](a) for a, kd in zip(args, kinds)), name
    with pytest.raises(ValueError, match="held experts"):
        m.route(f32(3, E), f32(3, H), bf16(H), 1e-6, E, k, True, False, b, held=range(12, 20))
    # gpt-oss: topk_softmax routing, the experts' biases and the clamped SwiGLU
    from metrale_cli.models.spec import RouterSpec

    kern.calls.clear()
    router = RouterSpec("topk_softmax", bias=True)
    m.route(f32(3, E), f32(3, H), bf16(H), 1e-6, E, k, False, False, b, router=router)
    m.topk_rows(f32(5, E), E, k, False, False, i32(5, k), f32(5, k), f32(5), router=router)
    m.gate_up(3, bf16(E, 2 * inter, H), b, f32(rows * k, inter), bias=bf16(E, 2 * inter), activation="swiglu_oai",
              limit=7.0, alpha=1.702)
    m.down(3, bf16(E, H, inter), b, f32(rows * k, inter), f32(3, H), accumulate=True, bias=bf16(E, H))
    assert len(kern.calls) == 4
    assert int(kern.calls[0][1][-6]) == moe.ROUTER_KINDS["topk_softmax"]
    assert [int(a) for a in kern.calls[2][1][-4:-2]] == [1, 2]  # use_bias, ACT_SWIGLU_OAI
    assert int(kern.calls[3][1][-1]) == 1  # use_bias
    for name, args in kern.calls:
        kinds = params[name.split("<")[0].strip()]
        assert len(args) == len(kinds), f"{name}: {len(args)} arguments, the kernel takes {len(kinds)}"
        assert all(KIND_OK[kd](a) for a, kd in zip(args, kinds)), name
    with pytest.raises(ValueError, match="gate_up bias"):
        m.gate_up(3, bf16(E, 2 * inter, H), b, f32(rows * k, inter), bias=bf16(E, inter))
    with pytest.raises(ValueError, match="limit"):
        m.gate_up(3, bf16(E, 2 * inter, H), b, f32(rows * k, inter), activation="swiglu_oai")
    with pytest.raises(ValueError, match="activation"):
        m.gate_up(3, bf16(E, 2 * inter, H), b, f32(rows * k, inter), activation="gelu_tanh")
