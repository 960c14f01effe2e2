"""Every launch wrapper of `Kernels` passes its kernel the arguments the .cu signature declares, on a
machine without a GPU: the wrappers run against stand-in arrays (shape, dtype, pointer; no data), the
launches are recorded instead of run, and each recorded argument tuple is checked against the kernel's
parameter list parsed from its .cu file, one by one: a device array for a pointer, np.int32 for int,
np.float32 for float, np.int64 for long long. A kernel parameter added in CUDA but not in Python (or
the other way round, or in another order of types) fails here instead of on the GPU, where it would
read garbage. It checks no numbers: tests/gpu does."""

from __future__ import annotations

import re
from math import prod
from types import SimpleNamespace

import numpy as np
import pytest

from metrale_cli.backends.cuda.kernels import names, nvrtc
from metrale_cli.backends.cuda.kernels.launch import Kernels

SIGNATURE = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)", re.S)


def _param_kinds(params: str) -> list[str]:
    kinds = []
    for p in params.split(","):
        p = p.strip()
        if "*" in p:
            kinds.append("ptr")
        elif re.search(r"\blong long\b", p):
            kinds.append("i64")
        elif re.search(r"\bint\b", p):
            kinds.append("i32")
        elif re.search(r"\bfloat\b", p):
            kinds.append("f32")
        else:
            raise AssertionError(f"parameter {p!r}: unknown kind")
    return kinds


def kernel_params() -> dict[str, list[str]]:
    """Kernel (template) name -> the kinds of its parameters, from the kernel files NVRTC compiles."""
    out = {}
    for f in nvrtc._SOURCES:
        for name, params in SIGNATURE.findall((nvrtc._CUDA_DIR / f).read_text()):
            out[name] = _param_kinds(params)
    return out


