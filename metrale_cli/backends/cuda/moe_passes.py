"""engine/loop.py's mixture-of-experts ops on the GPU (mixed into passes.py's RowsPass and PrefillPass).

Every norm of a sparse layer takes the (1 + w) offset of the family's norms (qwen3_next).

Rows path (decode, verify, short prefills; graph-captured; FP8 and MXFP4 experts read as stored by the kernels' format
policies, with an FP8 shared expert's down weight in the down kernel too): the router GEMV with the RMSNorm fused and the router's
bias in its epilogue (the engine's projections, projections.py), then kernels.moe's route (top-k, shared gate, h, the union of the rows'
experts), gate_up (reads only the union's experts, each once; the experts' gate/up bias and the spec's activation,
SwiGLU or gpt-oss's clamped one) and down (the weighted sum over each row's experts, each with its down bias, plus
the shared expert, added into the residual stream in its epilogue). No host reads.

The fused rows path runs a sparse layer as the rows path does.

Prefill path (eager; experts kept as stored (FP8, MXFP4) are first dequantized to bf16 scratch, the experts the chunk
chose only, Projections.experts_bf16): the router in fp32 (cuBLAS SGEMM on an fp32 copy of the router, so the expert
choice is made on fp32 logits as on the rows path; its bias added in fp32), top-k on the device, then one host sync to group the
(token, expert) pairs by expert (`ExpertGroups`) and one cuBLAS strided batched GEMM over every expert
for gate_up and one for down (bf16 operands, fp32 output), plus a GEMM pair for each of the few most-chosen
experts' overflow rows (each row's expert's gate/up bias added before the activation, its down bias after the
down GEMM); each token's experts are then weighted and added in increasing expert order, as the NumPy
reference sums them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ...engine.ops import Route
from .kernels.moe import MOE_MAX_ROWS, MoeKernels, RouteBuffers

if TYPE_CHECKING:
    from ...config import ModelConfig
    from ...models.spec import MoeSpec


def gated_shared(spec: MoeSpec) -> bool:
    """Whether the block's shared expert is scaled by sigmoid(its gate row of the router) (qwen2_moe); DeepSeek's
    and GLM's shared experts are ungated (the route kernels write a gate of 1)."""
    return bool(spec.shared_expert_size) and spec.shared_expert_gated


def moe_kernels(kern: Any) -> MoeKernels:
    """The MoE kernels of the engine whose kernels are `kern` (a cuda.kernels.Kernels), compiled once: MoeState's,
    and the prefill's dequantization of experts kept as stored (mxfp4.py)."""
    mk = getattr(kern, "_moe_kernels", None)
    if mk is None:
        mk = kern._moe_kernels = MoeKernels(kern)
    return mk


class MoeState:
    """The rows path's preallocated MoE buffers and kernels of one engine (CudaEngine.moe)."""

    def __init__(self, cp: Any, cfg: ModelConfig, kern: Any) -> None:
        spec = cfg.moe.spec
        self.spec = spec
        self.kern = moe_kernels(kern)  # compiled now: never during a graph capture
        width = spec.num_experts + (1 if gated_shared(spec) else 0)  # a gated shared expert's gate logit last
        self.logits = cp.zeros((MOE_MAX_ROWS, width), cp.float32)
        self.buf = RouteBuffers.allocate(cp, spec.num_experts, spec.top_k, cfg.hidden_size)
        self.act = cp.zeros((MOE_MAX_ROWS * spec.top_k, spec.intermediate_size), cp.float32)
        self.act_s = (cp.zeros((MOE_MAX_ROWS, spec.shared_expert_size), cp.float32)
                      if spec.shared_expert_size else None)


class RowsMoe:
    """RowsPass's route / experts (self: a RowsPass)."""

    def route(self, x, w_router, spec: MoeSpec, *, norm, bias=None, correction=None):
        st, m = self.e.moe, self.m
        logits = st.logits[:m]
        self.e.proj.linear(x, w_router, logits, bias, norm_weight=norm[0], eps=norm[1].eps,
                           norm_offset=norm[1].offset)  # a bias [E]: no router with one has a shared gate row
        st.kern.route(logits, x, norm[0], norm[1].eps, spec.num_experts, spec.top_k, spec.norm_topk_prob,
                      bool(spec.shared_expert_size), st.buf, held=spec.held, norm_offset=norm[1].offset,
                      router=spec.router, correction=correction, shared_gated=spec.shared_expert_gated, stream=self.s)
        b = st.buf
        return Route(logits[:, :spec.num_experts], b.idx[:m], b.wts[:m],
                     b.sgate[:m, None] if gated_shared(spec) else None)

    def experts(self, x, route, w_gate_up, w_down, spec: MoeSpec, *, norm, shared, tap, bias=None):
        st, m, e = self.e.moe, self.m, self.e
        first = spec.first_expert
        with_shared = None
        if shared is not None:
            act_s = st.act_s[:m]
            e.proj.linear(x, shared[0], act_s, swiglu=True, norm_weight=norm[0], eps=norm[1].eps,
                          norm_offset=norm[1].offset)
            with_shared = (shared[1], act_s)
        b_gu, b_down = (None, None) if bias is None else bias
        st.kern.gate_up(m, w_gate_up, st.buf, st.act, first=first, bias=b_gu, activation=spec.activation,
                        limit=spec.swiglu_limit, alpha=spec.swiglu_alpha, stream=self.s)
        if tap is not None and self._tap is not None:  # the block's output before the residual add, beside
            y = e.cp.empty((m, x.shape[1]), e.cp.float32)
            st.kern.down(m, w_down, st.buf, st.act, y, shared=with_shared, accumulate=False, first=first,
                         bias=b_down, stream=self.s)
            if e.tp is not None:  # a rank's held experts and shared columns: summed over the ranks
                e.tp.comm.all_reduce(y, self.s)
            self.tap(tap, y)
        # under --tp a rank's experts give a partial sum (the experts' inputs, h and act, were taken from x above)
        return self.add_reduced(x, lambda r: st.kern.down(m, w_down, st.buf, st.act, r, shared=with_shared,
                                                          accumulate=True, first=first, bias=b_down,
                                                          stream=self.s))


