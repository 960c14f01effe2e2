"""The gated delta rule's two NumPy forms (backends/numpy/gated_delta.py) on fresh random inputs: the chunked
rule equals the recurrent one (small chunks here so that lengths cross several boundaries, from a nonzero
initial state), and both equal transformers' torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule
when torch is installed; the causal conv and its state equal a full-sequence conv."""

from __future__ import annotations

import numpy as np
import pytest

from metrale_cli.backends.numpy import gated_delta as gd


def draw(rng, t, hk=2, hv=4, dk=16, dv=24, decay=1.0):
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    return dict(q=f(t, hk, dk), k=f(t, hk, dk), v=f(t, hv, dv),
                g=(-rng.uniform(0, decay, (t, hv))).astype(np.float32),
                beta=rng.uniform(0, 1, (t, hv)).astype(np.float32), state=f(hv, dk, dv))


def rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("t", [1, 7, 8, 9, 24])
def test_chunked_equals_recurrent(t):
    rng = np.random.default_rng()
    x = draw(rng, t)
    q, k = gd.prepare(x["q"], x["k"], 2)
    kept: list = []
    o1, s1 = gd.recurrent(q, k, x["v"], x["g"], x["beta"], x["state"], kept)
    o2, s2 = gd.chunked(q, k, x["v"], x["g"], x["beta"], x["state"], chunk=8)
    assert rel(o2, o1) <= 2e-6 and rel(s2, s1) <= 2e-6
    assert len(kept) == t and np.array_equal(kept[-1], s1)
    # the rule split in two passes (the state carried over) gives the same outputs
    h = t // 2
    oa, sa = gd.chunked(q[:h], k[:h], x["v"][:h], x["g"][:h], x["beta"][:h], x["state"], chunk=8) if h else (
        np.zeros((0,) + o1.shape[1:], np.float32), x["state"])
    ob, sb = gd.recurrent(q[h:], k[h:], x["v"][h:], x["g"][h:], x["beta"][h:], sa)
    assert rel(np.concatenate([oa, ob]), o1) <= 2e-6 and rel(sb, s1) <= 2e-6


def test_the_causal_conv_carries_its_state():
    rng = np.random.default_rng()
    x, w = rng.normal(size=(11, 6)).astype(np.float32), rng.normal(size=(6, 4)).astype(np.float32)
    whole, state = gd.causal_conv(x, w, np.zeros((6, 3), np.float32))
    a, sa = gd.causal_conv(x[:5], w, np.zeros((6, 3), np.float32))
    b, sb = gd.causal_conv(x[5:], w, sa)
    np.testing.assert_allclose(np.concatenate([a, b]), whole, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(sb, state)
    np.testing.assert_array_equal(state, x[-3:].T)
    ref = sum(np.pad(x, ((3, 0), (0, 0)))[j:j + 11] * w[:, j] for j in range(4))  # direct definition
    np.testing.assert_allclose(whole, ref / (1 + np.exp(-ref)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t,decay", [(1, 1.0), (63, 1.0), (64, 1.0), (65, 1.0), (192, 1.0), (130, 20.0)])
def test_against_transformers(t, decay):
    torch = pytest.importorskip("torch")
    m = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    rng = np.random.default_rng()
    x = draw(rng, t, decay=decay)
    args = [torch.from_numpy(x[n])[None] for n in ("q", "k", "v", "g", "beta")]
    init = torch.from_numpy(x["state"])[None]
    tc, tcs = m.torch_chunk_gated_delta_rule(*args, initial_state=init, output_final_state=True,
                                             use_qk_l2norm_in_kernel=True)
    tr, trs = m.torch_recurrent_gated_delta_rule(*args, initial_state=init, output_final_state=True,
                                                 use_qk_l2norm_in_kernel=True)
    q, k = gd.prepare(x["q"], x["k"], 2)
    o1, s1 = gd.recurrent(q, k, x["v"], x["g"], x["beta"], x["state"])
    o2, s2 = gd.chunked(q, k, x["v"], x["g"], x["beta"], x["state"])  # chunk 64, as transformers
    errs = [rel(o1, tr[0].numpy()), rel(s1, trs[0].numpy()), rel(o2, tc[0].numpy()), rel(s2, tcs[0].numpy())]
    print(f"T={t} decay<={decay}: recurrent {errs[0]:.1e}/{errs[1]:.1e}, chunked {errs[2]:.1e}/{errs[3]:.1e}, "
          f"chunked vs recurrent {rel(o2, o1):.1e}")
    # strong decays (|g| up to 20 per token) cost the fp32 chunked rule ~1e-5 (exp of differences of large
    # cumulative decays), in transformers as here
    assert max(errs) <= (1e-5 if decay <= 1 else 5e-5)
