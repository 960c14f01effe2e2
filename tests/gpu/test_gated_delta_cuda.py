"""The Gated DeltaNet kernels (kernels/gated_delta.cu) against the NumPy reference (backends/numpy: the layer's
`LinearAttentionOps.mix` path and gated_delta.py) on fresh random inputs: one decode row and verify-like rows
with the state after each row in its ring slot (positions that wrap around the ring), a prefill-like pass that
keeps only the last row's state, both projection layouts, every key head dim the kernels take; and the attention
output gate's two launches (elementwise.cu)."""

from __future__ import annotations

import numpy as np
import pytest

from metrale_cli.backends.numpy import gated_delta as ref
from metrale_cli.backends.numpy.linear_attention import softplus, split
from metrale_cli.logits import bf16_bits_to_fp32, fp32_to_bf16_bits
from metrale_cli.models.spec import LinearAttentionSpec


def _rel(a, b) -> float:
    return float(np.abs(np.asarray(a) - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.mark.parametrize("dk,dv,hk,hv,grouped", [(128, 128, 2, 4, True), (64, 96, 1, 3, False), (256, 64, 2, 2, True)])
@pytest.mark.parametrize("rows,every", [(1, True), (5, True), (5, False), (40, False)])
def test_one_layer_against_the_reference(cp, kernels, rng, dk, dv, hk, hv, grouped, rows, every):
    from metrale_cli.backends.cuda.kernels.gated_delta import GatedDeltaKernels, column_maps

    spec = LinearAttentionSpec(hk, hv, dk, dv, 4, 1e-6, grouped=grouped)
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    proj = f(rows, spec.in_size)
    w_bits = fp32_to_bf16_bits(f(spec.conv_dim, 4) * 0.5)
    norm_bits = fp32_to_bf16_bits(rng.uniform(0.5, 1.5, dv).astype(np.float32))
    a_log = np.log(rng.uniform(0.05, 2.0, hv)).astype(np.float32)
    dt_bias = f(hv) * 0.5
    conv_state, rec_state = f(spec.conv_dim, 3), f(hv, dk, dv) * 0.1

    # the reference (fp32 NumPy), as LinearAttentionOps.mix computes it
    q, k, v, z, b, a = split(proj, spec)
    mixed = np.concatenate([q.reshape(rows, -1), k.reshape(rows, -1), v.reshape(rows, -1)], axis=1)
    conv, _ = ref.causal_conv(mixed, bf16_bits_to_fp32(w_bits), conv_state)
    kd = spec.k_dim
    qq, kk = ref.prepare(conv[:, :kd].reshape(rows, hk, dk), conv[:, kd:2 * kd].reshape(rows, hk, dk), hv // hk)
    beta = 1 / (1 + np.exp(-b))
    g = -np.exp(a_log) * softplus(a + dt_bias)
    rec_kept: list = []
    o, _ = ref.recurrent(qq, kk, conv[:, 2 * kd:].reshape(rows, hv, dv), g, beta, rec_state, rec_kept)
    y = ref.gated_rms_norm(o, z, bf16_bits_to_fp32(norm_bits), spec.eps).reshape(rows, spec.v_dim)

    gk = GatedDeltaKernels(kernels)
    R = 7  # ring slots; the first position is chosen so that the pass wraps around the ring
    p0 = int(rng.integers(R, 3 * R))
    maps = {n: cp.asarray(m) for n, m in column_maps(spec).items()}
    ring_conv = np.full((R, spec.conv_dim, 3), np.nan, np.float32)  # slots the pass must not read: NaN
    ring_rec = np.full((R, hv, dk, dv), np.nan, np.float32)
    ring_conv[p0 % R], ring_rec[p0 % R] = conv_state, rec_state
    d_proj, d_ring_conv, d_ring_rec = cp.asarray(proj), cp.asarray(ring_conv), cp.asarray(ring_rec)
    d_pos = cp.asarray(np.arange(p0, p0 + rows, dtype=np.int32))
    d_conv = cp.empty((rows, spec.conv_dim), cp.float32)
    d_beta, d_g = cp.empty((rows, hv), cp.float32), cp.empty((rows, hv), cp.float32)
    d_o, d_y = cp.empty((rows, hv, dv), cp.float32), cp.empty((rows, spec.v_dim), cp.float32)
    gk.conv(d_proj, maps["src"], cp.asarray(w_bits), d_ring_conv, d_pos, d_conv, every=every)
    gk.gates(d_proj, maps["b"], maps["a"], cp.asarray(a_log), cp.asarray(dt_bias), d_beta, d_g)
    gk.recurrent(d_conv, d_beta, d_g, d_ring_rec, d_pos, d_o, spec, every=every)
    gk.gated_norm(d_o, d_proj, maps["z"], cp.asarray(norm_bits), spec.eps, d_y)
    cp.cuda.runtime.deviceSynchronize()

    assert _rel(d_conv.get(), conv) <= 1e-6
    assert _rel(d_beta.get(), beta) <= 1e-6 and _rel(d_g.get(), g) <= 1e-6
    assert _rel(d_o.get(), o) <= 1e-5 and _rel(d_y.get(), y) <= 1e-5
    full = np.concatenate([conv_state.T, mixed])
    got_conv, got_rec = d_ring_conv.get(), d_ring_rec.get()
    kept = [j for j in range(1, rows + 1) if every or j == rows][-(R - 1):]  # later rows overwrite earlier slots
    for j in kept:
        np.testing.assert_array_equal(got_conv[(p0 + j) % R], full[j:j + 3].T)
        assert _rel(got_rec[(p0 + j) % R], rec_kept[j - 1]) <= 1e-5
    untouched = set(range(R)) - {(p0 + j) % R for j in range(1, rows + 1) if every or j == rows}
    for s in untouched - {p0 % R}:
        assert np.isnan(got_conv[s]).all() and np.isnan(got_rec[s]).all()  # nothing written there


def test_output_gate_kernels(cp, kernels, rng):
    """gate_split (q rows of each head, then k | v) and output_gate (y * sigmoid(gate_h)) against NumPy."""
    m, nh, hd, kv = 3, 4, 256, 2 * 2 * 256
    gated = rng.normal(size=(m, 2 * nh * hd + kv)).astype(np.float32)
    y = rng.normal(size=(m, nh * hd)).astype(np.float32)
    heads = gated[:, :2 * nh * hd].reshape(m, nh, 2 * hd)
    d_plain = cp.empty((m, nh * hd + kv), cp.float32)
    kernels.gate_split(cp.asarray(gated), d_plain, nh, hd)
    np.testing.assert_array_equal(d_plain.get(), np.concatenate([heads[..., :hd].reshape(m, -1), gated[:, 2 * nh * hd:]], 1))
    d_y = cp.asarray(y)
    kernels.output_gate(d_y, cp.asarray(gated), nh, hd)
    want = y * (1 / (1 + np.exp(-heads[..., hd:].reshape(m, -1))))
    assert _rel(d_y.get(), want) <= 1e-6


@pytest.mark.parametrize("dk,dv,hk,hv,grouped", [(128, 128, 2, 4, True), (64, 96, 1, 3, False), (256, 64, 2, 2, True)])
@pytest.mark.parametrize("rows", [17, 34, 130])  # 34: the state after the last row goes to the slot the conv read
def test_the_prefill_kernels_give_the_rows_kernels_numbers(cp, kernels, rng, dk, dv, hk, hv, grouped, rows):
    """conv_rows + qk_norm + recurrent(prenormed) (the prefill path) against conv + recurrent (the rows path, every
    row in sequence) on the same inputs: the same outputs and final state to the last bits of fp32, and the
    reference's."""
    from metrale_cli.backends.cuda.kernels.gated_delta import GatedDeltaKernels, column_maps

    spec = LinearAttentionSpec(hk, hv, dk, dv, 4, 1e-6, grouped=grouped)
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    proj = f(rows, spec.in_size)
    w = cp.asarray(fp32_to_bf16_bits(f(spec.conv_dim, 4) * 0.5))
    beta = cp.asarray(rng.uniform(0.05, 0.95, (rows, hv)).astype(np.float32))
    g = cp.asarray(-rng.uniform(0.01, 1.0, (rows, hv)).astype(np.float32))
    R, p0 = 17, int(rng.integers(0, 40))
    ring_conv = np.full((R, spec.conv_dim, 3), np.nan, np.float32)
    ring_rec = np.full((R, hv, dk, dv), np.nan, np.float32)
    ring_conv[p0 % R], ring_rec[p0 % R] = f(spec.conv_dim, 3), f(hv, dk, dv) * 0.1
    gk = GatedDeltaKernels(kernels)
    src = cp.asarray(column_maps(spec)["src"])
    pos = cp.asarray(np.arange(p0, p0 + rows, dtype=np.int32))
    d_proj = cp.asarray(proj)
    out = {}
    for prefill in (False, True):
        rc, rr = cp.asarray(ring_conv), cp.asarray(ring_rec)
        conv, o = cp.empty((rows, spec.conv_dim), cp.float32), cp.empty((rows, hv, dv), cp.float32)
        if prefill:
            gk.conv_rows(d_proj, src, w, rc, pos, conv)
            gk.qk_norm(conv, spec)
        else:
            gk.conv(d_proj, src, w, rc, pos, conv, every=False)
        gk.recurrent(conv, beta, g, rr, pos, o, spec, every=False, prenormed=prefill)
        cp.cuda.runtime.deviceSynchronize()
        last = (p0 + rows) % R
        out[prefill] = (conv[:, 2 * spec.k_dim:].get(), o.get(), rc[last].get(), rr[last].get())
    for a, b in zip(out[True], out[False]):
        assert _rel(a, b) <= 1e-6
    # and the reference (gated_delta.py) from the same conv output
    conv_ref, conv_after = ref.causal_conv(proj[:, column_maps(spec)["src"]], bf16_bits_to_fp32(w.get()),
                                           ring_conv[p0 % R])
    kd = spec.k_dim
    qq, kk = ref.prepare(conv_ref[:, :kd].reshape(rows, hk, dk), conv_ref[:, kd:2 * kd].reshape(rows, hk, dk), hv // hk)
    o_ref, rec_after = ref.recurrent(qq, kk, conv_ref[:, 2 * kd:].reshape(rows, hv, dv), g.get(), beta.get(),
                                     ring_rec[p0 % R])
    assert _rel(out[True][1], o_ref) <= 1e-5 and _rel(out[True][3], rec_after) <= 1e-5
    np.testing.assert_array_equal(out[True][2], conv_after)


def _rule_f64(q, k, v, g, beta, state):
    """The recurrent rule in float64 (q, k prepared and repeated to the value heads): o [T, H, dv], the final state."""
    s = np.array(state, np.float64)
    out = np.empty(v.shape, np.float64)
    for t in range(q.shape[0]):
        s *= np.exp(g[t].astype(np.float64))[:, None, None]
        mem = np.einsum("hk,hkv->hv", k[t], s)
        s += k[t][:, :, None] * ((v[t] - mem) * beta[t][:, None])[:, None, :]
        out[t] = np.einsum("hk,hkv->hv", q[t], s)
    return out, s


@pytest.mark.parametrize("dk,dv", [(128, 128), (64, 80)])  # dv 80: a partial slice of the state's 32 columns
@pytest.mark.parametrize("rows", [17, 63, 64, 65, 200, 513])
def test_the_chunked_rule_against_the_sequential_kernel(cp, kernels, rng, dk, dv, rows):
    """recurrent_chunked (gdn_chunk_prep + gdn_chunk_state) against recurrent(prenormed=True) (the sequential
    kernel) and the rule in float64, from a nonzero state in a ring slot (Hv = 2 Hk): the outputs and the state
    written to the slot of p0 + T; no other slot written."""
    from metrale_cli.backends.cuda.kernels.gated_delta import GatedDeltaKernels, chunk_work_shapes

    hk, hv = 2, 4
    spec = LinearAttentionSpec(hk, hv, dk, dv, 4, 1e-6, grouped=False)
    gk = GatedDeltaKernels(kernels)
    conv = cp.asarray(rng.normal(size=(rows, spec.conv_dim)).astype(np.float32))
    gk.qk_norm(conv, spec)
    beta = rng.uniform(0.05, 0.95, (rows, hv)).astype(np.float32)
    g = -rng.uniform(0.01, 1.0, (rows, hv)).astype(np.float32)
    R, p0 = 17, int(rng.integers(0, 60))
    ring = np.full((R, hv, dk, dv), np.nan, np.float32)
    ring[p0 % R] = rng.normal(size=(hv, dk, dv)).astype(np.float32) * 0.1
    pos = cp.asarray(np.arange(p0, p0 + rows, dtype=np.int32))
    d_beta, d_g = cp.asarray(beta), cp.asarray(g)
    results = {}
    for chunked in (False, True):
        rr, o = cp.asarray(ring), cp.full((rows, hv, dv), np.nan, cp.float32)
        if chunked:
            work = {n: cp.full(s, np.nan, cp.float32) for n, s in chunk_work_shapes(rows, spec).items()}
            gk.recurrent_chunked(conv, d_beta, d_g, rr, pos, o, spec, work)
        else:
            gk.recurrent(conv, d_beta, d_g, rr, pos, o, spec, every=False, prenormed=True)
        cp.cuda.runtime.deviceSynchronize()
        results[chunked] = (o.get(), rr.get())
    x, kd = conv.get(), spec.k_dim
    q = np.repeat(x[:, :kd].reshape(rows, hk, dk), hv // hk, axis=1)
    k = np.repeat(x[:, kd:2 * kd].reshape(rows, hk, dk), hv // hk, axis=1)
    o64, s64 = _rule_f64(q, k, x[:, 2 * kd:].reshape(rows, hv, dv), g, beta, ring[p0 % R])
    (o_seq, ring_seq), (o_chk, ring_chk) = results[False], results[True]
    last = (p0 + rows) % R
    errs = {"o chunked/sequential": _rel(o_chk, o_seq),
            "state chunked/sequential": _rel(ring_chk[last], ring_seq[last]),
            "o chunked/f64": _rel(o_chk, o64), "state chunked/f64": _rel(ring_chk[last], s64),
            "o sequential/f64": _rel(o_seq, o64), "state sequential/f64": _rel(ring_seq[last], s64)}
    print(f"dk={dk} dv={dv} T={rows}: " + ", ".join(f"{n} {e:.1e}" for n, e in errs.items()))
    assert max(errs.values()) <= 1e-4
    for s in set(range(R)) - {last, p0 % R}:
        assert np.isnan(ring_chk[s]).all()  # nothing written there
    if last != p0 % R:
        np.testing.assert_array_equal(ring_chk[p0 % R], ring[p0 % R])  # the slot read is left as it was