# From this many rows per expert, the prefill runs one GEMM per chosen expert instead of the strided batched
# GEMM over all of them (many experts with few rows each: batched; few experts with many rows: one each).
PER_EXPERT_ROWS = 256


class ExpertGroups:
    """How a prefill's (token, expert) pairs are laid out for the expert GEMMs: sorted by expert (stable:
    increasing token within an expert); expert e's first `rows` pairs at rows e*rows.. of the main block,
    which one strided batched GEMM computes for every expert at once (padding rows repeat token 0; their
    results are never read); the pairs of an expert past `rows` (the few most-chosen experts) in the
    overflow rows after it, one GEMM per such expert.  `rows` is the 90th percentile of the chosen
    experts' counts rounded up to 8, so about a tenth of them overflow and the padding stays small.
    source[r] = the token whose h fills row r; row_of_pair[t * k + j] = the row of token t's j-th choice;
    overflow = [(first row, count, expert)]."""

    def __init__(self, idx: np.ndarray, experts: int) -> None:
        t, k = idx.shape
        flat = idx.reshape(-1)
        order = np.argsort(flat, kind="stable")
        counts = np.bincount(flat, minlength=experts)
        self.experts = experts
        self.rows = -(-int(np.ceil(np.quantile(counts[counts > 0], 0.9))) // 8) * 8
        main = experts * self.rows
        over = np.maximum(counts - self.rows, 0)
        over_start = main + np.concatenate([[0], np.cumsum(over)[:-1]])
        self.overflow = [(int(over_start[e]), int(over[e]), int(e)) for e in np.nonzero(over)[0]]
        self.total = main + int(over.sum())
        bounds = np.concatenate([[0], np.cumsum(counts)])
        ex = flat[order]
        rank = np.arange(t * k) - bounds[ex]
        rows = np.where(rank < self.rows, ex * self.rows + rank, over_start[ex] + rank - self.rows)
        self.source = np.zeros(self.total, np.int32)
        self.source[rows] = order // k
        self.row_of_pair = np.empty(t * k, np.int64)
        self.row_of_pair[order] = rows
        self.counts = counts

    def used(self, experts: int | None = None) -> list[tuple[int, int]]:
        """[(expert, its rows in the main block)] of the chosen experts below `experts` (None: all)."""
        n = len(self.counts) if experts is None else experts
        return [(int(e), int(min(c, self.rows))) for e, c in enumerate(self.counts[:n]) if c]


class PrefillMoe:
    """PrefillPass's route / experts (self: a PrefillPass; runs under `with engine.stream`)."""

    def route(self, x, w_router, spec: MoeSpec, *, norm, bias=None, correction=None):
        cp, t = self.e.cp, self.t
        h = cp.empty_like(x)
        self.k.rmsnorm(x, norm[0], norm[1].eps, h, offset=norm[1].offset, stream=self.s)
        self._moe_h = h  # the experts' input, kept for experts()
        router = cp.empty(w_router.shape, cp.float32)
        self.k.bf16_to_f32(w_router, router, stream=self.s)
        logits = cp.ascontiguousarray(h @ router.T)  # fp32 [T, E (+1)]
        if bias is not None:  # the router's bias [E], as the reference adds it to the fp32 logits
            logits[:, :spec.num_experts] += self._f32(bias)
        idx = cp.empty((t, spec.top_k), cp.int32)
        wts = cp.empty((t, spec.top_k), cp.float32)
        sgate = cp.empty((t,), cp.float32)
        self.e.moe.kern.topk_rows(logits, spec.num_experts, spec.top_k, spec.norm_topk_prob,
                                  bool(spec.shared_expert_size), idx, wts, sgate, router=spec.router,
                                  correction=correction, shared_gated=spec.shared_expert_gated, stream=self.s)
        return Route(logits[:, :spec.num_experts], idx, wts, sgate[:, None] if gated_shared(spec) else None)

    def experts(self, x, route, w_gate_up, w_down, spec: MoeSpec, *, norm, shared, tap, bias=None):
        cp, e, h = self.e.cp, self.e, self._moe_h
        t, k = route.top_k_index.shape
        idx = route.top_k_index.get()  # the one host sync of the layer: group the tokens by expert
        held = spec.held
        # a tensor-parallel rank's experts: its pairs keep their local index, the others go to the extra
        # "expert" len(held), whose rows no GEMM computes and whose weight is zeroed below
        local = np.where((idx >= held.start) & (idx < held.stop), idx - held.start, len(held))
        plan = ExpertGroups(local, len(held) + (1 if len(held) < spec.num_experts else 0))
        src = cp.asarray(plan.source)
        main = plan.experts * plan.rows
        d = cp.empty((plan.total, x.shape[1]), cp.float32)  # each (token, expert) pair's down projection
        hb = cp.empty((main, h.shape[1]), cp.uint16)  # h's rows in expert order: the main block
        self.k.f32_to_bf16(h[src[:main]], hb, stream=self.s)
        chosen = [ex for ex, _ in plan.used(len(held))]  # experts kept as stored (FP8, MXFP4): these to bf16
        w_gate_up, w_down = e.proj.experts_bf16(w_gate_up, chosen), e.proj.experts_bf16(w_down, chosen)
        used = plan.used(len(held)) if plan.rows >= PER_EXPERT_ROWS else None
        gu = e.proj.gemm_experts(hb, w_gate_up, plan.rows, cp.zeros((main, w_gate_up.shape[1]), cp.float32), used)
        b_gu, b_down = (None, None) if bias is None else bias
        if b_gu is not None:  # expert e's rows of the main block: its gate/up bias (other ranks' "expert": none)
            gu.reshape(plan.experts, plan.rows, -1)[:len(held)] += self._f32(b_gu)[:, None, :]
        act = self._glu(gu, spec)
        del gu
        actb = cp.empty(act.shape, cp.uint16)
        self.k.f32_to_bf16(act, actb, stream=self.s)
        e.proj.gemm_experts(actb, w_down, plan.rows, d[:main], used)
        if b_down is not None:  # each expert's down bias, before its routing weight (as the reference adds it)
            d[:main].reshape(plan.experts, plan.rows, -1)[:len(held)] += self._f32(b_down)[:, None, :]
        for first, n, ex in plan.overflow:  # the most-chosen experts' pairs past the main block
            if ex >= len(held):  # another rank's experts: no weights here, weight 0 below
                d[first:first + n] = 0
                continue
            rows = h[src[first:first + n]]
            gu_ex = e.proj.gemm(rows, w_gate_up[ex], None if b_gu is None else b_gu[ex])
            d[first:first + n] = e.proj.gemm(self._glu(gu_ex, spec), w_down[ex], None if b_down is None else b_down[ex])
        # y[t] = sum over t's experts in increasing order (as the reference sums) of weight * its row of d
        order = np.argsort(idx, axis=1)
        rows_d = cp.asarray(np.take_along_axis(plan.row_of_pair.reshape(t, k), order, 1))
        pick = cp.asarray((np.arange(t)[:, None] * k + order).reshape(-1))
        weights = route.top_k_weights.reshape(-1)[pick].reshape(t, k)
        mine = cp.asarray(np.take_along_axis(local, order, 1) < len(held))
        y = cp.zeros_like(x)
        for j in range(k):  # another rank's pairs add nothing here (their rows of d were never computed)
            y += weights[:, j:j + 1] * cp.where(mine[:, j:j + 1], d[rows_d[:, j]], 0)
        if shared is not None:  # gated (qwen2_moe) or added as it is (DeepSeek, GLM)
            s = e.proj.gemm(self._glu(e.proj.gemm(h, shared[0])), shared[1])
            y += route.shared_gate * s if route.shared_gate is not None else s
        if e.tp is not None:  # the held experts' and shared columns' share, summed over the ranks
            e.tp.comm.all_reduce(y, self.s)
        self.tap(tap, y)
        x += y
        return x

    def _glu(self, gu, spec: MoeSpec | None = None):
        """The experts' activation of gate/up rows gu f32 [R, 2I] (spec's: SwiGLU or gpt-oss's clamped one; None:
        SwiGLU, the shared expert's)."""
        act = self.e.cp.empty((gu.shape[0], gu.shape[1] // 2), self.e.cp.float32)
        if spec is None:
            self.k.swiglu(gu, act, stream=self.s)
        else:
            self.k.swiglu(gu, act, activation=spec.activation, limit=spec.swiglu_limit, alpha=spec.swiglu_alpha,
                          stream=self.s)
        return act

    def _f32(self, w):
        """An fp32 copy of bf16 device bits w (the experts' biases)."""
        out = self.e.cp.empty(w.shape, self.e.cp.float32)
        self.k.bf16_to_f32(w, out, stream=self.s)
        return out
