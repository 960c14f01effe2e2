"""The launch wrappers of the modules built for some models only (kernels/mla.py's MlaKernels, kernels/moe.py's route
and top-k with the router kinds) pass their kernels the arguments the .cu signatures declare, on a machine without a
GPU, as tests/test_cuda_launch_args.py checks the core module's: stand-in arrays, launches recorded instead of run,
each argument against the kernel's parameter list parsed from mla.cu / moe.cu; and the grids and dynamic shared
memory the kernels assume.  It checks no numbers: tests/gpu/test_mla_cuda.py and test_moe_routers_cuda.py do."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from metrale_cli.backends.cuda.kernels import mla, moe, nvrtc
from metrale_cli.models.spec import RouterSpec

from metrale_cli.backends.cuda.kernels.launch import Kernels
from test_cuda_launch_args import KIND_OK, SIGNATURE, FakeArray, Recorder, _param_kinds, bf16, f32, i32


@pytest.fixture
def kern():
    """A `Kernels` with no CUDA behind it (its checks only): the wrappers' launches are recorded in kern.calls."""
    k = object.__new__(Kernels)
    k._np, k._bf16_dtype, k.pdl, k._pdl_launcher, k.device_id = np, None, False, None, 0
    k._cp = SimpleNamespace(ndarray=FakeArray, float32=np.float32)
    k._dummy = FakeArray((8,), np.uint16)
    k.calls = []
    return k


def params(*files: str) -> dict[str, list[str]]:
    out = {}
    for f in files:
        for name, ps in SIGNATURE.findall((nvrtc._CUDA_DIR / f).read_text()):
            out[name] = _param_kinds(ps)
    return out


def check(calls, kinds_of: dict, n: int) -> None:
    assert len(calls) == n, [c[0] for c in calls]
    for name, args in calls:
        kinds = kinds_of[name.split("<")[0].strip()]
        assert len(args) == len(kinds), f"{name}: {len(args)} arguments, the kernel takes {len(kinds)}"
        for i, (a, kind) in enumerate(zip(args, kinds)):
            assert KIND_OK[kind](a), f"{name}: argument {i} is {type(a).__name__}, the kernel takes {kind}"
    calls.clear()


def _wrapper(cls, kern, names):
    w = object.__new__(cls)
    w.k, w._cp, w._np = kern, kern._cp, np
    w._fn = {n: Recorder(n, kern.calls) for n in names}
    return w


D = mla.MlaDims(20, 128, 64, 128, 512)


@pytest.mark.parametrize("m", [1, 16, 300])
def test_mla_launches(kern, m):
    mk = _wrapper(mla.MlaKernels, kern, mla.PLAIN)
    ctx, splits = 512, 3
    pos = i32(m)
    mk.append(f32(m, D.latent), pos, bf16(D.rank), 1e-6, f32(D.rope // 2), D, bf16(ctx, D.latent), f32(m, D.rank),
              attention_scaling=1.1, interleave=False)
    mk.absorb_q(f32(m, D.heads * (D.nope + D.rope)), bf16(D.heads * (D.nope + D.v), D.rank), pos, f32(D.rope // 2),
                D, f32(m, D.heads, D.latent))
    ws_o, ws_ml = f32(m * splits * D.heads * D.rank), f32(m * splits * D.heads * 2)
    mk.attend(f32(m, D.heads, D.latent), bf16(ctx, D.latent), pos, D, 0.1, splits, ws_o, ws_ml)
    grid, block, kw = mk._fn["mla_attend_kernel"].last
    assert grid == (splits, 2, m) and block == (mla.MLA_HG * 32,) and kw["shared_mem"] == D.attend_smem() <= 48 * 1024
    mk.out(ws_o, ws_ml, bf16(D.heads * (D.nope + D.v), D.rank), D, splits, f32(m, D.heads * D.v))
    assert mk._fn["mla_out_kernel"].last[0] == (D.heads, D.v // mla.MLA_OUT_V, m)
    assert mk._fn["mla_q_kernel"].last[0] == (D.rank // mla.MLA_Q_COLS, D.heads)
    check(kern.calls, params("mla.cu"), 4)


def test_mla_operands_are_checked(kern):
    mk = _wrapper(mla.MlaKernels, kern, mla.PLAIN)
    with pytest.raises(ValueError, match="workspace"):
        mk.attend(f32(2, D.heads, D.latent), bf16(64, D.latent), i32(2), D, 0.1, 4, f32(10), f32(10))
    with pytest.raises(ValueError, match="cache rows"):
        mk.append(f32(2, D.latent), i32(2), bf16(D.rank), 1e-6, f32(D.rope // 2), D, bf16(64, 100), f32(2, D.rank))
    with pytest.raises(ValueError, match="q"):
        mk.absorb_q(f32(2, 7), bf16(D.heads * (D.nope + D.v), D.rank), i32(2), f32(D.rope // 2), D,
                    f32(2, D.heads, D.latent))
    assert not kern.calls


@pytest.mark.parametrize("kind,groups,corr", [("softmax_topk", (1, 1), False), ("sigmoid_biased_grouped", (8, 4), True),
                                              ("sigmoid_biased_grouped", (1, 1), False),
                                              ("softmax_group_limited", (8, 3), False)])
@pytest.mark.parametrize("shared_gated", [True, False])
@pytest.mark.parametrize("e, k", [(256, 8), (512, 10)])
def test_moe_route_launches_take_the_router_kind(kern, kind, groups, corr, shared_gated, e, k):
    mk = _wrapper(moe.MoeKernels, kern, moe.name_expressions())
    hidden, m = 512, 3
    router = RouterSpec(kind, n_group=groups[0], topk_group=groups[1], routed_scaling_factor=2.5)
    b = moe.RouteBuffers(i32(16, k), f32(16, k), f32(16), f32(16, hidden), i32(1), i32(e), FakeArray((e,), np.uint32),
                         i32(e, 16))
    width = e + (1 if shared_gated else 0)
    c = f32(e) if corr else None
    mk.route(f32(m, width), f32(m, hidden), bf16(hidden), 1e-6, e, k, True, True, b, router=router, correction=c,
             shared_gated=shared_gated)
    mk.topk_rows(f32(40, width), e, k, True, True, i32(40, k), f32(40, k), f32(40), router=router, correction=c,
                 shared_gated=shared_gated)
    calls = list(kern.calls)
    check(kern.calls, params("moe.cu"), 2)
    ns = 8 if e <= 256 else 16  # the instance of the fewest slots (logits a lane) that hold e
    assert [c[0] for c in calls] == [f"moe_route_kernel<{ns}>", f"moe_topk_rows_kernel<{ns}>"]
    assert mk._fn[calls[0][0]].last[2]["shared_mem"] == 4 * m * width  # the rows' logits, staged
    for _, args in calls:  # the trailing router arguments: kind, groups, scaling, correction, its flag
        kind_code, n_group, topk_group, scaling, ptr, use = args[-6:]
        assert int(kind_code) == moe.ROUTER_KINDS[kind] and float(scaling) == 2.5 and int(use) == corr
        assert (int(n_group), int(topk_group)) == (groups if kind != "softmax_topk" else (1, 1))
        assert (ptr is c) if corr else ptr is kern._dummy
    shared_mode = int(calls[0][1][11])  # route's has_shared (after the norm offset and eps)
    assert shared_mode == (1 if shared_gated else 2)
    with pytest.raises(ValueError, match="logits width"):
        mk.route(f32(m, e + 1 - shared_gated), f32(m, hidden), bf16(hidden), 1e-6, e, k, True, True, b, router=router,
                 shared_gated=shared_gated)
