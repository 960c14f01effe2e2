"""The tensor-core GEMV (`Kernels.gemv_tc`, gemv_tc.cu) against a float64 NumPy reference of the
bf16-rounded weights and fp32 x, on fresh random data; outputs are poisoned (NaN) before each
launch so an unwritten element fails, and a sentinel tail past the output catches stray stores.
Also: a token's row is bit-identical whatever M is (decode M=1 vs verify M=8/16)."""

from __future__ import annotations

import numpy as np
import pytest

import gpu_helpers
from gpu_helpers import BF16, rand_bf16, ref_rmsnorm, silu

pytestmark = pytest.mark.gpu

TOL = 2e-5  # x split into bf16 hi + lo: ~2.4e-6 relative (numpy emulation), plus fp32 tensor-core accumulation
TOL_NORM = 1e-4


# ----------------------------------------------------------------------------- helpers
def assert_close(out, ref, seed, tol=TOL):
    gpu_helpers.assert_close(out, ref, seed, tol)


def norm_inputs(rng, M, K):
    """Un-normalised residual rows (mean not zero, rows of different scale) and a bf16 norm weight."""
    x = (rng.standard_normal((M, K), dtype=np.float32) * np.float32(3.0)
         + rng.standard_normal((M, 1), dtype=np.float32)).astype(np.float32)
    x *= rng.uniform(0.1, 10.0, size=(M, 1)).astype(np.float32)
    nb, nf = rand_bf16(rng, (K,))
    return x, nb, nf


SENTINEL = np.float32(-12345.5)


def guarded_out(cp, M, N, init=None, pad=64):
    """An out array [M, N] (NaN, or `init`) that is the head of a buffer whose tail holds a sentinel."""
    buf = cp.full(M * N + pad, SENTINEL, dtype=cp.float32)
    out = buf[: M * N].reshape(M, N)
    if init is None:
        out[...] = np.nan
    else:
        out[...] = cp.asarray(init)
    return buf, out


def check_tail(cp, buf, M, N, seed):
    tail = cp.asnumpy(buf[M * N:])
    assert (tail == SENTINEL).all(), f"seed={seed}: gemv_tc wrote past the end of out"


def run_tc(cp, kernels, x, wb, N, *, bias=None, h0=None, swiglu=False, nb=None, eps=1e-6):
    M = x.shape[0]
    buf, out = guarded_out(cp, M, N, h0)
    kernels.gemv_tc(cp.asarray(x), cp.asarray(wb), out, None if bias is None else cp.asarray(bias),
                    accumulate=h0 is not None, swiglu=swiglu, norm_weight=None if nb is None else cp.asarray(nb),
                    eps=eps)
    got = cp.asnumpy(out)
    return got, buf


def reference(x, wf, *, bf=None, h0=None, swiglu=False, nf=None, eps=1e-6):
    xx = ref_rmsnorm(x, nf, eps) if nf is not None else x.astype(np.float64)
    r = xx @ wf.T.astype(np.float64)
    if swiglu:
        i = wf.shape[0] // 2
        r = silu(r[:, :i]) * r[:, i:]
    if bf is not None:
        r = r + bf
    if h0 is not None:
        r = r + h0
    return r


# ----------------------------------------------------------------------------- plain / bias / accumulate
@pytest.mark.parametrize("M", range(1, 17))
def test_gemv_tc_every_m(cp, kernels, rng, seed, M):
    N, K = 777, 520
    wb, wf = rand_bf16(rng, (N, K), 0.05)
    bb, bf = rand_bf16(rng, (N,))
    x = rng.standard_normal((M, K), dtype=np.float32)
    got, buf = run_tc(cp, kernels, x, wb, N, bias=bb)
    assert_close(got, reference(x, wf, bf=bf), seed)
    check_tail(cp, buf, M, N, seed)
    h0 = rng.standard_normal((M, N), dtype=np.float32)
    got, buf = run_tc(cp, kernels, x, wb, N, h0=h0)
    assert_close(got, reference(x, wf, h0=h0), seed)
    check_tail(cp, buf, M, N, seed)


