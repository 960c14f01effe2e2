"""Tuning tables of the kernels (which compiled configuration each row count uses, which further ones
are compiled) and the launch geometry derived from them.  Constants marked "must match" mirror a
#define or template constant of a .cu file; the measurements behind the defaults are in ../NOTES.md."""

from __future__ import annotations

GEMV_WARPS = 4  # must match gemv.cu (register variant)
GEMV_XS_WARPS = 8  # must match gemv.cu (shared-memory-x variant)
GEMV_MAX_M = 16
# A gemv config is (R, U): R output rows per warp and U 16-byte chunks per row in flight per
# lane (register variant: x read through L1); U = 0 selects the variant that stages x in shared
# memory (for larger M).  Defaults per M, chosen from benchmarks/bench_kernels.py sweeps on the H200
# (figures in NOTES.md): M=1 (1, 8); M=2 (2, 4); M=3..8 (4, 2); M>=9 the shared-memory-x variant,
# which beat the register variant (4, 1) at M=16 (that one stays compiled).
GEMV_DEFAULT = {m: ((1, 8) if m == 1 else (2, 4) if m == 2 else (4, 2) if m <= 8 else (4, 0)) for m in range(1, 17)}
# SwiGLU: R output rows per warp = 2R weight rows.
GEMV_SWIGLU_DEFAULT = {m: ((1, 4) if m <= 4 else (2, 1)) for m in range(1, 17)}
# Further compiled (M, R, U) instances, for benchmarks and tests (pass config=(R, U)).
GEMV_EXTRA = ((1, 2, 4), (1, 4, 2), (1, 2, 8), (4, 2, 4), (4, 1, 8), (8, 8, 0), (16, 4, 1)) + tuple(
    (m, 4, 0) for m in range(5, 9)
)
GEMV_SWIGLU_EXTRA = tuple((m, 2, 0) for m in range(5, 17))
# The fused-RMSNorm variants (norm_weight=...) are compiled for the default configs only.

# Streaming GEMV with the fused norm (gemv_stream.cu, `Kernels.gemv_stream`), one row: one wave of blocks, each
# streaming a contiguous range of weight rows.  A config is (U, B): U 16-byte chunks per thread in flight, B
# blocks per SM asked for (fewer when registers or shared memory hold fewer).  The engine takes it for a normed,
# ungated projection of one row with K % GEMV_STREAM_K_MULTIPLE == 0 and at least GEMV_STREAM_MIN_WEIGHTS
# weights (H200, bench_kernels --stream, final kernel: llama-3.1-8b qkv 19.5 -> 15.8 us, gemma-2-9b 21.0 -> 17.9,
# phi-3-mini 20.1 -> 17.2; the 5120 x 2048 qkv of qwen3-30b-a3b only 9.7 -> 9.4, and 10.2 on the first,
# general version: below the threshold, never timed in a step).
GEMV_STREAM_THREADS = 256  # must match gemv_stream.cu (GS_THREADS)
GEMV_STREAM_PART_STRIDE = GEMV_STREAM_THREADS // 32 + 1  # must match gemv_stream.cu (GS_PART_STRIDE)
GEMV_STREAM_K_MULTIPLE = 256
GEMV_STREAM_MIN_WEIGHTS = 1 << 24
GEMV_STREAM_DEFAULT = (4, 4)
GEMV_STREAM_US = (4, 8)  # compiled U (the default's in the core module, the others in the extra one)

