"""The CUDA engine's Python side for the hybrid Gated DeltaNet families (qwen3_next, qwen3_5) on the CPU: the
linear_attention kind's CUDA module (backends/cuda/linear_attention.py: the states' ring slots, the rows and prefill
ops), the attention output gate and the sparse layers' (1 + w) norms, with the kernels replaced by NumPy
implementations of their documented contracts (every call bound against the real wrapper's signature, as in
tests/test_cuda_plumbing.py: the Gated DeltaNet kernels against GatedDeltaKernels, the MoE kernels against
MoeKernels), against the NumPy engine on the fixtures: prefill (rows path, and prefill path with the sequential and
the chunked rule), decode, verify == sequential decode, trim to a verify row then decode == a fresh run, the refusal
of a trim the slots cannot serve, the dumped state, and that the rows path allocates nothing and reads nothing back
(what a graph capture needs). The chunked rule's stand-in is a NumPy mirror of its two kernels (chunk_prep,
chunk_state: the same chunks, padding, work area and order), itself checked against the NumPy rules. No CUDA kernel
runs here: tests/gpu/test_gated_delta_cuda.py and test_linear_engine_cuda.py do that."""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import numpy as np
import pytest

plumbing = pytest.importorskip("test_cuda_plumbing")
from metrale_cli.backends.cuda import linear_attention as cuda_linear  # noqa: E402
from metrale_cli.backends.cuda import moe_passes  # noqa: E402
from metrale_cli.backends.cuda.kernels.gated_delta import CHUNK, GatedDeltaKernels, chunk_work_shapes  # noqa: E402
from metrale_cli.backends.cuda.kernels.moe import MoeKernels  # noqa: E402
from metrale_cli.backends.cuda.projections import Projections  # noqa: E402
from metrale_cli.backends.numpy import gated_delta as ref  # noqa: E402
from metrale_cli.backends.numpy.linear_attention import softplus  # noqa: E402
from metrale_cli.errors import InputError  # noqa: E402

f32, bf16, rel, rows = plumbing.f32, plumbing.bf16, plumbing.rel, plumbing.rows
MODELS = ["qwen3_next", "qwen3_5", "qwen3_5_moe_text"]


def sigmoid(x):
    return np.float32(1) / (np.float32(1) + np.exp(-np.asarray(x, np.float32)))


class Bound:
    """Each public method called through the real class's signature (an unknown keyword fails here)."""

    REAL: type = object

    def __init__(self, kern):
        self.k = kern
        self.calls: list[str] = []

    def __getattribute__(self, name):
        attr = object.__getattribute__(self, name)
        real = getattr(object.__getattribute__(self, "REAL"), name, None)
        if name.startswith("_") or not callable(real) or not callable(attr):
            return attr
        sig = inspect.signature(real)

        def checked(*args, **kwargs):
            sig.bind(None, *args, **kwargs)
            object.__getattribute__(self, "calls").append(name)
            return attr(*args, **kwargs)
        return checked


