"""Template-instance names of the kernels (NVRTC name expressions): which instances the core
module compiles (what the engine launches) and which the extra module (the rest: tests, benchmarks),
and the plain extern "C" kernels."""

from __future__ import annotations

from .tuning import (
    DECODE_CLUSTER,
    DECODE_HEAD_DIMS,
    DECODE_SIMT_KB,
    DECODE_SIMT_SPLITS,
    DECODE_TC_HEAD_DIMS,
    GEMV_DEFAULT,
    GEMV_EXTRA,
    GEMV_SWIGLU_DEFAULT,
    GEMV_SWIGLU_EXTRA,
    GEMV_STREAM_DEFAULT,
    GEMV_STREAM_US,
    GEMV_RING_CHUNKS,
    GEMV_RING_ENGINE_THREADS,
    GEMV_RING_THREADS,
    GEMV_TC_DEFAULT,
    GEMV_TC_EXTRA,
    GEMV_TC_MIN_ROWS,
    GEMV_TC_SWIGLU_DEFAULT,
    GEMV_TC_SWIGLU_EXTRA,
    PREFILL_BQ,
    PREFILL_BQS,
    PREFILL_HEAD_DIMS,
    prefill_bk,
)


def gemv_name(m: int, r: int, u: int, swiglu: bool, norm: bool = False) -> str:
    sw = "true" if swiglu else "false"
    nm = "true" if norm else "false"
    if u == 0:
        return f"gemv_xs_kernel<{m}, {r}, {sw}, {nm}>"
    return f"gemv_kernel<{m}, {r}, {u}, {sw}, {nm}>"


def gemv_stream_name(u: int) -> str:
    return f"gemv_stream_kernel<{u}>"


def _gemv_stream_names(core: bool) -> list[str]:
    """The streaming GEMV's instances: the default U (core), or the other compiled ones (extra)."""
    return [gemv_stream_name(u) for u in GEMV_STREAM_US if (u == GEMV_STREAM_DEFAULT[0]) == core]


def gemv_ring_name(norm: bool, gated: bool, chunks: int, threads: int) -> str:
    return f"gemv_ring_kernel<{'true' if norm else 'false'}, {'true' if gated else 'false'}, {chunks}, {threads}>"


GEMV_RING_NAMES = tuple(gemv_ring_name(nm, g, p, t) for nm in (False, True) for g in (False, True)
                       for p in GEMV_RING_CHUNKS for t in GEMV_RING_THREADS)
# The instances the engine launches (Kernels.ring_engine_config: 1 or 2 chunks at GEMV_RING_ENGINE_THREADS), in
# the core module; the rest (512 threads, 3 chunks: tests and bench_kernels --ring) in the extra one.
GEMV_RING_ENGINE_NAMES = tuple(gemv_ring_name(nm, g, p, GEMV_RING_ENGINE_THREADS) for nm in (False, True)
                              for g in (False, True) for p in (1, 2))


def gemv_tc_name(nt: int, tiles: int, w: int, u: int, swiglu: bool, norm: bool = False) -> str:
    sw = "true" if swiglu else "false"
    nm = "true" if norm else "false"
    return f"gemv_tc_kernel<{nt}, {tiles}, {w}, {u}, {sw}, {nm}>"


def _gemv_tc_names() -> list[str]:
    names: list[str] = []
    for swiglu, default, extra in (
        (False, GEMV_TC_DEFAULT, GEMV_TC_EXTRA),
        (True, GEMV_TC_SWIGLU_DEFAULT, GEMV_TC_SWIGLU_EXTRA),
    ):
        for m, cfg in default.items():
            for norm in (False, True):
                names.append(gemv_tc_name(2 if m > 8 else 1, *cfg, swiglu, norm))
        for cfg in extra:
            for nt in (1, 2):
                names.append(gemv_tc_name(nt, *cfg, swiglu))
    return list(dict.fromkeys(names))



def _b(flag: bool) -> str:
    return "true" if flag else "false"


