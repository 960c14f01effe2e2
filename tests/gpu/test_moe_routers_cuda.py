"""The router kinds on the GPU (kernels/routers.cu through MoeKernels.route and .topk_rows) against the NumPy
reference (backends/numpy/routers.py + moe.route's renormalisation and routed_scaling_factor), on fresh random
logits every run: the same experts in the same order (ties to the lowest index), the same weights within fp32
rounding; a correction that changes the choice; an ungated shared expert's gate of 1.  Every kind also with 512
experts, top-10 (Qwen3-Next) and 1024 (the kernels' bound, past 48 KiB of staged logits), each slot count of the
route kernels' instances (kernels/moe.MOE_SLOTS) once at least."""

from __future__ import annotations

import numpy as np
import pytest

from metrale_cli.backends.numpy.routers import ROUTERS
from metrale_cli.models.spec import MoeSpec, RouterSpec

from gpu_helpers import assert_union, bf16_bits, untied_logits

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def moe_kernels(kernels):
    from metrale_cli.backends.cuda.kernels.moe import MoeKernels

    return MoeKernels(kernels)


def _reference(logits, spec: MoeSpec, correction):
    idx, w = ROUTERS[spec.router.kind](logits, spec, correction)
    if spec.norm_topk_prob:
        d = w.sum(-1, keepdims=True)
        w = w / (d + np.float32(1e-20) if spec.router.kind == "sigmoid_biased_grouped" else d)
    return idx, w * np.float32(spec.router.routed_scaling_factor)


CASES = [  # kind, experts, top_k, n_group, topk_group, norm, scaling
    ("sigmoid_biased_grouped", 256, 8, 8, 4, True, 2.5),  # DeepSeek-V3
    ("sigmoid_biased_grouped", 64, 6, 1, 1, True, 2.446),  # Moonlight
    ("sigmoid_biased_grouped", 128, 8, 1, 1, True, 1.0),  # GLM-4.5-Air
    ("sigmoid_biased_grouped", 16, 4, 4, 2, False, 1.5),
    ("sigmoid_biased_grouped", 160, 8, 32, 3, True, 2.0),
    ("softmax_group_limited", 160, 6, 8, 3, False, 16.0),  # DeepSeek-V2
    ("softmax_group_limited", 8, 3, 4, 2, True, 1.5),
    ("softmax_topk", 64, 6, 1, 1, False, 1.0),  # DeepSeek-V2-Lite (greedy)
    ("softmax_topk", 64, 6, 1, 1, True, 2.0),
    ("topk_softmax", 32, 4, 1, 1, False, 1.0),  # gpt-oss-20b
]


WIDE = [  # 512 experts, top-10 (Qwen3-Next-80B-A3B's router is softmax_topk) and 1024, every kind
    ("softmax_topk", 512, 10, 1, 1, True, 1.0),
    ("sigmoid_biased_grouped", 512, 10, 8, 4, True, 2.5),
    ("sigmoid_biased_grouped", 512, 10, 1, 1, True, 1.0),
    ("softmax_group_limited", 512, 10, 16, 4, False, 16.0),
    ("topk_softmax", 512, 10, 1, 1, False, 1.0),
    ("softmax_topk", 1024, 16, 1, 1, True, 1.0),
    ("sigmoid_biased_grouped", 1024, 8, 32, 4, True, 2.5),
]


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("kind,experts,k,n_group,topk_group,norm,scaling", CASES)
def test_router_kinds_match_numpy(cp, moe_kernels, rng, seed, m, kind, experts, k, n_group, topk_group, norm,
                                  scaling):
    _check_router(cp, moe_kernels, rng, seed, m, kind, experts, k, n_group, topk_group, norm, scaling)


@pytest.mark.parametrize("m", [1, 2, 7, 10, 16])
@pytest.mark.parametrize("kind,experts,k,n_group,topk_group,norm,scaling", WIDE)
def test_router_kinds_match_numpy_with_512_and_1024_experts(cp, moe_kernels, rng, seed, m, kind, experts, k, n_group,
                                                            topk_group, norm, scaling):
    _check_router(cp, moe_kernels, rng, seed, m, kind, experts, k, n_group, topk_group, norm, scaling)


def _check_router(cp, moe_kernels, rng, seed, m, kind, experts, k, n_group, topk_group, norm, scaling):
    from metrale_cli.backends.cuda.kernels.moe import RouteBuffers

    router = RouterSpec(kind, n_group=n_group, topk_group=topk_group, routed_scaling_factor=scaling)
    spec = MoeSpec(experts, k, 64, norm, "silu", 64, router=router, shared_expert_gated=False)
    hidden = 256
    corr = (rng.standard_normal(experts) * 1.0).astype(np.float32) if kind == "sigmoid_biased_grouped" else None
    logits = untied_logits(rng, m, experts, k, corr=corr)
    want_idx, want_w = _reference(logits, spec, corr)
    if corr is not None:  # the correction changes the choice somewhere (else the test would not see it)
        plain, _ = _reference(logits, spec, None)
        assert not np.array_equal(plain, want_idx), f"seed={seed}"
    x = rng.standard_normal((m, hidden)).astype(np.float32)
    b = RouteBuffers.allocate(cp, experts, k, hidden)
    d_corr = None if corr is None else cp.asarray(corr)
    moe_kernels.route(cp.asarray(logits), cp.asarray(x), cp.asarray(bf16_bits(np.ones(hidden))), 1e-5, experts, k,
                      norm, True, b, router=router, correction=d_corr, shared_gated=False)
    idx = cp.empty((m, k), cp.int32)
    wts = cp.empty((m, k), cp.float32)
    sgate = cp.empty((m,), cp.float32)
    moe_kernels.topk_rows(cp.asarray(logits), experts, k, norm, True, idx, wts, sgate, router=router,
                          correction=d_corr, shared_gated=False)
    cp.cuda.Device().synchronize()
    for got_idx, got_w, got_g in ((b.idx[:m].get(), b.wts[:m].get(), b.sgate[:m].get()),
                                  (idx.get(), wts.get(), sgate.get())):
        np.testing.assert_array_equal(got_idx, want_idx, err_msg=f"seed={seed}")
        np.testing.assert_allclose(got_w, want_w, rtol=2e-6, atol=1e-7, err_msg=f"seed={seed}")
        assert np.all(got_g == 1.0)  # the ungated shared expert
    assert_union(b, want_idx, seed)


def test_grouped_ties_go_to_the_lowest_group_and_expert(cp, moe_kernels):
    from metrale_cli.backends.cuda.kernels.moe import RouteBuffers

    router = RouterSpec("sigmoid_biased_grouped", n_group=4, topk_group=2)
    spec = MoeSpec(16, 4, 64, True, router=router)
    logits = np.zeros((2, 16), np.float32)  # row 0: every score equal: groups 0, 1 and experts 0..3
    logits[1, [5, 6, 13, 14]] = 3.0  # row 1: groups 1 and 3 tie on their best two
    want, _ = _reference(logits, spec, np.zeros(16, np.float32))
    b = RouteBuffers.allocate(cp, 16, 4, 64)
    moe_kernels.route(cp.asarray(logits), cp.asarray(np.ones((2, 64), np.float32)),
                      cp.asarray(bf16_bits(np.ones(64))), 1e-5, 16, 4, True, False, b, router=router,
                      correction=cp.zeros(16, cp.float32))
    cp.cuda.Device().synchronize()
    np.testing.assert_array_equal(b.idx[:2].get(), want)
    np.testing.assert_array_equal(want[0], [0, 1, 2, 3])
