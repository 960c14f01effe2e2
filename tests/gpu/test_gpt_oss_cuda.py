"""gpt-oss on the CUDA engine, against float64 / NumPy references on fresh random data every run.

Kernels: attention sinks in the decode combine kernel (one row and several, with and without a window, one split and
many) and at the end of flash prefill; the router GEMV's bias and the topk_softmax router kind (rows path route
kernel and prefill top-k; ties to the lowest index, a NaN logit chosen last); the experts kernels with gate/up and
down biases and gpt-oss's clamped SwiGLU on values that hit the clamps; the prefill's elementwise swiglu_oai.

Engines: tiny random gpt-oss checkpoints (4 layers alternating sliding (window 16) and full, head_dim 64, YaRN, 8
experts top-4, q/k/v/o biases, sinks) with bf16 experts (and a clamp of 1.0, which most gate/up values hit) and
with MXFP4 experts (read as stored by the MoE kernels since issue 41; tests/gpu/test_moe_mxfp4_cuda.py tests their
kernels): prefill T = 5 (rows path) and 40 (prefill path, past the window),
24 greedy steps, verify == sequential decode, trim then decode == a fresh run, and the sinks reaching the output.
The GPU's bf16 KV cache moves the router logits by ~1e-3, so a near-tie routing decision may flip; rows past the
first flip are not compared (tests/gpu/test_moe_cuda.py's first_flip, which asserts every flip is a near tie).
"""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from metrale_cli.backends.numpy import moe as np_moe
from metrale_cli.backends.numpy import ops as np_ops
from metrale_cli.backends.numpy import routers as np_routers
from metrale_cli.config import parse_config
from metrale_cli.engine.ops import Route
from metrale_cli.model import open_model
from metrale_cli.models.spec import MoeSpec, RouterSpec
from metrale_cli.random_weights import RandomTensors

from gpu_helpers import TOL as KERNEL_TOL
from gpu_helpers import bits_f32, decoded_and_verified, make_cache, rand_bf16, rel, rel_err, rows
from test_moe_cuda import TOL, _spec, first_flip, greedy_err, prefill_err, trace
pytestmark = pytest.mark.gpu

TOL_TC = 1e-3  # the decode tensor-core kernel (head_dim 64, 128), as tests/gpu/test_attention_decode.py


# -- attention sinks ---------------------------------------------------------------------------------------


def ref_sinks(q, kb, vb, positions, scale, sinks, window):
    """float64: row m at position p sees keys (p - window, p] (all up to p without a window); head h's sink logit
    joins its softmax denominator (sinks None: plain attention)."""
    kf, vf = bits_f32(kb).astype(np.float64), bits_f32(vb).astype(np.float64)
    M, nh, hd = q.shape
    n_kv = kf.shape[0]
    G = nh // n_kv
    out = np.zeros((M, nh, hd))
    for m, p in enumerate(positions):
        lo = 0 if window is None else max(0, p - window + 1)
        s = np.einsum("kgd,kld->kgl", q[m].astype(np.float64).reshape(n_kv, G, hd), kf[:, lo:p + 1]) * scale
        top = s.max(axis=-1, keepdims=True)
        den = 0.0
        if sinks is not None:
            sk = np.asarray(sinks, np.float64).reshape(n_kv, G, 1)
            top = np.maximum(top, sk)
            den = np.exp(sk - top)
        e = np.exp(s - top)
        out[m] = (np.einsum("kgl,kld->kgd", e, vf[:, lo:p + 1]) / (e.sum(axis=-1, keepdims=True) + den)).reshape(nh, hd)
    return out


def _sinks(rng, nh):
    """Sink logits from well below to well above the scores' log-sum (the softmax of 16..300 keys): each matters."""
    return rng.uniform(-3.0, 8.0, nh).astype(np.float32)


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("M, window, n_splits", [(1, None, None), (1, None, 1), (4, None, 7), (1, 16, None),
                                                 (5, 16, 3), (16, 128, None)])
