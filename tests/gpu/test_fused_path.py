"""The fused rows path (CUDA engine path "fused", issue 16) against the rows path and the NumPy engine.

Kernels: gemv_qkv_rope (the qkv GEMV with rope + KV append in the last block of each head) against the
unfused gemv / gemv_tc + rope_kv_append on the same fresh random data: the rows path's arithmetic in the same
order, so it is held to 1e-6 (in practice equal), and its last-block counters must be back at zero after every
launch (a launch that lost a block leaves one non-zero); attention_decode with rope + KV append in the split
kernel (one row) against rope_kv_append then attention_decode.
Engine: fresh random checkpoints (llama, qwen3 with q/k norm at head_dim 128, llama3 rope, mistral
head_dim 32): logits of the fused path vs the rows path (<= 1e-4) and the NumPy engine (the parity
tests' 2e-2), greedy tokens equal except near-ties, graph replay == eager bit for bit, verify == sequential
decode, trim then decode, and a 3000-token context (47 active splits: two combine batches).
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import (TOL, decoded_and_verified, inv_freq_default, nan_like, rand_bf16, random_checkpoints,
                         ref_attention, rel, rel_err, rows, tokens_agree)

from metrale_cli import decoding
from metrale_cli.model import open_model

pytestmark = pytest.mark.gpu

SAME = 1e-6  # fused vs unfused kernels: the same operations in the same order


def counters_zero(cp, c, seed):
    host = cp.asnumpy(c)
    assert not host.any(), f"seed={seed}: last-block counters left non-zero at {np.flatnonzero(host)[:8]}"


# -- gemv_qkv_rope ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m", [2, 3, 5, 8, 9, 16])
@pytest.mark.parametrize("hd,nh,n_kv,rot,qk_norm,bias", [
    (128, 8, 2, None, False, False),  # llama-like
    (128, 8, 2, None, True, False),   # qwen3-like (q/k norm)
    (64, 4, 4, None, False, True),    # qwen2-like (qkv bias), MHA
    (96, 4, 2, 64, False, False),     # partial rotary (phi-3 / phi-4-mini style)
    (256, 4, 1, None, True, False),   # gemma-like head_dim 256
    (32, 8, 2, None, False, False),
])
def test_fused_qkv_rope_equals_unfused(cp, kernels, rng, seed, m, hd, nh, n_kv, rot, qk_norm, bias):
    K, max_ctx, eps = 512, 64, 1e-5
    slots = nh + 2 * n_kv
    N = slots * hd
    rd = hd if rot is None else rot
    x = cp.asarray(rng.standard_normal((m, K), dtype=np.float32) * 3)
    wb, _ = rand_bf16(rng, (N, K), 0.05)
    nwb, _ = rand_bf16(rng, (K,))
    bb = rand_bf16(rng, (N,))[0] if bias else None
    qnb, knb = (rand_bf16(rng, (hd,))[0], rand_bf16(rng, (hd,))[0]) if qk_norm else (None, None)
    w, nw = cp.asarray(wb), cp.asarray(nwb)
    b = None if bb is None else cp.asarray(bb)
    qn, kn = (None, None) if qnb is None else (cp.asarray(qnb), cp.asarray(knb))
    pos = cp.asarray(rng.choice(max_ctx, size=m, replace=False).astype(np.int32))
    inv = cp.asarray(inv_freq_default(rd, 10000.0))
    kc0, _ = rand_bf16(rng, (n_kv, max_ctx, hd))
    vc0, _ = rand_bf16(rng, (n_kv, max_ctx, hd))
    rope_kw = dict(attention_scaling=1.19, rotary_dim=rot)

    # unfused, as the rows path: the GEMV the engine picks (gemv_tc from GEMV_TC_MIN_ROWS rows), then rope_kv_append
    from metrale_cli.backends.cuda.kernels import GEMV_TC_MIN_ROWS

    qkv_a, q_a = nan_like(cp, (m, N)), nan_like(cp, (m, nh, hd))
    kc_a, vc_a = cp.asarray(kc0), cp.asarray(vc0)
    if m >= GEMV_TC_MIN_ROWS:
        kernels.gemv_tc(x, w, qkv_a, b, norm_weight=nw, eps=eps, norm_offset=0.0)
    else:
        kernels.gemv(x, w, qkv_a, b, norm_weight=nw, eps=eps)
    kernels.rope_kv_append(qkv_a, pos, inv, q_a, kc_a, vc_a, qn, kn, eps, **rope_kw)

    counters = cp.zeros((slots + 3,), cp.int32)
    for rep in range(2):  # the second launch finds the counters the first one reset
        qkv_b, q_b = nan_like(cp, (m, N)), nan_like(cp, (m, nh, hd))
        kc_b, vc_b = cp.asarray(kc0), cp.asarray(vc0)
        kernels.gemv_qkv_rope(x, w, b, nw, qkv_b, pos, inv, q_b, kc_b, vc_b, counters, eps=eps, q_norm=qn, k_norm=kn,
                              rope_eps=eps, **rope_kw)
        cp.cuda.Device().synchronize()
        counters_zero(cp, counters, seed)
        assert rel_err(cp.asnumpy(qkv_b), cp.asnumpy(qkv_a), seed) <= SAME
        assert rel_err(cp.asnumpy(q_b), cp.asnumpy(q_a), seed) <= SAME
        for got, want in ((kc_b, kc_a), (vc_b, vc_a)):
            g, w_ = cp.asnumpy(got).astype(np.int32), cp.asnumpy(want).astype(np.int32)
            assert int(np.abs(g - w_).max()) <= 1, f"seed={seed}: cache differs by more than one bf16 step (rep {rep})"
            assert np.mean(g != w_) <= 1e-3, f"seed={seed}: cache rows differ"


def test_fused_qkv_rope_skips_bad_positions(cp, kernels, rng, seed):
    hd, nh, n_kv, m, K, max_ctx = 64, 4, 2, 4, 256, 30
    N = (nh + 2 * n_kv) * hd
    x = cp.asarray(rng.standard_normal((m, K), dtype=np.float32))
    w = cp.asarray(rand_bf16(rng, (N, K), 0.05)[0])
    nw = cp.asarray(rand_bf16(rng, (K,))[0])
    kc0, _ = rand_bf16(rng, (n_kv, max_ctx, hd))
    vc0, _ = rand_bf16(rng, (n_kv, max_ctx, hd))
    kc, vc = cp.asarray(kc0), cp.asarray(vc0)
    pos = cp.asarray(np.array([-1, 7, max_ctx, 29], np.int32))
    counters = cp.zeros((nh + 2 * n_kv,), cp.int32)
    kernels.gemv_qkv_rope(x, w, None, nw, nan_like(cp, (m, N)), pos, cp.asarray(inv_freq_default(hd, 1e4)),
                          nan_like(cp, (m, nh, hd)), kc, vc, counters)
    kh, vh = cp.asnumpy(kc), cp.asnumpy(vc)
    untouched = [p for p in range(max_ctx) if p not in (7, 29)]
    assert np.array_equal(kh[:, untouched], kc0[:, untouched]) and np.array_equal(vh[:, untouched], vc0[:, untouched])
    assert not np.array_equal(kh[:, 7], kc0[:, 7])
    counters_zero(cp, counters, seed)


# -- rope + KV append in the attention split kernel (one row) ---------------------------------------------------

ROPE_CASES = [
    # hd, n_kv, G, key position p (the row's), max_ctx, rot (None: all dims), q/k norm
    (128, 8, 4, 1024, 1100, None, False),  # llama-3.1-8b's heads: p alone in the last split
    (128, 8, 4, 3000, 4096, None, True),   # qwen3-like, 47 splits
    (128, 2, 8, 700, 1024, 96, False),     # partial rotary (phi-4-mini: 96 of 128), 8 query heads per KV head
    (64, 4, 2, 63, 256, None, False),      # p at the end of a 64-key split
    (64, 4, 2, 64, 256, None, True),       # p first in a split
    (32, 2, 4, 0, 64, None, False),        # p = 0: the only key is the new one
    (128, 1, 1, 200, 256, None, False),
]


@pytest.mark.parametrize("hd,n_kv,G,p,max_ctx,rot,qk_norm", ROPE_CASES)
def test_attention_with_rope_equals_rope_then_attention(cp, kernels, rng, seed, hd, n_kv, G, p, max_ctx, rot, qk_norm):
    """attention_decode(rope=...) on the unrotated qkv row (the fused path's one-row attention: q rotated in each
    split block, k/v appended by the block whose split holds the position; the combine a launch of its own) against
    rope_kv_append then attention_decode on the same fresh data: the same output (the same rope code, to 2e-5), the
    same cache (the appended row within one bf16 step, the rest untouched), and against a float64 reference."""
    nh = n_kv * G
    slots = nh + 2 * n_kv
    eps, scale = 1e-5, hd ** -0.5
    assert kernels.rope_fits(hd, nh, n_kv) is None
    qkv = cp.asarray(rng.standard_normal((1, slots * hd), dtype=np.float32))
    kb, _ = rand_bf16(rng, (n_kv, max_ctx, hd))
    vb, _ = rand_bf16(rng, (n_kv, max_ctx, hd))
    qn, kn = (cp.asarray(rand_bf16(rng, (hd,))[0]), cp.asarray(rand_bf16(rng, (hd,))[0])) if qk_norm else (None, None)
    inv = cp.asarray(inv_freq_default(hd if rot is None else rot, 10000.0))
    pos = cp.asarray(np.array([p], np.int32))
    rope = dict(inv_freq=inv, q_norm=qn, k_norm=kn, eps=eps, attention_scaling=1.07, norm_offset=0.0, rotary_dim=rot)
    s = kernels.decode_splits(max_ctx, n_kv, 1, nh)
    ws = cp.full(kernels.decode_workspace_size(1, nh, hd, s), np.nan, dtype=cp.float32)

    kc_a, vc_a = cp.asarray(kb), cp.asarray(vb)
    q_a = nan_like(cp, (1, nh, hd))
    kernels.rope_kv_append(qkv, pos, inv, q_a, kc_a, vc_a, qn, kn, eps, attention_scaling=1.07, rotary_dim=rot)
    a = nan_like(cp, (1, nh, hd))
    kernels.attention_decode(q_a, kc_a, vc_a, pos, a, scale, n_splits=s, workspace=ws)

    kc_b, vc_b = cp.asarray(kb), cp.asarray(vb)
    qkv0 = qkv.copy()
    b = nan_like(cp, (1, nh, hd))
    kernels.attention_decode(qkv.reshape(1, slots, hd), kc_b, vc_b, pos, b, scale, n_splits=s, workspace=ws, rope=rope)
    cp.cuda.Device().synchronize()
    assert cp.array_equal(qkv, qkv0), "the qkv row must stay unrotated"
    # the same rope code, inlined in two kernels: q may differ in its last bit, and so its bf16 hi/lo split
    assert rel_err(cp.asnumpy(b), cp.asnumpy(a), seed) <= 2e-5
    others = [j for j in range(max_ctx) if j != p]
    for got, want, init in ((kc_b, kc_a, kb), (vc_b, vc_a, vb)):
        g, w_ = cp.asnumpy(got), cp.asnumpy(want)
        assert np.array_equal(g[:, others], init[:, others]), f"seed={seed}: the kernel wrote outside position {p}"
        d = np.abs(g[:, p].astype(np.int32) - w_[:, p].astype(np.int32))
        assert int(d.max()) <= 1, f"seed={seed}: the appended row differs by more than one bf16 step"
    kf = (cp.asnumpy(kc_b).astype(np.uint32) << 16).view(np.float32)
    vf = (cp.asnumpy(vc_b).astype(np.uint32) << 16).view(np.float32)
    ref = ref_attention(cp.asnumpy(q_a), kf, vf, np.array([p], np.int32), scale)
    assert rel_err(cp.asnumpy(b), ref, seed) <= 1e-3


def test_attention_rope_refuses_what_it_cannot_do(cp, kernels):
    assert kernels.rope_fits(96, 32, 32) is not None and kernels.rope_fits(256, 8, 4) is not None
    assert kernels.rope_fits(128, 32, 2) is not None  # 16 query heads per KV head
    assert kernels.rope_fits(128, 32, 8, window=512) is not None and kernels.rope_fits(128, 32, 8, softcap=50.0)
    hd, n_kv, nh, max_ctx = 64, 2, 4, 128
    kc = cp.zeros((n_kv, max_ctx, hd), cp.uint16)
    rope = dict(inv_freq=cp.asarray(inv_freq_default(hd, 1e4)))
    qkv = cp.ones((2, nh + 2 * n_kv, hd), cp.float32)
    out = cp.zeros((2, nh, hd), cp.float32)
    with pytest.raises(ValueError, match="rope in the split kernel"):  # two rows
        kernels.attention_decode(qkv, kc, kc.copy(), cp.asarray(np.array([3, 4], np.int32)), out, 0.1, rope=rope)


# -- the engine ------------------------------------------------------------------------------------------------

BASE = dict(vocab_size=1003, hidden_size=256, intermediate_size=344, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
            rms_norm_eps=1e-5, rope_theta=10000.0)
ARCHS = {
    "llama": dict(model_type="llama", head_dim=64, dtype="bfloat16"),
    "qwen3": dict(model_type="qwen3", head_dim=128, dtype="bfloat16"),
    "llama3_rope": dict(model_type="llama", dtype="bfloat16", head_dim=64, rope_parameters={
        "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": dict(model_type="mistral", head_dim=32, num_attention_heads=8, num_key_value_heads=2,
                    dtype="bfloat16"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    seed = int(np.random.default_rng().integers(2**31))
    out = random_checkpoints(tmp_path_factory.mktemp("fused_ckpt"), BASE, ARCHS, seed)
    print(f"checkpoints drawn with seed {seed}")
    return out


def gpu_engine(path, ctx=160, fused=True, **kw):
    """fused: the engine on the fused path (else the rows path): one row rotates in the attention kernel, more
    rows in the qkv GEMV."""
    e = open_model(path, device="cuda", max_context=ctx, fp32_logits=True).engine
    e.set_path("fused" if fused else "rows")
    if fused:
        assert e.fused_plan(2)["qkv_rope"] is None
        assert "attention split kernel" in e.fused_plan(1)["qkv_rope"]
    for k, v in kw.items():
        setattr(e, k, v)
    return e


@pytest.mark.parametrize("name", list(ARCHS))
def test_fused_greedy_matches_rows_path_and_numpy(cp, checkpoints, name, rng):
    path = checkpoints[name]
    cpu = open_model(path, device="cpu", max_context=160, fp32_logits=True).engine
    fused, plain = gpu_engine(path), gpu_engine(path, fused=False)
    prompt = [int(t) for t in rng.integers(0, cpu.vocab_size(), 12)]
    a = decoding.run_decode(cpu, prompt, 24, keep_rows=True)
    b = decoding.run_decode(fused, prompt, 24, keep_rows=True)
    c = decoding.run_decode(plain, prompt, 24, keep_rows=True)
    fused.check_fused()
    ta, tb, tc = ([s.token for s in r.steps] for r in (a, b, c))
    ra, rb, rc = a.rows.array(), b.rows.array(), c.rows.array()
    n = tokens_agree(ta, tb, ra)
    err = rel(rb[:n], ra[:n])
    m = tokens_agree(tc, tb, rc)
    same = rel(rb[:m], rc[:m])
    print(f"{name}: fused vs numpy {err:.2e} over {n} rows, fused vs rows path {same:.2e} over {m}")
    assert err <= 2e-2 and same <= 1e-4


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_fused_graph_replay_equals_eager(cp, checkpoints, name, rng):
    g = gpu_engine(checkpoints[name], 64)
    e = gpu_engine(checkpoints[name], 64, use_graphs=False)
    prompt = [int(t) for t in rng.integers(0, g.vocab_size(), 7)]
    drafts = [int(t) for t in rng.integers(0, g.vocab_size(), 4)]
    out = []
    for eng in (g, e):
        eng.prefill(prompt)
        r = []
        for t in drafts[:3]:
            eng.decode(t)
            r.append(rows(eng, eng.decode_logits_ptr(), 1).tobytes())
        eng.verify(drafts)
        r += [rows(eng, eng.logits_buffer_ptr().row_ptr(i), 1).tobytes() for i in range(4)]
        eng.check_fused()
        out.append(r)
    assert len(g.graphs) >= 2 and not len(e.graphs)
    assert out[0] == out[1]


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("k", [1, 2, 4, 8, 15])
def test_fused_verify_equals_sequential_and_trim(cp, checkpoints, name, k, rng):
    gpu = gpu_engine(checkpoints[name])
    prompt = [int(t) for t in rng.integers(0, gpu.vocab_size(), 9)]
    drafts = [int(t) for t in rng.integers(0, gpu.vocab_size(), k)]
    seq, ver = decoded_and_verified(gpu, prompt, drafts)
    assert rel(ver, seq) <= TOL
    plain = gpu_engine(checkpoints[name], fused=False)
    plain.prefill(prompt)
    plain.verify(drafts)
    assert rel(ver, rows(plain, plain.logits_buffer_ptr(), k)) <= 1e-4  # the same kernels' arithmetic
    keep = int(rng.integers(0, k + 1))
    gpu.trim(len(prompt) + keep)
    gpu.decode(3)
    fresh = gpu_engine(checkpoints[name], 64)
    fresh.prefill(prompt)
    if keep:
        fresh.verify(drafts[:keep])
    fresh.decode(3)
    assert rel(rows(gpu, gpu.decode_logits_ptr(), 1), rows(fresh, fresh.decode_logits_ptr(), 1)) <= 1e-3
    gpu.check_fused()
    fresh.check_fused()


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_fused_long_context_crosses_many_splits(cp, checkpoints, name, rng):
    """3000 cached positions in a 4096 cache: 64 splits of which 47 hold keys at M = 1 (two combine
    batches), 17 at M = 8; fused vs rows path vs the NumPy engine."""
    path = checkpoints[name]
    fused, plain = gpu_engine(path, 4096), gpu_engine(path, 4096, fused=False)
    cpu = open_model(path, device="cpu", max_context=4096, fp32_logits=True).engine
    assert fused.kern.decode_splits(4096, 2, 1, 4) >= 48  # 64 on 132 SMs
    prompt = [int(t) for t in rng.integers(0, fused.vocab_size(), 3000)]
    steps = [int(t) for t in rng.integers(0, fused.vocab_size(), 6)]
    out = {}
    for key, e in (("fused", fused), ("rows", plain), ("cpu", cpu)):
        e.prefill(prompt)
        got = []
        for t in steps:
            e.decode(t)
            got.append(rows(e, e.decode_logits_ptr(), 1)[0])
        e.verify(steps[:8])
        got += list(rows(e, e.logits_buffer_ptr(), len(steps)))
        out[key] = np.stack(got)
    fused.check_fused()
    print(f"{name} @3000: fused vs rows {rel(out['fused'], out['rows']):.2e}, vs numpy {rel(out['fused'], out['cpu']):.2e}")
    assert rel(out["fused"], out["rows"]) <= 1e-4
    assert rel(out["fused"], out["cpu"]) <= 2e-2


def test_fused_path_switch_keeps_the_cache(cp, checkpoints, rng):
    """set_path between calls: the cache written by one path is read by the other."""
    e = gpu_engine(checkpoints["qwen3"], fused=False)
    ref = gpu_engine(checkpoints["qwen3"], fused=False)
    prompt = [int(t) for t in rng.integers(0, e.vocab_size(), 10)]
    steps = [int(t) for t in rng.integers(0, e.vocab_size(), 6)]
    e.prefill(prompt)
    ref.prefill(prompt)
    for i, t in enumerate(steps):
        e.set_path("fused" if i % 2 else "rows")
        e.decode(t)
        ref.decode(t)
        assert rel(rows(e, e.decode_logits_ptr(), 1), rows(ref, ref.decode_logits_ptr(), 1)) <= 1e-4
    e.check_fused()
