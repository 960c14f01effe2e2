"""The CUDA engine's rows paths (`CudaEngine.set_path`, `load_cuda_engine(path=)`, METRALE_CUDA_PATH, `metrale bench
--path`), both giving the same logits within fp32 summation order (tests/gpu/test_fused_path.py), both launching
with programmatic dependent launch where the device has it:

- "fused" (DEFAULT_PATH): FusedRowsPass, the rows path with one launch fewer per layer: rope + KV append in the
  attention split kernel (one row) or in the qkv GEMV's last blocks (verify rows);
- "rows" (BASE_PATH, the one path a tensor-parallel rank runs): RowsPass, every one-row projection on the ring GEMV
  (gemv_ring.cu) where it fits (Kernels.ring_fits), so that a projection's blocks request their first weights
  while the kernel before it drains.

No CuPy here: the CLI checks a --path before any engine is built."""

from __future__ import annotations

import os

from ...errors import UsageError

ROWS_PATHS = ("rows", "fused")
DEFAULT_PATH = "fused"  # what load_cuda_engine gives one GPU (METRALE_CUDA_PATH or its `path` choose another)
BASE_PATH = "rows"  # what the constructor sets up, and the one path a tensor-parallel rank runs (verified under --tp)
PATH_ENV = "METRALE_CUDA_PATH"


def check_path(path: str) -> str:
    """A rows-path name (ROWS_PATHS), or UsageError naming the valid ones."""
    name = str(path).strip().lower()
    if name not in ROWS_PATHS:
        raise UsageError(f"unknown CUDA engine path '{path}' (choose from {', '.join(ROWS_PATHS)})")
    return name


def default_path(tensor_parallel: bool = False) -> str:
    """The rows path an engine starts on: $METRALE_CUDA_PATH when set (checked), else DEFAULT_PATH, or BASE_PATH
    for a tensor-parallel rank."""
    value = os.environ.get(PATH_ENV, "").strip()
    return check_path(value) if value else BASE_PATH if tensor_parallel else DEFAULT_PATH
