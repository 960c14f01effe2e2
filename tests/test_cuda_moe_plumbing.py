"""The CUDA engine's sparse layers (backends/cuda/moe_passes.py) on the CPU, with the MoE kernels replaced by
NumPy implementations of their documented contracts (kernels/moe.py), each call bound against the real
`MoeKernels` method's signature: the router kind, its groups, choice correction (kept fp32 on the device),
routed_scaling_factor and the ungated shared expert reach the kernels, on the glm4_moe fixture (and the
DeepSeek fixtures in tests/test_cuda_mla_plumbing.py) against the NumPy engine; gpt-oss's router bias, topk_softmax
routing, clamped-SwiGLU experts with biases and attention sinks on its two fixtures (bf16 and MXFP4 experts).  Not a test of a kernel:
tests/gpu/test_moe_cuda.py and tests/gpu/test_mla_cuda.py are."""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import numpy as np
import pytest

from test_cuda_plumbing import FIXTURES, TOL, bf16, f32, fake_engine, glu, rel, rows

moe_kernels = pytest.importorskip("metrale_cli.backends.cuda.kernels.moe")
from metrale_cli.backends.cuda import moe_passes  # noqa: E402
from metrale_cli.backends.cuda.projections import Projections  # noqa: E402
from metrale_cli.backends.numpy.routers import ROUTERS  # noqa: E402