@pytest.mark.parametrize("N,K", [(1000, 264), (4097, 4104), (64, 8), (3000, 1024), (17, 32), (5, 40), (33, 4096)])
@pytest.mark.parametrize("M", [1, 3, 8, 9, 16])
def test_gemv_tc_shapes(cp, kernels, rng, seed, N, K, M):
    """Odd N (partial row tiles), K = 8 (one partial chunk), K % 32 != 0, K over many chunks."""
    wb, wf = rand_bf16(rng, (N, K), 0.05)
    x = rng.standard_normal((M, K), dtype=np.float32)
    use_bias = (N + M) % 2 == 1
    bb, bf = rand_bf16(rng, (N,))
    got, buf = run_tc(cp, kernels, x, wb, N, bias=bb if use_bias else None)
    assert_close(got, reference(x, wf, bf=bf if use_bias else None), seed)
    check_tail(cp, buf, M, N, seed)


# ----------------------------------------------------------------------------- swiglu
@pytest.mark.parametrize("I,K", [(1000, 264), (33, 4104), (4097, 520), (5, 8), (16, 32)])
@pytest.mark.parametrize("M", [1, 4, 8, 13, 16])
def test_gemv_tc_swiglu(cp, kernels, rng, seed, I, K, M):
    wb, wf = rand_bf16(rng, (2 * I, K), 0.05)
    x = rng.standard_normal((M, K), dtype=np.float32)
    got, buf = run_tc(cp, kernels, x, wb, I, swiglu=True)
    assert_close(got, reference(x, wf, swiglu=True), seed)
    check_tail(cp, buf, M, I, seed)


@pytest.mark.parametrize("M", [1, 8, 16])
def test_gemv_tc_swiglu_long_k(cp, kernels, rng, seed, M):
    I, K = 515, 4104
    wb, wf = rand_bf16(rng, (2 * I, K), 0.05)
    x = rng.standard_normal((M, K), dtype=np.float32)
    got, buf = run_tc(cp, kernels, x, wb, I, swiglu=True)
    assert_close(got, reference(x, wf, swiglu=True), seed)
    check_tail(cp, buf, M, I, seed)


# ----------------------------------------------------------------------------- fused RMSNorm
@pytest.mark.parametrize("K", [4096, 256, 8, 40])
@pytest.mark.parametrize("M", [1, 2, 7, 8, 9, 16])
def test_gemv_tc_fused_rmsnorm(cp, kernels, rng, seed, K, M):
    """gemv_tc(x, norm_weight=w) == rmsnorm then gemv_tc, plain with bias and swiglu."""
    N, I = 1003, 301
    eps = 1e-5
    x, nb, nf = norm_inputs(rng, M, K)
    wb, wf = rand_bf16(rng, (N, K), 0.05)
    bb, bf = rand_bf16(rng, (N,))
    got, buf = run_tc(cp, kernels, x, wb, N, bias=bb, nb=nb, eps=eps)
    assert_close(got, reference(x, wf, bf=bf, nf=nf, eps=eps), seed, tol=TOL_NORM)
    check_tail(cp, buf, M, N, seed)
    h = cp.full((M, K), np.nan, dtype=cp.float32)
    kernels.rmsnorm(cp.asarray(x), cp.asarray(nb), eps, h)
    two, _ = run_tc(cp, kernels, cp.asnumpy(h), wb, N, bias=bb)
    assert_close(got, two, seed, tol=TOL_NORM)

    gb, gf = rand_bf16(rng, (2 * I, K), 0.05)
    got, buf = run_tc(cp, kernels, x, gb, I, swiglu=True, nb=nb, eps=eps)
    assert_close(got, reference(x, gf, swiglu=True, nf=nf, eps=eps), seed, tol=TOL_NORM)
    check_tail(cp, buf, M, I, seed)