class FakeGatedDelta(Bound):
    """kernels/gated_delta.py's contracts: the ring slots (slot p % R holds position p) read at positions[0] and
    written at each next position (every) or the last."""

    REAL = GatedDeltaKernels

    def conv(self, proj, src, weight, ring, positions, out, *, every=True, stream=None):
        t, R, p0 = proj.shape[0], ring.shape[0], int(positions[0])
        assert list(np.asarray(positions)) == list(range(p0, p0 + t))
        kernel = weight.shape[1]
        mixed = np.asarray(proj)[:, np.asarray(src)]
        out[...], _ = ref.causal_conv(mixed, f32(weight), np.asarray(ring[p0 % R]))
        full = np.concatenate([np.asarray(ring[p0 % R]).T, mixed])
        for j in range(1, t + 1):
            if every or j == t:
                ring[(p0 + j) % R] = full[j:j + kernel - 1].T

    def conv_rows(self, proj, src, weight, ring, positions, out, *, stream=None):
        assert proj.shape[0] >= weight.shape[1] - 1
        FakeGatedDelta.conv(self, proj, src, weight, ring, positions, out, every=False)

    def qk_norm(self, conv, spec, *, stream=None):
        t, kd, hk = conv.shape[0], spec.k_dim, spec.num_k_heads
        conv[:, :kd] = (ref.l2norm(np.asarray(conv[:, :kd]).reshape(t, hk, -1)) *
                        np.float32(spec.k_head_dim ** -0.5)).reshape(t, kd)
        conv[:, kd:2 * kd] = ref.l2norm(np.asarray(conv[:, kd:2 * kd]).reshape(t, hk, -1)).reshape(t, kd)

    def gates(self, proj, b_col, a_col, a_log, dt_bias, beta, g, *, stream=None):
        proj = np.asarray(proj)
        beta[...] = sigmoid(proj[:, np.asarray(b_col)])
        g[...] = -np.exp(np.asarray(a_log)) * softplus(proj[:, np.asarray(a_col)] + np.asarray(dt_bias))

    def recurrent(self, conv, beta, g, ring, positions, out, spec, *, every=True, prenormed=False, stream=None):
        t, R, p0, kd = conv.shape[0], ring.shape[0], int(positions[0]), spec.k_dim
        conv = np.asarray(conv)
        q, k = conv[:, :kd].reshape(t, spec.num_k_heads, -1), conv[:, kd:2 * kd].reshape(t, spec.num_k_heads, -1)
        rep = spec.num_v_heads // spec.num_k_heads
        if prenormed:  # qk_norm ran: only the heads' repetition
            q, k = np.repeat(q, rep, axis=1), np.repeat(k, rep, axis=1)
        else:
            q, k = ref.prepare(q, k, rep)
        kept: list = []
        out[...], _ = ref.recurrent(q, k, conv[:, 2 * kd:].reshape(t, spec.num_v_heads, -1), np.asarray(g),
                                    np.asarray(beta), np.asarray(ring[p0 % R]), kept)
        for j, s in enumerate(kept, start=1):
            if every or j == t:
                ring[(p0 + j) % R] = s

    def recurrent_chunked(self, conv, beta, g, ring, positions, out, spec, work, *, stream=None):
        t, R, p0 = conv.shape[0], ring.shape[0], int(positions[0])
        assert list(np.asarray(positions)) == list(range(p0, p0 + t))
        assert {n: tuple(a.shape) for n, a in work.items()} == chunk_work_shapes(t, spec)
        conv, beta, g = np.asarray(conv), np.asarray(beta), np.asarray(g)
        chunk_prep(conv, beta, g, spec, work)
        ring[(p0 + t) % R] = chunk_state(conv, spec, work, out, np.asarray(ring[p0 % R]))

    def gated_norm(self, o, proj, z_col, weight, eps, y, *, stream=None):
        t, hv, dv = o.shape
        z = np.asarray(proj)[:, np.asarray(z_col)].reshape(t, hv, dv)
        y[...] = ref.gated_rms_norm(np.asarray(o), z, f32(weight), eps).reshape(t, hv * dv)


def _heads(conv, spec):
    """q, k [T, v_heads, dk] (value head h reads key head h // (Hv / Hk)) and v [T, v_heads, dv] of a conv output."""
    t, kd, rep = conv.shape[0], spec.k_dim, spec.num_v_heads // spec.num_k_heads
    q = np.repeat(conv[:, :kd].reshape(t, spec.num_k_heads, -1), rep, axis=1)
    k = np.repeat(conv[:, kd:2 * kd].reshape(t, spec.num_k_heads, -1), rep, axis=1)
    return q, k, conv[:, 2 * kd:].reshape(t, spec.num_v_heads, -1)


