"""Tuning tables of the kernels (which compiled configuration each row count uses) and the launch
geometry derived from them.  Constants marked "must match" mirror a #define or template constant of a
.cu file; the measurements behind the defaults are in the design notes (docs/)."""

from __future__ import annotations

GEMV_WARPS = 4  # must match gemv.cu
GEMV_MAX_M = 16  # rows the GEMV kernels take (gemv below GEMV_TC_MIN_ROWS, gemv_tc from there on)
# A gemv config is (R, U): R output rows per warp and U 16-byte chunks per row in flight per lane (x read
# through L1).  The rows path takes gemv.cu for the rows below GEMV_TC_MIN_ROWS (and a one-row projection the
# ring GEMV does not take, such as a large lm_head): one config per row count.
GEMV_DEFAULT = {1: (1, 8), 2: (2, 4)}
# SwiGLU: R output rows per warp = 2R weight rows.
GEMV_SWIGLU_DEFAULT = {1: (1, 4), 2: (1, 4)}

# Ring GEMV of one row (gemv_ring.cu, `Kernels.gemv_ring`): one block of GEMV_RING_THREADS threads per SM; each
# thread streams its chunks of weights into a shared-memory ring of GEMV_RING_STAGES slots by cp.async (no
# registers held by loads in flight), the first GEMV_RING_STAGES - 1 slots requested before pdl_wait.  A block may
# take all the shared memory a block may have; the next projection's block starts when it exits (PDL).
GEMV_RING_THREADS = 1024  # the block size (all of an SM)
GEMV_RING_STAGES = 4  # must match gemv_ring.cu (GT_STAGES)
GEMV_RING_CHUNKS = (1, 2)  # compiled P: 16-byte chunks per thread and ring slot
GEMV_RING_K_MULTIPLE = 256
# The rows path's ring: one chunk per thread and slot below GEMV_RING_DEEP_BYTES of weights and two from there
# on; nothing with more than GEMV_RING_MAX_N outputs (a large lm_head stays on gemv).
GEMV_RING_DEEP_BYTES = 1 << 26
GEMV_RING_MAX_N = 65536
GEMV_RING_SMEM_SLACK = 2048  # per block: the runtime's reserved KiB and the kernel's static shared memory


def ring_fixed_smem_bytes(k: int, n: int, grid: int, gated: bool, threads: int = GEMV_RING_THREADS) -> int:
    """Dynamic shared memory of gemv_ring_kernel besides its ring: x' as float4 [2][k / 8], then the partials of
    the most stream rows a block owns (gated: twice its output rows) x (threads / 32 + 1) (the .cu's STRIDE)."""
    rows = _ceil_div(n, grid) * (2 if gated else 1)
    return k * 4 + rows * (threads // 32 + 1) * 4


# The rows path takes the tensor-core GEMV from this many rows on and the fp32-FMA GEMV below (for a one-row
# projection the ring GEMV does not take).
GEMV_TC_MIN_ROWS = 3


def uses_tc(m: int) -> bool:
    """Whether the rows path takes the tensor-core GEMV (rather than gemv.cu) for m rows."""
    return m >= GEMV_TC_MIN_ROWS


# Tensor-core GEMV (gemv_tc.cu, `Kernels.gemv_tc`).  A config is (TILES, W, U): TILES tiles of 16
# output rows per block (SwiGLU: 2 TILES weight tiles), W warps splitting K, U chunks of 32 k per
# step and lane.  Each config is compiled for NT = 1 (M <= 8) and NT = 2 (M <= 16) token tiles.
# A token's result depends on (W, GEMV_TC_P) only, not on M, TILES or U: W is the same for all M
# so that a verify row equals the decode row bit for bit.
GEMV_TC_P = 4  # must match gemv_tc.cu (k chunks per partition group)
GEMV_TC_DEFAULT = {m: (1, 8, 4) for m in range(1, 17)}
GEMV_TC_SWIGLU_DEFAULT = {m: (1, 8, 4) for m in range(1, 17)}
# The fused-RMSNorm variants are compiled for every config.

ATTN_WARPS = 4  # must match attention.cu
DECODE_HEAD_DIMS = (32, 64, 96, 128, 256)
PREFILL_HEAD_DIMS = (32, 64, 96, 128, 256)
# Gate activations of the fused gated MLP (gate_act in common.cu, its ACT_* codes).
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
GLU_OAI = 2  # common.cu's ACT_SWIGLU_OAI: gpt-oss's clamped SwiGLU (the MoE kernels and the prefill's swiglu only)
# flash_prefill.cu (tensor cores): a block takes PREFILL_BQ query rows of one head, 16 rows per warp,
# and walks key tiles of PREFILL_BK keys (must match FP_BK there).  PREFILL_BQS are compiled.
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
DECODE_SIMT_KB = 8  # keys per warp step of the SIMT split kernel (its template argument KB)
ATTN_SIMT_ALIGN = ATTN_WARPS * DECODE_SIMT_KB  # the smallest split multiple of the SIMT split kernel
# The SIMT split kernel per head_dim: (its split sizes' multiple, blocks per SM that decode_splits aims at).
# head_dim 96: 32-key splits, ~4 blocks per SM (64 registers); 256: 64-key splits, ~2 per SM (161 registers).
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
    return GEMV_WARPS * 32, GEMV_WARPS * r


def prefill_smem_bytes(hd: int) -> int:
    """Dynamic shared memory of flash_prefill_kernel: 2 stages x (K, V) x prefill_bk x (hd + 8) bf16."""
    return 2 * 2 * prefill_bk(hd) * (hd + 8) * 2