def test_decode_sinks_match_float64(cp, kernels, rng, seed, hd, M, window, n_splits):
    n_kv, G = 2, 4
    nh, ctx = n_kv * G, 300
    positions = np.arange(ctx - M, ctx, dtype=np.int32)
    kb, vb = make_cache(rng, n_kv, ctx + 40, hd, ctx)
    q = rng.standard_normal((M, nh, hd), dtype=np.float32)
    sinks = _sinks(rng, nh)
    scale = 1.0 / math.sqrt(hd)

    def run(s):
        out = cp.full((M, nh, hd), np.nan, cp.float32)
        kernels.attention_decode(cp.asarray(q), cp.asarray(kb), cp.asarray(vb), cp.asarray(positions), out, scale,
                                 n_splits=n_splits, window=window, sinks=None if s is None else cp.asarray(s))
        return out.get()

    got = run(sinks)
    ref = ref_sinks(q, kb, vb, positions, scale, sinks, window)
    err = rel_err(got, ref, seed)
    moved = rel(ref, ref_sinks(q, kb, vb, positions, scale, None, window))
    print(f"decode sinks hd={hd} M={M} window={window}: rel err {err:.2e} (the sinks move the output by {moved:.2e})")
    assert err <= TOL_TC, f"seed={seed}"
    assert moved > 1e-2  # the test sees the sinks
    # a sink far below every score is no sink: the plain kernel's output, bit for bit
    assert np.array_equal(run(np.full(nh, -1e4, np.float32)), run(None))


@pytest.mark.parametrize("start, T, window", [(0, 5, None), (0, 40, 16), (0, 130, None), (37, 129, 16),
                                              (5, 64, 128)])
def test_flash_prefill_sinks_match_float64(cp, kernels, rng, seed, start, T, window):
    hd, n_kv, G = 64, 2, 4
    nh = n_kv * G
    kb, vb = make_cache(rng, n_kv, start + T + 19, hd, start + T)
    q = rng.standard_normal((T, nh, hd), dtype=np.float32)
    sinks = _sinks(rng, nh)
    scale = 1.0 / math.sqrt(hd)

    def run(s):
        out = cp.full((T, nh, hd), np.nan, cp.float32)
        kernels.attention_prefill(cp.asarray(q), cp.asarray(kb), cp.asarray(vb), start, T, out, scale, window=window,
                                  sinks=None if s is None else cp.asarray(s))
        return out.get()

    got = run(sinks)
    ref = ref_sinks(q, kb, vb, start + np.arange(T), scale, sinks, window)
    err = rel_err(got, ref, seed)
    moved = rel(ref, ref_sinks(q, kb, vb, start + np.arange(T), scale, None, window))
    print(f"prefill sinks start={start} T={T} window={window}: rel err {err:.2e} (sinks move it {moved:.2e})")
    assert err <= KERNEL_TOL, f"seed={seed}"
    assert moved > 1e-2


# -- router: GEMV bias + topk_softmax ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_kernels(kernels):
    from metrale_cli.backends.cuda.kernels.moe import MoeKernels

    return MoeKernels(kernels)


def _np_topk_softmax(logits, k):
    spec = MoeSpec(logits.shape[1], k, 64, False, "swiglu_oai", router=RouterSpec("topk_softmax", bias=True))
    return np_routers.topk_softmax(logits, spec, None)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("experts, k", [(8, 4), (32, 4), (128, 4), (256, 8)])
