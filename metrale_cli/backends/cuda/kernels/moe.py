"""Python wrappers of the mixture-of-experts kernels (moe.cu), a CuPy RawModule of their own.

The module is built from common.cu + moe.cu only when a sparse model is loaded, so dense models pay no
compile time for it. Launches go through the engine's `Kernels` (the same PDL setting); every method
checks its operands (ValueError with a clear message) and launches without host reads or syncs, so the
rows path stays capturable in a CUDA graph.

Device buffers of one sparse layer's routing (`RouteBuffers`, allocated once by the engine per layer):
  idx int32 [16, k], wts f32 [16, k], sgate f32 [16], h f32 [16, H], n_union int32 [1],
  union_e int32 [U], union_mask uint32 [U], union_slot int32 [U, 16] with U = min(E, 16 k).
The expert count bounds the routing only (MOE_MAX_EXPERTS): the route kernels are compiled for each slot count of
MOE_SLOTS (NS of a row's logits a lane) and a launch takes the fewest that hold E; the experts kernels index the
union, whatever E.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .nvrtc import joined_source
from .tuning import ACTIVATIONS, GLU_OAI

MOE_SLOTS = (1, 4, 8, 16, 32)  # the route kernels' instances: NS logits a lane, E <= 32 NS
MOE_MAX_EXPERTS = 32 * MOE_SLOTS[-1]  # must match moe.cu
MOE_MAX_ROWS = 16
MOE_MAX_K = 16
MOE_WARPS = 4  # warps of a gate_up block
MOE_DOWN_WARPS = 8  # warps of a down block (they share its output rows' experts)
MOE_TOPK_WARPS = 8  # warps (rows) of a prefill top-k block: must match moe.cu
MOE_DOWN_ITEMS = 264  # a down block's items at most: union experts x K parts (<= 256) + shared parts (<= 8)
GATE_UP_R = 1  # output rows per gate_up warp


@dataclass(frozen=True)
class ExpertFormat:
    """A weight format the experts kernels read (moe.cu's policy struct `policy`): `chunk` weights a 16-byte chunk
    (K a multiple of it), `scale` the dtype of its scale grid (None: no scales), `block` the one scale block width the
    policy reads (None: any multiple of `chunk`), `name` as messages say it."""

    policy: str
    chunk: int
    scale: str | None
    block: int | None
    name: str


# The experts' weight formats (expert_format(w) -> moe.cu's policy): a new one is an entry here and a struct there.
EXPERT_FORMATS = {
    "bf16": ExpertFormat("MoeBf16", 8, None, None, "bf16"),
    "fp8": ExpertFormat("MoeFp8", 16, "float32", None, "FP8"),  # backends/cuda/fp8.py's Fp8Experts / Fp8Weight
    "mxfp4": ExpertFormat("MoeMxfp4", 32, "uint8", 32, "MXFP4"),  # backends/cuda/mxfp4.py's Mxfp4Experts
}
DEQUANT_FORMATS = ("mxfp4",)  # moe_dequant_bf16_kernel's instances (FP8's prefill dequantizes with fp8.cu)


def down_rows(mt: int) -> int:
    """Output rows of a down block: 4 up to 4 rows, then 2 and 1 (its shared memory holds items x rows x MT
    floats: 16.5 KB each way).  Which block computes a row never changes the row's numbers."""
    return 4 if mt <= 4 else 64 // (4 * mt)
MOE_MTS = (1, 2, 4, 8, 16)  # compiled row-count bounds; a call with M rows takes the smallest MT >= M


def _mt(m: int) -> int:
    return next(t for t in MOE_MTS if t >= m)


def _slots(experts: int) -> int:
    return next(s for s in MOE_SLOTS if 32 * s >= experts)


def route_name(experts: int) -> str:
    return f"moe_route_kernel<{_slots(experts)}>"


def topk_rows_name(experts: int) -> str:
    return f"moe_topk_rows_kernel<{_slots(experts)}>"


def route_smem(m: int, ld: int) -> int:
    """The route kernel's dynamic shared memory: the M rows' logits (ld floats each)."""
    return 4 * m * ld


def gate_up_name(mt: int, fmt: str = "bf16") -> str:
    return f"moe_gate_up_kernel<{mt}, {GATE_UP_R}, {EXPERT_FORMATS[fmt].policy}>"


def down_name(mt: int, fmt: str = "bf16") -> str:
    return f"moe_down_kernel<{mt}, {down_rows(mt)}, {EXPERT_FORMATS[fmt].policy}>"


def dequant_name(fmt: str) -> str:
    return f"moe_dequant_bf16_kernel<{EXPERT_FORMATS[fmt].policy}>"


def expert_format(w: Any) -> str:
    """The experts kernels' format of weight w (an EXPERT_FORMATS key): "bf16" for a device array of bf16 bits, else
    the `moe_format` a weight kept as stored names (its bytes `data`, scale grid `scale`, scale block height `srow` and
    width `bk`, logical `shape`: fp8.py's Fp8Experts and Fp8Weight "fp8", mxfp4.py's Mxfp4Experts "mxfp4")."""
    return getattr(w, "moe_format", "bf16")


def is_fp8(w: Any) -> bool:
    """Whether w is an FP8 weight kept as stored (backends/cuda/fp8.py's Fp8Experts or Fp8Weight)."""
    return expert_format(w) == "fp8"


def down_parts(experts: int, top_k: int, inter: int, shared: int) -> tuple[int, int]:
    """(P, PS): the K parts each chosen expert's and the shared expert's down rows are split into, so a
    decode step (top_k experts) gives the block's MOE_DOWN_WARPS warps work (Mixtral's 2 experts: 4 parts
    each), with at least one 8-element chunk per lane in a part.  A function of the model only: the sum
    order of a row must not depend on the number of rows."""
    union = min(experts, MOE_MAX_ROWS * top_k)
    p = max(1, min(-(-MOE_DOWN_WARPS // top_k), (MOE_DOWN_ITEMS - MOE_DOWN_WARPS) // union, inter // 256))
    ps = max(1, min(MOE_DOWN_WARPS, shared // 256)) if shared else 0
    return p, ps


def module_source() -> str:
    """common.cu, routers.cu (the router kinds), e4m3.cu and e2m1.cu (the FP8 and MXFP4 experts' conversions), then
    moe.cu."""
    return joined_source('routers.cu', 'e4m3.cu', 'e2m1.cu', 'moe.cu')


def name_expressions() -> tuple[str, ...]:
    routes = tuple(n for ns in MOE_SLOTS for n in (route_name(32 * ns), topk_rows_name(32 * ns)))
    experts = tuple(n for fmt in EXPERT_FORMATS for mt in MOE_MTS for n in (gate_up_name(mt, fmt), down_name(mt, fmt)))
    return routes + experts + tuple(dequant_name(fmt) for fmt in DEQUANT_FORMATS)


# models/spec.RouterSpec kinds with a device function (routers.cu's MOE_ROUTER_*); the others are refused.
ROUTER_KINDS = {"softmax_topk": 0, "sigmoid_biased_grouped": 1, "softmax_group_limited": 2, "topk_softmax": 3}
GROUPED_KINDS = ("sigmoid_biased_grouped", "softmax_group_limited")  # the kinds that read n_group / topk_group
# models/spec.MoeSpec activations the experts kernels compute (common.cu's codes: SwiGLU, gpt-oss's clamped SwiGLU).
MOE_ACTIVATIONS = {"silu": ACTIVATIONS["silu"], "swiglu_oai": GLU_OAI}
MOE_MAX_GROUPS = 32  # one lane per group: must match routers.cu


def router_args(np: Any, router: Any, experts: int, correction: Any, dummy: Any) -> tuple:
    """The route kernels' trailing arguments (kind, n_group, topk_group, scaling, correction, use_correction)
    for `router` (a models/spec.RouterSpec; None: softmax_topk unscaled), checked."""
    if router is None:
        return (np.int32(0), np.int32(1), np.int32(1), np.float32(1.0), dummy, np.int32(0))
    if router.kind not in ROUTER_KINDS:
        raise ValueError(f"moe route: no device function for router kind {router.kind}")
    grouped = router.kind in GROUPED_KINDS
    n_group, topk_group = (router.n_group, router.topk_group) if grouped else (1, 1)
    if not 1 <= topk_group <= n_group <= MOE_MAX_GROUPS or experts % n_group:
        raise ValueError(f"moe route: {n_group} groups (<= {MOE_MAX_GROUPS}, dividing {experts} experts), "
                         f"top {topk_group}")
    if router.kind == "sigmoid_biased_grouped" and n_group > 1 and experts // n_group < 2:
        raise ValueError("moe route: sigmoid_biased_grouped scores each group's best two experts")
    if correction is not None:
        if router.kind != "sigmoid_biased_grouped":
            raise ValueError(f"moe route: a choice correction for router kind {router.kind}")
        if correction.dtype != np.float32 or correction.shape != (experts,):
            raise ValueError(f"moe route: correction must be f32 [{experts}], got {correction.dtype} "
                             f"{tuple(correction.shape)}")
    return (np.int32(ROUTER_KINDS[router.kind]), np.int32(n_group), np.int32(topk_group),
            np.float32(router.routed_scaling_factor), dummy if correction is None else correction,
            np.int32(correction is not None))


def _activation(activation: str, limit: float | None) -> int:
    """The experts kernels' act code of a MoeSpec activation (MOE_ACTIVATIONS), checked."""
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"moe experts: activation {activation!r} (the kernels compute {', '.join(MOE_ACTIVATIONS)})")
    if activation == "swiglu_oai" and (limit is None or not float(limit) > 0):
        raise ValueError(f"moe experts: swiglu_oai needs a positive limit, got {limit}")
    return MOE_ACTIVATIONS[activation]


def shared_mode(has_shared: bool, shared_gated: bool) -> int:
    """The route kernels' has_shared: 0 no shared expert, 1 gated by sigmoid(its logit), 2 ungated."""
    return 0 if not has_shared else 1 if shared_gated else 2


@dataclass
class RouteBuffers:
    """One sparse layer's routing on the rows path (device arrays; see the module docstring)."""

    idx: Any
    wts: Any
    sgate: Any
    h: Any
    n_union: Any
    union_e: Any
    union_mask: Any
    union_slot: Any

    @staticmethod
    def allocate(cp, experts: int, k: int, hidden: int) -> RouteBuffers:
        u = min(experts, MOE_MAX_ROWS * k)
        r = MOE_MAX_ROWS
        return RouteBuffers(cp.zeros((r, k), cp.int32), cp.zeros((r, k), cp.float32), cp.zeros(r, cp.float32),
                            cp.zeros((r, hidden), cp.float32), cp.zeros(1, cp.int32), cp.zeros(u, cp.int32),
                            cp.zeros(u, cp.uint32), cp.full((u, r), -1, cp.int32))


class MoeKernels:
    """The MoE kernels, launched through `kern` (a cuda.kernels.Kernels) for its checks and PDL."""

    def __init__(self, kern: Any) -> None:
        cp = kern._cp
        self.k, self._cp, self._np = kern, cp, kern._np
        names = name_expressions()
        try:
            module = cp.RawModule(code=module_source(), options=("-std=c++17", "-DMETRALE_NVRTC"),
                                  name_expressions=names)
            self._fn = {n: module.get_function(n) for n in names}
            for ns in MOE_SLOTS:  # the logits of 16 rows of 1024 experts: more than the default 48 KiB
                self._fn[route_name(32 * ns)].max_dynamic_shared_size_bytes = route_smem(MOE_MAX_ROWS, 32 * ns + 1)
        except Exception as e:  # an NVRTC or driver failure: one clear line
            from ....errors import DeviceError

            raise DeviceError(f"cannot compile the MoE kernels ({type(e).__name__}: {str(e).splitlines()[0]})") from None

    def _launch(self, name: str, grid: tuple, block: tuple, args: tuple, stream: Any, shared_mem: int = 0) -> None:
        k = self.k
        if k.pdl:
            if k._pdl_launcher is None:
                from .pdl import PdlLauncher

                k._pdl_launcher = PdlLauncher(self._cp)
            k._pdl_launcher.launch(self._fn[name], grid, block, args, stream, shared_mem)
        else:
            self._fn[name](grid, block, args, stream=stream, shared_mem=shared_mem)

    @staticmethod
    def check_sizes(experts: int, top_k: int, *sizes: int, n_group: int = 1) -> str | None:
        """Why these MoE sizes cannot run on the kernels (None when they can)."""
        if n_group > MOE_MAX_GROUPS:
            return f"n_group {n_group} (the router kernels take at most {MOE_MAX_GROUPS} groups)"
        if experts > MOE_MAX_EXPERTS:
            return f"{experts} experts (the router kernels take at most {MOE_MAX_EXPERTS})"
        if top_k > MOE_MAX_K:
            return f"num_experts_per_tok {top_k} (at most {MOE_MAX_K})"
        odd = [s for s in sizes if s % 8]
        if odd:
            return f"an expert size {odd[0]} that is not a multiple of 8"
        return None

    # ------------------------------------------------------------------ launches
    def route(self, logits: Any, x: Any, norm_w: Any, eps: float, experts: int, top_k: int, norm_topk: bool,
              has_shared: bool, b: RouteBuffers, *, held: range | None = None, norm_offset: float = 0.0,
              router: Any = None, correction: Any = None, shared_gated: bool = True, stream: Any = None) -> None:
        """Top-k, shared gate, h = rmsnorm(x) (scaled by norm_offset + norm_w) and the union of the rows' experts
        (one block).
        logits f32 [M, E (+1: a gated shared expert's gate logit)], x f32 [M, H], norm_w bf16 [H]; M <= 16.
        `held`: the experts this engine holds (a tensor-parallel rank's range; None: all): the union lists only
        those, so gate_up / down compute this rank's share of every row's sum; the routing itself is over all E
        experts.  `router`: the models/spec.RouterSpec whose kind chooses (None: softmax top-k, unscaled);
        `correction` f32 [E] its choice correction (sigmoid_biased_grouped); `shared_gated` False: the shared
        expert's gate is 1 (sgate written as 1.0, no gate logit)."""
        np, k = self._np, self.k
        k._f32(logits, "logits", 2)
        k._f32(x, "x", 2)
        k._bf16(norm_w, "norm_w", 1)
        m, ld = logits.shape
        hidden = x.shape[1]
        if not 1 <= m <= MOE_MAX_ROWS or x.shape[0] != m:
            raise ValueError(f"moe route: {m} logits rows and {x.shape[0]} x rows (1..{MOE_MAX_ROWS}, equal)")
        gate_col = 1 if has_shared and shared_gated else 0
        if ld != experts + gate_col or experts > MOE_MAX_EXPERTS or not 1 <= top_k <= min(experts, MOE_MAX_K):
            raise ValueError(f"moe route: logits width {ld} for {experts} experts (shared gate {has_shared}), top-{top_k}")
        k._shape(norm_w, "norm_w", (hidden,))
        if hidden % 4:
            raise ValueError(f"moe route: hidden size {hidden} must be a multiple of 4")
        k._aligned(x, "x")
        if b.h.shape[1] != hidden or b.idx.shape[1] != top_k:
            raise ValueError("moe route: buffers allocated for another hidden size or top-k")
        held = range(experts) if held is None else held
        if not 0 <= held.start < held.stop <= experts:
            raise ValueError(f"moe route: held experts {held.start}..{held.stop - 1} outside 0..{experts - 1}")
        args = (logits, np.int32(ld), x, norm_w, np.float32(norm_offset), np.float32(eps), np.int32(m), np.int32(hidden),
                np.int32(experts), np.int32(top_k), np.int32(1 if norm_topk else 0),
                np.int32(shared_mode(has_shared, shared_gated)),
                b.idx, b.wts, b.sgate, b.h, b.n_union, b.union_e, b.union_mask, b.union_slot,
                np.int32(held.start), np.int32(held.stop), *router_args(np, router, experts, correction, k._dummy))
        self._launch(route_name(experts), (1,), (MOE_MAX_ROWS * 32,), args, stream, route_smem(m, ld))

    def topk_rows(self, logits: Any, experts: int, top_k: int, norm_topk: bool, has_shared: bool, idx: Any,
                  wts: Any, sgate: Any, *, router: Any = None, correction: Any = None, shared_gated: bool = True,
                  stream: Any = None) -> None:
        """The prefill router: idx int32 [T, k], wts f32 [T, k], sgate f32 [T] from logits f32 [T, E (+1)];
        `router`, `correction`, `shared_gated` as route's."""
        np, k = self._np, self.k
        k._f32(logits, "logits", 2)
        t, ld = logits.shape
        if (ld != experts + (1 if has_shared and shared_gated else 0) or experts > MOE_MAX_EXPERTS
                or not 1 <= top_k <= min(experts, MOE_MAX_K)):
            raise ValueError(f"moe topk: logits width {ld} for {experts} experts, top-{top_k}")
        k._i32(idx, "idx", 2)
        k._shape(idx, "idx", (t, top_k))
        k._f32(wts, "wts", 2)
        k._shape(wts, "wts", (t, top_k))
        k._f32(sgate, "sgate", 1)
        if t == 0:
            return
        args = (logits, np.int32(ld), np.int32(t), np.int32(experts), np.int32(top_k),
                np.int32(1 if norm_topk else 0), np.int32(shared_mode(has_shared, shared_gated)), idx, wts, sgate,
                *router_args(np, router, experts, correction, k._dummy))
        self._launch(topk_rows_name(experts), (-(-t // MOE_TOPK_WARPS),), (32 * MOE_TOPK_WARPS,), args, stream)

    def gate_up(self, m: int, w_gate_up: Any, b: RouteBuffers, act: Any, *, first: int = 0, bias: Any = None,
                activation: str = "silu", limit: float | None = None, alpha: float = 1.702,
                stream: Any = None) -> None:
        """act f32 [16 k, I] rows m k + j = silu(gate) * up of the expert row m chose at slot j, from b.h;
        w_gate_up [E, 2I, H] holding experts first .. (route's `held`): bf16, or experts kept as stored in a format of
        EXPERT_FORMATS (expert_format: FP8 blocks, MXFP4; dequantized in registers, H a multiple of its chunk).
        Reads each chosen expert once.
        `bias` bf16 [E, 2I] (gate, then up, as the weights' rows): added to gate and up first.  `activation`
        (MOE_ACTIVATIONS): "swiglu_oai" computes min(g, limit) * sigmoid(alpha min(g, limit)) *
        (clip(u, -limit, limit) + 1) instead (gpt-oss; `limit` required)."""
        np, k = self._np, self.k
        fmt, wargs = self._experts(w_gate_up, "w_gate_up")
        k._f32(act, "act", 2)
        e, i2, hidden = w_gate_up.shape
        inter = i2 // 2
        top_k = b.idx.shape[1]
        k._shape(act, "act", (MOE_MAX_ROWS * top_k, inter))
        self._common(m, hidden, inter, wargs[0], act, b)
        self._bias(bias, (e, i2), "gate_up bias")
        code = _activation(activation, limit)
        rows = MOE_WARPS * GATE_UP_R
        grid = (-(-inter // rows), min(e, m * top_k))
        args = (b.h, *wargs, b.n_union, b.union_e, b.union_mask, b.union_slot, act,
                np.int32(inter), np.int32(hidden), np.int32(top_k), np.int32(first),
                k._dummy if bias is None else bias, np.int32(bias is not None), np.int32(code), np.float32(limit or 0.0), np.float32(alpha))
        self._launch(gate_up_name(_mt(m), fmt), grid, (MOE_WARPS * 32,), args, stream)

    def down(self, m: int, w_down: Any, b: RouteBuffers, act: Any, out: Any, *, shared: tuple[Any, Any] | None = None,
             accumulate: bool, first: int = 0, bias: Any = None, stream: Any = None) -> None:
        """out f32 [M, H] (=|+=) the weighted sum of the chosen experts' down projections of act, plus
        sigmoid-gated shared = (w_shared [H, S], act_shared f32 [M, S]) when given.  w_down [E, H, I] holding experts
        first .. (route's `held`): bf16, or experts kept as stored in a format of EXPERT_FORMATS (I a multiple of its
        chunk); the shared expert's down weight is bf16, or in the experts' format (an FP8 projection's Fp8Weight
        beside FP8 experts: `data` uint8 [H, S], `scale` [ceil(H / srow), ceil(S / bk)]).  `bias` bf16 [E, H]: each
        expert's, added to its projection before the routing weight scales it."""
        np, k = self._np, self.k
        fmt, wargs = self._experts(w_down, "w_down")
        k._f32(out, "out", 2)
        e, hidden, inter = w_down.shape
        top_k = b.idx.shape[1]
        k._shape(out, "out", (m, hidden))
        k._shape(act, "act", (MOE_MAX_ROWS * top_k, inter))
        self._common(m, hidden, inter, wargs[0], act, b)
        s_fmt = None if shared is None else expert_format(shared[0])
        if s_fmt is not None and s_fmt != "bf16":
            if s_fmt != fmt:
                name = EXPERT_FORMATS[s_fmt].name
                raise ValueError(f"moe down: an {name} shared expert takes {name} experts (experts in another format "
                                 "read a bf16 one)")
            w_s, act_s, s, s_args = self._stored_shared(shared, m, hidden)
        else:
            w_s, act_s, s = self._shared(shared, m, hidden, b, "down")
            s_args = (k._dummy, np.int32(1), np.int32(8), np.int32(0), np.int32(0))
        k._disjoint(out, "out", act, "act")
        self._bias(bias, (e, hidden), "down bias")
        parts, shared_parts = down_parts(e, top_k, inter, s)
        args = (act, *wargs, b.wts, b.n_union, b.union_e, b.union_mask, b.union_slot, act_s, w_s, *s_args, b.sgate,
                np.int32(s), out, np.int32(m), np.int32(hidden), np.int32(inter), np.int32(top_k),
                np.int32(parts), np.int32(shared_parts), np.int32(1 if accumulate else 0), np.int32(first),
                k._dummy if bias is None else bias, np.int32(bias is not None))
        self._launch(down_name(_mt(m), fmt), (-(-hidden // down_rows(_mt(m))),), (MOE_DOWN_WARPS * 32,), args, stream)

    def dequant_bf16(self, w: Any, expert: int, out: Any, *, stream: Any = None) -> None:
        """out bf16 [N, K] = expert `expert` (its index in w) of stacked experts w [E, N, K] kept as stored in a format
        of DEQUANT_FORMATS (MXFP4), each weight its exact value rounded to bf16 (nearest even): the MoE prefill's
        weights for cuBLAS, the values the rows path computes with."""
        np, k = self._np, self.k
        fmt, wargs = self._experts(w, "w")
        if fmt not in DEQUANT_FORMATS:
            raise ValueError(f"moe dequant: no dequantization kernel for {EXPERT_FORMATS[fmt].name} experts "
                             f"(it has {', '.join(EXPERT_FORMATS[f].name for f in DEQUANT_FORMATS)})")
        e, n, kk = w.shape
        if not 0 <= expert < e:
            raise ValueError(f"moe dequant: expert {expert} of {e}")
        k._bf16(out, "out", 2)
        k._shape(out, "out", (n, kk))
        k._aligned(out, "out")
        chunks = n * kk // EXPERT_FORMATS[fmt].chunk
        if chunks == 0:
            return
        args = (*wargs, np.int32(expert), out, np.int32(n), np.int32(kk))
        self._launch(dequant_name(fmt), (-(-chunks // 256),), (256,), args, stream)

    def _stored(self, w: Any, what: str, ndim: int) -> tuple[str, tuple[Any, ...]]:
        """(format, (data, scale, SB, srow, bk, KB)) of a weight kept as stored (expert_format), checked: bytes `data`
        uint8 [(E,) N, K * 16 / chunk] of logical shape [(E,) N, K], its scale grid [(E,) ceil(N / srow), ceil(K / bk)]
        in the format's scale dtype, K and bk multiples of the format's chunk (a 16-byte chunk never spans two scale
        blocks; bk the format's one block width where it has one), 16-byte aligned."""
        k, np = self.k, self._np
        fmt = expert_format(w)
        spec = EXPERT_FORMATS.get(fmt)
        if spec is None or spec.scale is None:
            raise ValueError(f"{what}: no experts kernels for weights of format {fmt!r}")
        data, scale, srow, bk, shape = w.data, w.scale, int(w.srow), int(w.bk), tuple(w.shape)
        k._arr(data, what)
        if data.dtype != np.uint8 or data.ndim != ndim or len(shape) != ndim:
            raise ValueError(f"{what}: expected uint8 {spec.name} bytes of {ndim} dims, got {data.dtype} "
                             f"{tuple(data.shape)}")
        n, kk = shape[-2:]
        c = spec.chunk
        if kk % c or bk % c or bk <= 0 or srow <= 0 or (spec.block is not None and (bk, srow) != (spec.block, 1)):
            raise ValueError(f"{what}: K ({kk}) and the scale block width ({bk}) must be multiples of {c}"
                             + (f" ({spec.name}: blocks of 1 x {spec.block})" if spec.block else ""))
        k._shape(data, what, shape[:-1] + (kk * 16 // c,))
        k._arr(scale, f"{what} scale")
        if scale.dtype != np.dtype(spec.scale) or scale.ndim != ndim:
            raise ValueError(f"{what} scale: expected {spec.scale} of {ndim} dims, got {scale.dtype} "
                             f"{tuple(scale.shape)}")
        sb, kb = -(-n // srow), -(-kk // bk)
        k._shape(scale, f"{what} scale", shape[:-2] + (sb, kb))
        k._aligned(data, what)
        return fmt, (data, scale, np.int32(sb), np.int32(srow), np.int32(bk), np.int32(kb))

    def _experts(self, w: Any, what: str) -> tuple[str, tuple[Any, ...]]:
        """(format, the experts kernels' weight arguments (w, ws, SB, srow, bk, KB)), checked: bf16 experts [E, N, K]
        (no scales: stand-ins), or stacked experts kept as stored (_stored)."""
        if expert_format(w) != "bf16":
            return self._stored(w, what, 3)
        np = self._np
        self.k._bf16(w, what, 3)
        return "bf16", (w, self.k._dummy, np.int32(0), np.int32(1), np.int32(8), np.int32(0))

    def _stored_shared(self, shared: tuple[Any, Any], m: int, hidden: int) -> tuple[Any, Any, int, tuple[Any, ...]]:
        """(w_s, act_s, S, (ws_s, s_srow, s_bk, s_KB, s_fmt)) of a shared down weight [hidden, S] kept as stored in
        the experts' format and its activations f32 [m, S], checked."""
        k, np = self.k, self._np
        w, a = shared
        _, (data, scale, _, srow, bk, kb) = self._stored(w, "w_shared", 2)
        width = w.shape[1]
        k._shape(data, "w_shared", (hidden, data.shape[1]))
        k._f32(a, "act_shared", 2)
        k._shape(a, "act_shared", (m, width))
        k._aligned(a, "act_shared")
        return data, a, width, (scale, srow, bk, kb, np.int32(1))

    def _bias(self, bias: Any, shape: tuple[int, int], what: str) -> None:
        """An experts kernel's optional bias: bf16 of `shape` ([E, N], the held experts'), checked."""
        if bias is not None:
            self.k._bf16(bias, what, 2)
            self.k._shape(bias, what, shape)

    def _shared(self, shared: tuple[Any, Any] | None, m: int, hidden: int, b: RouteBuffers,
                what: str) -> tuple[Any, Any, int]:
        """(w_shared, act_shared, S) checked, or stand-ins and S = 0 without a shared expert."""
        if shared is None:
            return self.k._dummy, b.h, 0
        return self._projection(shared, m, hidden, "w_shared", "act_shared", f"{what}: shared expert size")

    def _projection(self, pair: tuple[Any, Any], m: int, hidden: int, wn: str, an: str,
                    what: str) -> tuple[Any, Any, int]:
        """(w bf16 [hidden, K], its activations f32 [m, K], K) checked: 16-byte aligned, K a multiple of 8."""
        k = self.k
        w, a = pair
        k._bf16(w, wn, 2)
        k._f32(a, an, 2)
        width = w.shape[1]
        k._shape(w, wn, (hidden, width))
        k._shape(a, an, (m, width))
        if width % 8:
            raise ValueError(f"moe {what} {width} must be a multiple of 8")
        k._aligned(w, wn)
        k._aligned(a, an)
        return w, a, width

    def _common(self, m: int, hidden: int, inter: int, w: Any, act: Any, b: RouteBuffers) -> None:
        k = self.k
        if not 1 <= m <= MOE_MAX_ROWS:
            raise ValueError(f"moe experts: M = {m} rows (1..{MOE_MAX_ROWS})")
        if hidden % 8 or inter % 8:
            raise ValueError(f"moe experts: hidden {hidden} and expert size {inter} must be multiples of 8")
        if b.h.shape[1] != hidden:
            raise ValueError(f"moe experts: routing buffers for hidden {b.h.shape[1]}, weights for {hidden}")
        for a, name in ((w, "weights"), (act, "act"), (b.h, "h")):
            k._aligned(a, name)


__all__ = ["EXPERT_FORMATS", "MOE_ACTIVATIONS", "MoeKernels", "ROUTER_KINDS", "RouteBuffers", "down_parts",
           "expert_format", "is_fp8", "module_source", "name_expressions", "router_args"]
