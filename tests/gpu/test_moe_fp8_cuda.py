"""FP8 block experts read as stored by the CUDA MoE kernels (issue 41), on fresh random data every run.

Kernels (moe.cu's moe_gate_up_kernel / moe_down_kernel with their FP8 policy, through kernels/moe.py): against a float64 NumPy
definition (each e4m3 value times its block's fp32 scale; random e4m3 weights and scales, never zero) on the GPU's own
routing, M in {1, 3, 16}, partial edge blocks (K and N not multiples of the block) and scales expanded per row
(srow = 1), the shared expert's down weight in FP8 or bf16; a row's numbers do not depend on the other rows (a verify
row equals its decode row bit for bit).

Engines (qwen3_moe with a dense layer, qwen2_moe with a gated FP8 shared expert, 128 x 128 blocks over sizes that
are not multiples of 128): the CUDA engine against the NumPy engine (which dequantizes exactly and computes in fp32)
over prefill (T = 5: the rows path; T = 40: the prefill path's dequantized experts and cuBLAS), 24 greedy decode
steps, and verify == sequential decode.  Routing flips at near ties are handled as tests/gpu/test_moe_cuda.py does.
METRALE_CUDA_UNVERIFIED=1 (conftest.py) lets the engine load what these tests verify.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from metrale_cli.engine.ops import Route
from metrale_cli.models.spec import MoeSpec

from gpu_helpers import rand_bf16, rel
from test_fp8 import write_fp8
from test_moe_cuda import TOL, _route, check_verify, greedy_err, moe_kernels, pair, prefill_err  # noqa: F401 (a fixture)

pytestmark = pytest.mark.gpu


def e4m3_nonzero(rng, shape) -> np.ndarray:
    q = rng.uniform(-448, 448, shape).astype(ml_dtypes.float8_e4m3fn)
    q[q.astype(np.float32) == 0] = 1.0
    return q


def scales(rng, lead, n, k, srow, bk) -> np.ndarray:
    return np.exp(rng.uniform(-9, -5, lead + (-(-n // srow), -(-k // bk)))).astype(np.float32)


def dequant64(q, scale, srow, bk) -> np.ndarray:
    """[..., N, K] float64: each e4m3 value times its (row block, column block)'s scale."""
    n, k = q.shape[-2:]
    full = np.repeat(np.repeat(scale.astype(np.float64), srow, -2)[..., :n, :], bk, -1)[..., :k]
    return q.astype(np.float64) * full


class Experts:
    """Stacked FP8 experts as backends/cuda/fp8.Fp8Experts holds them (kernels/moe.expert_format's attributes)."""

    moe_format = "fp8"

    def __init__(self, cp, q, scale, srow, bk):
        self.data, self.scale = cp.asarray(q.view(np.uint8)), cp.asarray(scale)
        self.srow, self.bk, self.shape = srow, bk, q.shape


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("experts, k, hidden, inter, srow, bk, shared", [
    (8, 2, 256, 128, 128, 128, None),        # whole blocks
    (16, 4, 208, 80, 1, 128, "fp8"),         # partial K blocks (208, 80), scales per row (a fused gate/up)
    (64, 8, 320, 1040, 16, 32, "bf16"),      # several down parts (down_parts), 16-row blocks, a bf16 shared expert
])
def test_fp8_expert_kernels_match_the_definition(cp, moe_kernels, rng, seed, m, experts, k, hidden, inter, srow, bk,
                                                shared):
    s = 160 if shared else 0
    spec = MoeSpec(experts, k, inter, True, "silu", s or None)
    logits = (rng.standard_normal((m, experts + bool(shared))) * 2).astype(np.float32)
    x = rng.standard_normal((m, hidden)).astype(np.float32)
    nb, _ = rand_bf16(rng, (hidden,), 0.3)
    b = _route(cp, moe_kernels, logits, x, nb, spec)
    gq, dq = e4m3_nonzero(rng, (experts, 2 * inter, hidden)), e4m3_nonzero(rng, (experts, hidden, inter))
    gs, ds = scales(rng, (experts,), 2 * inter, hidden, srow, bk), scales(rng, (experts,), hidden, inter, srow, bk)
    gu64, dn64 = dequant64(gq, gs, srow, bk), dequant64(dq, ds, srow, bk)
    act = cp.full((16 * k, inter), np.nan, cp.float32)
    moe_kernels.gate_up(m, Experts(cp, gq, gs, srow, bk), b, act)
    h = b.h[:m].get().astype(np.float64)
    route = Route(None, b.idx[:m].get(), b.wts[:m].get())  # the GPU's routing (tests/gpu/test_moe_cuda.py checks it)
    got = act.get()
    want_act = np.zeros((m * k, inter))
    for r in range(m):
        for j in range(k):
            gu = gu64[route.top_k_index[r, j]] @ h[r]
            g, u = gu[:inter], gu[inter:]
            want_act[r * k + j] = g / (1 + np.exp(-g)) * u
    err = rel(got[:m * k], want_act)
    assert err <= 1e-5, f"seed={seed}: gate_up rel err {err:.2e}"
    a64 = got[:m * k].astype(np.float64)  # down on the kernel's own act: each kernel against its definition
    want = np.zeros((m, hidden))
    for r in range(m):
        for j in np.argsort(route.top_k_index[r]):
            want[r] += route.top_k_weights[r, j] * (dn64[route.top_k_index[r, j]] @ a64[r * k + j])
    shared_arg = None
    if shared:
        act_s = rng.standard_normal((m, s)).astype(np.float32)
        if shared == "fp8":
            sq, ss = e4m3_nonzero(rng, (hidden, s)), scales(rng, (), hidden, s, 128, 32)
            w_s, w64 = Experts(cp, sq, ss, 128, 32), dequant64(sq, ss, 128, 32)
        else:
            sb, sf = rand_bf16(rng, (hidden, s), s ** -0.5)
            w_s, w64 = cp.asarray(sb), sf.astype(np.float64)
        want += b.sgate[:m].get()[:, None].astype(np.float64) * (act_s.astype(np.float64) @ w64.T)
        shared_arg = (w_s, cp.asarray(act_s))
    base = rng.standard_normal((m, hidden)).astype(np.float32)
    out = cp.asarray(base)
    fresh = cp.full((m, hidden), np.nan, cp.float32)
    w_down = Experts(cp, dq, ds, srow, bk)
    moe_kernels.down(m, w_down, b, act, fresh, shared=shared_arg, accumulate=False)
    moe_kernels.down(m, w_down, b, act, out, shared=shared_arg, accumulate=True)
    y = fresh.get()
    err = rel(y, want)
    assert err <= 1e-5, f"seed={seed}: down rel err {err:.2e}"
    np.testing.assert_allclose(out.get(), base + y, rtol=1e-6, atol=1e-6)
    if m > 1:  # row m - 1 alone: the same numbers bit for bit (the sum order does not depend on M)
        b1 = _route(cp, moe_kernels, logits[-1:], x[-1:], nb, spec)
        act1 = cp.full((16 * k, inter), np.nan, cp.float32)
        moe_kernels.gate_up(1, Experts(cp, gq, gs, srow, bk), b1, act1)
        assert np.array_equal(act1.get()[:k], got[(m - 1) * k:m * k])
        one = cp.full((1, hidden), np.nan, cp.float32)
        moe_kernels.down(1, w_down, b1, act1, one, accumulate=False,
                         shared=None if shared_arg is None else (shared_arg[0], shared_arg[1][-1:]))
        assert np.array_equal(one.get()[0], y[-1])