def chunk_prep(conv, beta, g, spec, work):
    """gdn_chunk_prep_kernel in NumPy, block by block (chunk n, value head h): the work area from conv (q and k
    normalised), beta, g [T, Hv]; rows past T are zeros. G in row order, A and intra masked, then the forward
    substitution x_i -= A[i, :i] x[:i] of beta exp(G) k (W) and beta v (U)."""
    L, (t, hv) = CHUNK, beta.shape
    q, k, v = _heads(conv, spec)
    lower, diag = np.tril(np.ones((L, L), bool), -1), np.tril(np.ones((L, L), bool))
    for n in range(work["cum"].shape[1] // L):
        rows = slice(n * L, min(n * L + L, t))
        m = rows.stop - rows.start
        for h in range(hv):
            def pad(x):
                return np.concatenate([x, np.zeros((L - m,) + x.shape[1:], np.float32)])

            qc, kc, vc = pad(q[rows, h]), pad(k[rows, h]), pad(v[rows, h])
            bet, cum = pad(beta[rows, h]), np.cumsum(pad(g[rows, h]))
            decay = np.where(diag, np.exp(cum[:, None] - cum[None, :]), np.float32(0))
            a = np.where(lower, bet[:, None] * (kc @ kc.T) * decay, np.float32(0))
            x = np.concatenate([kc * bet[:, None] * np.exp(cum)[:, None], vc * bet[:, None]], axis=1)
            for i in range(1, L):
                x[i] -= a[i, :i] @ x[:i]
            at = slice(n * L, n * L + L)
            work["w"][h, at], work["u"][h, at] = x[:, :spec.k_head_dim], x[:, spec.k_head_dim:]
            work["intra"][h, at] = np.where(diag, (qc @ kc.T) * decay, np.float32(0))
            work["cum"][h, at] = cum


def chunk_state(conv, spec, work, out, state):
    """gdn_chunk_state_kernel in NumPy (every column of a head at once: the kernel's slices of CHUNK_BV columns
    are independent): per head, the chunks in order from `state` [Hv, dk, dv], reading the work area; out
    [T, Hv, dv] written, the final state returned."""
    L, t = CHUNK, conv.shape[0]
    q, k, _ = _heads(conv, spec)
    s = np.array(state, np.float32)
    for n in range(work["cum"].shape[1] // L):
        rows, at = slice(n * L, min(n * L + L, t)), slice(n * L, n * L + L)
        m = rows.stop - rows.start
        for h in range(spec.num_v_heads):
            cum, pad = work["cum"][h, at], np.zeros((L - m, spec.k_head_dim), np.float32)
            qd = np.concatenate([q[rows, h], pad]) * np.exp(cum)[:, None]
            kd = np.concatenate([k[rows, h], pad]) * np.exp(cum[-1] - cum)[:, None]
            v_new = work["u"][h, at] - work["w"][h, at] @ s[h]
            o = qd @ s[h] + work["intra"][h, at] @ v_new
            out[rows, h] = o[:m]
            s[h] = s[h] * np.exp(cum[-1]) + kd.T @ v_new
    return s


class FakeMoe(Bound):
    """kernels/moe.py's contracts: softmax top-k (ties to the lowest expert), the sigmoid shared gate, h with the
    norm's offset, each row's experts weighted and summed, the gated shared expert added."""

    REAL = MoeKernels

    @staticmethod
    def check_sizes(experts, top_k, *sizes):
        return None

    def _topk(self, logits, experts, top_k, norm_topk, has_shared, idx, wts, sgate):
        lg = np.asarray(logits, np.float32)
        p = np.exp(lg[:, :experts] - lg[:, :experts].max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        order = np.argsort(-p, axis=1, kind="stable")[:, :top_k]
        w = np.take_along_axis(p, order, 1)
        idx[...] = order
        wts[...] = w / w.sum(axis=1, keepdims=True) if norm_topk else w
        if has_shared:
            sgate[...] = sigmoid(lg[:, experts])

    def route(self, logits, x, norm_w, eps, experts, top_k, norm_topk, has_shared, b, *, held=None, norm_offset=0.0,
              router=None, correction=None, shared_gated=True, stream=None):
        assert (router is None or router.kind == "softmax_topk") and shared_gated  # these families' routing
        m = logits.shape[0]
        self._topk(logits, experts, top_k, norm_topk, has_shared, b.idx[:m], b.wts[:m], b.sgate[:m])
        x = np.asarray(x, np.float32)
        b.h[:m] = (f32(norm_w) + np.float32(norm_offset)) * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))

    def topk_rows(self, logits, experts, top_k, norm_topk, has_shared, idx, wts, sgate, *, router=None,
                  correction=None, shared_gated=True, stream=None):
        assert (router is None or router.kind == "softmax_topk") and shared_gated
        self._topk(logits, experts, top_k, norm_topk, has_shared, idx, wts, sgate)

    def gate_up(self, m, w_gate_up, b, act, *, first=0, bias=None, activation="silu", limit=None, alpha=1.702,
                stream=None):
        assert bias is None and activation == "silu"  # these families' experts
        k = b.idx.shape[1]
        for r in range(m):
            for j in range(k):
                gu = f32(w_gate_up[int(b.idx[r, j]) - first]) @ np.asarray(b.h[r])
                n = gu.shape[0] // 2
                act[r * k + j] = plumbing.ACT["silu"](gu[:n]) * gu[n:]

    def down(self, m, w_down, b, act, out, *, shared=None, accumulate, first=0, bias=None, stream=None):
        assert bias is None
        k = b.idx.shape[1]
        y = np.zeros((m, w_down.shape[1]), np.float32)
        for r in range(m):
            for j in np.argsort(np.asarray(b.idx[r])):
                y[r] += b.wts[r, j] * (f32(w_down[int(b.idx[r, j]) - first]) @ np.asarray(act[r * k + j]))
            if shared is not None:
                y[r] += b.sgate[r] * (f32(shared[0]) @ np.asarray(shared[1][r]))
        out[...] = (out + y) if accumulate else y


class LinearFakeKernels(plumbing.FakeKernels):
    """The core kernels' stand-ins plus the attention output gate's two launches."""

    def gate_split(self, gated, plain, n_heads, head_dim, *, stream=None):
        m, q = plain.shape[0], n_heads * head_dim
        heads = np.asarray(gated)[:, :2 * q].reshape(m, n_heads, 2 * head_dim)
        plain[:, :q] = heads[..., :head_dim].reshape(m, q)
        plain[:, q:] = np.asarray(gated)[:, 2 * q:]

    def output_gate(self, y, gated, n_heads, head_dim, *, stream=None):
        m, q = y.shape[0], n_heads * head_dim
        gate = np.asarray(gated)[:, :2 * q].reshape(m, n_heads, 2 * head_dim)[..., head_dim:].reshape(m, q)
        y[...] = np.asarray(y) * sigmoid(gate)


def _exact_gemm(self, x, w, bias=None, accumulate_into=None):
    """The prefill GEMM with fp32 activations: the cuBLAS call's bf16 rounding of x (which
    tests/test_cuda_plumbing.py models) left out, so that what is compared here is the layers' plumbing."""
    y = np.asarray(x, np.float32) @ f32(w).T
    if bias is not None:
        y = y + f32(bias)
    if accumulate_into is None:
        return plumbing._wrap(y.astype(np.float32))
    accumulate_into += y
    return accumulate_into


def every_expert(monkeypatch):
    """The fixtures' sparse layers with top_k = every expert, in both engines: the MoE prefill's bf16 activations
    then move the weights a little instead of swapping a near-tied expert (a 0.1 change of a logits row)."""
    import dataclasses

    real = plumbing.load_config

    def load(path):
        cfg = real(path)
        if cfg.moe is None:
            return cfg
        spec = dataclasses.replace(cfg.moe.spec, top_k=cfg.moe.spec.num_experts)
        return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, spec=spec))

    monkeypatch.setattr(plumbing, "load_config", load)