# ----------------------------------------------------------------------------- the engine's combinations
@pytest.mark.parametrize("M", [1, 2, 4, 8, 16])
def test_gemv_tc_layer_combinations(cp, kernels, rng, seed, M):
    """A small Llama layer: qkv (bias + norm), o (+= residual), gate_up (swiglu + norm), down (+=),
    lm_head (plain, large odd N)."""
    H, Q, I, V = 512, 768, 1376, 32003
    eps = 1e-6
    x, nb, nf = norm_inputs(rng, M, H)
    wqkv, fqkv = rand_bf16(rng, (Q, H), 0.05)
    bqkv, fbqkv = rand_bf16(rng, (Q,))
    got, _ = run_tc(cp, kernels, x, wqkv, Q, bias=bqkv, nb=nb, eps=eps)
    assert_close(got, reference(x, fqkv, bf=fbqkv, nf=nf, eps=eps), seed, tol=TOL_NORM)

    attn = rng.standard_normal((M, H), dtype=np.float32)
    wo, fo = rand_bf16(rng, (H, H), 0.05)
    got, _ = run_tc(cp, kernels, attn, wo, H, h0=x)
    assert_close(got, reference(attn, fo, h0=x), seed)

    wgu, fgu = rand_bf16(rng, (2 * I, H), 0.05)
    got, _ = run_tc(cp, kernels, x, wgu, I, swiglu=True, nb=nb, eps=eps)
    assert_close(got, reference(x, fgu, swiglu=True, nf=nf, eps=eps), seed, tol=TOL_NORM)

    act = rng.standard_normal((M, I), dtype=np.float32)
    wd, fd = rand_bf16(rng, (H, I), 0.05)
    got, _ = run_tc(cp, kernels, act, wd, H, h0=x)
    assert_close(got, reference(act, fd, h0=x), seed)

    wl, fl = rand_bf16(rng, (V, H), 0.05)
    got, buf = run_tc(cp, kernels, x, wl, V)
    assert_close(got, reference(x, fl), seed)
    check_tail(cp, buf, M, V, seed)


# ----------------------------------------------------------------------------- M-independence
def _same_bits(a, b, what, seed):
    a32 = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    b32 = np.ascontiguousarray(b, dtype=np.float32).view(np.uint32)
    diff = a32 != b32
    assert not diff.any(), (
        f"seed={seed}: {what}: {int(diff.sum())} values differ, first at {np.argwhere(diff)[0]} "
        f"({a.reshape(-1)[np.argmax(diff.reshape(-1))]!r} vs {b.reshape(-1)[np.argmax(diff.reshape(-1))]!r})"
    )


@pytest.mark.parametrize("kind", ["plain", "bias_norm", "accumulate", "swiglu_norm", "swiglu"])
@pytest.mark.parametrize("N,K", [(1000, 4096), (77, 520), (1001, 14336)])
def test_gemv_tc_row_independent_of_m(cp, kernels, rng, seed, kind, N, K):
    """Row m of a call with M rows is bit-identical to the M = 1 call on that row (and to M = 8 on
    the first 8 rows), with the default configs (same W for every M)."""
    swiglu = kind.startswith("swiglu")
    wrows = 2 * N if swiglu else N
    wb, _ = rand_bf16(rng, (wrows, K), 0.05)
    x, nb, _ = norm_inputs(rng, 16, K)
    bb, _ = rand_bf16(rng, (N,))
    h0 = rng.standard_normal((16, N), dtype=np.float32)
    kw = dict(
        swiglu=swiglu,
        bias=bb if kind == "bias_norm" else None,
        nb=nb if kind.endswith("norm") else None,
    )

    def call(rows):
        return run_tc(cp, kernels, x[rows], wb, N, h0=h0[rows] if kind == "accumulate" else None, **kw)[0]

    full = call(slice(0, 16))
    eight = call(slice(0, 8))
    four = call(slice(4, 8))
    _same_bits(eight, full[:8], f"{kind} M=8 vs M=16", seed)
    _same_bits(four, full[4:8], f"{kind} M=4 vs M=16", seed)
    for m in (0, 3, 7, 8, 13, 15):
        _same_bits(call(slice(m, m + 1)), full[m:m + 1], f"{kind} M=1 row {m} vs M=16", seed)


def test_gemv_tc_nan_stays_in_its_row(cp, kernels, rng, seed):
    """A NaN in one token's x poisons that row only (never passes, never leaks to other rows)."""
    N, K = 300, 264
    wb, wf = rand_bf16(rng, (N, K), 0.05)
    x = rng.standard_normal((10, K), dtype=np.float32)
    x[3, 17] = np.nan
    got, _ = run_tc(cp, kernels, x, wb, N)
    assert np.isnan(got[3]).all(), f"seed={seed}: NaN in x row 3 did not reach every output of row 3"
    rest = [m for m in range(10) if m != 3]
    assert_close(got[rest], reference(x[rest], wf), seed)


