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