def _gemm_experts(self, xb, w, rows_, out, used=None):
    for e in range(w.shape[0]):
        out[e * rows_:(e + 1) * rows_] = f32(xb[e * rows_:(e + 1) * rows_]) @ f32(w[e]).T
    return out


@contextmanager
def fake_engine(name: str, monkeypatch, ctx: int = 64, path: str = "rows"):
    from metrale_cli.backends.cuda import engine as cuda_engine, loading as cuda_loading
    from metrale_cli.checkpoint import Checkpoint

    cfg = plumbing.load_config(plumbing.FIXTURES / name)
    kern = LinearFakeKernels()
    cp = kern._cp
    cp.where = lambda *a: plumbing._wrap(np.where(*a))  # the MoE prefill's extra CuPy calls
    cp.zeros_like = lambda a: plumbing._wrap(np.zeros_like(a))
    cp.uint32 = np.uint32
    monkeypatch.setattr(cuda_linear, "GatedDeltaKernels", FakeGatedDelta)
    monkeypatch.setattr(moe_passes, "MoeKernels", FakeMoe)
    monkeypatch.setattr(Projections, "gemm_bf16", _exact_gemm)
    monkeypatch.setattr(Projections, "gemm_experts", _gemm_experts)
    ckpt = Checkpoint.open(plumbing.FIXTURES / name)
    try:
        weights = cuda_loading.upload_weights(cfg, ckpt, kern)
        engine = cuda_engine.CudaEngine(cfg, weights, kern, ctx, fp32_logits=True, use_graphs=False)
        if path != "rows":
            engine.set_path(path)
        yield engine
    finally:
        ckpt.close()