class FakeArray:
    """The surface of cupy.ndarray the wrappers read: shape, dtype, flags, device, pointer."""

    _next = 1 << 20

    def __init__(self, shape, dtype, ptr=None):
        self.shape, self.dtype = tuple(int(s) for s in shape), np.dtype(dtype)
        self.ndim, self.size = len(self.shape), prod(self.shape)
        self.nbytes = self.size * self.dtype.itemsize
        if ptr is None:
            ptr = FakeArray._next
            FakeArray._next += -(-max(self.nbytes, 1) // 4096) * 4096 + 4096  # disjoint, aligned
        self.data = SimpleNamespace(ptr=ptr)
        self.flags = SimpleNamespace(c_contiguous=True)
        self.device = SimpleNamespace(id=0)

    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if shape == (-1,):
            shape = (self.size,)
        return FakeArray(shape, self.dtype, self.data.ptr)

    def __getitem__(self, s):  # 1-D slices of the workspace; q[:, :n] of a qkv row (the rope instances)
        if isinstance(s, tuple):
            shape = [len(range(*d.indices(n))) for d, n in zip(s, self.shape)] + list(self.shape[len(s):])
            return FakeArray(shape, self.dtype, self.data.ptr)
        start, stop, _ = s.indices(self.shape[0])
        return FakeArray((stop - start,), self.dtype, self.data.ptr + start * self.dtype.itemsize)


class Recorder:
    def __init__(self, name, calls):
        self.name, self.calls = name, calls
        self.attributes = {"num_regs": 90}
        self.max_dynamic_shared_size_bytes = 48 * 1024

    def __call__(self, grid, block, args, **kw):
        self.calls.append((self.name, args))
        self.last = (grid, block, kw)


@pytest.fixture
def kern():
    """A real `Kernels` with no CUDA behind it: its launches are recorded in kern.calls."""
    k = object.__new__(Kernels)
    k._np = np
    k._cp = SimpleNamespace(ndarray=FakeArray, float32=np.float32,
                            empty=lambda n, dtype: FakeArray((n,), dtype))
    k.device_id, k.num_sms, k._bf16_dtype = 0, 132, None
    k.regs_per_sm, k.smem_per_sm, k.smem_per_block_optin = 65536, 233472, 232448  # an H200
    k._dummy = FakeArray((8,), np.uint16)
    k._workspace, k.pdl, k._pdl_launcher = None, False, None
    k.calls = []
    every = names.name_expressions() + names.fused_name_expressions() + names.PLAIN_KERNELS
    k._fn = {n: Recorder(n, k.calls) for n in every}
    k._fused_names, k._fused_module = frozenset(), object()
    return k


def f32(*shape):
    return FakeArray(shape, np.float32)


def bf16(*shape):
    return FakeArray(shape, np.uint16)


def i32(*shape):
    return FakeArray(shape, np.int32)


KIND_OK = {"ptr": lambda a: isinstance(a, FakeArray), "i32": lambda a: type(a) is np.int32,
           "f32": lambda a: type(a) is np.float32, "i64": lambda a: type(a) is np.int64}


def check(kern, n_launches: int) -> None:
    params = kernel_params()
    assert len(kern.calls) == n_launches, [c[0] for c in kern.calls]
    for name, args in kern.calls:
        kinds = params[name.split("<")[0].strip()]
        assert len(args) == len(kinds), f"{name}: {len(args)} arguments, the kernel takes {len(kinds)}"
        for i, (a, kind) in enumerate(zip(args, kinds)):
            assert KIND_OK[kind](a), f"{name}: argument {i} is {type(a).__name__}, the kernel takes {kind}"
    kern.calls.clear()


H, K, N, V = 64, 64, 40, 50


def test_elementwise_and_norm_launches(kern):
    kern.embedding(i32(3), bf16(V, H), f32(3, H), scale=8.0)
    kern.embedding(i32(3), bf16(V, H), f32(3, H))
    kern.f32_to_bf16(f32(3, H), bf16(3, H))
    kern.bf16_to_f32(bf16(3, H), f32(3, H))
    kern.softcap(f32(3, V), 30.0)
    kern.swiglu(f32(3, 2 * N), f32(3, N), activation="gelu_tanh")
    kern.swiglu(f32(3, 2 * N), f32(3, N))
    kern.rmsnorm(f32(3, H), bf16(H), 1e-6, f32(3, H), f32(3, H), offset=1.0)
    kern.rmsnorm_add(f32(3, H), bf16(H), 1e-6, f32(3, H), offset=1.0)
    kern.argmax(f32(3, V), i32(3))
    check(kern, 10)


def test_split_argmax_launches(kern):
    """Fewer rows than SMs and a row of more than one ARGMAX_CHUNK: several blocks per row (one launch, the
    last block reduces); the workspace is checked; many rows or short rows: one block per row."""
    assert [kern.argmax_blocks(n, V) for n, V in ((1, 128256), (1, 262144), (16, 128256), (1, 4096), (1, 2048),
                                                  (132, 128256), (6, 32003))] == [63, 128, 63, 2, 0, 0, 16]
    kern.argmax(bf16(1, 128256), i32(1), workspace=i32(kern.argmax_workspace_size(1, 63)))
    kern.argmax(f32(2, 262144), i32(2), workspace=i32(kern.argmax_workspace_size(2, 128)))
    kern.argmax(f32(200, 128256), i32(200))
    assert [c[0] for c in kern.calls] == ["argmax_split_bf16_kernel", "argmax_split_f32_kernel", "argmax_f32_kernel"]
    check(kern, 3)
    with pytest.raises(ValueError, match="workspace"):
        kern.argmax(bf16(1, 128256), i32(1), workspace=i32(kern.argmax_workspace_size(1, 63) - 1))


@pytest.mark.parametrize("m", [1, 2])
def test_gemv_launches(kern, m):
    kern.gemv(f32(m, K), bf16(N, K), f32(m, N), bf16(N), accumulate=True)
    kern.gemv(f32(m, K), bf16(N, K), f32(m, N), norm_weight=bf16(K), norm_offset=1.0)
    kern.gemv_swiglu(f32(m, K), bf16(2 * N, K), f32(m, N), norm_weight=bf16(K), activation="gelu_tanh")
    check(kern, 3)


@pytest.mark.parametrize("m", [1, 2, 5, 16])
def test_gemv_tc_launches(kern, m):
    kern.gemv_tc(f32(m, K), bf16(N, K), f32(m, N), bf16(N))
    kern.gemv_tc(f32(m, K), bf16(2 * N, K), f32(m, N), swiglu=True, norm_weight=bf16(K), norm_offset=1.0,
                 activation="gelu_tanh")
    check(kern, 2)


def test_gemv_takes_the_rows_below_the_tensor_core_gemv(kern):
    with pytest.raises(ValueError, match="use gemv_tc"):
        kern.gemv(f32(3, K), bf16(N, K), f32(3, N))
    assert not kern.calls


def test_gemv_ring_launches(kern):
    """The ring GEMV: the .cu's parameters, one block of GEMV_RING_THREADS per SM (fewer for fewer rows), the
    deepest compiled ring (GEMV_RING_CHUNKS chunks per thread and slot) within a block's shared memory."""
    from metrale_cli.backends.cuda.kernels.tuning import (GEMV_RING_CHUNKS, GEMV_RING_SMEM_SLACK, GEMV_RING_STAGES,
                                                          GEMV_RING_THREADS, ring_fixed_smem_bytes)

    most = 232448 + 1024 - GEMV_RING_SMEM_SLACK
    per_chunk = GEMV_RING_STAGES * GEMV_RING_THREADS * 16
    for n, k, gated, kw in ((6144, 4096, False, dict(norm_weight=bf16(4096))), (4096, 4096, False, {}),
                            (14336, 4096, True, dict(norm_weight=bf16(4096), activation="gelu_tanh")),
                            (4096, 14336, False, dict(accumulate=True)), (40, 256, False, {})):
        bias = bf16(n) if n == 6144 else None
        kern.gemv_ring(f32(1, k), bf16(2 * n if gated else n, k), f32(1, n), bias, swiglu=gated, **kw)
        name, args = kern.calls[-1]
        p = int(name.rstrip(">").split(",")[-2])
        assert name == names.gemv_ring_name("norm_weight" in kw, gated, p, GEMV_RING_THREADS)
        (grid,), (threads,), launch = kern._fn[name].last
        assert threads == GEMV_RING_THREADS and grid == min(n, 132)
        fixed = ring_fixed_smem_bytes(k, n, grid, gated)
        assert launch["shared_mem"] == fixed + p * per_chunk <= most
        assert p in GEMV_RING_CHUNKS and (p == max(GEMV_RING_CHUNKS) or launch["shared_mem"] + per_chunk > most)
    check(kern, 5)
    with pytest.raises(ValueError, match="does not fit"):  # x of 160 KiB leaves no room for two chunks
        kern.gemv_ring(f32(1, 40960), bf16(4096, 40960), f32(1, 4096), chunks=2)


def test_gemv_ring_refusals_and_fit(kern):
    with pytest.raises(ValueError, match="multiple of 256"):
        kern.gemv_ring(f32(1, 264), bf16(40, 264), f32(1, 40))
    with pytest.raises(ValueError, match="takes 1"):
        kern.gemv_ring(f32(2, 256), bf16(40, 256), f32(2, 40))
    with pytest.raises(ValueError, match="accumulate"):
        kern.gemv_ring(f32(1, 256), bf16(80, 256), f32(1, 40), swiglu=True, accumulate=True)
    with pytest.raises(ValueError, match="chunks"):
        kern.gemv_ring(f32(1, 256), bf16(40, 256), f32(1, 40), chunks=9)  # not compiled
    assert kern.ring_fits(1, 4096, 6144) and kern.ring_fits(1, 14336, 4096) and kern.ring_fits(1, 4096, 14336, True)
    assert not kern.ring_fits(2, 4096, 6144) and not kern.ring_fits(1, 4104, 6144)
    assert not kern.ring_fits(1, 65536, 4096)  # x alone: 256 KiB, more than a block's shared memory
    assert not kern.ring_fits(1, 4096, 128256)  # the lm_head stays on gemv (GEMV_RING_MAX_N)
    assert kern.ring_chunks(4096, 4096, False) == 1 and kern.ring_chunks(4096, 14336, True) == 2
    core = set(names.name_expressions())  # what the engine launches is compiled with it, never on first use
    for k, n, gated in ((4096, 6144, False), (4096, 4096, False), (4096, 14336, True), (14336, 4096, False),
                        (2048, 3072, False), (3072, 8192, True)):
        for norm in (False, True):
            assert names.gemv_ring_name(norm, gated, kern.ring_chunks(k, n, gated), 1024) in core
    assert not kern.calls


@pytest.mark.parametrize("rotary_dim", [None, 12])
def test_rope_launches(kern, rotary_dim):
    m, nh, nkv, hd, ctx = 3, 4, 2, 16, 32
    rd = hd if rotary_dim is None else rotary_dim
    kern.rope(f32(m, nh, hd), i32(m), f32(rd // 2), bf16(hd), rotary_dim=rotary_dim, norm_offset=1.0)
    kern.rope_kv_append(f32(m, (nh + 2 * nkv) * hd), i32(m), f32(rd // 2), f32(m, nh, hd), bf16(nkv, ctx, hd),
                        bf16(nkv, ctx, hd), bf16(hd), bf16(hd), attention_scaling=1.2, rotary_dim=rotary_dim)
    kern.kv_append(f32(m, nkv, hd), f32(m, nkv, hd), bf16(nkv, ctx, hd), bf16(nkv, ctx, hd), i32(m))
    check(kern, 3)


@pytest.mark.parametrize("hd", [64, 96, 128, 256])
@pytest.mark.parametrize("window,softcap", [(None, None), (24, None), (None, 50.0), (24, 50.0)])
def test_attention_launches(kern, hd, window, softcap):
    m, nh, nkv, ctx = 5, 8, 2, 256
    kern.attention_decode(f32(m, nh, hd), bf16(nkv, ctx, hd), bf16(nkv, ctx, hd), i32(m), f32(m, nh, hd), 0.1,
                          window=window, softcap=softcap)
    ext = window is not None or softcap is not None
    split = kern.calls[0][0]
    assert split == names.decode_name(hd, split_qb(split), ext=ext)  # the EXT instance only when needed
    kern.attention_prefill(f32(40, nh, hd), bf16(nkv, ctx, hd), bf16(nkv, ctx, hd), 7, 40, f32(40, nh, hd), 0.1,
                           window=window, softcap=softcap)
    assert kern.calls[2][0] == names.prefill_name(hd, ext=ext)
    check(kern, 3)


@pytest.mark.parametrize("window", [None, 24])
def test_sinks_launches(kern, window):
    """Attention sinks (gpt-oss) reach the decode combine kernel (the split kernel unchanged) and flash prefill's
    EXT instance (with or without a window), as an fp32 [n_heads] operand."""
    m, nh, nkv, ctx, hd = 5, 8, 2, 256, 64
    kern.attention_decode(f32(m, nh, hd), bf16(nkv, ctx, hd), bf16(nkv, ctx, hd), i32(m), f32(m, nh, hd), 0.1,
                          window=window, sinks=f32(nh))
    assert kern.calls[0][0] == names.decode_name(hd, split_qb(kern.calls[0][0]), ext=window is not None)
    assert kern.calls[1][1][-1] == np.int32(1)  # use_sinks
    kern.attention_prefill(f32(40, nh, hd), bf16(nkv, ctx, hd), bf16(nkv, ctx, hd), 7, 40, f32(40, nh, hd), 0.1,
                           window=window, sinks=f32(nh))
    assert kern.calls[2][0] == names.prefill_name(hd, ext=True) and kern.calls[2][1][-1] == np.int32(1)
    check(kern, 3)
    with pytest.raises(ValueError, match="sinks"):
        kern.attention_decode(f32(m, nh, hd), bf16(nkv, ctx, hd), bf16(nkv, ctx, hd), i32(m), f32(m, nh, hd), 0.1,
                              sinks=bf16(nh))
    with pytest.raises(ValueError, match="sinks"):
        kern.attention_prefill(f32(40, nh, hd), bf16(nkv, ctx, hd), bf16(nkv, ctx, hd), 7, 40, f32(40, nh, hd), 0.1,
                               sinks=f32(nkv))


def test_swiglu_oai_launch(kern):
    kern.swiglu(f32(3, 2 * N), f32(3, N), activation="swiglu_oai", limit=7.0, alpha=1.702)
    assert int(kern.calls[0][1][4]) == 2 and float(kern.calls[0][1][5]) == 7.0  # ACT_SWIGLU_OAI, its limit
    check(kern, 1)
    with pytest.raises(ValueError, match="limit"):
        kern.swiglu(f32(3, 2 * N), f32(3, N), activation="swiglu_oai")


def test_decode_splits(kern):
    """The tensor-core head dims keep ~2 blocks per SM and 64-key splits; the SIMT ones 32-key splits, ~4 blocks
    per SM at head_dim 96 (phi-3-mini: 32 KV heads, G = 1) and ~2 at 256 (gemma-2-9b: 8 KV heads, G = 2)."""
    assert kern.decode_splits(2048, 8, 1, 32) == kern.decode_splits(2048, 8, 1, 32, 128) == 32  # 33, capped
    # 33 on 132 SMs, one past a combine batch: 32 (tuning.ATTN_COMBINE_BATCH)
    assert kern.decode_splits(8192, 8, 1, 32, 128) == 32
    assert kern.decode_splits(8192, 8, 1, 16, 256) == 32 and kern.decode_splits(2048, 8, 1, 16, 256) == 32
    assert kern.decode_splits(8192, 4, 1, 32, 128) == 66  # far past a batch: the blocks matter more
    assert kern.decode_splits(8192, 32, 1, 32, 96) == 17 and kern.decode_splits(300, 32, 1, 32, 96) == 10
    assert kern.decode_splits(8192, 8, 8, 16, 256) == 9  # 16 query vectors: 4 blocks of 4 per KV head


def split_qb(name: str) -> int:
    """Query vectors per block of a decode split instance name (tensor-core: 8 x its NQ argument)."""
    a = [int(x) for x in re.findall(r"\d+", name.split("<")[1].split(",", 2)[1])]
    return a[0] * 8 if name.startswith("attn_decode_tc_kernel") else a[0]


@pytest.mark.parametrize("m", [2, 3, 8, 9, 16])
@pytest.mark.parametrize("rotary_dim,qk_norm,bias", [(None, False, False), (12, True, True)])
def test_fused_qkv_rope_launches(kern, m, rotary_dim, qk_norm, bias):
    """The fused rows path's qkv GEMV + rope + KV append: one launch of the fp32-FMA instance below
    GEMV_TC_MIN_ROWS rows, of the tensor-core one from there on, with the .cu's parameter list."""
    nh, nkv, hd, ctx = 4, 2, 16, 32
    rd = hd if rotary_dim is None else rotary_dim
    n = (nh + 2 * nkv) * hd
    norms = dict(q_norm=bf16(hd), k_norm=bf16(hd)) if qk_norm else {}
    kern.gemv_qkv_rope(f32(m, K), bf16(n, K), bf16(n) if bias else None, bf16(K), f32(m, n), i32(m), f32(rd // 2),
                       f32(m, nh, hd), bf16(nkv, ctx, hd), bf16(nkv, ctx, hd), i32(nh + 2 * nkv),
                       rotary_dim=rotary_dim, attention_scaling=1.2, norm_offset=1.0, **norms)
    want = names.gemv_tc_qkv_rope_name(2 if m > 8 else 1, 1, 8, 4) if m >= 3 else None
    assert kern.calls[0][0] == (want or names.gemv_qkv_rope_name(m, *names.GEMV_DEFAULT[m]))
    check(kern, 1)


def test_fused_qkv_rope_refusals(kern):
    nh, nkv, hd, ctx = 4, 2, 16, 32
    n = (nh + 2 * nkv) * hd
    args = lambda m, cnt=nh + 2 * nkv: (f32(m, K), bf16(n, K), None, bf16(K), f32(m, n), i32(m), f32(hd // 2),  # noqa: E731
                                        f32(m, nh, hd), bf16(nkv, ctx, hd), bf16(nkv, ctx, hd), i32(cnt))
    with pytest.raises(ValueError, match="no fused qkv instance"):  # one row rotates in the attention kernel
        kern.gemv_qkv_rope(*args(1))
    assert kern.qkv_rope_fusable(1) is not None and all(kern.qkv_rope_fusable(m) is None for m in range(2, 17))
    with pytest.raises(ValueError, match="counters"):
        kern.gemv_qkv_rope(*args(2, cnt=3))
    a = list(args(2))
    a[3] = None
    with pytest.raises(ValueError, match="norm_weight"):
        kern.gemv_qkv_rope(*a)
    assert not kern.calls


@pytest.mark.parametrize("hd", [32, 64, 128])
def test_rope_attention_launches(kern, hd):
    """attention_decode with `rope` (one row, the unrotated qkv row): the ROPE split instance and the combine; the
    rope arguments reach the kernel as its signature declares them; a second row is refused."""
    nh, nkv, ctx = 8, 2, 256
    rope = dict(inv_freq=f32(hd // 2), q_norm=bf16(hd), k_norm=bf16(hd), eps=1e-6, attention_scaling=1.0,
                norm_offset=0.0, rotary_dim=None)
    qkv = f32(1, nh + 2 * nkv, hd)
    kern.attention_decode(qkv, bf16(nkv, ctx, hd), bf16(nkv, ctx, hd), i32(1), f32(1, nh, hd), 0.1, rope=rope)
    assert [c[0] for c in kern.calls] == [names.decode_name(hd, 8, rope=True), "attn_decode_combine_kernel"]
    check(kern, 2)
    with pytest.raises(ValueError, match="one row"):
        kern.attention_decode(f32(2, nh + 2 * nkv, hd), bf16(nkv, ctx, hd), bf16(nkv, ctx, hd), i32(2),
                              f32(2, nh, hd), 0.1, rope=rope)
    assert not kern.calls
