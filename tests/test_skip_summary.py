"""Without CuPy or a GPU the GPU tests skip as one summary line, still counted as skipped (item 17)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed: the GPU tests may run")
def test_gpu_skips_are_one_line_and_still_counted():
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/gpu/test_attention_decode.py"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:]
    lines = r.stdout.splitlines()
    skip_lines = [line for line in lines if line.startswith("SKIPPED")]
    assert len(skip_lines) == 1, skip_lines
    n = int(re.fullmatch(r"SKIPPED \[(\d+)\] tests/gpu \(GPU tests\): cupy is not importable.*", skip_lines[0])[1])
    assert re.fullmatch(rf"{n} skipped in .*", lines[-1]) and n > 1