def decode_name(hd: int, qb: int, ext: bool = False, fused: bool = False, rope: bool = False,
                cluster: int = 0) -> str:
    """The split kernel for head_dim hd taking qb query vectors per block (_decode_qb); ext: with the
    sliding-window / softcap code (the SIMT kernel always has it); fused: with the combine in the last
    split block (the fused rows path; those instances are in the fused module); rope: with rope + KV
    append in its prologue (tensor cores, one row: the fused rows path); cluster: with the combine in a
    block cluster of that many splits (tensor cores; the cluster attention module)."""
    if hd in DECODE_TC_HEAD_DIMS:
        cl = f", {cluster}" if cluster else ""
        return f"attn_decode_tc_kernel<{hd}, {qb // 8}, {_b(ext)}, {_b(fused)}, {_b(rope)}{cl}>"
    return f"attn_decode_split_kernel<{hd}, {qb}, {DECODE_SIMT_KB}, {DECODE_SIMT_SPLITS[hd][0]}, {_b(fused)}>"


def gemv_qkv_rope_name(m: int, r: int, u: int) -> str:
    """The fused qkv GEMV + rope + KV append, fp32-FMA register variant (gemv.cu), M rows, config (R, U)."""
    return f"gemv_qkv_rope_kernel<{m}, {r}, {u}>"


def gemv_tc_qkv_rope_name(nt: int, tiles: int, w: int, u: int) -> str:
    """The fused qkv GEMV + rope + KV append, tensor-core variant (gemv_tc.cu)."""
    return f"gemv_tc_qkv_rope_kernel<{nt}, {tiles}, {w}, {u}>"


def fused_qkv_fp32_rows() -> tuple[int, ...]:
    """Row counts with a fused qkv instance of the fp32-FMA GEMV: those whose GEMV_DEFAULT config is the
    register variant (U > 0; the shared-memory-x variant has no fused epilogue)."""
    return tuple(m for m, (_, u) in GEMV_DEFAULT.items() if u > 0)


def fused_name_expressions() -> tuple[str, ...]:
    """The instances of the fused module (compiled by Kernels.load_fused, only when the engine takes the
    fused rows path): the fused qkv GEMVs (+ rope + KV append) for every row count of the rows path."""
    names = [gemv_qkv_rope_name(m, *GEMV_DEFAULT[m]) for m in fused_qkv_fp32_rows()]
    names += [gemv_tc_qkv_rope_name(2 if m > 8 else 1, *cfg) for m, cfg in GEMV_TC_DEFAULT.items()]
    return tuple(dict.fromkeys(names))


def fused_attention_name_expressions() -> tuple[str, ...]:
    """The split kernels with their combine fused into the last split block, for every head_dim, query block
    and window / softcap variant, and the one-row tensor-core instances with rope + KV append as well (the
    attention in one launch): their own module (Kernels.load_fused_attention), compiled only on request
    (attention_decode with `counters`, CudaEngine.set_fused_attention(True)).  The fused rows path does not use them
    by default: on the H100 the split + combine pair was faster (NOTES.md, issue 16)."""
    names = []
    for hd in DECODE_HEAD_DIMS:
        for qb in (8, 16) if hd in DECODE_TC_HEAD_DIMS else (1, 2, 4):
            names.append(decode_name(hd, qb, fused=True))
            if hd in DECODE_TC_HEAD_DIMS:
                names.append(decode_name(hd, qb, ext=True, fused=True))
        if hd in DECODE_TC_HEAD_DIMS:
            names.append(decode_name(hd, 8, rope=True, fused=True))
    return tuple(dict.fromkeys(names))


def cluster_attention_name_expressions() -> tuple[str, ...]:
    """The one-row split kernels with rope + KV append and the combine in a block cluster of DECODE_CLUSTER splits
    (engine path "fused-cluster"): their own module (Kernels.load_cluster_attention), compiled on request."""
    return tuple(decode_name(hd, 8, rope=True, cluster=DECODE_CLUSTER) for hd in DECODE_TC_HEAD_DIMS)


