"""engine/loop.py's mixture-of-experts ops on the GPU (mixed into passes.py's RowsPass and PrefillPass).

Rows path (decode, verify, short prefills; graph-captured): the router GEMV with the RMSNorm fused
(the engine's `_linear`), then kernels.moe's route (top-k, shared gate, h, the union of the rows'
experts), gate_up (reads only the union's experts, each once) and down (the weighted sum over each row's
experts, plus the shared expert, added into the residual stream in its epilogue). No host reads.

Prefill path (eager): the router in fp32 (cuBLAS SGEMM on an fp32 copy of the router, so the expert
choice is made on fp32 logits as on the rows path), top-k on the device, then one host sync to group the
tokens by expert and cuBLAS GEMMs per chosen expert (bf16 operands, fp32 output), in increasing expert
order, weighted and added as the NumPy reference does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ...engine.loop import Route
from .kernels.moe import MOE_MAX_ROWS, MoeKernels, RouteBuffers

if TYPE_CHECKING:
    from ...config import ModelConfig
    from ...models.spec import MoeSpec


class MoeState:
    """The rows path's preallocated MoE buffers and kernels of one engine (CudaEngine.moe)."""

    def __init__(self, cfg: ModelConfig, kern: Any) -> None:
        cp = kern._cp
        spec = cfg.moe.spec
        self.spec = spec
        self.kern = MoeKernels(kern)  # compiled now: never during a graph capture
        width = spec.num_experts + (1 if spec.shared_expert_size else 0)
        self.logits = cp.zeros((MOE_MAX_ROWS, width), cp.float32)
        self.buf = RouteBuffers.allocate(cp, spec.num_experts, spec.top_k, cfg.hidden_size)
        self.act = cp.zeros((MOE_MAX_ROWS * spec.top_k, spec.intermediate_size), cp.float32)
        self.act_s = (cp.zeros((MOE_MAX_ROWS, spec.shared_expert_size), cp.float32)
                      if spec.shared_expert_size else None)


class RowsMoe:
    """RowsPass's route / experts (self: a RowsPass)."""

    def route(self, x, w_router, spec: MoeSpec, *, norm):
        st, m = self.e.moe, self.m
        logits = st.logits[:m]
        self.e._linear(x, w_router, logits, norm_weight=norm[0], eps=norm[1].eps)
        st.kern.route(logits, x, norm[0], norm[1].eps, spec.num_experts, spec.top_k, spec.norm_topk_prob,
                      bool(spec.shared_expert_size), st.buf, stream=self.s)
        b = st.buf
        return Route(logits[:, :spec.num_experts], b.idx[:m], b.wts[:m],
                     b.sgate[:m, None] if spec.shared_expert_size else None)

    def experts(self, x, route, w_gate_up, w_down, spec: MoeSpec, *, norm, shared, tap):
        st, m = self.e.moe, self.m
        with_shared = None
        if shared is not None:
            act_s = st.act_s[:m]
            self.e._linear(x, shared[0], act_s, swiglu=True, norm_weight=norm[0], eps=norm[1].eps)
            with_shared = (shared[1], act_s)
        st.kern.gate_up(m, w_gate_up, st.buf, st.act, stream=self.s)
        if tap is not None and self._tap is not None:  # the block's output before the residual add, beside
            y = self.e.cp.empty((m, x.shape[1]), self.e.cp.float32)
            st.kern.down(m, w_down, st.buf, st.act, y, shared=with_shared, accumulate=False, stream=self.s)
            self.tap(tap, y)
        st.kern.down(m, w_down, st.buf, st.act, x, shared=with_shared, accumulate=True, stream=self.s)
        return x


class PrefillMoe:
    """PrefillPass's route / experts (self: a PrefillPass; runs under `with engine.stream`)."""

    def route(self, x, w_router, spec: MoeSpec, *, norm):
        cp, t = self.e.cp, self.t
        h = cp.empty_like(x)
        self.k.rmsnorm(x, norm[0], norm[1].eps, h, stream=self.s)
        self._moe_h = h  # the experts' input, kept for experts()
        router = cp.empty(w_router.shape, cp.float32)
        self.k.bf16_to_f32(w_router, router, stream=self.s)
        logits = cp.ascontiguousarray(h @ router.T)  # fp32 [T, E (+1)]
        idx = cp.empty((t, spec.top_k), cp.int32)
        wts = cp.empty((t, spec.top_k), cp.float32)
        sgate = cp.empty((t,), cp.float32)
        self.e.moe.kern.topk_rows(logits, spec.num_experts, spec.top_k, spec.norm_topk_prob,
                                  bool(spec.shared_expert_size), idx, wts, sgate, stream=self.s)
        return Route(logits[:, :spec.num_experts], idx, wts, sgate[:, None] if spec.shared_expert_size else None)

    def experts(self, x, route, w_gate_up, w_down, spec: MoeSpec, *, norm, shared, tap):
        cp, e, h = self.e.cp, self.e, self._moe_h
        t, k = route.top_k_index.shape
        flat = route.top_k_index.reshape(-1).get()  # the one host sync of the layer: group tokens by expert
        order = np.argsort(flat, kind="stable")
        bounds = np.searchsorted(flat[order], np.arange(spec.num_experts + 1))
        order_d = cp.asarray(order)
        weights = route.top_k_weights.reshape(-1)
        y = cp.zeros_like(x)
        for ex in range(spec.num_experts):  # increasing expert order, as the reference sums
            if bounds[ex] == bounds[ex + 1]:
                continue
            pairs = order_d[bounds[ex]:bounds[ex + 1]]
            tokens = pairs // k  # distinct within one expert
            out = e._gemm(self._swiglu(e._gemm(cp.ascontiguousarray(h[tokens]), w_gate_up[ex])), w_down[ex])
            y[tokens] += out * weights[pairs][:, None]
        if shared is not None:
            y += route.shared_gate * e._gemm(self._swiglu(e._gemm(h, shared[0])), shared[1])
        self.tap(tap, y)
        x += y
        return x

    def _swiglu(self, gu):
        act = self.e.cp.empty((gu.shape[0], gu.shape[1] // 2), self.e.cp.float32)
        self.k.swiglu(gu, act, stream=self.s)
        return act
