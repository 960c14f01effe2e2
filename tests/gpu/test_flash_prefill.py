"""attention_prefill (flash_prefill.cu, tensor cores) against a float64 NumPy reference.

Random bf16 caches whose rows past start_pos + T hold NaN (any read of them that reaches the
output shows), q rows past T hold NaN (they must not be read), out rows past T hold a sentinel
(they must not be written).  q and P are rounded to bf16 in the kernel, so the tolerance is the
kernel tests' ||out - ref|| / ||ref|| <= 1e-2 (about 2-4e-3 is expected)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from metrale_cli.backends.cuda.kernels import PREFILL_BQS

from gpu_helpers import assert_close, bits_f32, make_cache, rel_err

pytestmark = pytest.mark.gpu
SENTINEL = 12345.0


def ref_prefill(q, kb, vb, start, rows, scale):
    """float64 reference for the query rows `rows` (row t at position start + t)."""
    kf = bits_f32(kb).astype(np.float64)
    vf = bits_f32(vb).astype(np.float64)
    _, nh, hd = q.shape
    n_kv = kf.shape[0]
    G = nh // n_kv
    out = np.zeros((len(rows), nh, hd))
    for i, t in enumerate(rows):
        p = start + int(t)
        qq = q[t].astype(np.float64).reshape(n_kv, G, hd)
        s = np.einsum("kgd,kld->kgl", qq, kf[:, : p + 1]) * scale
        s -= s.max(axis=-1, keepdims=True)
        e = np.exp(s)
        o = np.einsum("kgl,kld->kgd", e, vf[:, : p + 1]) / e.sum(axis=-1, keepdims=True)
        out[i] = o.reshape(nh, hd)
    return out


def run_prefill(cp, kernels, rng, hd, n_kv, G, start, T, block_q=None, q_scale=1.0, extra_rows=5):
    nh = n_kv * G
    max_ctx = start + T + 19
    kb, vb = make_cache(rng, n_kv, max_ctx, hd, start + T)
    q = rng.standard_normal((T + extra_rows, nh, hd), dtype=np.float32) * np.float32(q_scale)
    q[T:] = np.nan  # rows past T must not be read
    out = cp.full((T + extra_rows, nh, hd), np.nan, dtype=cp.float32)
    out[T:] = SENTINEL
    scale = 1.0 / math.sqrt(hd)
    kernels.attention_prefill(cp.asarray(q), cp.asarray(kb), cp.asarray(vb), start, T, out, scale, block_q=block_q)
    o = cp.asnumpy(out)
    assert (o[T:] == SENTINEL).all(), "rows past T were written"
    return q, kb, vb, o[:T], scale


@pytest.mark.parametrize("block_q", PREFILL_BQS)
@pytest.mark.parametrize("hd", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("n_kv,G", [(2, 1), (1, 4)])
@pytest.mark.parametrize("start,T", [(0, 1), (0, 7), (0, 63), (0, 64), (0, 65), (0, 300), (5, 64), (100, 257), (37, 129)])
def test_flash_prefill(cp, kernels, rng, seed, block_q, hd, n_kv, G, start, T):
    q, kb, vb, o, scale = run_prefill(cp, kernels, rng, hd, n_kv, G, start, T, block_q)
    assert_close(o, ref_prefill(q, kb, vb, start, np.arange(T), scale), seed)


@pytest.mark.parametrize("block_q", PREFILL_BQS)
@pytest.mark.parametrize("hd,n_kv,G,start,T", [(128, 2, 4, 0, 2048), (128, 1, 4, 3000, 1100), (64, 2, 2, 0, 2048)])
def test_flash_prefill_long(cp, kernels, rng, seed, block_q, hd, n_kv, G, start, T):
    q, kb, vb, o, scale = run_prefill(cp, kernels, rng, hd, n_kv, G, start, T, block_q)
    assert np.isfinite(o).all(), f"seed={seed}: unwritten or non-finite rows"
    rows = np.unique(np.concatenate([rng.choice(T, size=48, replace=False), [0, 1, T - 1, T // 2]]))
    assert_close(o[rows], ref_prefill(q, kb, vb, start, rows, scale), seed)


def test_flash_prefill_sharper_softmax(cp, kernels, rng, seed):
    """q scaled by 3: scores with a standard deviation of about 3 (a peakier softmax)."""
    q, kb, vb, o, scale = run_prefill(cp, kernels, rng, 128, 2, 2, 50, 200, q_scale=3.0)
    assert_close(o, ref_prefill(q, kb, vb, 50, np.arange(200), scale), seed)


def test_flash_prefill_first_row_is_value_zero(cp, kernels, rng, seed):
    """Row 0 at position 0 sees only key 0: P = 1 exactly, so out = v[0] exactly."""
    q, kb, vb, o, _ = run_prefill(cp, kernels, rng, 128, 2, 4, 0, 70)
    vf = bits_f32(vb)
    for h in range(8):
        np.testing.assert_array_equal(o[0, h], vf[h // 4, 0], err_msg=f"seed={seed} head {h}")


def test_flash_prefill_chunks_equal_whole(cp, kernels, rng, seed):
    """Chunked prefill (start_pos > 0) computes the same rows as one pass over the whole prompt
    (same kernel, same tiles of keys: equal up to fp32 summation order, here checked to 1e-5)."""
    hd, n_kv, G, T = 128, 2, 2, 333
    nh = n_kv * G
    kb, vb = make_cache(rng, n_kv, T + 7, hd, T)
    q = rng.standard_normal((T, nh, hd), dtype=np.float32)
    kc, vc = cp.asarray(kb), cp.asarray(vb)
    whole = cp.full((T, nh, hd), np.nan, dtype=cp.float32)
    kernels.attention_prefill(cp.asarray(q), kc, vc, 0, T, whole, hd**-0.5)
    parts = cp.full((T, nh, hd), np.nan, dtype=cp.float32)
    for a, b in ((0, 100), (100, 164), (164, 333)):
        kernels.attention_prefill(cp.asarray(q[a:b]), kc, vc, a, b - a, parts[a:b], hd**-0.5)
    w, p = cp.asnumpy(whole), cp.asnumpy(parts)
    assert np.isfinite(p).all()
    assert rel_err(p, w, seed) <= 1e-5
    assert_close(w, ref_prefill(q, kb, vb, 0, np.arange(T), hd**-0.5), seed)


def test_flash_prefill_rejects_bad_input(cp, kernels):
    kb = cp.zeros((2, 64, 128), dtype=cp.uint16)
    vb = cp.zeros((2, 64, 128), dtype=cp.uint16)
    q = cp.zeros((8, 4, 128), dtype=cp.float32)
    out = cp.zeros((8, 4, 128), dtype=cp.float32)
    with pytest.raises(ValueError, match="block_q"):
        kernels.attention_prefill(q, kb, vb, 0, 8, out, 0.1, block_q=32)
    with pytest.raises(ValueError, match="max_ctx"):
        kernels.attention_prefill(q, kb, vb, 60, 8, out, 0.1)
    with pytest.raises(ValueError, match="T = 9"):
        kernels.attention_prefill(q, kb, vb, 0, 9, out, 0.1)
    k48 = cp.zeros((2, 64, 48), dtype=cp.uint16)  # head_dim 48: no compiled instance (256 has one)
    with pytest.raises(ValueError, match="head_dim"):
        kernels.attention_prefill(cp.zeros((8, 4, 48), cp.float32), k48, k48.copy(), 0, 8,
                                  cp.zeros((8, 4, 48), cp.float32), 0.1)
    big = cp.zeros(2 * 65 * 128 + 8, dtype=cp.uint16)
    with pytest.raises(ValueError, match="aligned"):  # a cache view that starts 2 bytes in
        kernels.attention_prefill(q, big[1 : 1 + 2 * 64 * 128].reshape(2, 64, 128), vb, 0, 8, out, 0.1)