def prefill_name(hd: int, bq: int = PREFILL_BQ, ext: bool = False) -> str:
    """The flash prefill kernel for head_dim hd, bq query rows per block; ext: with the sliding-window /
    softcap code."""
    return f"flash_prefill_kernel<{hd}, {bq // 16}, {prefill_bk(hd)}, {'true' if ext else 'false'}>"



def _all_name_expressions() -> list[str]:
    names: list[str] = []
    for m, (r, u) in GEMV_DEFAULT.items():
        names.append(gemv_name(m, r, u, False))
    for m, r, u in GEMV_EXTRA:
        names.append(gemv_name(m, r, u, False))
    for m, (r, u) in GEMV_SWIGLU_DEFAULT.items():
        names.append(gemv_name(m, r, u, True))
    for m, r, u in GEMV_SWIGLU_EXTRA:
        names.append(gemv_name(m, r, u, True))
    for m, (r, u) in GEMV_DEFAULT.items():
        names.append(gemv_name(m, r, u, False, True))
    for m, (r, u) in GEMV_SWIGLU_DEFAULT.items():
        names.append(gemv_name(m, r, u, True, True))
    for hd in DECODE_HEAD_DIMS:
        for qb in (8, 16) if hd in DECODE_TC_HEAD_DIMS else (1, 2, 4):
            names.append(decode_name(hd, qb))
            if hd in DECODE_TC_HEAD_DIMS:  # and its instance with the window / softcap code
                names.append(decode_name(hd, qb, ext=True))
        if hd in DECODE_TC_HEAD_DIMS:  # one row with rope + KV append (the fused rows path)
            names.append(decode_name(hd, 8, rope=True))
    for hd in PREFILL_HEAD_DIMS:
        for bq in PREFILL_BQS:
            names.append(prefill_name(hd, bq))
            names.append(prefill_name(hd, bq, ext=True))
    names += _gemv_tc_names()
    names += _gemv_stream_names(core=True) + _gemv_stream_names(core=False)
    names += GEMV_RING_NAMES
    return list(dict.fromkeys(names))


def name_expressions(extra: bool = False) -> tuple[str, ...]:
    """The template instances of the core module (what the engine launches: the fp32-FMA GEMV for
    fewer than GEMV_TC_MIN_ROWS rows, the tensor-core GEMV defaults, attention), or with extra=True
    the remaining ones (other row counts and configs of the fp32-FMA GEMV, other gemv_tc configs: for
    tests and benchmarks).  Keeping them apart halves the first-use compile time of the engine."""
    core = set()
    for m in range(1, GEMV_TC_MIN_ROWS):
        for sw, table in ((False, GEMV_DEFAULT), (True, GEMV_SWIGLU_DEFAULT)):
            for norm in (False, True):
                core.add(gemv_name(m, *table[m], sw, norm))
    for sw, table in ((False, GEMV_TC_DEFAULT), (True, GEMV_TC_SWIGLU_DEFAULT)):
        for m, cfg in table.items():
            for norm in (False, True):
                core.add(gemv_tc_name(2 if m > 8 else 1, *cfg, sw, norm))
    core.update(_gemv_stream_names(core=True))
    core.update(GEMV_RING_ENGINE_NAMES)
    names = _all_name_expressions()
    is_core = [n in core or not n.startswith("gemv") for n in names]
    return tuple(n for n, c in zip(names, is_core) if c != extra)


PLAIN_KERNELS = (
    "embedding_kernel",
    "f32_to_bf16_kernel",
    "bf16_to_f32_kernel",
    "swiglu_kernel",
    "kv_append_kernel",
    "rmsnorm_kernel",
    "rmsnorm_add_kernel",
    "softcap_kernel",
    "rope_kernel",
    "rope_kv_append_kernel",
    "attn_decode_combine_kernel",
    "argmax_f32_kernel",
    "argmax_bf16_kernel",
    "argmax_split_f32_kernel",
    "argmax_split_bf16_kernel",
)