def test_biased_router_and_topk_softmax_match_numpy(cp, kernels, moe_kernels, rng, seed, m, experts, k):
    """The router GEMV adds the bias (the logits the NumPy engine routes on); the route kernel (rows path) and the
    prefill top-k choose the k largest logits in order and softmax over them."""
    from metrale_cli.backends.cuda.kernels.moe import RouteBuffers

    hidden = 512
    h = rng.standard_normal((m, hidden)).astype(np.float32)
    wb, w = rand_bf16(rng, (experts, hidden), hidden ** -0.5)
    bb, b = rand_bf16(rng, (experts,), 1.0)
    logits = cp.empty((m, experts), cp.float32)
    dh, dw, db = cp.asarray(h), cp.asarray(wb), cp.asarray(bb)
    for r in range(m):  # the fp32-FMA GEMV one row at a time (it is compiled for 1 and 2 rows)
        kernels.gemv(dh[r:r + 1], dw, logits[r:r + 1], db)
    got_logits = logits.get()
    np.testing.assert_allclose(got_logits, h @ w.T + b, rtol=1e-5, atol=1e-5, err_msg=f"seed={seed}")
    idx, wts = _np_topk_softmax(got_logits, k)  # on the GPU's logits: the choice itself is compared
    router = RouterSpec("topk_softmax", bias=True)
    buf = RouteBuffers.allocate(cp, experts, k, hidden)
    nw, _ = rand_bf16(rng, (hidden,), 0.3)
    moe_kernels.route(logits, cp.asarray(h), cp.asarray(nw), 1e-5, experts, k, False, False, buf, router=router)
    np.testing.assert_array_equal(buf.idx[:m].get(), idx, err_msg=f"seed={seed}")
    np.testing.assert_allclose(buf.wts[:m].get(), wts, rtol=1e-6, atol=1e-7, err_msg=f"seed={seed}")
    t = 40
    many = (rng.standard_normal((t, experts)) * 3).astype(np.float32)
    i2, w2, sg = cp.empty((t, k), cp.int32), cp.empty((t, k), cp.float32), cp.empty((t,), cp.float32)
    moe_kernels.topk_rows(cp.asarray(many), experts, k, False, False, i2, w2, sg, router=router)
    idx, wts = _np_topk_softmax(many, k)
    np.testing.assert_array_equal(i2.get(), idx, err_msg=f"seed={seed}")
    np.testing.assert_allclose(w2.get(), wts, rtol=1e-6, atol=1e-7, err_msg=f"seed={seed}")


def test_topk_softmax_ties_and_nan(cp, moe_kernels, rng):
    """Equal logits go to the lowest index; a NaN logit is chosen after every real one (as NumPy's sort puts it
    last): not chosen while k real logits remain, else last, its NaN reaching every weight of the row."""
    router = RouterSpec("topk_softmax", bias=True)

    def choose(logits, k):
        t, e = logits.shape
        i, w = cp.empty((t, k), cp.int32), cp.empty((t, k), cp.float32)
        moe_kernels.topk_rows(cp.asarray(logits), e, k, False, False, i, w, cp.empty(t, cp.float32), router=router)
        return i.get(), w.get()

    logits = (rng.standard_normal((2, 32)) - 5).astype(np.float32)
    logits[0, [3, 7, 9, 20, 30]] = 2.0  # five equal maxima: 3, 7, 9, 20 win, with equal weights
    logits[1, 6] = np.nan
    logits[1, [1, 2, 3, 4]] = 5.0
    idx, wts = choose(logits, 4)
    np.testing.assert_array_equal(idx[0], [3, 7, 9, 20])
    np.testing.assert_allclose(wts[0], 0.25, rtol=1e-6)
    np.testing.assert_array_equal(idx[1], [1, 2, 3, 4])
    assert np.all(np.isfinite(wts[1]))
    every = np.array([[1.0, np.nan, 3.0, 2.0]], np.float32)  # k = E: the NaN must be chosen
    idx, wts = choose(every, 4)
    np.testing.assert_array_equal(idx[0], [2, 3, 0, 1])
    assert np.all(np.isnan(wts[0]))
    ref_idx, _ = _np_topk_softmax(every, 4)
    np.testing.assert_array_equal(idx, ref_idx)


# -- experts: biases + swiglu_oai --------------------------------------------------------------------------