def _tokens(n):
    return [int(t) for t in np.random.default_rng().integers(0, 300, n)]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("plen", [12, 20, 65, 130])  # the rows path (<= 16 rows), the prefill path: sequential, chunked
def test_prefill_and_decode_match_the_numpy_engine(name, plen, monkeypatch):
    every_expert(monkeypatch)
    prompt, steps = _tokens(plen), _tokens(8)
    cpu = plumbing.cpu_engine(name, ctx=256)
    with fake_engine(name, monkeypatch, ctx=256) as gpu:
        assert gpu.prefill(prompt, all_logits=True) == cpu.prefill(prompt, all_logits=True) == plen
        err = rel(rows(gpu, gpu.logits_buffer_ptr(), plen), rows(cpu, cpu.logits_buffer_ptr(), plen))
        a, b = [], []
        for t in steps:
            cpu.decode(t)
            gpu.decode(t)
            a.append(rows(cpu, cpu.decode_logits_ptr(), 1)[0])
            b.append(rows(gpu, gpu.decode_logits_ptr(), 1)[0])
        derr = rel(np.stack(b), np.stack(a))
        st = gpu.states["linear_attention"]
        calls = set(st.kernels.calls)
        dumped = st.tensors()
    print(f"{name} T={plen}: prefill rel err {err:.2e}, decode rows {derr:.2e}")
    assert err < plumbing.TOL and derr < plumbing.TOL
    assert calls == ({"conv", "gates", "recurrent", "gated_norm"} | ({"conv_rows", "qk_norm"} if plen > 16 else set())
                     | ({"recurrent_chunked"} if plen >= cuda_linear.CHUNKED_MIN_ROWS else set()))
    if any(getattr(x.mixer, "output_gate", False) for x in cpu.cfg.definition.layers):
        assert {"gate_split", "output_gate"} <= set(gpu.kern.calls)
    want = cpu.states["linear_attention"].tensors()  # --dump-state's tensors, at the same position
    assert set(dumped) == set(want)
    assert max(rel(dumped[n], want[n]) for n in want) < plumbing.TOL


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("path", ["rows", "fused"])
def test_verify_equals_sequential_decode_and_trim_restores_a_row(name, path, monkeypatch):
    """verify k rows == k decode steps; trim to each accepted count then decode == a fresh run decoding to there
    (the state read from that position's ring slot); a trim the slots cannot serve is refused by name."""
    prompt, drafts = _tokens(20), _tokens(6)
    with fake_engine(name, monkeypatch, path=path) as seq_engine:
        seq_engine.prefill(prompt)
        seq = []
        for t in drafts:
            seq_engine.decode(t)
            seq.append(rows(seq_engine, seq_engine.decode_logits_ptr(), 1)[0])
    with fake_engine(name, monkeypatch, path=path) as gpu:  # its slots never held the drafts' sequential states
        gpu.prefill(prompt)
        gpu.verify(drafts)
        assert rel(rows(gpu, gpu.logits_buffer_ptr(), 6), np.stack(seq)) < plumbing.SAME_TOL
        after = {}
        for accepted in (6, 4, 1, 0):  # trims back, each from the verify's end (a fresh verify before each)
            gpu.trim(20)
            gpu.verify(drafts)
            gpu.trim(20 + accepted)
            gpu.decode(7)
            after[accepted] = rows(gpu, gpu.decode_logits_ptr(), 1)[0]
        with pytest.raises(InputError, match="cannot trim the linear-attention state to position 10"):
            gpu.trim(10)  # inside the prefill: no slot holds it
    with fake_engine(name, monkeypatch, path=path) as fresh:
        for accepted, got in after.items():
            fresh.reset()
            fresh.prefill(prompt)  # the same prefill, then sequential decode steps to the accepted count
            for t in drafts[:accepted]:
                fresh.decode(t)
            fresh.decode(7)
            assert rel(got, rows(fresh, fresh.decode_logits_ptr(), 1)[0]) < plumbing.SAME_TOL, accepted


