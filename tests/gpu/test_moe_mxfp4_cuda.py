"""MXFP4 experts read as stored by the CUDA MoE kernels (issue 41), on fresh random data every run.

Kernels (moe.cu's moe_gate_up_kernel / moe_down_kernel with their MXFP4 policy, e2m1.cu, through kernels/moe.py):
against a float64 NumPy definition on the dequantized weights (each e2m1 value times 2^(E8M0 - 127): random codes,
scale bytes spread over 8 octaves) on the GPU's own routing, M in 1..16 (every compiled row bound), top-k 4, the
experts' gate/up and down biases and gpt-oss's clamped SwiGLU, gpt-oss-20b's own sizes (2880 wide: several down
parts, partial chunk steps) among them; a row's numbers do not depend on the other rows (a verify row equals its
decode row bit for bit); moe_dequant_bf16_kernel equals NumPy's bf16 rounding of the exact values bit for bit under
every one of the 256 scale bytes.

Engines: tiny random gpt-oss checkpoints with MXFP4 experts (test_gpt_oss_cuda.py's shape: 4 layers alternating
sliding and full, 8 experts top-4, biases, sinks) read as stored, against the NumPy engine (exact dequantization,
fp32): prefill (T = 5: the rows path; T = 40: the prefill path's dequantized experts and cuBLAS), 24 greedy decode
steps on both rows paths, verify == sequential decode.  Routing flips at near ties are handled as
tests/gpu/test_moe_cuda.py does.  METRALE_CUDA_UNVERIFIED=1 (conftest.py) lets the engine load what these tests
verify.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from metrale_cli.backends.numpy import ops as np_ops
from metrale_cli.config import parse_config
from metrale_cli.engine.ops import Route
from metrale_cli.models.quantized import mxfp4
from metrale_cli.models.spec import RouterSpec
from metrale_cli.random_weights import RandomTensors

from gpu_helpers import rand_bf16, rel
from test_gpt_oss_cuda import ARCHS as OSS_ARCHS
from test_gpt_oss_cuda import BASE as OSS_BASE
from test_gpt_oss_cuda import pair
from test_moe_cuda import TOL, check_verify, greedy_err, moe_kernels, prefill_err  # noqa: F401 (a fixture)

pytestmark = pytest.mark.gpu


class Experts:
    """Stacked MXFP4 experts as backends/cuda/mxfp4.Mxfp4Experts holds them (kernels/moe.expert_format's
    attributes): the blocks' bytes as rows of K / 2, the E8M0 bytes."""

    moe_format = "mxfp4"
    srow, bk = 1, 32

    def __init__(self, cp, blocks, scales):
        e, n, g, _ = blocks.shape
        self.data, self.scale = cp.asarray(blocks.reshape(e, n, 16 * g)), cp.asarray(scales)
        self.shape = (e, n, 32 * g)


