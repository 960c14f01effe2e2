"""The CUDA sources compile with nvcc (sm_90, PTX only) on a machine without a GPU: every .cu file on
its own (its `#include "common.cu"` resolved) with every template instance that the runtime asks NVRTC
for (core and fused modules), and module_source() as the one translation unit NVRTC compiles.  Skipped
cleanly where nvcc is absent; the GPU tests compile the same sources with NVRTC."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from metrale_cli.backends.cuda.kernels import names, nvrtc

ARCH = "-arch=sm_90"
CHUNK = 24  # template instances per translation unit, so that the big files spread over the cores
KERNEL_DEF = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(")


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


def _all_instances() -> list[str]:
    return list(names.name_expressions()) + list(names.fused_name_expressions()) + list(names.PLAIN_KERNELS)


def _defining_file() -> dict[str, str]:
    """Kernel (template) name -> the .cu file that defines it."""
    where: dict[str, str] = {}
    for f in nvrtc._SOURCES:
        for name in KERNEL_DEF.findall((nvrtc._CUDA_DIR / f).read_text()):
            assert name not in where, f"{name} is defined in {where[name]} and {f}"
            where[name] = f
    return where


def _instances_by_file() -> dict[str, list[str]]:
    where = _defining_file()
    by_file: dict[str, list[str]] = {f: [] for f in nvrtc._SOURCES}
    for inst in _all_instances():
        base = inst.split("<")[0].strip()
        assert base in where, f"{inst}: no kernel {base} in {', '.join(nvrtc._SOURCES)}"
        by_file[where[base]].append(inst)
    return by_file


def _units() -> dict[str, tuple[str, list[str]]]:
    """label -> (.cu file, the instances its translation unit takes): each file on its own, the files
    with many instances in chunks of CHUNK."""
    units: dict[str, tuple[str, list[str]]] = {}
    for f, insts in _instances_by_file().items():
        parts = [insts[i:i + CHUNK] for i in range(0, len(insts), CHUNK)]
        for i, part in enumerate(parts):
            units[f if len(parts) == 1 else f"{f}[{i + 1}/{len(parts)}]"] = (f, part)
    return units


def _compile(nvcc: str, tu: Path) -> tuple[int, str, str]:
    """(exit code, stderr, ptx) of nvcc -ptx on tu with the runtime's options."""
    ptx = tu.with_suffix(".ptx")
    cmd = [nvcc, ARCH, *nvrtc.COMPILE_OPTIONS, "-ptx", "-o", str(ptx), str(tu)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return r.returncode, r.stderr, ptx.read_text() if r.returncode == 0 else ""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Compile every source (and the NVRTC module) once, in parallel; {label: (rc, stderr, ptx, n)}."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (PATH, /usr/local/cuda/bin): the sources are compiled only by the GPU tests")
    tmp = tmp_path_factory.mktemp("cuda_sources")
    jobs: dict[str, tuple[Path, int]] = {}
    for i, (label, (f, insts)) in enumerate(_units().items()):
        tu = tmp / f"check_{i}_{f}"
        # Taking each kernel's address in host code makes nvcc instantiate and compile it.
        table = ",\n".join(f"    (void*)&{n}" for n in insts)
        tu.write_text(f'#include "{nvrtc._CUDA_DIR / f}"\n\nvoid* const metrale_instances[] = {{\n{table}\n}};\n')
        jobs[label] = (tu, len(insts))
    module = tmp / "module.cu"
    module.write_text(nvrtc.module_source())
    jobs["module_source()"] = (module, len(names.PLAIN_KERNELS))  # templates: instantiated above
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        # the biggest units first, so that no long one starts last
        order = sorted(jobs, key=lambda label: -jobs[label][1])
        futures = {label: pool.submit(_compile, nvcc, jobs[label][0]) for label in order}
        return {label: (*fut.result(), jobs[label][1]) for label, fut in futures.items()}


def test_every_runtime_instance_names_a_kernel_of_one_file():
    by_file = _instances_by_file()
    assert sum(len(v) for v in by_file.values()) == len(set(_all_instances()))
    assert all(by_file.values()), {f: v for f, v in by_file.items() if not v}


@pytest.mark.slow
@pytest.mark.parametrize("label", [*_units(), "module_source()"])
def test_cuda_source_compiles(compiled, label):
    rc, stderr, ptx, n_kernels = compiled[label]
    assert rc == 0, f"nvcc failed on {label}:\n{stderr[-4000:]}"
    entries = re.findall(r"^\s*(?:\.visible\s+)?\.entry\s+(\w+)", ptx, re.M)
    if label in _units():  # a file split into chunks: its extern "C" kernels are in every chunk's PTX
        f, insts = _units()[label]
        plain = set(names.PLAIN_KERNELS) & set(KERNEL_DEF.findall((nvrtc._CUDA_DIR / f).read_text()))
        n_kernels += len(plain - set(insts))
    assert len(entries) == n_kernels, f"{label}: {len(entries)} kernels in the PTX, expected {n_kernels}"


def test_split_argmax_constants_match_the_source():
    from metrale_cli.backends.cuda.kernels import tuning

    src = (nvrtc._CUDA_DIR / "argmax.cu").read_text()
    threads = int(re.search(r"#define ARGMAX_THREADS (\d+)", src).group(1))
    per = int(re.search(r"#define ARGMAX_PER (\d+)", src).group(1))
    assert (tuning.ARGMAX_THREADS, tuning.ARGMAX_CHUNK) == (threads, threads * per)


def test_attention_constants_match_the_source():
    from metrale_cli.backends.cuda.kernels import tuning

    src = (nvrtc._CUDA_DIR / "attention.cu").read_text()
    for name in ("ATTN_TC_WARPS", "ATTN_CHUNK_ALIGN", "ATTN_COMBINE_BATCH", "ATTN_WARPS"):
        assert int(re.search(rf"#define {name} (\d+)", src).group(1)) == getattr(tuning, name), name