# ---- the engine ---------------------------------------------------------------------------------------------

ARCHS = {
    "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=1003, hidden_size=320, intermediate_size=352, head_dim=128,
                      num_experts=16, num_experts_per_tok=4, moe_intermediate_size=80, norm_topk_prob=True,
                      mlp_only_layers=[1]),
    "qwen2_moe": dict(model_type="qwen2_moe", vocab_size=1003, hidden_size=256, intermediate_size=352, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=96, shared_expert_intermediate_size=192,
                      norm_topk_prob=False),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    rng = np.random.default_rng()
    root = tmp_path_factory.mktemp("moe_fp8")
    return {name: write_fp8(root / name, arch, [128, 128], rng) for name, arch in ARCHS.items()}


def test_the_checkpoints_keep_their_experts_fp8(cp, checkpoints):
    from metrale_cli.backends.cuda.fp8 import Fp8Experts
    from metrale_cli.model import open_model

    for path in checkpoints.values():
        gpu = open_model(path, device="cuda", max_context=32, fp32_logits=True).engine
        sparse = [lw for lw in gpu.w.layers if "experts_gate_up" in lw]
        assert sparse and all(isinstance(lw["experts_gate_up"], Fp8Experts)
                              and isinstance(lw["experts_down"], Fp8Experts) for lw in sparse)


@pytest.mark.parametrize("name", list(ARCHS))
@pytest.mark.parametrize("plen", [5, 40])  # 5: the graph rows path; 40: the prefill path (dequantized experts)
def test_fp8_moe_prefill_parity(cp, checkpoints, name, plen, rng, seed):
    err, n = prefill_err(*pair(checkpoints[name]), plen, rng, seed)
    print(f"{name} FP8 experts prefill T={plen}: rel err {err:.2e} over {n} rows")
    assert err <= TOL, f"seed={seed}"


@pytest.mark.parametrize("name", list(ARCHS))
def test_fp8_moe_greedy_24_steps(cp, checkpoints, name, rng, seed):
    cpu, gpu = pair(checkpoints[name])
    prompt = [int(t) for t in rng.integers(0, cpu.vocab_size(), 12)]
    err, same, n = greedy_err(cpu, gpu, prompt, 24, seed)
    print(f"{name} FP8 experts: {same} greedy tokens equal of 24, rel err over {n} rows {err:.2e}")
    assert err <= TOL, f"seed={seed}"


@pytest.mark.parametrize("name", list(ARCHS))
@pytest.mark.parametrize("k", [3, 8])
def test_fp8_moe_verify_equals_sequential(cp, checkpoints, name, k, rng, seed):
    cpu, gpu = pair(checkpoints[name], 64)
    prompt = [int(t) for t in rng.integers(0, gpu.vocab_size(), 9)]
    drafts = [int(t) for t in rng.integers(0, gpu.vocab_size(), k)]
    check_verify(cpu, gpu, prompt, drafts, seed)