def test_decode_steps_keep_the_last_ring_positions(monkeypatch):
    """After decode steps the last RING - 1 positions stay reachable by trim; an older one is refused; trim to 0
    starts from a zero state."""
    prompt = _tokens(4)
    with fake_engine("qwen3_5", monkeypatch) as gpu:
        gpu.prefill(prompt)
        for t in _tokens(cuda_linear.RING + 3):
            gpu.decode(t)
        end = gpu.length
        gpu.trim(end - (cuda_linear.RING - 1))
        with pytest.raises(InputError, match="GPU keeps it only at the last"):
            gpu.trim(gpu.length - 1)  # its slot went to the position RING later
        gpu.trim(0)
        gpu.prefill(prompt)
        gpu.decode(5)
        again = rows(gpu, gpu.decode_logits_ptr(), 1)[0]
        gpu.reset()
        gpu.prefill(prompt)
        gpu.decode(5)
        assert np.array_equal(again, rows(gpu, gpu.decode_logits_ptr(), 1)[0])
        st = gpu.states["linear_attention"]
        assert st.nbytes == cuda_linear.RING * st.sequence_nbytes
        s = st.spec
        assert st.sequence_nbytes == 3 * 4 * (s.conv_dim * (s.conv_kernel - 1) + s.num_v_heads * s.k_head_dim *
                                              s.v_head_dim)  # the fixture's three linear layers, fp32


@pytest.mark.parametrize("path", ["rows", "fused"])
def test_the_rows_path_allocates_nothing_and_reads_nothing_back(path, monkeypatch):
    """What a CUDA graph capture needs of the Python side: after the first step, decode and verify passes allocate
    no device memory and copy nothing to the host (the positions are read on the device)."""
    with fake_engine("qwen3_next", monkeypatch, path=path) as gpu:
        gpu.prefill(_tokens(5))
        gpu.decode(3)
        cp = gpu.cp

        def refused(*a, **k):
            raise AssertionError("allocated or read back inside a rows pass")

        saved = {n: getattr(cp, n) for n in ("zeros", "empty", "empty_like", "asarray", "concatenate")}
        for n in saved:
            setattr(cp, n, refused)
        monkeypatch.setattr(plumbing.Arr, "get", refused)
        gpu.decode(4)
        gpu.verify(_tokens(4))
        for n, f in saved.items():
            setattr(cp, n, f)


