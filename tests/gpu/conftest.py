"""Fixtures of the GPU tests: skip cleanly without CuPy or a CUDA device; one compiled
`Kernels` per session; a fresh random seed per test, printed when the test fails
(set METRALE_TEST_SEED to replay one)."""

from __future__ import annotations

import os
import secrets

# The GPU tests are what verifies the CUDA code that is refused elsewhere until it has run on a GPU
# (backends/cuda/loading.unverified_features).
os.environ.setdefault("METRALE_CUDA_UNVERIFIED", "1")

import numpy as np
import pytest


def _cupy_or_reason():
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install
        return None, f"cupy is not importable ({type(exc).__name__}: {exc})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return None, f"no CUDA device visible ({type(exc).__name__}: {exc})"
    if n < 1:
        return None, "no CUDA device visible"
    return cupy, None


@pytest.fixture(scope="session")
def cp():
    cupy, reason = _cupy_or_reason()
    if cupy is None:
        pytest.skip(reason)
    return cupy


@pytest.fixture(scope="session")
def kernels(cp):
    from metrale_cli.backends.cuda.kernels import Kernels

    k = Kernels()
    k.load_fused()  # every compiled module (tests capture graphs, which must not compile)
    return k


@pytest.fixture
def seed(request):
    env = os.environ.get("METRALE_TEST_SEED")
    s = int(env) if env else secrets.randbits(32)
    request.node._metrale_seed = s
    return s


@pytest.fixture
def rng(seed):
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    s = getattr(item, "_metrale_seed", None)
    if s is not None and report.failed:
        report.sections.append(("metrale random seed", f"seed = {s}  (replay: METRALE_TEST_SEED={s})"))