def _oai_case(rng, m, experts, k, inter, hidden, limit):
    """Routing for m rows, and expert weights whose gate/up values (h has unit RMS) reach well past the clamp:
    std 4 limit / 3, about 45% of them beyond it."""
    logits = rng.standard_normal((m, experts)).astype(np.float32)
    x = rng.standard_normal((m, hidden)).astype(np.float32)
    gu_b, gu = rand_bf16(rng, (experts, 2 * inter, hidden), 4 * limit / 3 * hidden ** -0.5)
    dn_b, dn = rand_bf16(rng, (experts, hidden, inter), inter ** -0.5)
    bgu_b, bgu = rand_bf16(rng, (experts, 2 * inter), 1.0)
    bdn_b, bdn = rand_bf16(rng, (experts, hidden), 1.0)
    return logits, x, (gu_b, gu), (dn_b, dn), (bgu_b, bgu), (bdn_b, bdn)


@pytest.mark.parametrize("m", [1, 2, 4, 7, 16])
@pytest.mark.parametrize("experts, k, inter", [(8, 4, 96), (32, 4, 1032), (128, 4, 2880 // 10)])
def test_oai_expert_kernels_with_biases_match_numpy(cp, moe_kernels, rng, seed, m, experts, k, inter):
    from metrale_cli.backends.cuda.kernels.moe import RouteBuffers

    hidden, limit, alpha = 256, 7.0, 1.702
    logits, x, (gu_b, gu), (dn_b, dn), (bgu_b, bgu), (bdn_b, bdn) = _oai_case(rng, m, experts, k, inter, hidden,
                                                                              limit)
    ones = np.full(hidden, 0x3F80, np.uint16)  # norm weight 1
    b = RouteBuffers.allocate(cp, experts, k, hidden)
    moe_kernels.route(cp.asarray(logits), cp.asarray(x), cp.asarray(ones), 1e-5, experts, k, False, False, b,
                      router=RouterSpec("topk_softmax", bias=True))
    act = cp.full((16 * k, inter), np.nan, cp.float32)
    moe_kernels.gate_up(m, cp.asarray(gu_b), b, act, bias=cp.asarray(bgu_b), activation="swiglu_oai", limit=limit,
                        alpha=alpha)
    out = cp.full((m, hidden), np.nan, cp.float32)
    moe_kernels.down(m, cp.asarray(dn_b), b, act, out, accumulate=False, bias=cp.asarray(bdn_b))
    h = b.h[:m].get()
    route = Route(None, b.idx[:m].get(), b.wts[:m].get())  # the GPU's choice (the router test compares it)
    ref = np_moe.experts(h, route, gu, dn, np_ops.glu("swiglu_oai", limit, alpha), bias=(bgu, bdn))
    pre = np.stack([gu[e] @ h[r] + bgu[e] for r in range(m) for e in route.top_k_index[r]])  # [m k, 2I]
    g_over = float(np.mean(pre[:, :inter] > limit))
    u_over = float(np.mean(np.abs(pre[:, inter:]) > limit))
    err = rel_err(out.get(), ref, seed)
    print(f"oai experts m={m} E={experts} I={inter}: rel err {err:.2e}; gate > {limit}: {g_over:.0%}, "
          f"|up| > {limit}: {u_over:.0%}")
    assert g_over > 0.05 and u_over > 0.05  # the clamps are exercised
    assert err <= 1e-5, f"seed={seed}"
    base = rng.standard_normal((m, hidden)).astype(np.float32)
    acc = cp.asarray(base)
    moe_kernels.down(m, cp.asarray(dn_b), b, act, acc, accumulate=True, bias=cp.asarray(bdn_b))
    np.testing.assert_allclose(acc.get(), base + out.get(), rtol=1e-6, atol=1e-6)


def test_prefill_swiglu_oai_matches_numpy(cp, kernels, rng, seed):
    limit, alpha = 7.0, 1.702
    gu = (rng.standard_normal((37, 2 * 200)) * 8).astype(np.float32)
    gu[3, 5] = np.nan  # NaN gate and up stay NaN (a clamp must not hide them)
    gu[4, 205] = np.nan
    out = cp.full((37, 200), 0.0, cp.float32)
    kernels.swiglu(cp.asarray(gu), out, activation="swiglu_oai", limit=limit, alpha=alpha)
    got = out.get()
    ref = np_ops.glu("swiglu_oai", limit, alpha)(gu)
    assert np.isnan(got[3, 5]) and np.isnan(got[4, 5])
    ok = np.isfinite(ref)
    np.testing.assert_allclose(got[ok], ref[ok], rtol=2e-6, atol=1e-6, err_msg=f"seed={seed}")


# -- engines -----------------------------------------------------------------------------------------------

BASE = dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], vocab_size=1003, hidden_size=256,
            intermediate_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
            num_local_experts=8, num_experts_per_tok=4, sliding_window=16, max_position_embeddings=512,
            rms_norm_eps=1e-5, attention_bias=True, hidden_act="silu", tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "original_max_position_embeddings": 64, "truncate": False},
            swiglu_alpha=1.702, dtype="bfloat16")