def expert_f32(w, e: int | None = None) -> np.ndarray:
    """Weight w (expert e of stacked experts) as the kernels read it, in fp32: bf16 bits widened, FP8 experts /
    an FP8 shared weight (kernels/moe.expert_format "fp8") as each e4m3 value times its block's fp32 scale, MXFP4
    experts ("mxfp4") as each e2m1 value times 2^(E8M0 scale - 127); the checks of the wrapper's kept (K and the block
    width multiples of the format's chunk)."""
    fmt = moe_kernels.expert_format(w)
    if fmt == "bf16":
        return f32(w if e is None else w[e])
    import ml_dtypes

    data, scale = (w.data, w.scale) if e is None else (w.data[e], w.scale[e])
    if fmt == "mxfp4":
        from metrale_cli.models.quantized import mxfp4

        n, half = data.shape
        assert data.dtype == np.uint8 and scale.dtype == np.uint8 and scale.shape == (n, 2 * half // 32)
        assert (w.srow, w.bk) == (1, 32)
        return mxfp4.dequantize(np.asarray(data).reshape(n, -1, 16), np.asarray(scale))
    n, k = data.shape
    assert data.dtype == np.uint8 and k % 16 == 0 and w.bk % 16 == 0
    assert scale.shape == (-(-n // w.srow), -(-k // w.bk)) and scale.dtype == np.float32
    q = np.asarray(data).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return q * np.repeat(np.repeat(np.asarray(scale), w.srow, 0)[:n], w.bk, 1)[:, :k]


class FakeMoeKernels:
    """kernels/moe.MoeKernels' contracts in NumPy (the union is not kept: gate_up / down read idx and wts); bf16, FP8
    or MXFP4 experts (expert_f32), an FP8 shared expert with FP8 experts only."""

    def __init__(self, kern):
        self.k = kern
        self.calls: list[tuple[str, dict]] = []

    def __getattribute__(self, name):
        real = getattr(moe_kernels.MoeKernels, name, None)
        attr = object.__getattribute__(self, name)
        if callable(real) and not name.startswith("_") and callable(attr) and name != "check_sizes":
            sig = inspect.signature(real)

            def checked(*args, **kwargs):
                bound = sig.bind(None, *args, **kwargs)
                object.__getattribute__(self, "calls").append((name, dict(bound.arguments)))
                return attr(*args, **kwargs)
            return checked
        return attr

    @staticmethod
    def _choose(logits, experts, top_k, norm_topk, router, correction):
        from metrale_cli.models.spec import MoeSpec, RouterSpec

        router = router or RouterSpec()
        moe_kernels.router_args(np, router, experts, correction, None)  # the wrapper's checks
        spec = MoeSpec(experts, top_k, 8, norm_topk, router=router)
        corr = None if correction is None else np.asarray(correction, np.float32)
        idx, w = ROUTERS[router.kind](np.asarray(logits[:, :experts], np.float32), spec, corr)
        if norm_topk:
            d = w.sum(-1, keepdims=True)
            w = w / (d + np.float32(1e-20) if router.kind == "sigmoid_biased_grouped" else d)
        return idx, w * np.float32(router.routed_scaling_factor)

    def _gate(self, logits, experts, has_shared, shared_gated, n):
        if not has_shared:
            return np.zeros(n, np.float32)
        if not shared_gated:
            return np.ones(n, np.float32)
        return 1 / (1 + np.exp(-np.asarray(logits[:, experts], np.float32)))

    def route(self, logits, x, norm_w, eps, experts, top_k, norm_topk, has_shared, b, *, held=None, norm_offset=0.0,
              router=None, correction=None, shared_gated=True, stream=None):
        m = logits.shape[0]
        assert logits.shape[1] == experts + (1 if has_shared and shared_gated else 0)
        if correction is not None:
            assert correction.dtype == np.float32  # kept fp32 on the device (loading.FP32_KEYS)
        idx, w = self._choose(logits, experts, top_k, norm_topk, router, correction)
        b.idx[:m], b.wts[:m] = idx, w
        b.sgate[:m] = self._gate(logits, experts, has_shared, shared_gated, m)
        b.h[:m] = self.k._normed(x, norm_w, eps, norm_offset)

    def topk_rows(self, logits, experts, top_k, norm_topk, has_shared, idx, wts, sgate, *, router=None,
                  correction=None, shared_gated=True, stream=None):
        i, w = self._choose(logits, experts, top_k, norm_topk, router, correction)
        idx[...], wts[...] = i, w
        sgate[...] = self._gate(logits, experts, has_shared, shared_gated, logits.shape[0])

    def gate_up(self, m, w_gate_up, b, act, *, first=0, bias=None, activation="silu", limit=None, alpha=1.702,
                stream=None):
        k = b.idx.shape[1]
        moe_kernels._activation(activation, limit)  # the wrapper's checks
        for r in range(m):
            for j in range(k):
                e = b.idx[r, j] - first
                gu = expert_f32(w_gate_up, e) @ b.h[r] + (0 if bias is None else f32(bias[e]))
                act[r * k + j] = glu(gu[None], activation, limit, alpha)[0]

    def down(self, m, w_down, b, act, out, *, shared=None, accumulate, first=0, bias=None, stream=None):
        k = b.idx.shape[1]
        if shared is not None and moe_kernels.is_fp8(shared[0]):
            assert moe_kernels.is_fp8(w_down), "an FP8 shared expert with bf16 experts (the wrapper refuses it)"
        y = np.zeros((m, w_down.shape[1]), np.float32)
        for r in range(m):
            for j in np.argsort(b.idx[r]):  # experts in increasing order, each with its bias before its weight
                e = b.idx[r, j] - first
                y[r] += b.wts[r, j] * (expert_f32(w_down, e) @ act[r * k + j] + (0 if bias is None else f32(bias[e])))
            if shared is not None:
                y[r] += b.sgate[r] * (expert_f32(shared[0]) @ shared[1][r])
        out[...] = out + y if accumulate else y


    def dequant_bf16(self, w, expert, out, *, stream=None):
        assert moe_kernels.expert_format(w) in moe_kernels.DEQUANT_FORMATS
        out[...] = bf16(expert_f32(w, expert))


def _fake_gemm_experts(self, xb, w, rows, out, used=None):
    for e in range(w.shape[0]) if used is None else [e for e, _ in used]:
        out[e * rows:(e + 1) * rows] = f32(xb[e * rows:(e + 1) * rows]) @ f32(w[e]).T
    return out


@contextmanager
def fake_moe():
    orig = moe_passes.MoeKernels, Projections.gemm_experts
    moe_passes.MoeKernels = FakeMoeKernels
    Projections.gemm_experts = _fake_gemm_experts
    try:
        yield
    finally:
        moe_passes.MoeKernels, Projections.gemm_experts = orig


def cpu_engine(name: str, ctx: int = 64):
    """The NumPy engine on the weights the CUDA engine holds: bf16-rounded, the router's correction and the attention
    sinks kept fp32 (loading.FP32_KEYS)."""
    from metrale_cli.backends.cuda.loading import FP32_KEYS
    from metrale_cli.backends.numpy.engine import NumpyEngine, read_weights
    from metrale_cli.checkpoint import Checkpoint
    from metrale_cli.config import load_config

    cfg = load_config(FIXTURES / name)
    w = read_weights(cfg, Checkpoint.open(FIXTURES / name))
    # fp32 tensors rounded; bf16 ones (read as their bits) and stored formats (dequantized exactly) as they are
    r = lambda a: f32(bf16(a)) if getattr(a, "dtype", None) == np.float32 else a  # noqa: E731
    w.embed, w.final_norm, w.lm_head = r(w.embed), r(w.final_norm), r(w.lm_head)
    w.layers = [{k: v if k in FP32_KEYS else r(v) for k, v in lw.items()} for lw in w.layers]
    return NumpyEngine(cfg, w, ctx, fp32_logits=True)


def routing(e, fn) -> np.ndarray:
    """The chosen experts [layers, T, k] (sorted per row) of the sparse layers while fn() runs on engine e."""
    from metrale_cli.engine.observe import tapping

    got = []
    with tapping(e, lambda name, x: got.append(np.sort(np.array(x), -1)) if name.endswith("top_k_index") else None):
        fn()
    return np.stack(got)


def first_flip(a: np.ndarray, b: np.ndarray) -> int:
    """The first row whose experts differ in some sparse layer (the row count when none): the bf16 KV cache
    moves the router's inputs by ~1e-3, which flips a near tie, and a flipped row differs by much more."""
    differ = np.nonzero((a != b).any(axis=(0, 2)))[0]
    return int(differ[0]) if len(differ) else a.shape[1]


def run_both(name, plen, steps=8, fakes=fake_moe):
    """(prefill rel err over the rows before the first routing flip, decode rel err likewise, the calls of the MoE,
    MLA and other kernels)
    of the CUDA engine's Python side against the NumPy engine; a prompt whose first row flips is redrawn."""
    rng = np.random.default_rng()
    for _ in range(6):
        prompt = [int(t) for t in rng.integers(0, 300, plen)]
        cpu = cpu_engine(name)
        with fakes(), fake_engine(name) as gpu:
            ra = routing(gpu, lambda: gpu.prefill(prompt, all_logits=True))
            rb = routing(cpu, lambda: cpu.prefill(prompt, all_logits=True))
            n = first_flip(ra, rb)
            if n == 0:
                continue
            err = rel(rows(gpu, gpu.logits_buffer_ptr(), plen)[:n], rows(cpu, cpu.logits_buffer_ptr(), plen)[:n])
            a, b = [], []
            for t in [int(t) for t in rng.integers(0, 300, steps)] if n == plen else []:
                ga = routing(gpu, lambda: gpu.decode(t))
                ca = routing(cpu, lambda: cpu.decode(t))
                if first_flip(ga, ca) == 0:
                    break
                a.append(rows(cpu, cpu.decode_logits_ptr(), 1)[0])
                b.append(rows(gpu, gpu.decode_logits_ptr(), 1)[0])
            calls = (list(gpu.moe.kern.calls) + (list(gpu.states["mla"].kern.calls) if "mla" in gpu.states else [])
                     + [(n, {}) for n in gpu.kern.calls])
        return err, (rel(np.stack(b), np.stack(a)) if a else 0.0), calls
    raise AssertionError("six prompts in a row routed differently from their first row")


@pytest.mark.parametrize("plen", [12, 20])  # the rows path (<= 16 rows) and the prefill path
def test_glm4_moe_routing_reaches_the_kernels_and_matches_the_numpy_engine(plen):
    err, derr, calls = run_both("glm4_moe", plen)
    print(f"glm4_moe T={plen}: prefill {err:.2e}, decode {derr:.2e}")
    assert err < TOL and derr < TOL
    routes = [a for n, a in calls if n in ("route", "topk_rows")]
    assert routes and all(a["router"].kind == "sigmoid_biased_grouped" and a["correction"] is not None
                          and a["shared_gated"] is False for a in routes)
    # the rows path's route kernel and experts, or the prefill's top-k (decode steps may follow it, after a routing
    # flip they are not run)
    assert {n for n, _ in calls} >= ({"topk_rows"} if plen > 16 else {"route", "gate_up", "down"})


def test_the_correction_stays_fp32_on_the_device():
    with fake_moe(), fake_engine("glm4_moe") as gpu:
        sparse = [lw for lw in gpu.w.layers if "router_correction" in lw]
        assert sparse and all(lw["router_correction"].dtype == np.float32 for lw in sparse)
        assert all(lw["router"].dtype == np.uint16 for lw in sparse)  # the rest stays bf16


@pytest.mark.parametrize("kind,groups", [("softmax_topk", (1, 1)), ("sigmoid_biased_grouped", (4, 2)),
                                         ("softmax_group_limited", (8, 3))])
def test_router_args_follow_the_kind(kind, groups):
    from metrale_cli.models.spec import RouterSpec

    r = RouterSpec(kind, n_group=groups[0], topk_group=groups[1], routed_scaling_factor=2.5)
    corr = np.zeros(64, np.float32) if kind == "sigmoid_biased_grouped" else None
    args = moe_kernels.router_args(np, r, 64, corr, "dummy")
    assert [int(args[0]), int(args[1]), int(args[2]), float(args[3]), int(args[5])] == [
        moe_kernels.ROUTER_KINDS[kind], *(groups if kind != "softmax_topk" else (1, 1)), 2.5, corr is not None]
    if kind != "softmax_topk":
        with pytest.raises(ValueError, match="groups"):
            moe_kernels.router_args(np, RouterSpec(kind, n_group=64, topk_group=2), 4096, None, "dummy")
    assert moe_kernels.MoeKernels.check_sizes(64, 4, 8, n_group=33).startswith("n_group 33")


def _record_sinks(monkeypatch):
    """The sinks each fake attention call received (FakeKernels._attend, which decode and prefill both call)."""
    import test_cuda_plumbing

    seen = []
    attend = test_cuda_plumbing.FakeKernels._attend

    def recording(self, q, k_cache, v_cache, positions, scale, window, softcap, sinks=None):
        seen.append((window, None if sinks is None else np.array(sinks)))
        return attend(self, q, k_cache, v_cache, positions, scale, window, softcap, sinks)

    monkeypatch.setattr(test_cuda_plumbing.FakeKernels, "_attend", recording)
    return seen


@pytest.mark.parametrize("name", ["gpt_oss", "gpt_oss_mxfp4"])  # bf16 experts; MXFP4 experts read as stored
@pytest.mark.parametrize("plen", [12, 20])  # the rows path (<= 16 rows) and the prefill path
def test_gpt_oss_reaches_the_kernels_and_matches_the_numpy_engine(name, plen, monkeypatch):
    """The router bias (in the logits both paths route on), topk_softmax, the experts' biases and swiglu_oai with
    the spec's limit and alpha, and every layer's sinks (fp32 [heads]) with its window: the logits match the NumPy
    engine's over prefill and decode rows."""
    from metrale_cli.config import load_config

    sinks = _record_sinks(monkeypatch)
    err, derr, calls = run_both(name, plen)
    print(f"{name} T={plen}: prefill {err:.2e}, decode {derr:.2e}")
    assert err < TOL and derr < TOL
    spec = load_config(FIXTURES / name).moe.spec
    routes = [a for n, a in calls if n in ("route", "topk_rows")]
    assert routes and all(a["router"].kind == "topk_softmax" and a["norm_topk"] is False for a in routes)
    if plen <= 16:
        gate_up = [a for n, a in calls if n == "gate_up"]
        down = [a for n, a in calls if n == "down"]
        assert gate_up and all(a["bias"] is not None and a["activation"] == "swiglu_oai"
                               and a["limit"] == spec.swiglu_limit and a["alpha"] == spec.swiglu_alpha
                               for a in gate_up)
        assert down and all(a["bias"] is not None for a in down)
    else:
        assert "swiglu" in {n for n, _ in calls}  # the prefill's activation (the fake checks its arguments)
    assert sinks and all(s is not None and s.dtype == np.float32 for _, s in sinks)
    assert {w for w, _ in sinks} == {4, None}  # sliding and full layers


def test_gpt_oss_router_bias_and_sinks_are_used():
    """With the router bias zeroed the routing moves, with the sinks far below every score the logits move: both
    reach the GPU engine's computation (not merely its arguments)."""
    prompt = list(range(3, 23))

    def logits(change=None):
        with fake_moe(), fake_engine("gpt_oss") as gpu:
            if change is not None:
                for lw in gpu.w.layers:
                    change(lw)
            idx = routing(gpu, lambda: gpu.prefill(prompt, all_logits=True))
            return idx, rows(gpu, gpu.logits_buffer_ptr(), len(prompt))

    idx, base = logits()
    idx_nb, _ = logits(lambda lw: lw.update(router_bias=np.zeros_like(lw["router_bias"])))
    _, no_sinks = logits(lambda lw: lw.update(sinks=np.full_like(lw["sinks"], -1e4)))
    assert (idx != idx_nb).any()
    assert rel(no_sinks, base) > 1e-2


def test_gpt_oss_prefill_overflow_rows_take_their_experts_biases(monkeypatch):
    """The prefill's experts past the main block (ExpertGroups' overflow: one GEMM pair each) add their own gate/up and
    down biases and activation too: with the main block cut to 8 rows per expert most experts overflow."""
    from types import SimpleNamespace

    small = SimpleNamespace(**{**vars(np), "quantile": lambda a, q: 1})  # ExpertGroups' rows: 8
    monkeypatch.setattr(moe_passes, "np", small)
    seen = []
    init = moe_passes.ExpertGroups.__init__

    def counting(self, idx, experts):
        init(self, idx, experts)
        seen.append(len(self.overflow))

    monkeypatch.setattr(moe_passes.ExpertGroups, "__init__", counting)
    err, _, _ = run_both("gpt_oss", 40, steps=0)
    print(f"gpt_oss T=40 with overflow rows in {sum(1 for n in seen if n)} of {len(seen)} layers: prefill {err:.2e}")
    assert any(seen) and err < TOL


def test_gpt_oss_fused_path_equals_the_rows_path(monkeypatch):
    """The "fused" rows path (the default on one GPU; the stand-in engine starts on "rows") hands the sinks to the
    attention kernels too and gives the rows path's logits over decode and verify rows."""
    from test_cuda_plumbing import SAME_TOL

    sinks = _record_sinks(monkeypatch)
    rng = np.random.default_rng()
    prompt = [int(t) for t in rng.integers(0, 300, 8)]
    steps = [int(t) for t in rng.integers(0, 300, 6)]
    out = {}
    for path in ("rows", "fused"):
        with fake_moe(), fake_engine("gpt_oss") as gpu:
            gpu.set_path(path)
            gpu.prefill(prompt)
            sinks.clear()
            got = []
            for t in steps:
                gpu.decode(t)
                got.append(rows(gpu, gpu.decode_logits_ptr(), 1)[0])
            assert len(sinks) == 4 * len(steps) and all(s is not None for _, s in sinks)
            gpu.check_fused()
            gpu.reset()
            gpu.prefill(prompt)
            gpu.verify(steps)
            out[path] = (np.stack(got), rows(gpu, gpu.logits_buffer_ptr(), len(steps)))
    assert rel(out["fused"][0], out["rows"][0]) < SAME_TOL and rel(out["fused"][1], out["rows"][1]) < SAME_TOL

