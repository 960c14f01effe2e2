"""The CUDA mixture-of-experts path against the NumPy reference, on fresh random data every run.

Kernels (moe.cu through moe_kernels.py): the router kernel's choice equals NumPy's on the same fp32
logits (same experts, same order, ties to the lowest index), its weights, shared gate, h and union (also of a
tensor-parallel rank's held experts), up to 1024 experts (512, top-10: Qwen3-Next); the
expert kernels equal NumPy's experts on the same h and routing (fp32 over the same bf16 weights); a row's
result does not depend on the other rows of the call; experts no row chose are never used (their
weights are NaN); a captured graph replays with new inputs as eager launches compute.

Engines (qwen3_moe with a dense layer, qwen2_moe with the shared expert, mixtral, and qwen3_next with Qwen3-Next's
512 experts, top-10, and its gated shared expert): GPU against CPU on
random bf16 checkpoints. The GPU's bf16 KV cache (and the prefill path's bf16 GEMM operands) moves the
router logits by ~1e-3 relative, so a routing decision at a near tie may go the other way, which
changes that token a lot. Every such difference must be a near tie on the CPU (k-th minus (k+1)-th
probability < ROUTE_TIE; with 512 experts every gap is below it, and the first differing decision only bounds the
rows compared); rows before the first differing decision are compared with the dense tests' tolerance (attention
is causal: a later token's routing cannot change earlier rows).
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from metrale_cli import decoding
from metrale_cli.backends.numpy import moe as np_moe
from metrale_cli.backends.numpy import ops as np_ops
from metrale_cli.backends.numpy import routers as np_routers
from metrale_cli.backends.numpy.ops import rms_norm, silu
from metrale_cli.config import parse_config
from metrale_cli.engine.ops import Route
from metrale_cli.model import open_model
from metrale_cli.models.spec import MoeSpec
from metrale_cli.random_weights import RandomTensors
from metrale_cli.engine.observe import tapping

from gpu_helpers import (assert_near_tie, assert_union, bf16_bits, decoded_and_verified, rand_bf16, rel, rows,
                         untied_logits)

pytestmark = pytest.mark.gpu

TOL = 2e-2  # logits, as tests/gpu/test_cuda_engine.py
ROUTE_TIE = 1e-2  # a CPU routing gap below this may flip on the GPU
BASE = dict(vocab_size=1003, hidden_size=256, intermediate_size=344, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
            dtype="bfloat16")
ARCHS = {
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=128, num_experts=16, num_experts_per_tok=4,
                      moe_intermediate_size=128, norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96,
                      shared_expert_intermediate_size=192, norm_topk_prob=False),
    "mixtral": dict(model_type="mixtral", num_attention_heads=8, head_dim=32, num_local_experts=8,
                    num_experts_per_tok=2, sliding_window=None),
    "qwen3_next_512": dict(model_type="qwen3_next", head_dim=256, tie_word_embeddings=False,
                           layer_types=["linear_attention", "full_attention", "linear_attention"],
                           linear_conv_kernel_dim=4, linear_num_key_heads=2, linear_num_value_heads=4,
                           linear_key_head_dim=128, linear_value_head_dim=128,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
                           num_experts=512, num_experts_per_tok=10, moe_intermediate_size=64,
                           shared_expert_intermediate_size=128, norm_topk_prob=True, decoder_sparse_step=1,
                           mlp_only_layers=[1]),
}


# -- kernels ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_kernels(kernels):
    from metrale_cli.backends.cuda.kernels.moe import MoeKernels

    return MoeKernels(kernels)


def _route(cp, mk, logits, x, norm_w_bits, spec: MoeSpec, eps=1e-5, norm_offset=0.0, held=None):
    from metrale_cli.backends.cuda.kernels.moe import RouteBuffers

    b = RouteBuffers.allocate(cp, spec.num_experts, spec.top_k, x.shape[1])
    mk.route(cp.asarray(logits), cp.asarray(x), cp.asarray(norm_w_bits), eps, spec.num_experts, spec.top_k,
             spec.norm_topk_prob, bool(spec.shared_expert_size), b, norm_offset=norm_offset, held=held)
    cp.cuda.Device().synchronize()
    return b


def _np_choice(logits, spec: MoeSpec):
    probs = np_ops.softmax(logits[:, :spec.num_experts])
    idx = np_routers.top_k(probs, spec.top_k)
    w = np.take_along_axis(probs, idx, -1)
    if spec.norm_topk_prob:
        w = w / w.sum(-1, keepdims=True)
    return idx, w


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 16])
@pytest.mark.parametrize("experts, k, norm, shared", [(8, 2, True, False), (16, 4, False, True), (128, 8, True, False),
                                                      (60, 4, False, True), (256, 16, True, False),
                                                      (512, 10, True, True), (1024, 16, True, False)])
def test_route_kernel_matches_numpy(cp, moe_kernels, rng, seed, m, experts, k, norm, shared):
    """(512, 10) with the gated shared expert's logit last: Qwen3-Next; 1024 x 16 rows: 64 KiB of staged logits."""
    spec = MoeSpec(experts, k, 64, norm, "silu", 64 if shared else None)
    hidden = 512
    logits = untied_logits(rng, m, experts, k, extra=int(shared))
    x = rng.standard_normal((m, hidden)).astype(np.float32)
    nb, nw = rand_bf16(rng, (hidden,), 0.3)
    b = _route(cp, moe_kernels, logits, x, nb, spec)
    idx, w = _np_choice(logits, spec)
    np.testing.assert_array_equal(b.idx[:m].get(), idx, err_msg=f"seed={seed}")
    np.testing.assert_allclose(b.wts[:m].get(), w, rtol=1e-6, atol=1e-7, err_msg=f"seed={seed}")
    if shared:
        np.testing.assert_allclose(b.sgate[:m].get(), np_ops.sigmoid(logits[:, -1]), rtol=1e-6)
    np.testing.assert_allclose(b.h[:m].get(), rms_norm(x, nw, 1e-5), rtol=1e-5, atol=1e-6)
    # the (1 + w) norms of qwen3_next's sparse layers: h scaled by 1 + w, the routing unchanged
    b1 = _route(cp, moe_kernels, logits, x, nb, spec, norm_offset=1.0)
    np.testing.assert_array_equal(b1.idx[:m].get(), idx, err_msg=f"seed={seed}")
    np.testing.assert_allclose(b1.h[:m].get(), rms_norm(x, nw + np.float32(1.0), 1e-5), rtol=1e-5, atol=1e-6)
    # the union: every chosen expert once, increasing, with its rows and slots
    assert_union(b, idx, seed)
    # a tensor-parallel rank's experts (bounds off the bitmap's 32-expert words): the same routing over all E, the
    # union of the held experts only
    held = range(experts // 3 + 5, 2 * experts // 3 + 3)
    bh = _route(cp, moe_kernels, logits, x, nb, spec, held=held)
    np.testing.assert_array_equal(bh.idx[:m].get(), idx, err_msg=f"seed={seed}")
    assert_union(bh, idx, seed, held)


def test_route_ties_go_to_the_lowest_index_and_nan_stays_nan(cp, moe_kernels, rng):
    spec = MoeSpec(32, 4, 64, True)
    logits = np.zeros((3, 32), np.float32)
    logits[1, [5, 9, 20, 30]] = 1.0
    logits[1, [3, 7]] = 1.0  # six equal maxima: 3, 5, 7, 9 win
    logits[2, 4] = np.nan
    x = rng.standard_normal((3, 64)).astype(np.float32)
    b = _route(cp, moe_kernels, logits, x, bf16_bits(np.ones(64)), spec)
    idx = b.idx[:3].get()
    np.testing.assert_array_equal(idx[0], [0, 1, 2, 3])
    np.testing.assert_array_equal(idx[1], [3, 5, 7, 9])
    assert np.all((idx[2] >= 0) & (idx[2] < 32)) and len(set(idx[2])) == 4  # valid, distinct experts
    assert np.all(np.isnan(b.wts[2].get()))  # the NaN reaches the output, never a wrong index


def _expert_weights(rng, experts, inter, hidden):
    gu_b, gu = rand_bf16(rng, (experts, 2 * inter, hidden), hidden ** -0.5)
    dn_b, dn = rand_bf16(rng, (experts, hidden, inter), inter ** -0.5)
    return gu_b, gu, dn_b, dn


@pytest.mark.parametrize("m", [1, 2, 4, 7, 16])
@pytest.mark.parametrize("experts, k, shared, inter, s", [(8, 2, False, 96, 160), (16, 8, True, 96, 160),
                                                          (64, 4, False, 96, 160), (8, 2, True, 1032, 2056),
                                                          (512, 10, True, 64, 128), (1024, 16, False, 64, 160)])
def test_expert_kernels_match_numpy(cp, moe_kernels, rng, seed, m, experts, k, shared, inter, s):
    """(8, 2, 1032) splits each expert's down rows into K parts (kernels.moe.down_parts: 4 parts, the
    shared expert 8; 1032 and 2056 leave partial chunk steps at the parts' ends); (512, 10): Qwen3-Next's
    experts; (1024, 16) with 16 rows: a union of up to MOE_MAX_UNION (256) experts."""
    from metrale_cli.backends.cuda.kernels.moe import down_parts

    assert inter < 256 or down_parts(experts, k, inter, s if shared else 0) == (4, 8 if shared else 0)
    hidden = 256
    spec = MoeSpec(experts, k, inter, True, "silu", s if shared else None)
    logits = (rng.standard_normal((m, experts + shared)) * 2).astype(np.float32)
    x = rng.standard_normal((m, hidden)).astype(np.float32)
    nb, nw = rand_bf16(rng, (hidden,), 0.3)
    gu_b, gu, dn_b, dn = _expert_weights(rng, experts, inter, hidden)
    b = _route(cp, moe_kernels, logits, x, nb, spec)
    act = cp.full((16 * k, inter), np.nan, cp.float32)
    moe_kernels.gate_up(m, cp.asarray(gu_b), b, act)
    h = b.h[:m].get()
    route = Route(None, b.idx[:m].get(), b.wts[:m].get())  # the GPU's choice (checked above against NumPy's)
    ref = np_moe.experts(h, route, gu, dn, np_ops.glu('silu'))
    shared_arg = None
    if shared:
        sgu_b, sgu = rand_bf16(rng, (2 * s, hidden), hidden ** -0.5)
        sdn_b, sdn = rand_bf16(rng, (hidden, s), s ** -0.5)
        act_s = np_moe.gated(h, sgu, np_ops.glu('silu'))
        ref = ref + b.sgate[:m].get()[:, None] * (act_s @ sdn.T)
        shared_arg = (cp.asarray(sdn_b), cp.asarray(act_s))
    base = rng.standard_normal((m, hidden)).astype(np.float32)
    out = cp.asarray(base)
    moe_kernels.down(m, cp.asarray(dn_b), b, act, out, shared=shared_arg, accumulate=True)
    fresh = cp.full((m, hidden), np.nan, cp.float32)
    moe_kernels.down(m, cp.asarray(dn_b), b, act, fresh, shared=shared_arg, accumulate=False)
    y = fresh.get()
    err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert err <= 1e-5, f"seed={seed}: experts rel err {err:.2e}"
    np.testing.assert_allclose(out.get(), base + y, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("m", [2, 5, 16])
@pytest.mark.parametrize("k, inter", [(4, 96), (2, 1032)])
def test_a_row_does_not_depend_on_the_other_rows(cp, moe_kernels, rng, m, k, inter):
    """Row r of an M-row call equals, bit for bit, the 1-row call on row r (decode == verify rows), also
    when the down kernel splits the experts' rows into K parts."""
    experts, hidden = 16, 256
    spec = MoeSpec(experts, k, inter, False)
    logits = rng.standard_normal((m, experts)).astype(np.float32)
    x = rng.standard_normal((m, hidden)).astype(np.float32)
    nb, _ = rand_bf16(rng, (hidden,), 0.3)
    gu_b, _, dn_b, _ = _expert_weights(rng, experts, inter, hidden)
    gu_d, dn_d = cp.asarray(gu_b), cp.asarray(dn_b)

    def run(rows):
        b = _route(cp, moe_kernels, logits[rows], x[rows], nb, spec)
        act = cp.zeros((16 * k, inter), cp.float32)
        out = cp.zeros((len(rows), hidden), cp.float32)
        moe_kernels.gate_up(len(rows), gu_d, b, act)
        moe_kernels.down(len(rows), dn_d, b, act, out, accumulate=False)
        return out.get()

    full = run(list(range(m)))
    for r in (0, m - 1):
        assert np.array_equal(full[r], run([r])[0])


def test_unchosen_experts_are_never_used(cp, moe_kernels, rng):
    experts, k, hidden, inter, m = 32, 2, 256, 96, 4
    spec = MoeSpec(experts, k, inter, True)
    logits = rng.standard_normal((m, experts)).astype(np.float32)
    x = rng.standard_normal((m, hidden)).astype(np.float32)
    nb, _ = rand_bf16(rng, (hidden,), 0.3)
    gu_b, _, dn_b, _ = _expert_weights(rng, experts, inter, hidden)
    b = _route(cp, moe_kernels, logits, x, nb, spec)
    chosen = set(b.idx[:m].get().ravel().tolist())
    outs = []
    for poison in (False, True):
        g, d = gu_b.copy(), dn_b.copy()
        if poison:
            for e in set(range(experts)) - chosen:
                g[e] = 0x7FC0
                d[e] = 0x7FC0
        act = cp.zeros((16 * k, inter), cp.float32)
        out = cp.zeros((m, hidden), cp.float32)
        moe_kernels.gate_up(m, cp.asarray(g), b, act)
        moe_kernels.down(m, cp.asarray(d), b, act, out, accumulate=False)
        outs.append(out.get())
    assert len(chosen) < experts and np.all(np.isfinite(outs[1]))
    assert np.array_equal(outs[0], outs[1])


def test_moe_launches_replay_in_a_graph(cp, moe_kernels, rng):
    """route + gate_up + down captured once, replayed on new logits and x: equal to eager launches."""
    from metrale_cli.backends.cuda.kernels.moe import RouteBuffers

    experts, k, hidden, inter, m = 16, 4, 256, 96, 3
    spec = MoeSpec(experts, k, inter, True)
    nb, _ = rand_bf16(rng, (hidden,), 0.3)
    gu_b, _, dn_b, _ = _expert_weights(rng, experts, inter, hidden)
    gu_d, dn_d, nw = cp.asarray(gu_b), cp.asarray(dn_b), cp.asarray(nb)
    logits, x = cp.zeros((m, experts), cp.float32), cp.zeros((m, hidden), cp.float32)
    b = RouteBuffers.allocate(cp, experts, k, hidden)
    act, out = cp.zeros((16 * k, inter), cp.float32), cp.zeros((m, hidden), cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)

    def body():
        moe_kernels.route(logits, x, nw, 1e-5, experts, k, True, False, b, stream=stream)
        moe_kernels.gate_up(m, gu_d, b, act, stream=stream)
        moe_kernels.down(m, dn_d, b, act, out, accumulate=False, stream=stream)

    cp.cuda.Device().synchronize()
    stream.begin_capture()
    body()
    graph = stream.end_capture()
    for _ in range(3):
        logits[:] = cp.asarray(rng.standard_normal((m, experts)).astype(np.float32))
        x[:] = cp.asarray(rng.standard_normal((m, hidden)).astype(np.float32))
        cp.cuda.Device().synchronize()
        graph.launch(stream=stream)
        stream.synchronize()
        replayed = out.get()
        body()
        stream.synchronize()
        assert np.array_equal(replayed, out.get())


# -- engines ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    seed = int(np.random.default_rng().integers(2**31))
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for name, extra in ARCHS.items():
        raw = {**BASE, **extra}
        src = RandomTensors(parse_config(raw), seed=seed)
        d = root / name
        d.mkdir()
        save_file({n: np.asarray(src.array(n), dtype=np.float32).astype(ml_dtypes.bfloat16)
                   for n in src.tensor_names()}, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(raw))
        out[name] = d
    print(f"MoE checkpoints drawn with seed {seed}")
    return out


def pair(path, ctx: int = 160):
    return (open_model(path, device="cpu", max_context=ctx, fp32_logits=True).engine,
            open_model(path, device="cuda", max_context=ctx, fp32_logits=True).engine)


def trace(e, chunks) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per sparse layer (chosen experts [T, k], router logits [T, E]) of `chunks` run from position 0,
    each chunk one pass (the kernels of the pass that chunk stands for)."""
    got: dict[str, list] = {}

    def tap(name, x):
        if ".mlp.gate" in name:
            got.setdefault(name, []).append(np.array(x))

    e.reset()
    for c in chunks:
        with tapping(e, tap):
            e.prefill(list(c))
    layers = sorted({int(n.split(".")[2]) for n in got})
    return {i: (np.concatenate(got[f"model.layers.{i}.mlp.gate.top_k_index"]),
                np.concatenate(got[f"model.layers.{i}.mlp.gate"])) for i in layers}


def first_flip(cpu, gpu, spec: MoeSpec, seed) -> int:
    """The first row whose expert set differs in some layer (the row count when none).  A differing decision
    whose inputs were still alike (no flip in an earlier layer at this row or before: a row attends to the rows
    before it) must be a near tie in the CPU's probabilities; past such a flip a row's inputs differ and it may route
    apart at any gap (the first version asserted on those too: a mixtral verify failed at layer 2 row 7, gap 0.038)."""
    first = None
    for i in sorted(cpu):
        ci, cl = cpu[i]
        gi = gpu[i][0]
        flipped = None  # this layer's first flip: it changes the later layers' inputs only
        for t in range(len(ci)):
            if set(ci[t]) != set(gi[t]):
                if first is None or t < first:
                    p = np.sort(np_ops.softmax(cl[t:t + 1])[0])[::-1]
                    gap = p[spec.top_k - 1] - p[spec.top_k]
                    assert gap < ROUTE_TIE, f"seed={seed}: layer {i} row {t} routed differently with CPU gap {gap:.3g}"
                flipped = t if flipped is None else min(flipped, t)
        if flipped is not None:
            first = flipped if first is None else min(first, flipped)
    n = len(next(iter(cpu.values()))[0])
    if first is not None:
        print(f"routing differs first at row {first} of {n} (a near tie)")
    return n if first is None else first


def _spec(e) -> MoeSpec:
    return next(layer.mlp for layer in e.cfg.definition.layers if isinstance(layer.mlp, MoeSpec))


def prefill_err(cpu, gpu, plen: int, rng, seed, comparable=None) -> tuple[float, int]:
    """(rel err of the GPU's prefill logits against the CPU's over the rows before the first routing flip, those rows)
    of a random prompt of plen tokens; a prompt whose first row flips (a near tie, checked) is redrawn, up to four.
    comparable(cpu, gpu, prompt) -> rows: another rule for the rows to compare (default: first_flip of the traces)."""
    for _ in range(4):
        prompt = [int(t) for t in rng.integers(0, cpu.vocab_size(), plen)]
        n = (comparable(cpu, gpu, prompt) if comparable is not None
             else first_flip(trace(cpu, [prompt]), trace(gpu, [prompt]), _spec(cpu), seed))
        if n > 0:
            break
    assert n > 0, f"seed={seed}: four prompts in a row routed differently from their first row"
    cpu.reset()
    gpu.reset()
    cpu.prefill(prompt, all_logits=True)
    gpu.prefill(prompt, all_logits=True)
    return rel(rows(gpu, gpu.logits_buffer_ptr(), plen)[:n], rows(cpu, cpu.logits_buffer_ptr(), plen)[:n]), n


@pytest.mark.parametrize("name", list(ARCHS))
@pytest.mark.parametrize("plen", [5, 16, 40])  # 5, 16: the graph rows path; 40: the cuBLAS prefill path
def test_moe_prefill_parity(cp, checkpoints, name, plen, rng, seed):
    err, n = prefill_err(*pair(checkpoints[name]), plen, rng, seed)
    print(f"{name} prefill T={plen}: rel err {err:.2e} over {n} rows")
    assert err <= TOL, f"seed={seed}"


@pytest.mark.parametrize("name", list(ARCHS))
def test_moe_router_taps_match_cpu(cp, checkpoints, name, rng, seed):
    cpu, gpu = pair(checkpoints[name])
    prompt = [int(t) for t in rng.integers(0, cpu.vocab_size(), 12)]
    c, g = trace(cpu, [prompt]), trace(gpu, [prompt])
    n = first_flip(c, g, _spec(cpu), seed)
    # The first sparse layer's router sees the same inputs on every row; a later layer's only on the rows
    # before the first routing flip (a near tie, checked by first_flip), which changes what follows.
    first = min(c)
    assert rel(g[first][1], c[first][1]) <= TOL, f"seed={seed}: layer {first} router logits"
    for i in sorted(c)[1:]:
        if n:
            assert rel(g[i][1][:n], c[i][1][:n]) <= TOL, f"seed={seed}: layer {i} router logits"


def check_verify(cpu, gpu, prompt: list[int], drafts: list[int], seed) -> None:
    """The GPU's verify of `drafts` after `prompt` equals its sequential decode within 1e-3 (the router GEMV differs by
    its row count only), and the CPU's verify over the rows before the first routing flip within TOL."""
    seq, ver = decoded_and_verified(gpu, prompt, drafts)
    assert rel(ver, seq) <= 1e-3, f"seed={seed}"
    n = first_flip(trace(cpu, [prompt, drafts]), trace(gpu, [prompt, drafts]), _spec(gpu), seed) - len(prompt)
    if n > 0:
        cpu.reset()
        cpu.prefill(prompt)
        cpu.verify(drafts)
        assert rel(ver[:n], rows(cpu, cpu.logits_buffer_ptr(), len(drafts))[:n]) <= TOL, f"seed={seed}"


def greedy_err(cpu, gpu, prompt: list[int], steps: int, seed) -> tuple[float, int, int]:
    """(rel err of the GPU's greedy decode rows against the CPU's, the tokens equal before the first difference, the
    rows compared) of `steps` greedy steps after `prompt`. The routing of the common tokens is traced pass by pass as
    decode ran them (prompt, then one token a step): row i comes from the pass at position len(prompt) - 1 + i and
    is comparable while every position up to it routed alike. A token that differs with the same routing must be a
    logits near tie."""
    a = decoding.run_decode(cpu, prompt, steps, keep_rows=True)
    b = decoding.run_decode(gpu, prompt, steps, keep_rows=True)
    ta, tb = [s.token for s in a.steps], [s.token for s in b.steps]
    same = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
    chunks = [prompt] + [[t] for t in ta[:same]]
    first = first_flip(trace(cpu, chunks), trace(gpu, chunks), _spec(cpu), seed)
    n = max(0, min(first - len(prompt) + 1, len(ta)))
    if same < len(ta) and n == same + 1:
        assert_near_tie(a.rows.array()[same], f"seed={seed}: token {same}")
    return (rel(b.rows.array()[:n], a.rows.array()[:n]) if n else 0.0), same, n


@pytest.mark.parametrize("name", list(ARCHS))
def test_moe_greedy_32_steps(cp, checkpoints, name, rng, seed):
    cpu, gpu = pair(checkpoints[name])
    prompt = [int(t) for t in rng.integers(0, cpu.vocab_size(), 12)]
    err, same, n = greedy_err(cpu, gpu, prompt, 32, seed)
    print(f"{name}: {same} greedy tokens equal of 32, rel err over {n} rows {err:.2e}")
    assert err <= TOL, f"seed={seed}"


@pytest.mark.parametrize("name", list(ARCHS))
@pytest.mark.parametrize("k", [2, 4, 8])
def test_moe_verify_equals_sequential_and_trim(cp, checkpoints, name, k, rng, seed):
    cpu, gpu = pair(checkpoints[name])
    prompt = [int(t) for t in rng.integers(0, gpu.vocab_size(), 9)]
    drafts = [int(t) for t in rng.integers(0, gpu.vocab_size(), k)]
    # rows of the verify pass choose different experts
    g = trace(gpu, [prompt, drafts])
    spec = _spec(gpu)
    assert any(len({tuple(sorted(r)) for r in idx[len(prompt):]}) > 1 for idx, _ in g.values()), f"seed={seed}"
    seq, ver = decoded_and_verified(gpu, prompt, drafts)
    # the same kernels on the same rows (the router GEMV differs by its row count only)
    assert rel(ver, seq) <= 1e-3, f"seed={seed}"
    n = first_flip(trace(cpu, [prompt, drafts]), g, spec, seed) - len(prompt)
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
    assert rel(rows(gpu, gpu.decode_logits_ptr(), 1), rows(fresh, fresh.decode_logits_ptr(), 1)) <= 1e-3


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe", "qwen3_next_512"])
def test_moe_graph_replay_equals_eager(cp, checkpoints, name, rng):
    path = checkpoints[name]
    g = open_model(path, device="cuda", max_context=64, fp32_logits=True).engine
    e = open_model(path, device="cuda", max_context=64, fp32_logits=True).engine
    e.use_graphs = False
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
        r.append(rows(eng, eng.logits_buffer_ptr(), 4).tobytes())
        out.append(r)
    assert len(g.graphs) >= 2 and not len(e.graphs)
    assert out[0] == out[1]


def test_moe_bench_floor_on_gpu(cp, checkpoints, tmp_path):
    """The bench on a small MoE config: the floor counts only the chosen experts (one row: exactly top_k)."""
    from metrale_cli.bench import run_bench

    raw = {**BASE, **ARCHS["qwen3_moe"]}
    (tmp_path / "tiny-moe.json").write_text(json.dumps(raw))
    r = run_bench(str(tmp_path / "tiny-moe.json"), device="cuda", context=64, ks=(4,), prefill_tokens=64,
                  repeats=5, with_transformers=False)
    assert r.get("experts read by the decode step").value == pytest.approx(100 * 4 / 16)
    assert r.get("decode step").value > 0 and r.get("verify k=4 floor").value >= r.get("decode floor").value
