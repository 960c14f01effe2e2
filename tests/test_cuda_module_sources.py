"""The CUDA modules built only for some models (kernels/moe.py: common.cu + routers.cu + moe.cu; kernels/mla.py:
common.cu + mla.cu; kernels/fp8.py and w4.py: the quantized GEMV qgemv.cu with their policies' instances) compile with nvcc (sm_90, PTX only) on a machine without a GPU, as the one translation unit
NVRTC compiles and each .cu file on its own (its includes resolved), with every kernel the wrappers launch in the
PTX.  Skipped cleanly where nvcc is absent; the GPU tests compile the same sources with NVRTC."""

from __future__ import annotations

import re
import subprocess

import pytest

from metrale_cli.backends.cuda.kernels import fp8, mla, moe, nvrtc, w4

from test_cuda_sources import ARCH, _nvcc

pytestmark = pytest.mark.slow


def _entries(nvcc: str, tu, tmp_path, extra=()) -> set[str]:
    ptx = tmp_path / (tu.stem + ".ptx")
    r = subprocess.run([nvcc, ARCH, *nvrtc.COMPILE_OPTIONS, *extra, "-ptx", "-o", str(ptx), str(tu)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"nvcc failed on {tu.name}:\n{r.stderr[-4000:]}"
    return set(re.findall(r"^\s*(?:\.visible\s+)?\.entry\s+(\w+)", ptx.read_text(), re.M))


@pytest.fixture(scope="module")
def nvcc():
    found = _nvcc()
    if found is None:
        pytest.skip("nvcc not found (PATH, /usr/local/cuda/bin): the sources are compiled only by the GPU tests")
    return found


def test_the_moe_module_compiles_with_every_kernel(nvcc, tmp_path):
    tu = tmp_path / "moe_module.cu"
    tu.write_text(moe.module_source())
    assert not _entries(nvcc, tu, tmp_path, ("-DMETRALE_NVRTC",))  # every kernel a template: NVRTC's name expressions
    standalone = _entries(nvcc, nvrtc._CUDA_DIR / "moe.cu", tmp_path)  # its instances, includes resolved
    assert len(standalone) == len(moe.name_expressions())


@pytest.mark.parametrize("module", [fp8, w4], ids=["fp8", "w4"])
def test_the_quantized_gemv_modules_compile_with_every_instance(nvcc, tmp_path, module):
    """Each module's translation unit with its instances (the name expressions NVRTC gets, taken by address here):
    every instance and plain kernel in the PTX; FP8's widening is the sm_89+ conversion."""
    tu = tmp_path / f"{module.__name__.rsplit('.', 1)[1]}_module.cu"
    tu.write_text(module.module_source() + "\nvoid* const metrale_instances[] = {\n"
                  + ",\n".join(f"    (void*)&{n}" for n in module.instance_names()) + "\n};\n")
    plain = getattr(module, "PLAIN", ())
    entries = _entries(nvcc, tu, tmp_path)
    assert len(entries) == len(module.instance_names()) + len(plain) and set(plain) <= entries
    if module is fp8:
        assert "cvt.rn.f16x2.e4m3x2" in (tmp_path / "fp8_module.ptx").read_text()


def test_the_mla_module_compiles_with_every_kernel(nvcc, tmp_path):
    tu = tmp_path / "mla_module.cu"
    tu.write_text(mla.module_source())
    assert _entries(nvcc, tu, tmp_path) == set(mla.PLAIN)
    assert _entries(nvcc, nvrtc._CUDA_DIR / "mla.cu", tmp_path) == set(mla.PLAIN)


def test_the_constants_match_the_sources():
    src = mla.module_source()
    for name in ("MLA_HG", "MLA_TK", "MLA_MAX_D", "MLA_LOADS", "MLA_MAX_R", "MLA_MAX_NOPE", "MLA_Q_COLS", "MLA_Q_WARPS",
                 "MLA_OUT_THREADS", "MLA_OUT_V"):
        assert int(re.search(rf"#define {name} (\d+)", src).group(1)) == getattr(mla, name), name
    routers = (nvrtc._CUDA_DIR / "routers.cu").read_text()
    assert int(re.search(r"#define MOE_MAX_GROUPS (\d+)", routers).group(1)) == moe.MOE_MAX_GROUPS
    codes = dict(re.findall(r"#define MOE_ROUTER_(\w+) (\d+)", routers))
    assert {int(v) for v in codes.values()} == set(moe.ROUTER_KINDS.values())
    assert int(codes["SIGMOID_GROUPED"]) == moe.ROUTER_KINDS["sigmoid_biased_grouped"]
    assert int(codes["SOFTMAX_GROUPED"]) == moe.ROUTER_KINDS["softmax_group_limited"]
    assert int(codes["SOFTMAX_TOPK"]) == moe.ROUTER_KINDS["softmax_topk"]