def test_a_gated_qkv_is_not_fused_and_the_gate_kernels_are_bound():
    """The fused path fuses no output-gated qkv projection (its q and gate rows are interleaved per head); the
    two gate launches exist on Kernels with the stand-ins' signatures."""
    from metrale_cli.backends.cuda.kernels import Kernels

    for name in ("gate_split", "output_gate"):
        assert inspect.signature(getattr(Kernels, name)).parameters.keys() == \
            inspect.signature(getattr(LinearFakeKernels, name)).parameters.keys()
    assert "norm_offset" in inspect.signature(MoeKernels.route).parameters


@pytest.mark.parametrize("name", MODELS)
def test_the_bench_floor_counts_the_state_a_step_moves(name):
    """`metrale bench`'s floor of a hybrid model counts its linear layers' states: read once and written after each
    row, i.e. (1 + rows) x the NumPy engine's state of one sequence; a plain attention model moves none."""
    from metrale_cli.floors import linear_state_bytes

    cpu = plumbing.cpu_engine(name)
    one = cpu.states["linear_attention"].nbytes
    assert linear_state_bytes(cpu.cfg) == 2 * one and linear_state_bytes(cpu.cfg, rows=4) == 5 * one
    assert linear_state_bytes(plumbing.load_config(plumbing.FIXTURES / "llama")) == 0


def test_the_presets_shapes_and_what_the_cuda_engine_gates(monkeypatch):
    """qwen3.5-27b (Qwen3.5-27B's text model: 64 layers, 48 of them Gated DeltaNet) runs on the CUDA engine's kernels
    and fits one 80 GB card in bf16; qwen3-next-80b-a3b-fp8 (FP8 block weights) is in the kernels' sizes (512 experts,
    top-10) and refused by name before anything loads until its FP8 experts read as stored and the route kernels past
    256 experts pass their GPU tests."""
    from metrale_cli.backends.cuda.loading import load_cuda_engine, unsupported_features, unverified_features
    from metrale_cli.bench import preset_path
    from metrale_cli.errors import DeviceError
    from metrale_cli.random_weights import RandomTensors

    dense = plumbing.load_config(preset_path("qwen3.5-27b"))
    kinds = [layer.mixer.kind for layer in dense.definition.layers]
    assert kinds.count("linear_attention") == 48 and kinds.count("attention") == 16
    assert unsupported_features(dense.definition) == []
    assert 26.5e9 < dense.definition.parameter_count() < 27.5e9  # 54 GB in bf16
    sparse = plumbing.load_config(preset_path("qwen3-next-80b-a3b-fp8"))
    assert sparse.quantization["quant_method"] == "fp8" and 79e9 < sparse.definition.parameter_count() < 81e9
    assert unsupported_features(sparse.definition) == []
    from metrale_cli.backends.cuda.loading import UNVERIFIED

    assert unverified_features(sparse.definition) == [name for name, _ in UNVERIFIED][:3]  # FP8, > 256 experts
    monkeypatch.delenv("METRALE_CUDA_UNVERIFIED", raising=False)
    with pytest.raises(DeviceError, match="MoE route kernels over more than 256 experts have not passed"):
        load_cuda_engine(sparse, RandomTensors(sparse), 64)
    s = sparse.moe.spec
    assert (s.num_experts, s.top_k) == (512, 10)
    assert MoeKernels.check_sizes(s.num_experts, s.top_k, s.intermediate_size, s.shared_expert_size,
                                  n_group=s.router.n_group) is None
    assert "1100 experts" in MoeKernels.check_sizes(1100, 10, 512, 512)


