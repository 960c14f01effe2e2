"""NVRTC source assembly and module loading: the kernels are compiled as ONE CuPy RawModule of
common.cu followed by every kernel file (CuPy's kernel cache hashes the source text only, so the
helpers travel inside it), with the template instances named by `names.name_expressions`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

_CUDA_DIR = Path(__file__).resolve().parent
_SOURCES = ("elementwise.cu", "norm_rope.cu", "gemv.cu", "gemv_ring.cu", "attention.cu", "flash_prefill.cu", "argmax.cu", "gemv_tc.cu")
COMPILE_OPTIONS = ("-std=c++17",)


def joined_source(*names: str) -> str:
    """One translation unit: common.cu, then each of `names` (kernels/*.cu) in order under a `// ---- name ----`
    line, the `#include` lines of the files joined here removed (every module is built this way)."""
    includes = {f'#include "{n}"' for n in ("common.cu", *names)}
    parts = [(_CUDA_DIR / "common.cu").read_text()]
    for name in names:
        text = (_CUDA_DIR / name).read_text()
        parts.append(f"// ---- {name} ----\n" + "\n".join(ln for ln in text.splitlines() if ln.strip() not in includes))
    return "\n".join(parts) + "\n"


def module_source() -> str:
    """common.cu followed by every kernel file of the core module, with their include lines removed."""
    return joined_source(*_SOURCES)


def compile_module(cupy: Any, names: Sequence[str]) -> Any:
    """One RawModule of module_source() with the template instances `names` (compiled on first use
    of a function, and cached by CuPy on disk)."""
    return cupy.RawModule(code=module_source(), options=COMPILE_OPTIONS, name_expressions=names)