def test_gemv_tc_accepts_ml_dtypes_bf16(cp, kernels, rng, seed):
    wb, wf = rand_bf16(rng, (300, 64), 0.1)
    w = cp.asarray(wb.view(BF16))
    x = rng.standard_normal((2, 64), dtype=np.float32)
    out = cp.full((2, 300), np.nan, dtype=cp.float32)
    kernels.gemv_tc(cp.asarray(x), w, out)
    assert_close(cp.asnumpy(out), x.astype(np.float64) @ wf.T.astype(np.float64), seed)


# ----------------------------------------------------------------------------- bad input
def test_gemv_tc_rejects_bad_input(cp, kernels):
    f32, u16 = cp.float32, cp.uint16
    out = cp.zeros((2, 10), dtype=f32)
    with pytest.raises(ValueError, match="multiple of 8"):
        kernels.gemv_tc(cp.zeros((2, 20), dtype=f32), cp.zeros((10, 20), dtype=u16), out)
    with pytest.raises(ValueError, match="1..16"):
        kernels.gemv_tc(cp.zeros((17, 16), dtype=f32), cp.zeros((10, 16), dtype=u16), cp.zeros((17, 10), dtype=f32))
    with pytest.raises(ValueError, match="float32"):
        kernels.gemv_tc(cp.zeros((2, 16), dtype=cp.float16), cp.zeros((10, 16), dtype=u16), out)
    with pytest.raises(ValueError, match="bfloat16"):
        kernels.gemv_tc(cp.zeros((2, 16), dtype=f32), cp.zeros((10, 16), dtype=f32), out)
    with pytest.raises(ValueError, match="shape"):
        kernels.gemv_tc(cp.zeros((2, 16), dtype=f32), cp.zeros((10, 16), dtype=u16), cp.zeros((2, 11), dtype=f32))
    with pytest.raises(ValueError, match="shape"):
        kernels.gemv_tc(cp.zeros((2, 16), dtype=f32), cp.zeros((10, 24), dtype=u16), out)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.gemv_tc(cp.zeros((2, 32), dtype=f32)[:, :16], cp.zeros((10, 16), dtype=u16), out)
    with pytest.raises(ValueError, match="overlap"):
        buf = cp.zeros((2, 16), dtype=f32)
        kernels.gemv_tc(buf, cp.zeros((16, 16), dtype=u16), buf)
    with pytest.raises(ValueError, match="aligned"):
        kernels.gemv_tc(cp.zeros(40, dtype=f32)[1:33].reshape(2, 16), cp.zeros((10, 16), dtype=u16), out)
    with pytest.raises(ValueError, match="bias"):
        kernels.gemv_tc(cp.zeros((2, 16), dtype=f32), cp.zeros((10, 16), dtype=u16), out, cp.zeros(9, dtype=u16))
    # swiglu: 2I rows, out [M, I], no bias
    with pytest.raises(ValueError, match="2\\*I"):
        kernels.gemv_tc(cp.zeros((2, 16), dtype=f32), cp.zeros((11, 16), dtype=u16), out, swiglu=True)
    with pytest.raises(ValueError, match="shape"):
        kernels.gemv_tc(cp.zeros((2, 16), dtype=f32), cp.zeros((10, 16), dtype=u16), out, swiglu=True)
    with pytest.raises(ValueError, match="bias"):
        kernels.gemv_tc(cp.zeros((2, 16), dtype=f32), cp.zeros((20, 16), dtype=u16), out,
                        cp.zeros(10, dtype=u16), swiglu=True)
    with pytest.raises(ValueError, match="empty"):
        kernels.gemv_tc(cp.zeros((2, 0), dtype=f32), cp.zeros((10, 0), dtype=u16), out)
    # norm weight
    x, w = cp.ones((2, 64), dtype=f32), cp.ones((10, 64), dtype=u16)
    with pytest.raises(ValueError, match="norm_weight"):
        kernels.gemv_tc(x, w, out, norm_weight=cp.ones((32,), dtype=u16))
    with pytest.raises(ValueError, match="norm_weight"):
        kernels.gemv_tc(x, w, out, norm_weight=cp.ones((64,), dtype=f32))
