"""attention_decode (attention.cu: tensor-core split kernel for head_dim 32/64/128, SIMT split
kernel for 256, and the combine kernel) against a float64 NumPy reference.

Random bf16 caches whose rows at and past L = max(positions) + 1 hold NaN (a read of them that
reaches the output shows), a NaN-poisoned output and workspace (an unwritten element shows).
q and the softmax weights go through the tensor cores as bf16 hi + lo pairs, so the tensor-core
path is held to ||out - ref|| / ||ref|| <= 1e-3 (about 1e-5 is expected), the SIMT path to the
kernel tests' 1e-2."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gpu_helpers import TOL, bf16_bits, bits_f32, make_cache, ref_attention, rel_err

pytestmark = pytest.mark.gpu

TOL_TC = 1e-3  # the tensor-core kernel splits q and P into bf16 hi + lo: far tighter than TOL


def assert_close(out, ref, seed, hd):
    tol = TOL if hd in (96, 256) else TOL_TC  # 96 and 256: the SIMT kernel
    e = rel_err(out, ref, seed)
    assert e <= tol, f"seed={seed}: relative error {e:.3e} > {tol:g}"


def run(cp, kernels, q, kb, vb, positions, scale, n_splits, workspace=True):
    M, nh, hd = q.shape
    out = cp.full((M, nh, hd), np.nan, dtype=cp.float32)
    ws = None
    if workspace:
        s = n_splits if n_splits is not None else kernels.decode_splits(kb.shape[1], kb.shape[0], M, nh, hd)
        ws = cp.full(kernels.decode_workspace_size(M, nh, hd, s), np.nan, dtype=cp.float32)
    kernels.attention_decode(
        cp.asarray(q), cp.asarray(kb), cp.asarray(vb), cp.asarray(np.asarray(positions, np.int32)), out, scale,
        n_splits=n_splits, workspace=ws,
    )
    return cp.asnumpy(out)


CASES = [
    # hd, n_kv, G, M, ctx (keys seen by row 0), n_splits
    (128, 8, 4, 1, 8192, None),
    (128, 8, 4, 4, 4100, None),
    (128, 8, 4, 8, 3000, None),
    (128, 2, 4, 16, 2049, None),
    (128, 2, 4, 1, 65, 1),
    (128, 2, 4, 1, 64, 3),
    (128, 2, 4, 1, 63, 200),
    (128, 1, 1, 1, 1, None),
    (128, 1, 1, 3, 2, 7),
    (128, 2, 8, 2, 777, 5),
    (128, 1, 16, 1, 300, 4),
    (128, 3, 5, 3, 1500, 33),
    (128, 1, 4, 1, 20000, 40),  # > 32 active splits: two combine batches
    (64, 2, 4, 1, 1000, None),
    (64, 2, 4, 5, 129, 2),
    (64, 4, 2, 16, 700, None),
    (64, 1, 16, 1, 5000, None),
    (32, 2, 1, 1, 7, None),
    (32, 2, 4, 3, 300, 64),
    (32, 1, 12, 2, 2500, 9),
    (256, 2, 2, 3, 1000, 7),
    (256, 1, 4, 1, 3000, None),
    (256, 2, 1, 16, 100, 2),
    (96, 4, 1, 1, 2000, None),  # Phi-3-mini's head_dim (SIMT kernel, 4 bf16 on 24 lanes)
    (96, 2, 3, 7, 300, 3),
    # long contexts: splits of thousands of keys (a kernel that skipped keys would miss the flat softmax's mean)
    (256, 2, 2, 1, 65536, None),
    (128, 2, 4, 1, 65536, None),
    (96, 2, 3, 2, 40000, None),
]


@pytest.mark.parametrize("hd,n_kv,G,M,ctx,n_splits", CASES)
def test_decode(cp, kernels, rng, seed, hd, n_kv, G, M, ctx, n_splits):
    nh = n_kv * G
    positions = (ctx - 1 + np.arange(M)).astype(np.int32)  # verify rows follow the decode row
    L = ctx + M - 1
    kb, vb = make_cache(rng, n_kv, L + 21, hd, L)
    q = rng.standard_normal((M, nh, hd), dtype=np.float32)
    scale = 1.0 / math.sqrt(hd)
    out = run(cp, kernels, q, kb, vb, positions, scale, n_splits, workspace=ctx % 2 == 0)
    assert_close(out, ref_attention(q, bits_f32(kb), bits_f32(vb), positions, scale), seed, hd)


@pytest.mark.parametrize("hd", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("n_splits", [None, 1, 5])
def test_decode_scattered_positions(cp, kernels, rng, seed, hd, n_splits):
    """Verify rows in any order, repeated positions, a position past max_ctx (clamped) and one
    with a negative position (NaN row, the others unaffected)."""
    n_kv, G, max_ctx = 2, 4, 1200
    nh = n_kv * G
    positions = np.array([700, 3, 64, 64, 5000, -1, 1100, 0, 511], dtype=np.int32)
    M = len(positions)
    kb, vb = make_cache(rng, n_kv, max_ctx, hd, max_ctx)
    q = rng.standard_normal((M, nh, hd), dtype=np.float32)
    out = run(cp, kernels, q, kb, vb, positions, 0.2, n_splits)
    ref = ref_attention(q, bits_f32(kb), bits_f32(vb), positions, 0.2)
    ok = positions >= 0
    assert np.isnan(out[~ok]).all(), f"seed={seed}: a row without keys must be NaN"
    assert_close(out[ok], ref[ok], seed, hd)


@pytest.mark.parametrize("hd", [64, 128, 256])
def test_decode_peaked_softmax(cp, kernels, rng, seed, hd):
    """Large logits (|q.k * scale| up to ~100): the online max and the split merge must rescale."""
    n_kv, G, M, ctx = 2, 4, 3, 3000
    nh = n_kv * G
    positions = (ctx - 1 + np.arange(M)).astype(np.int32)
    kb, vb = make_cache(rng, n_kv, ctx + M, hd, ctx + M - 1)
    q = rng.standard_normal((M, nh, hd), dtype=np.float32) * np.float32(8.0)
    out = run(cp, kernels, q, kb, vb, positions, 1.0 / math.sqrt(hd), 17)
    assert_close(out, ref_attention(q, bits_f32(kb), bits_f32(vb), positions, 1.0 / math.sqrt(hd)), seed, hd)


@pytest.mark.parametrize("hd", [32, 128, 256])
@pytest.mark.parametrize("which", ["k", "v"])
def test_decode_nan_propagates(cp, kernels, rng, seed, hd, which):
    """A NaN at a visible key reaches the output of every query head of that KV head, and no
    other; a NaN at a masked key (past every row's position) does not."""
    n_kv, G, M, ctx = 2, 2, 2, 900
    nh = n_kv * G
    positions = np.array([ctx - 1, ctx - 2], dtype=np.int32)
    kb, vb = make_cache(rng, n_kv, ctx + 10, hd, ctx)
    (kb if which == "k" else vb)[0, 333, 5] = 0x7FC0
    q = rng.standard_normal((M, nh, hd), dtype=np.float32)
    out = run(cp, kernels, q, kb, vb, positions, 0.1, 9)
    assert np.isnan(out[:, :G]).any(axis=-1).all(), f"seed={seed}: NaN of KV head 0 was dropped"
    ref = ref_attention(q, bits_f32(kb), bits_f32(vb), positions, 0.1)
    assert_close(out[:, G:], ref[:, G:], seed, hd)


def test_decode_graph_replay_any_length(cp, kernels, rng, seed):
    """One graph captured with a fixed n_splits serves every context length: positions change
    on the device between replays (short, long, verify rows), the workspace is re-poisoned."""
    hd, n_kv, G, M, max_ctx = 128, 4, 4, 4, 6000
    nh = n_kv * G
    kb, vb = make_cache(rng, n_kv, max_ctx, hd, max_ctx)
    kc, vc = cp.asarray(kb), cp.asarray(vb)
    n_splits = kernels.decode_splits(max_ctx, n_kv, M, nh)
    ws = cp.full(kernels.decode_workspace_size(M, nh, hd, n_splits), np.nan, dtype=cp.float32)
    q = cp.zeros((M, nh, hd), dtype=cp.float32)
    pos = cp.zeros(M, dtype=cp.int32)
    out = cp.zeros((M, nh, hd), dtype=cp.float32)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        kernels.attention_decode(q, kc, vc, pos, out, hd**-0.5, n_splits=n_splits, workspace=ws, stream=s)
        s.synchronize()
        s.begin_capture()
        kernels.attention_decode(q, kc, vc, pos, out, hd**-0.5, n_splits=n_splits, workspace=ws, stream=s)
        graph = s.end_capture()
    for p in ([0, 1, 2, 3], [99, 100, 101, 102], [5996, 5997, 5998, 5999], [4000, 17, 2500, 64], [1, -1, 0, 0]):
        positions = np.array(p, dtype=np.int32)
        qh = rng.standard_normal((M, nh, hd), dtype=np.float32)
        with s:
            q[...] = cp.asarray(qh)
            pos[...] = cp.asarray(positions)
            ws.fill(np.nan)
            out.fill(np.nan)
        graph.launch(stream=s)
        s.synchronize()
        o = cp.asnumpy(out)
        ref = ref_attention(qh, bits_f32(kb), bits_f32(vb), positions, hd**-0.5)
        ok = positions >= 0
        assert_close(o[ok], ref[ok], seed, hd)


def test_decode_with_pdl(cp, kernels, rng, seed):
    """With programmatic dependent launch on (when this Kernels has it), a kv_append followed by
    attention_decode sees the key just appended: the split kernel waits before reading the cache."""
    if not getattr(kernels, "pdl_supported", False):
        pytest.skip("Kernels has no PDL support here")
    hd, n_kv, G, max_ctx = 128, 8, 4, 4096
    nh = n_kv * G
    kb, vb = make_cache(rng, n_kv, max_ctx, hd, max_ctx)
    kc, vc = cp.asarray(kb), cp.asarray(vb)
    k_new = rng.standard_normal((1, n_kv, hd), dtype=np.float32) * np.float32(4.0)
    v_new = rng.standard_normal((1, n_kv, hd), dtype=np.float32)
    p = 3000
    q = rng.standard_normal((1, nh, hd), dtype=np.float32)
    pos = cp.asarray(np.array([p], dtype=np.int32))
    out = cp.full((1, nh, hd), np.nan, dtype=cp.float32)
    ws = cp.full(kernels.decode_workspace_size(1, nh, hd, 33), np.nan, dtype=cp.float32)
    old = kernels.pdl
    kernels.pdl = True
    try:
        kernels.kv_append(cp.asarray(k_new), cp.asarray(v_new), kc, vc, pos)
        kernels.attention_decode(cp.asarray(q), kc, vc, pos, out, hd**-0.5, n_splits=33, workspace=ws)
        o = cp.asnumpy(out)
    finally:
        kernels.pdl = old
    kb[:, p] = bf16_bits(k_new[0])
    vb[:, p] = bf16_bits(v_new[0])
    assert_close(o, ref_attention(q, bits_f32(kb), bits_f32(vb), np.array([p]), hd**-0.5), seed, hd)


def test_decode_splits_any_rows(kernels):
    """decode_splits gives >= 1 split, no split below 64 keys at max_ctx, and enough blocks to
    cover the GPU for every row count (it used to give 5 splits = 40 blocks at M = 1)."""
    sms = kernels.num_sms
    for max_ctx in (1, 63, 64, 1000, 8192, 131072):
        for n_kv, nh in ((8, 32), (1, 1), (4, 64), (32, 32)):
            for M in range(1, 17):
                s = kernels.decode_splits(max_ctx, n_kv, M, nh)
                assert 1 <= s <= max(1, math.ceil(max_ctx / 64)), (max_ctx, n_kv, nh, M, s)
                qv = M * (nh // n_kv)
                blocks = n_kv * math.ceil(qv / (8 if qv <= 8 else 16)) * s
                if max_ctx >= 8192 and s < math.ceil(max_ctx / 64):  # not capped by the 64-key minimum
                    # (a count just past one combine batch, 33..35, gives way to the batch: 32)
                    assert blocks >= 2 * sms * (32 / 35 if s == 32 else 1), (max_ctx, n_kv, nh, M, s, blocks)
    want = math.ceil(2 * sms / 8)
    assert kernels.decode_splits(8192, 8, 1, 32) == (32 if 32 < want <= 35 else want)
    # the SIMT head dims: splits of >= 32 keys
    for hd in (96, 256):
        for max_ctx in (1, 31, 32, 1000, 8192):
            for n_kv, nh in ((8, 16), (32, 32), (1, 4)):
                for M in (1, 2, 5, 16):
                    s = kernels.decode_splits(max_ctx, n_kv, M, nh, hd)
                    assert 1 <= s <= max(1, math.ceil(max_ctx / 32)), (hd, max_ctx, n_kv, nh, M, s)


def test_decode_rejects_misaligned_cache(cp, kernels):
    n_kv, max_ctx, hd = 1, 64, 64
    flat = cp.zeros(2 * n_kv * max_ctx * hd + 8, dtype=cp.uint16)
    kc = flat[1 : 1 + n_kv * max_ctx * hd].reshape(n_kv, max_ctx, hd)  # 2-byte offset
    vc = flat[-n_kv * max_ctx * hd :].reshape(n_kv, max_ctx, hd)
    q = cp.zeros((1, 1, hd), dtype=cp.float32)
    with pytest.raises(ValueError, match="aligned"):
        kernels.attention_decode(q, kc, vc, cp.zeros(1, dtype=cp.int32), cp.zeros_like(q), 0.1)