# Ring GEMV of one row (gemv_ring.cu, `Kernels.gemv_ring`): one block per SM; each thread streams its chunks of
# weights into a shared-memory ring of GEMV_RING_STAGES slots by cp.async (no registers held by loads in flight),
# the first GEMV_RING_STAGES - 1 slots requested before pdl_wait.  At 512 threads a block takes at most half an
# SM's shared memory (less GEMV_RING_SMEM_SLACK), so that the next projection's block fits beside it; at 1024 (the
# engine's) it may take all a block may have, and the next projection's block starts when it exits (PDL).
# The one-row attention of the "fused-cluster" path: DECODE_CLUSTER splits per (query block, KV head) in one thread-block
# cluster that merges them through distributed shared memory (no combine launch).  16 is above the portable 8: the
# launch opts in to the non-portable size.
DECODE_CLUSTER = 16
GEMV_RING_THREADS = (512, 1024)  # compiled block sizes: 512 = half an SM (two blocks fit, for PDL), 1024 = all of it
GEMV_RING_STAGES = 4  # must match gemv_ring.cu (GT_STAGES)
GEMV_RING_CHUNKS = (1, 2, 3)  # compiled P: 16-byte chunks per thread and ring slot (the deepest that fits is taken)
GEMV_RING_K_MULTIPLE = 256
# What the engine's rows path launches (H200, bench_kernels --ring, 2026-12-04): 1024 threads (half an SM at 512
# threads measured 55-73% of bandwidth, 1024 60-90%), one chunk per thread and slot below GEMV_RING_DEEP_BYTES of
# weights and two from there on (the qkv / o of the 3-12B presets were faster at 1, gate_up and down at 2), and
# nothing with more than GEMV_RING_MAX_N outputs (the lm_head stays on gemv: 98% of bandwidth there).
GEMV_RING_ENGINE_THREADS = 1024
GEMV_RING_DEEP_BYTES = 1 << 26
GEMV_RING_MAX_N = 65536
GEMV_RING_SMEM_SLACK = 2048  # per block: the runtime's reserved KiB and the kernel's static shared memory