@pytest.mark.parametrize("plen", [5, 20])
def test_the_linear_attention_taps_match_the_numpy_engine(plen, monkeypatch):
    """The layer dumps' taps on the CUDA engine (model.layers.{i}.linear_attn, the mixer output before the residual
    add): the same names as the NumPy engine's, and the same values within the bf16 weights' rounding."""
    prompt = _tokens(plen)
    cpu = plumbing.cpu_engine("qwen3_5")
    got, want = {}, {}
    with fake_engine("qwen3_5", monkeypatch) as gpu:
        gpu.tap = lambda name, x: got.setdefault(name, np.asarray(x))
        cpu.tap = lambda name, x: want.setdefault(name, np.asarray(x))
        gpu.prefill(prompt)
        cpu.prefill(prompt)
    linear = [n for n in want if n.endswith(".linear_attn")]
    assert set(got) == set(want) and len(linear) == 3
    assert max(rel(got[n], want[n]) for n in linear) < plumbing.TOL


@pytest.mark.parametrize("t", [1, 17, 63, 64, 65, 130, 200])
def test_the_chunked_kernels_blocked_algorithm_gives_the_rule(t):
    """The NumPy mirror of gdn_chunk_prep + gdn_chunk_state (chunks of CHUNK rows, the last one padded; the work
    area's layout) against the recurrent rule and the NumPy engine's chunked rule, from a nonzero state, GQA
    (Hv = 2 Hk), T below, at and across chunk boundaries; the work area's padded rows are zeros."""
    from metrale_cli.models.spec import LinearAttentionSpec

    rng = np.random.default_rng()
    hk, hv, dk, dv = 2, 4, 64, 80
    spec = LinearAttentionSpec(hk, hv, dk, dv, 4, 1e-6, grouped=False)
    conv = rng.normal(size=(t, spec.conv_dim)).astype(np.float32)
    kd = spec.k_dim
    q, k = ref.prepare(conv[:, :kd].reshape(t, hk, dk), conv[:, kd:2 * kd].reshape(t, hk, dk), 1)
    conv[:, :kd], conv[:, kd:2 * kd] = q.reshape(t, kd), k.reshape(t, kd)  # as qk_norm leaves them
    beta = rng.uniform(0.05, 0.95, (t, hv)).astype(np.float32)
    g = -rng.uniform(0.01, 1.0, (t, hv)).astype(np.float32)
    state = rng.normal(size=(hv, dk, dv)).astype(np.float32) * 0.1
    work = {n: np.full(shape, np.nan, np.float32) for n, shape in chunk_work_shapes(t, spec).items()}
    out = np.full((t, hv, dv), np.nan, np.float32)
    chunk_prep(conv, beta, g, spec, work)
    s = chunk_state(conv, spec, work, out, state)
    qq, kk, v = _heads(conv, spec)
    o_rec, s_rec = ref.recurrent(qq, kk, v, g, beta, state)
    o_chk, s_chk = ref.chunked(qq, kk, v, g, beta, state)
    errs = [rel(out, o_rec), rel(s, s_rec), rel(out, o_chk), rel(s, s_chk)]
    print(f"T={t}: vs recurrent {errs[0]:.1e} / {errs[1]:.1e}, vs chunked {errs[2]:.1e} / {errs[3]:.1e}")
    assert max(errs) <= 2e-5
    rows = work["cum"].shape[1]
    assert rows == -(-t // CHUNK) * CHUNK and not any(np.isnan(a).any() for a in work.values())
    for name in ("w", "u", "intra"):
        assert not work[name][:, t:].any()  # padded rows: zero q, k, v, beta
    np.testing.assert_array_equal(work["cum"][:, t:], np.repeat(work["cum"][:, t - 1:t], rows - t, axis=1))
