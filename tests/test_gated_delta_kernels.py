"""The Gated DeltaNet CUDA kernels' host side on a machine without a GPU: the column maps read the fused
projection exactly as the NumPy reference splits it (both layouts), and gated_delta.cu compiles with nvcc
(sm_90, PTX) as one translation unit with common.cu (skipped where nvcc is absent). The kernels themselves
are checked against the NumPy reference in tests/gpu/test_gated_delta_cuda.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from metrale_cli.backends.cuda.kernels import gated_delta as gdk
from metrale_cli.backends.numpy.linear_attention import split
from metrale_cli.models.spec import LinearAttentionSpec


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("hk,hv", [(2, 4), (1, 3), (2, 2)])
def test_column_maps_read_the_projection_as_the_reference_splits_it(grouped, hk, hv):
    spec = LinearAttentionSpec(hk, hv, 16, 24, 4, 1e-6, grouped=grouped)
    proj = np.random.default_rng().normal(size=(3, spec.in_size)).astype(np.float32)
    q, k, v, z, b, a = split(proj, spec)
    maps = gdk.column_maps(spec)
    mixed = np.concatenate([q.reshape(3, -1), k.reshape(3, -1), v.reshape(3, -1)], axis=1)
    np.testing.assert_array_equal(proj[:, maps["src"]], mixed)
    np.testing.assert_array_equal(proj[:, maps["z"]], z.reshape(3, -1))
    np.testing.assert_array_equal(proj[:, maps["b"]], b)
    np.testing.assert_array_equal(proj[:, maps["a"]], a)
    every = np.concatenate([maps[n] for n in ("src", "z", "b", "a")])
    assert sorted(every) == list(range(spec.in_size))  # each column read once


def test_the_kernels_compile_with_nvcc(tmp_path):
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").is_file() else None)
    if nvcc is None:
        pytest.skip("nvcc not found")
    src = tmp_path / "gated_delta_module.cu"
    src.write_text(gdk.module_source())
    r = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-ptx", "-o", str(tmp_path / "m.ptx"), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    ptx = (tmp_path / "m.ptx").read_text()
    for name in gdk.PLAIN:
        assert f".entry {name}(" in ptx, name


def test_the_chunked_rule_constants_and_shared_memory():
    """The chunked rule's Python constants are gated_delta.cu's, gdn_chunk_state's dynamic shared memory fits an
    H100 / H200 block's opt-in limit (227 KiB) at every key head dim, and the work area pads the rows to chunks."""
    import re

    src = (Path(gdk.__file__).parent / "gated_delta.cu").read_text()
    for name, value in (("GDN_CHUNK", gdk.CHUNK), ("GDN_CHUNK_THREADS", gdk.CHUNK_THREADS),
                        ("GDN_CHUNK_BV", gdk.CHUNK_BV)):
        assert re.search(rf"#define {name} (\d+)", src).group(1) == str(value), name
    assert [gdk.chunk_state_smem(dk) for dk in gdk.KEY_HEAD_DIMS] == [65536, 106496, 188416]
    assert max(gdk.chunk_state_smem(dk) for dk in gdk.KEY_HEAD_DIMS) <= 227 * 1024
    spec = LinearAttentionSpec(16, 48, 128, 128, 4, 1e-6, grouped=False)
    assert gdk.chunk_work_shapes(65, spec) == {"w": (48, 128, 128), "u": (48, 128, 128), "intra": (48, 128, 64),
                                               "cum": (48, 128)}
