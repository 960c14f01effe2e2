"""The benchmarks in benchmarks/ live outside the runtime package and run only on a GPU machine (bench_cpu:
with torch and transformers); here they are at least imported (no CuPy needed at import time), so that a moved
or renamed runtime module breaks this suite rather than the next GPU session."""

from __future__ import annotations

import importlib

import pytest

BENCHMARKS = ("bench_kernels", "bench_prefill", "bench_attention", "bench_moe_layer",
              "profile_kernels", "bench_cpu")


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_imports(name):
    mod = importlib.import_module(f"benchmarks.{name}")
    assert callable(mod.main)

