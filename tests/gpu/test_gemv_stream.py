"""The one-wave streaming GEMV with the fused norm (gemv_stream.cu) against float64 NumPy on fresh random data:
bias, accumulate, the (1 + w) norm offset, every compiled U and several blocks per SM, fewer rows than SMs,
outputs poisoned before each launch.  Then: the same function as the fp32-FMA gemv it replaces, the same bits
on every launch and in graph replay."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import assert_close, nan_like, rand_bf16, ref_rmsnorm

pytestmark = pytest.mark.gpu

SHAPES = [(6144, 4096), (8192, 3584), (9216, 3072), (1000, 512), (40, 256), (4097, 2048), (257, 14336)]


def _configs():
    from metrale_cli.backends.cuda.kernels.tuning import GEMV_STREAM_US

    return [(u, b) for u in GEMV_STREAM_US for b in (1, 2, 4)]


def _inputs(rng, k):
    x = (rng.standard_normal((1, k), dtype=np.float32) * 3).astype(np.float32)
    nb, nf = rand_bf16(rng, (k,), 0.5)
    return x, nb, nf


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("U,B", _configs())
def test_gemv_stream(cp, kernels, rng, seed, N, K, U, B):
    wb, wf = rand_bf16(rng, (N, K), 0.05)
    x, nb, nf = _inputs(rng, K)
    bb, bf = rand_bf16(rng, (N,))
    out = nan_like(cp, (1, N))
    kernels.gemv_stream(cp.asarray(x), cp.asarray(wb), out, cp.asarray(bb), norm_weight=cp.asarray(nb), eps=1e-5,
                        config=(U, B))
    ref = ref_rmsnorm(x, nf, 1e-5) @ wf.T.astype(np.float64) + bf
    assert_close(cp.asnumpy(out), ref, seed, tol=1e-5)


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_gemv_stream_accumulate_offset(cp, kernels, rng, seed, N, K, offset):
    wb, wf = rand_bf16(rng, (N, K), 0.05)
    x, nb, nf = _inputs(rng, K)
    h0 = rng.standard_normal((1, N), dtype=np.float32)
    out = cp.asarray(h0)
    kernels.gemv_stream(cp.asarray(x), cp.asarray(wb), out, accumulate=True, norm_weight=cp.asarray(nb), eps=1e-6,
                        norm_offset=offset)
    ref = h0 + ref_rmsnorm(x, nf + np.float32(offset), 1e-6) @ wf.T.astype(np.float64)
    assert_close(cp.asnumpy(out), ref, seed, tol=1e-5)


def test_gemv_stream_matches_gemv_and_repeats_bit_for_bit(cp, kernels, rng, seed):
    """The same function as gemv with the norm (within fp32 rounding), the same bits on every launch and
    graph replay."""
    N, K = 6144, 4096
    wb, _ = rand_bf16(rng, (N, K), 0.05)
    x, nb, _ = _inputs(rng, K)
    xd, wd, nd = cp.asarray(x), cp.asarray(wb), cp.asarray(nb)
    a, b, old = nan_like(cp, (1, N)), nan_like(cp, (1, N)), nan_like(cp, (1, N))
    kernels.gemv(xd, wd, old, norm_weight=nd)
    kernels.gemv_stream(xd, wd, a, norm_weight=nd)
    assert_close(cp.asnumpy(a), cp.asnumpy(old), seed, tol=1e-5)
    s = cp.cuda.Stream(non_blocking=True)
    s.begin_capture()
    kernels.gemv_stream(xd, wd, b, norm_weight=nd, stream=s)
    g = s.end_capture()
    for _ in range(3):
        b.fill(np.nan)
        g.launch(stream=s)
        s.synchronize()
        np.testing.assert_array_equal(cp.asnumpy(b), cp.asnumpy(a), err_msg=f"seed={seed}")