ARCHS = {
    "bf16": dict(swiglu_limit=1.0),  # a clamp most gate/up values pass: the engine's clamp path is exercised
    "mxfp4": dict(swiglu_limit=7.0, quantization_config={
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    seed = int(np.random.default_rng().integers(2**31))
    root = tmp_path_factory.mktemp("gpt_oss")
    out = {}
    for name, extra in ARCHS.items():
        raw = {**BASE, **extra}
        src = RandomTensors(parse_config(raw), seed=seed)
        d = root / name
        d.mkdir()
        tensors = {}
        for n in src.tensor_names():
            a = src.array(n)
            # the MXFP4 blocks / scales as drawn (uint8); every other tensor bf16
            tensors[n] = a if n in src.formatted else np.asarray(a, np.float32).astype(ml_dtypes.bfloat16)
        save_file(tensors, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(raw))
        out[name] = d
    print(f"gpt-oss checkpoints drawn with seed {seed}")
    return out


@pytest.fixture(autouse=True)
def unverified(monkeypatch):
    """The MXFP4 experts read as stored are gated until their tests pass (this file and test_moe_mxfp4_cuda.py)."""
    from metrale_cli.backends.cuda.loading import UNVERIFIED_ENV

    monkeypatch.setenv(UNVERIFIED_ENV, "1")


def pair(path, ctx: int = 160):
    return (open_model(path, device="cpu", max_context=ctx, fp32_logits=True).engine,
            open_model(path, device="cuda", max_context=ctx, fp32_logits=True).engine)


def _comparable(cpu, gpu, prompt, seed) -> int:
    """The rows of a prefill of `prompt` before the first routing flip (a near tie, checked)."""
    return first_flip(trace(cpu, [prompt]), trace(gpu, [prompt]), _spec(cpu), seed)


@pytest.mark.parametrize("name", list(ARCHS))
@pytest.mark.parametrize("plen", [5, 40])  # 5: the graph rows path; 40: the prefill path, past the window of 16
def test_gpt_oss_prefill_parity(cp, checkpoints, name, plen, rng, seed):
    err, n = prefill_err(*pair(checkpoints[name]), plen, rng, seed,
                         comparable=lambda c, g, prompt: _comparable(c, g, prompt, seed))
    print(f"gpt-oss {name} prefill T={plen}: rel err {err:.2e} over {n} rows")
    assert err <= TOL, f"seed={seed}"


@pytest.mark.parametrize("name", list(ARCHS))
@pytest.mark.parametrize("path", ["fused", "rows"])  # the rows paths (backends/cuda/paths.py): the default, the base
def test_gpt_oss_greedy_24_steps(cp, checkpoints, name, path, rng, seed, monkeypatch):
    from metrale_cli.backends.cuda.paths import PATH_ENV

    monkeypatch.setenv(PATH_ENV, path)
    cpu, gpu = pair(checkpoints[name])
    assert gpu.path == path
    prompt = [int(t) for t in rng.integers(0, cpu.vocab_size(), 12)]
    err, same, n = greedy_err(cpu, gpu, prompt, 24, seed)
    print(f"gpt-oss {name} ({path} path): {same} greedy tokens equal of 24 (positions 12..35: past the window), "
          f"rel err over {n} rows {err:.2e}")
    assert err <= TOL, f"seed={seed}"


@pytest.mark.parametrize("name", list(ARCHS))
@pytest.mark.parametrize("k", [1, 4])
def test_gpt_oss_verify_equals_sequential_and_trim(cp, checkpoints, name, k, rng, seed):
    cpu, gpu = pair(checkpoints[name])
    prompt = [int(t) for t in rng.integers(0, gpu.vocab_size(), 20)]  # past the window of 16
    drafts = [int(t) for t in rng.integers(0, gpu.vocab_size(), k)]
    seq, ver = decoded_and_verified(gpu, prompt, drafts)
    err = rel(ver, seq)
    print(f"gpt-oss {name} verify k={k} vs sequential decode: rel err {err:.2e}")
    assert err <= 1e-3, f"seed={seed}"  # the same kernels on the same rows (the router GEMV differs by row count)
    g = trace(gpu, [prompt, drafts])
    n = first_flip(trace(cpu, [prompt, drafts]), g, _spec(gpu), seed) - len(prompt)
    if n > 0:
        cpu.reset()
        cpu.prefill(prompt)
        cpu.verify(drafts)
        assert rel(ver[:n], rows(cpu, cpu.logits_buffer_ptr(), k)[:n]) <= TOL, f"seed={seed}"
    keep = int(rng.integers(0, k + 1))
    gpu.reset()
    gpu.prefill(prompt)
    gpu.verify(drafts)
    gpu.trim(len(prompt) + keep)
    gpu.decode(3)
    fresh = open_model(checkpoints[name], device="cuda", max_context=64, fp32_logits=True).engine
    fresh.prefill(prompt)
    if keep:
        fresh.verify(drafts[:keep])
    fresh.decode(3)
    trim_err = rel(rows(gpu, gpu.decode_logits_ptr(), 1), rows(fresh, fresh.decode_logits_ptr(), 1))
    print(f"gpt-oss {name} trim to {len(prompt) + keep} then decode vs a fresh run: rel err {trim_err:.2e}")
    assert trim_err <= 1e-3, f"seed={seed}"


def test_gpt_oss_sinks_reach_the_gpu_output(cp, checkpoints, rng, seed, tmp_path):
    """A copy of the checkpoint whose sinks are -1e4 (exp underflows to 0: no sinks) gives other GPU logits, and those
    match the NumPy engine on the same copy: the GPU reads the sinks and computes them as the reference does."""
    src = checkpoints["bf16"]
    dst = tmp_path / "nosinks"
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    for n in [n for n in tensors if n.endswith("self_attn.sinks")]:
        tensors[n] = np.full_like(tensors[n], -1e4)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    prompt = [int(t) for t in rng.integers(0, 1003, 40)]
    cpu, gpu = pair(dst)
    base = open_model(src, device="cuda", max_context=160, fp32_logits=True).engine
    n = _comparable(cpu, gpu, prompt, seed)
    got = []
    for e in (gpu, base, cpu):
        e.reset()
        e.prefill(prompt, all_logits=True)
        got.append(rows(e, e.logits_buffer_ptr(), len(prompt)))
    moved = rel(got[0], got[1])
    err = rel(got[0][:n], got[2][:n]) if n else 0.0
    print(f"gpt-oss without sinks: the GPU logits move by {moved:.2e}; against the CPU without sinks {err:.2e} "
          f"over {n} rows")
    assert moved > 1e-2, f"seed={seed}"
    assert err <= TOL, f"seed={seed}"