def random_mxfp4(rng, shape, fan_in, gain=1.0):
    """(blocks uint8 [..., N, K / 32, 16], scales uint8 [..., N, K / 32], float64 values [..., N, K]): any code,
    scales 2^-4 .. 2^4 around gain fan_in^-0.5 / 2.93 (weights of about that size, with blocks far apart)."""
    *lead, n, k = shape
    blocks = rng.integers(0, 256, (*lead, n, k // 32, 16), dtype=np.uint8)
    center = 127 + round(float(np.log2(gain * fan_in ** -0.5 / mxfp4.E2M1_RMS)))
    scales = (center + rng.integers(-4, 5, (*lead, n, k // 32))).astype(np.uint8)
    return blocks, scales, mxfp4.dequantize(blocks, scales).astype(np.float64)


@pytest.mark.parametrize("m", [1, 2, 3, 7, 16])  # the compiled row bounds 1, 2, 4, 8, 16
@pytest.mark.parametrize("experts, hidden, inter", [
    (8, 256, 128),      # one down part, one chunk step
    (32, 320, 1056),    # partial chunk steps (10 and 33 chunks a row), down_parts: 2 parts
    (8, 2880, 2880),    # gpt-oss-20b's expert sizes
])
def test_mxfp4_expert_kernels_match_the_definition(cp, moe_kernels, rng, seed, m, experts, hidden, inter):
    from metrale_cli.backends.cuda.kernels.moe import RouteBuffers

    k, limit, alpha = 4, 7.0, 1.702
    logits = rng.standard_normal((m, experts)).astype(np.float32)
    x = rng.standard_normal((m, hidden)).astype(np.float32)
    gq, gs, gu = random_mxfp4(rng, (experts, 2 * inter, hidden), hidden, gain=2.0)  # values past the clamp too
    dq, ds, dn = random_mxfp4(rng, (experts, hidden, inter), inter)
    bgu_b, bgu = rand_bf16(rng, (experts, 2 * inter), 1.0)
    bdn_b, bdn = rand_bf16(rng, (experts, hidden), 1.0)
    ones = np.full(hidden, 0x3F80, np.uint16)  # norm weight 1
    router = RouterSpec("topk_softmax", bias=True)

    def run(rows_logits, rows_x, accumulate_onto=None):
        n = rows_logits.shape[0]
        b = RouteBuffers.allocate(cp, experts, k, hidden)
        moe_kernels.route(cp.asarray(rows_logits), cp.asarray(rows_x), cp.asarray(ones), 1e-5, experts, k, False,
                          False, b, router=router)
        act = cp.full((16 * k, inter), np.nan, cp.float32)
        moe_kernels.gate_up(n, Experts(cp, gq, gs), b, act, bias=cp.asarray(bgu_b), activation="swiglu_oai",
                            limit=limit, alpha=alpha)
        out = cp.full((n, hidden), np.nan, cp.float32) if accumulate_onto is None else cp.asarray(accumulate_onto)
        moe_kernels.down(n, Experts(cp, dq, ds), b, act, out, accumulate=accumulate_onto is not None,
                         bias=cp.asarray(bdn_b))
        return b, act.get(), out.get()

    b, act, y = run(logits, x)
    h = b.h[:m].get().astype(np.float64)
    route = Route(None, b.idx[:m].get(), b.wts[:m].get())  # the GPU's choice (test_gpt_oss_cuda compares it)
    glu = np_ops.glu("swiglu_oai", limit, alpha)
    pre = np.stack([gu[route.top_k_index[r, j]] @ h[r] + bgu[route.top_k_index[r, j]] for r in range(m)
                    for j in range(k)])  # [m k, 2I]
    err = rel(act[:m * k], glu(pre))
    assert err <= 1e-5, f"seed={seed}: gate_up rel err {err:.2e}"
    assert float(np.mean(pre[:, :inter] > limit)) > 0.05  # the clamp is exercised
    err = rel(y, _down_ref(route, act[:m * k].astype(np.float64), dn, bdn, k))  # down on the kernel's own act
    print(f"mxfp4 experts m={m} E={experts} H={hidden} I={inter}: down rel err {err:.2e}")
    assert err <= 1e-5, f"seed={seed}: down rel err {err:.2e}"
    base = rng.standard_normal((m, hidden)).astype(np.float32)
    _, _, acc = run(logits, x, base.copy())
    np.testing.assert_allclose(acc, base + y, rtol=1e-6, atol=1e-6)
    if m > 1:  # row m - 1 alone: the same numbers bit for bit (the sum order does not depend on M)
        _, act1, y1 = run(logits[-1:], x[-1:])
        assert np.array_equal(act1[:k], act[(m - 1) * k:m * k]) and np.array_equal(y1[0], y[-1])


def _down_ref(route, a64, dn, bdn, k):
    """float64: per row, over its experts in increasing order, weight * (down_e . act + bias_e)."""
    m = route.top_k_index.shape[0]
    out = np.zeros((m, dn.shape[1]))
    for r in range(m):
        for j in np.argsort(route.top_k_index[r]):
            e = route.top_k_index[r, j]
            out[r] += route.top_k_weights[r, j] * (dn[e] @ a64[r * k + j] + bdn[e])
    return out


def test_mxfp4_dequantization_to_bf16_is_exact(cp, moe_kernels, rng):
    """The prefill's experts: bf16 (round to nearest even) of each exact value, bit for bit, under every scale byte
    (subnormal and overflowing products included); the other experts' rows untouched."""
    e, n, k = 3, 256, 256  # 8 scales a row: 2048 of them, every byte 8 times
    blocks = rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8)
    scales = rng.permutation(np.tile(np.arange(256, dtype=np.uint8), e * n * k // 32 // 256)).reshape(e, n, k // 32)
    w = Experts(cp, blocks, scales)
    out = cp.zeros((e, n, k), cp.uint16)
    moe_kernels.dequant_bf16(w, 1, out[1])
    cp.cuda.Device().synchronize()
    with np.errstate(over="ignore"):
        want = mxfp4.dequantize(blocks[1], scales[1]).astype(ml_dtypes.bfloat16).view(np.uint16)
    got = out.get()
    assert np.array_equal(got[1], want), f"{int(np.sum(got[1] != want))} of {want.size} differ"
    assert not got[[0, 2]].any()


# ---- the engine ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random gpt-oss checkpoint with MXFP4 experts (the format's own draw), every other tensor bf16."""
    seed = int(np.random.default_rng().integers(2**31))
    raw = {**OSS_BASE, **OSS_ARCHS["mxfp4"]}
    src = RandomTensors(parse_config(dict(raw)), seed=seed)
    d = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    tensors = {n: src.array(n) if n in src.formatted else np.asarray(src.array(n), np.float32).astype(ml_dtypes.bfloat16)
               for n in src.tensor_names()}
    save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(raw))
    print(f"gpt-oss MXFP4 checkpoint drawn with seed {seed}")
    return d


def test_the_engine_keeps_the_experts_as_stored(cp, checkpoint):
    from metrale_cli.backends.cuda.mxfp4 import Mxfp4Experts
    from metrale_cli.model import open_model

    gpu = open_model(checkpoint, device="cuda", max_context=32, fp32_logits=True).engine
    assert all(isinstance(lw["experts_gate_up"], Mxfp4Experts) and isinstance(lw["experts_down"], Mxfp4Experts)
               for lw in gpu.w.layers)


@pytest.mark.parametrize("plen", [5, 40])  # 5: the graph rows path; 40: the prefill path (dequantized experts)
def test_mxfp4_moe_prefill_parity(cp, checkpoint, plen, rng, seed):
    err, n = prefill_err(*pair(checkpoint), plen, rng, seed)
    print(f"gpt-oss MXFP4 experts prefill T={plen}: rel err {err:.2e} over {n} rows")
    assert err <= TOL, f"seed={seed}"


@pytest.mark.parametrize("path", ["fused", "rows"])
def test_mxfp4_moe_greedy_24_steps(cp, checkpoint, path, rng, seed, monkeypatch):
    from metrale_cli.backends.cuda.paths import PATH_ENV

    monkeypatch.setenv(PATH_ENV, path)
    cpu, gpu = pair(checkpoint)
    assert gpu.path == path
    prompt = [int(t) for t in rng.integers(0, cpu.vocab_size(), 12)]
    err, same, n = greedy_err(cpu, gpu, prompt, 24, seed)
    print(f"gpt-oss MXFP4 experts ({path} path): {same} greedy tokens equal of 24, rel err over {n} rows {err:.2e}")
    assert err <= TOL, f"seed={seed}"


@pytest.mark.parametrize("k", [3, 8])
def test_mxfp4_moe_verify_equals_sequential(cp, checkpoint, k, rng, seed):
    cpu, gpu = pair(checkpoint, 64)
    prompt = [int(t) for t in rng.integers(0, gpu.vocab_size(), 20)]  # past the window of 16
    drafts = [int(t) for t in rng.integers(0, gpu.vocab_size(), k)]
    check_verify(cpu, gpu, prompt, drafts, seed)
