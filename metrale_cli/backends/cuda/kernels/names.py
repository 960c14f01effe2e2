"""Template-instance names of the kernels (NVRTC name expressions): which instances the core module
compiles (what the engine launches), which the fused module (the fused rows path's qkv GEMVs), and the
plain extern "C" kernels."""

from __future__ import annotations

from .tuning import (
    DECODE_HEAD_DIMS,
    DECODE_SIMT_KB,
    DECODE_SIMT_SPLITS,
    DECODE_TC_HEAD_DIMS,
    GEMV_DEFAULT,
    GEMV_RING_CHUNKS,
    GEMV_RING_THREADS,
    GEMV_SWIGLU_DEFAULT,
    GEMV_TC_DEFAULT,
    GEMV_TC_MIN_ROWS,
    GEMV_TC_SWIGLU_DEFAULT,
    PREFILL_BQ,
    PREFILL_BQS,
    PREFILL_HEAD_DIMS,
    prefill_bk,
)


def gemv_name(m: int, r: int, u: int, swiglu: bool, norm: bool = False) -> str:
    return f"gemv_kernel<{m}, {r}, {u}, {_b(swiglu)}, {_b(norm)}>"


def gemv_ring_name(norm: bool, gated: bool, chunks: int, threads: int) -> str:
    return f"gemv_ring_kernel<{'true' if norm else 'false'}, {'true' if gated else 'false'}, {chunks}, {threads}>"


GEMV_RING_NAMES = tuple(gemv_ring_name(nm, g, p, GEMV_RING_THREADS) for nm in (False, True) for g in (False, True)
                        for p in GEMV_RING_CHUNKS)


def gemv_tc_name(nt: int, tiles: int, w: int, u: int, swiglu: bool, norm: bool = False) -> str:
    sw = "true" if swiglu else "false"
    nm = "true" if norm else "false"
    return f"gemv_tc_kernel<{nt}, {tiles}, {w}, {u}, {sw}, {nm}>"


def _gemv_tc_names() -> list[str]:
    names: list[str] = []
    for swiglu, default in ((False, GEMV_TC_DEFAULT), (True, GEMV_TC_SWIGLU_DEFAULT)):
        for m, cfg in default.items():
            for norm in (False, True):
                names.append(gemv_tc_name(2 if m > 8 else 1, *cfg, swiglu, norm))
    return list(dict.fromkeys(names))


def _b(flag: bool) -> str:
    return "true" if flag else "false"


def decode_name(hd: int, qb: int, ext: bool = False, rope: bool = False) -> str:
    """The split kernel for head_dim hd taking qb query vectors per block (_decode_qb); ext: with the
    sliding-window / softcap code (the SIMT kernel always has it); rope: with rope + KV append in its
    prologue (tensor cores, one row: the fused rows path)."""
    if hd in DECODE_TC_HEAD_DIMS:
        return f"attn_decode_tc_kernel<{hd}, {qb // 8}, {_b(ext)}, {_b(rope)}>"
    return f"attn_decode_split_kernel<{hd}, {qb}, {DECODE_SIMT_KB}, {DECODE_SIMT_SPLITS[hd][0]}>"


def gemv_qkv_rope_name(m: int, r: int, u: int) -> str:
    """The fused qkv GEMV + rope + KV append, fp32-FMA register variant (gemv.cu), M rows, config (R, U)."""
    return f"gemv_qkv_rope_kernel<{m}, {r}, {u}>"


def gemv_tc_qkv_rope_name(nt: int, tiles: int, w: int, u: int) -> str:
    """The fused qkv GEMV + rope + KV append, tensor-core variant (gemv_tc.cu)."""
    return f"gemv_tc_qkv_rope_kernel<{nt}, {tiles}, {w}, {u}>"


def fused_qkv_fp32_rows() -> tuple[int, ...]:
    """Row counts whose fused qkv GEMV is the fp32-FMA one: from 2 rows (one row rotates in the attention
    split kernel instead) below GEMV_TC_MIN_ROWS."""
    return tuple(m for m in GEMV_DEFAULT if 2 <= m < GEMV_TC_MIN_ROWS)


def fused_name_expressions() -> tuple[str, ...]:
    """The instances of the fused module (compiled by Kernels.load_fused, only when the engine takes the
    fused rows path): the fused qkv GEMVs (+ rope + KV append) for every row count from 2 on."""
    names = [gemv_qkv_rope_name(m, *GEMV_DEFAULT[m]) for m in fused_qkv_fp32_rows()]
    names += [gemv_tc_qkv_rope_name(2 if m > 8 else 1, *cfg) for m, cfg in GEMV_TC_DEFAULT.items()
              if m >= GEMV_TC_MIN_ROWS]
    return tuple(dict.fromkeys(names))


def prefill_name(hd: int, bq: int = PREFILL_BQ, ext: bool = False) -> str:
    """The flash prefill kernel for head_dim hd, bq query rows per block; ext: with the sliding-window /
    softcap code."""
    return f"flash_prefill_kernel<{hd}, {bq // 16}, {prefill_bk(hd)}, {'true' if ext else 'false'}>"



def name_expressions() -> tuple[str, ...]:
    """The template instances of the core module: what the engine launches (the fp32-FMA GEMV below
    GEMV_TC_MIN_ROWS rows, the tensor-core GEMV, the ring GEMV, attention, flash prefill)."""
    names: list[str] = []
    for table, swiglu in ((GEMV_DEFAULT, False), (GEMV_SWIGLU_DEFAULT, True)):
        for m in range(1, GEMV_TC_MIN_ROWS):
            for norm in (False, True):
                names.append(gemv_name(m, *table[m], swiglu, norm))
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
    names += GEMV_RING_NAMES
    return tuple(dict.fromkeys(names))


PLAIN_KERNELS = (
    "embedding_kernel",
    "f32_to_bf16_kernel",
    "bf16_to_f32_kernel",
    "swiglu_kernel",
    "kv_append_kernel",
    "gate_split_kernel",
    "output_gate_kernel",
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

