"""The Gated DeltaNet kernels (kernels/gated_delta.cu) against the NumPy reference (backends/numpy: the layer's
`LinearAttentionOps.mix` path and gated_delta.py) on fresh random inputs: one decode row and verify-like rows
with the state after each row, both projection layouts, every key head dim the kernels take."""

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
@pytest.mark.parametrize("rows", [1, 5])
def test_one_layer_against_the_reference(cp, kernels, rng, dk, dv, hk, hv, grouped, rows):
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
    conv, conv_after = ref.causal_conv(mixed, bf16_bits_to_fp32(w_bits), conv_state)
    kd = spec.k_dim
    qq, kk = ref.prepare(conv[:, :kd].reshape(rows, hk, dk), conv[:, kd:2 * kd].reshape(rows, hk, dk), hv // hk)
    beta = 1 / (1 + np.exp(-b))
    g = -np.exp(a_log) * softplus(a + dt_bias)
    kept: list = []
    o, rec_after = ref.recurrent(qq, kk, conv[:, 2 * kd:].reshape(rows, hv, dv), g, beta, rec_state, kept)
    y = ref.gated_rms_norm(o, z, bf16_bits_to_fp32(norm_bits), spec.eps).reshape(rows, spec.v_dim)

    gk = GatedDeltaKernels(kernels)
    maps = {n: cp.asarray(m) for n, m in column_maps(spec).items()}
    d_proj, d_conv_state, d_rec = cp.asarray(proj), cp.asarray(conv_state), cp.asarray(rec_state)
    d_conv = cp.empty((rows, spec.conv_dim), cp.float32)
    d_conv_saved = cp.empty((rows, spec.conv_dim, 3), cp.float32)
    d_beta, d_g = cp.empty((rows, hv), cp.float32), cp.empty((rows, hv), cp.float32)
    d_o, d_saved = cp.empty((rows, hv, dv), cp.float32), cp.empty((rows, hv, dk, dv), cp.float32)
    d_y = cp.empty((rows, spec.v_dim), cp.float32)
    gk.conv(d_proj, maps["src"], cp.asarray(w_bits), d_conv_state, d_conv, d_conv_saved)
    gk.gates(d_proj, maps["b"], maps["a"], cp.asarray(a_log), cp.asarray(dt_bias), d_beta, d_g)
    gk.recurrent(d_conv, d_beta, d_g, d_rec, d_o, spec, d_saved)
    gk.gated_norm(d_o, d_proj, maps["z"], cp.asarray(norm_bits), spec.eps, d_y)
    cp.cuda.runtime.deviceSynchronize()

    assert _rel(d_conv.get(), conv) <= 1e-6 and _rel(d_conv_state.get(), conv_after) == 0
    assert _rel(d_beta.get(), beta) <= 1e-6 and _rel(d_g.get(), g) <= 1e-6
    assert _rel(d_o.get(), o) <= 1e-5 and _rel(d_rec.get(), rec_after) <= 1e-5
    assert _rel(d_saved.get(), np.stack(kept)) <= 1e-5
    full = np.concatenate([conv_state.T, mixed])
    np.testing.assert_array_equal(d_conv_saved.get(), np.stack([full[j:j + 3].T for j in range(1, rows + 1)]))
    assert _rel(d_y.get(), y) <= 1e-5