def ring_fixed_smem_bytes(k: int, n: int, grid: int, gated: bool, threads: int = 512) -> int:
    """Dynamic shared memory of gemv_ring_kernel besides its ring: x' as float4 [2][k / 8], then the partials of
    the most stream rows a block owns (gated: twice its output rows) x (threads / 32 + 1) (the .cu's STRIDE)."""
    rows = _ceil_div(n, grid) * (2 if gated else 1)
    return k * 4 + rows * (threads // 32 + 1) * 4


# The rows path (engine) takes the tensor-core GEMV from this many rows on and the fp32-FMA GEMV below
# (the fp32-FMA GEMV is faster at 1-2 rows, gemv_tc from 3 on: NOTES.md, "Tensor-core GEMV").
GEMV_TC_MIN_ROWS = 3
# The engine's choices of projection kernel (CudaEngine.gemv_impl): "auto" (the streaming GEMV where it
# fits, else simt below GEMV_TC_MIN_ROWS rows and tc from there on), "simt+tc" (auto without the streaming
# GEMV), "simt" (the fp32-FMA GEMV for every row count), "tc" (the tensor-core GEMV for every row count).
# "ring": the ring GEMV (gemv_ring.cu) for every one-row projection it takes (Kernels.ring_fits), else as auto.
GEMV_IMPLS = ("auto", "simt+tc", "simt", "tc", "ring")


def uses_tc(impl: str, m: int) -> bool:
    """Whether the GEMV choice `impl` (GEMV_IMPLS) takes the tensor-core GEMV for m rows (streaming aside)."""
    return impl == "tc" or (impl != "simt" and m >= GEMV_TC_MIN_ROWS)

# Tensor-core GEMV (gemv_tc.cu, `Kernels.gemv_tc`).  A config is (TILES, W, U): TILES tiles of 16
# output rows per block (SwiGLU: 2 TILES weight tiles), W warps splitting K, U chunks of 32 k per
# step and lane.  Each config is compiled for NT = 1 (M <= 8) and NT = 2 (M <= 16) token tiles.
# A token's result depends on (W, GEMV_TC_P) only, not on M, TILES or U: keep W the same for all M
# so that a verify row equals the decode row bit for bit.  Defaults: provisional (to be tuned with
# `PYTHONPATH=. python3 -m benchmarks.bench_kernels --tc`).
GEMV_TC_P = 4  # must match gemv_tc.cu (k chunks per partition group)
GEMV_TC_DEFAULT = {m: (1, 8, 4) for m in range(1, 17)}
GEMV_TC_SWIGLU_DEFAULT = {m: (1, 8, 4) for m in range(1, 17)}
GEMV_TC_EXTRA = ((1, 8, 2), (2, 8, 4), (2, 4, 4), (1, 8, 6), (1, 8, 8), (1, 4, 8))
GEMV_TC_SWIGLU_EXTRA = ((1, 8, 2), (1, 4, 4), (1, 8, 8), (1, 4, 8))
# The fused-RMSNorm variants are compiled for the default configs only.

ATTN_WARPS = 4  # must match attention.cu
DECODE_HEAD_DIMS = (32, 64, 96, 128, 256)
PREFILL_HEAD_DIMS = (32, 64, 96, 128, 256)
# Gate activations of the fused gated MLP (gate_act in common.cu, its ACT_* codes).
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
# flash_prefill.cu (tensor cores): a block takes PREFILL_BQ query rows of one head, 16 rows per warp,
# and walks key tiles of PREFILL_BK keys (must match FP_BK there).  PREFILL_BQS are compiled; 64
# (4 warps) is the default: 128 (8 warps) was slower at every length measured (NOTES.md, flash prefill).
PREFILL_BQ = 64
PREFILL_BQS = (64,)
PREFILL_BK = 64


def prefill_bk(hd: int) -> int:
    """Keys per tile of flash_prefill_kernel (32 at head_dim 256, whose fragments fill the registers)."""
    return 32 if hd > 128 else PREFILL_BK


LOG2E = 1.4426950408889634


# Decode attention (attention.cu).  head_dim in DECODE_TC_HEAD_DIMS: the tensor-core split kernel,
# ATTN_TC_WARPS warps per block, 8 or 16 query vectors (rows x heads of one KV head) per block;
# head_dim 96 and 256: the SIMT split kernel (ATTN_WARPS warps, _decode_qb_max query vectors per block).
# Each tensor-core instance (and each flash prefill instance) is also compiled with the window / softcap
# code (EXT, names.decode_name / prefill_name).
# Splits are multiples of ATTN_CHUNK_ALIGN keys.  All must match attention.cu.
ATTN_TC_WARPS = 4
ATTN_CHUNK_ALIGN = 64
ATTN_COMBINE_BATCH = 32  # splits the combine kernel merges per round of loads
# The split argmax (argmax.cu argmax_split_*_kernel): threads per block, elements per block step.  Must match.
ARGMAX_THREADS = 256
ARGMAX_CHUNK = ARGMAX_THREADS * 8
DECODE_TC_HEAD_DIMS = (32, 64, 128)
DECODE_SIMT_KB = 8  # keys per warp step of the SIMT split kernel (its template argument KB; 4 until 2026-12-04)
ATTN_SIMT_ALIGN = ATTN_WARPS * DECODE_SIMT_KB  # the smallest split multiple of the SIMT split kernel
# The SIMT split kernel per head_dim: (its split sizes' multiple, blocks per SM that decode_splits aims at).
# head_dim 96: 32-key splits, ~4 blocks per SM (64 registers); 256: 64-key splits, ~2 per SM (161 registers):
# finer splits measured slower there (launch.Kernels.decode_splits has the H200 figures).
DECODE_SIMT_SPLITS = {96: (ATTN_SIMT_ALIGN, 4), 256: (ATTN_CHUNK_ALIGN, 2)}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def _decode_qb_max(hd: int) -> int:
    """Query vectors per block: the most the split kernel of head_dim hd takes."""
    return 16 if hd in DECODE_TC_HEAD_DIMS else 4


def _decode_qb(hd: int, n_qvec: int) -> int:
    """Query vectors per block for n_qvec = M * G query vectors per KV head."""
    if hd in DECODE_TC_HEAD_DIMS:
        return 8 if n_qvec <= 8 else 16
    return min(_decode_qb_max(hd), _next_pow2(n_qvec))


def _gemv_block_rows(r: int, u: int) -> tuple[int, int]:
    """(threads per block, output rows per block) of a gemv config."""
    warps = GEMV_XS_WARPS if u == 0 else GEMV_WARPS
    return warps * 32, warps * r


def stream_smem_bytes(k: int, n: int, grid: int) -> int:
    """Dynamic shared memory of gemv_stream_kernel: x as float4 [2][k / 8], then the partials of the most rows
    a block owns (ceil(n / grid)) x GEMV_STREAM_PART_STRIDE."""
    return k * 4 + _ceil_div(n, grid) * GEMV_STREAM_PART_STRIDE * 4


def prefill_smem_bytes(hd: int) -> int:
    """Dynamic shared memory of flash_prefill_kernel: 2 stages x (K, V) x prefill_bk x (hd + 8) bf16."""
    return 2 * 2 * prefill_bk(hd) * (hd + 8) * 2

