"""Python wrappers of the metrale CUDA kernels (CuPy RawModule, NVRTC).

`Kernels()` compiles every kernel once per process (CuPy also caches the binary on disk) and
exposes one method per kernel.  Each method checks shapes, dtypes, contiguity and alignment
(raising ValueError with a clear message) and launches; none synchronises the host, calls
cuBLAS, or reads a device value on the host, so every launch can be captured in a CUDA graph.
Values that change between decode steps (positions, hence context lengths) are read by the
kernels from small int32 device arrays.

Conventions (they mirror Hugging Face transformers):
  * activations: float32 on the device; accumulation in fp32;
  * weights: bfloat16 in HF layout [out_features, in_features]; a bf16 operand may be a CuPy
    array of dtype ml_dtypes.bfloat16 or of uint16/int16 holding the raw bits;
  * KV cache: bf16 [n_kv_heads, max_ctx, head_dim] per layer.  Keep one buffer per layer, or
    one [layers, n_kv_heads, max_ctx, head_dim] buffer and pass the contiguous view cache[layer];
  * rounding to bf16 (kv_append, f32_to_bf16) is round-to-nearest-even, bit-identical to
    torch's CPU `.to(torch.bfloat16)`, every NaN becoming 0x7FC0.

Every method takes `stream=None` (None: CuPy's current stream).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_CUDA_DIR = Path(__file__).resolve().parent
_SOURCES = ("elementwise.cu", "norm_rope.cu", "gemv.cu", "attention.cu", "flash_prefill.cu", "argmax.cu", "gemv_tc.cu")
_INCLUDE_LINE = '#include "common.cu"'
COMPILE_OPTIONS = ("-std=c++17", "-DMETRALE_NVRTC")

GEMV_WARPS = 4  # must match gemv.cu (register variant)
GEMV_XS_WARPS = 8  # must match gemv.cu (shared-memory-x variant)
GEMV_MAX_M = 16
# A gemv config is (R, U): R output rows per warp and U 16-byte chunks per row in flight per
# lane (register variant: x read through L1); U = 0 selects the variant that stages x in shared
# memory (for larger M).  Defaults per M, from the H200 measurements in bench_kernels.py (see
# NOTES.md): M=1 (1, 8); M=3..8 (4, 2); M>=9 the shared-memory-x variant (at M=16: 19-23% of read
# bandwidth against 14-15% for the register variant (4, 1), which stays compiled).
GEMV_DEFAULT = {m: ((1, 8) if m == 1 else (2, 4) if m == 2 else (4, 2) if m <= 8 else (4, 0)) for m in range(1, 17)}
# SwiGLU: R output rows per warp = 2R weight rows.
GEMV_SWIGLU_DEFAULT = {m: ((1, 4) if m <= 4 else (2, 1)) for m in range(1, 17)}
# Further compiled (M, R, U) instances, for benchmarks and tests (pass config=(R, U)).
GEMV_EXTRA = ((1, 2, 4), (1, 4, 2), (1, 2, 8), (4, 2, 4), (4, 1, 8), (8, 8, 0), (16, 4, 1)) + tuple(
    (m, 4, 0) for m in range(5, 9)
)
GEMV_SWIGLU_EXTRA = tuple((m, 2, 0) for m in range(5, 17))
# The fused-RMSNorm variants (norm_weight=...) are compiled for the default configs only.

# The rows path (engine) takes the tensor-core GEMV from this many rows on and the fp32-FMA GEMV below
# (H200, llama-3.1-8b, 1024 context, scripts/bench_variants.py: decode step 4.89 ms with the fp32-FMA
# GEMV vs 5.01 with gemv_tc, verify k=2 5.01 vs 5.05, k=4 6.11 vs 5.17, k=8 9.21 vs 5.43 ms).
GEMV_TC_MIN_ROWS = 3

# Tensor-core GEMV (gemv_tc.cu, `Kernels.gemv_tc`).  A config is (TILES, W, U): TILES tiles of 16
# output rows per block (SwiGLU: 2 TILES weight tiles), W warps splitting K, U chunks of 32 k per
# step and lane.  Each config is compiled for NT = 1 (M <= 8) and NT = 2 (M <= 16) token tiles.
# A token's result depends on (W, GEMV_TC_P) only, not on M, TILES or U: keep W the same for all M
# so that a verify row equals the decode row bit for bit.  Defaults: provisional (to be tuned with
# `python3 -m metrale_cli.cuda.bench_kernels --tc`).
GEMV_TC_P = 4  # must match gemv_tc.cu (k chunks per partition group)
GEMV_TC_DEFAULT = {m: (1, 8, 4) for m in range(1, 17)}
GEMV_TC_SWIGLU_DEFAULT = {m: (1, 8, 4) for m in range(1, 17)}
GEMV_TC_EXTRA = ((1, 8, 2), (2, 8, 4), (2, 4, 4), (1, 8, 6), (1, 8, 8), (1, 4, 8))
GEMV_TC_SWIGLU_EXTRA = ((1, 8, 2), (1, 4, 4), (1, 8, 8), (1, 4, 8))
# The fused-RMSNorm variants are compiled for the default configs only.

ATTN_WARPS = 4  # must match attention.cu
DECODE_HEAD_DIMS = (32, 64, 96, 128, 256)
PREFILL_HEAD_DIMS = (32, 64, 96, 128, 256)
# Gate activations of the fused gated MLP (gate_act in common.cu).
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
# flash_prefill.cu (tensor cores): a block takes PREFILL_BQ query rows of one head, 16 rows per warp,
# and walks key tiles of PREFILL_BK keys (must match FP_BK there).  PREFILL_BQS are compiled; 64
# (4 warps, 168 registers at head_dim 128 -> 3 blocks per SM) is the default.
PREFILL_BQ = 64
PREFILL_BQS = (64,)  # 128 (8 warps, 1 block per SM) was slower at every length measured (NOTES.md)
PREFILL_BK = 64


def prefill_bk(hd: int) -> int:
    """Keys per tile of flash_prefill_kernel (32 at head_dim 256, whose fragments fill the registers)."""
    return 32 if hd > 128 else PREFILL_BK


LOG2E = 1.4426950408889634


# Decode attention (attention.cu).  head_dim in DECODE_TC_HEAD_DIMS: the tensor-core split kernel,
# ATTN_TC_WARPS warps per block, 8 or 16 query vectors (rows x heads of one KV head) per block;
# head_dim 96 and 256: the SIMT split kernel (ATTN_WARPS warps, _decode_qb_max query vectors per block).
# Each tensor-core instance is also compiled with the window / softcap code (EXT, decode_name).
# Splits are multiples of ATTN_CHUNK_ALIGN keys.  All must match attention.cu.
ATTN_TC_WARPS = 4
ATTN_CHUNK_ALIGN = 64
DECODE_TC_HEAD_DIMS = (32, 64, 128)


def _decode_qb_max(hd: int) -> int:
    """Query vectors per block: the most the split kernel of head_dim hd takes."""
    return 16 if hd in DECODE_TC_HEAD_DIMS else 4


def _decode_kb(hd: int) -> int:
    """Keys per warp step of the SIMT split kernel (head_dim 256)."""
    return 4


def _decode_qb(hd: int, n_qvec: int) -> int:
    """Query vectors per block for n_qvec = M * G query vectors per KV head."""
    if hd in DECODE_TC_HEAD_DIMS:
        return 8 if n_qvec <= 8 else 16
    return min(_decode_qb_max(hd), _next_pow2(n_qvec))


def gemv_name(m: int, r: int, u: int, swiglu: bool, norm: bool = False) -> str:
    sw = "true" if swiglu else "false"
    nm = "true" if norm else "false"
    if u == 0:
        return f"gemv_xs_kernel<{m}, {r}, {sw}, {nm}>"
    return f"gemv_kernel<{m}, {r}, {u}, {sw}, {nm}>"


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


def _gemv_block_rows(r: int, u: int) -> tuple[int, int]:
    """(threads per block, output rows per block) of a gemv config."""
    warps = GEMV_XS_WARPS if u == 0 else GEMV_WARPS
    return warps * 32, warps * r


def decode_name(hd: int, qb: int, ext: bool = False) -> str:
    """The split kernel for head_dim hd taking qb query vectors per block (_decode_qb); ext: with the
    sliding-window / softcap code (the SIMT kernel always has it)."""
    if hd in DECODE_TC_HEAD_DIMS:
        return f"attn_decode_tc_kernel<{hd}, {qb // 8}, {'true' if ext else 'false'}>"
    return f"attn_decode_split_kernel<{hd}, {qb}, {_decode_kb(hd)}>"


def prefill_name(hd: int, bq: int = PREFILL_BQ) -> str:
    return f"flash_prefill_kernel<{hd}, {bq // 16}, {prefill_bk(hd)}>"


def prefill_smem_bytes(hd: int) -> int:
    """Dynamic shared memory of flash_prefill_kernel: 2 stages x (K, V) x prefill_bk x (hd + 8) bf16."""
    return 2 * 2 * prefill_bk(hd) * (hd + 8) * 2


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
    for hd in PREFILL_HEAD_DIMS:
        for bq in PREFILL_BQS:
            names.append(prefill_name(hd, bq))
    names += _gemv_tc_names()
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
)


def module_source() -> str:
    """common.cu followed by every kernel file, with their include lines removed."""
    parts = [(_CUDA_DIR / "common.cu").read_text()]
    for name in _SOURCES:
        text = (_CUDA_DIR / name).read_text()
        lines = [ln for ln in text.splitlines() if ln.strip() != _INCLUDE_LINE]
        parts.append(f"// ---- {name} ----\n" + "\n".join(lines))
    return "\n".join(parts) + "\n"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


class PdlLauncher:
    """Launches a compiled CuPy kernel through the driver's cuLaunchKernelEx with the
    programmatic-stream-serialization attribute (PDL), which CuPy's own launcher does not expose.
    Under stream capture the dependency becomes a programmatic edge of the CUDA graph."""

    _ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION

    def __init__(self, cp: Any) -> None:
        import ctypes

        import numpy

        self._ct, self._np, self._cp = ctypes, numpy, cp
        self._lib = ctypes.CDLL("libcuda.so.1")

        class Attr(ctypes.Structure):  # CUlaunchAttribute: id, pad to 8, 64-byte value union
            _fields_ = [("id", ctypes.c_uint32), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint64 * 8)]

        class Config(ctypes.Structure):  # CUlaunchConfig
            _fields_ = [
                ("gridDimX", ctypes.c_uint32), ("gridDimY", ctypes.c_uint32), ("gridDimZ", ctypes.c_uint32),
                ("blockDimX", ctypes.c_uint32), ("blockDimY", ctypes.c_uint32), ("blockDimZ", ctypes.c_uint32),
                ("sharedMemBytes", ctypes.c_uint32), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(Attr)), ("numAttrs", ctypes.c_uint32),
            ]

        self._attr = Attr()
        self._attr.id = self._ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
        self._attr.value[0] = 1  # programmaticStreamSerializationAllowed (int) = 1
        self._Config = Config
        self._fn = self._lib.cuLaunchKernelEx
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.POINTER(Config), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]

    def _param(self, a: Any) -> Any:
        ct, np = self._ct, self._np
        if isinstance(a, self._cp.ndarray):
            return ct.c_uint64(a.data.ptr)
        if isinstance(a, np.int32):
            return ct.c_int32(int(a))
        if isinstance(a, np.float32):
            return ct.c_float(float(a))
        if isinstance(a, np.int64):
            return ct.c_int64(int(a))
        raise TypeError(f"PDL launch: unsupported kernel argument type {type(a).__name__}")

    def launch(self, fn: Any, grid: tuple, block: tuple, args: tuple, stream: Any) -> None:
        ct = self._ct
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        if stream is None:
            stream = self._cp.cuda.get_current_stream()
        cfg = self._Config(g[0], g[1], g[2], b[0], b[1], b[2], 0, ct.c_void_p(stream.ptr),
                           ct.pointer(self._attr), 1)
        params = [self._param(a) for a in args]
        ptrs = (ct.c_void_p * len(params))(*[ct.cast(ct.pointer(p), ct.c_void_p) for p in params])
        func = getattr(fn, "kernel", fn).ptr  # RawKernel -> cupy.cuda.function.Function -> CUfunction
        rc = self._fn(ct.byref(cfg), ct.c_void_p(func), ptrs, None)
        if rc != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {rc}")


class Kernels:
    """All kernels of the CUDA engine.  Construct once per process (after choosing the device)."""

    def __init__(self) -> None:
        import cupy  # lazily: this module is imported only when the CUDA engine is chosen
        import numpy

        self._cp = cupy
        self._np = numpy
        self._names = name_expressions()
        self._module = cupy.RawModule(
            code=module_source(), options=COMPILE_OPTIONS, name_expressions=self._names
        )
        # Fetch every function now: compiling and loading must not happen during a capture.
        self._fn = {n: self._module.get_function(n) for n in self._names + PLAIN_KERNELS}
        self._extra_names = frozenset(name_expressions(extra=True))
        self._extra_module = None
        dev = cupy.cuda.Device()
        self.device_id = dev.id
        self.num_sms = int(dev.attributes["MultiProcessorCount"])
        self._bf16_dtype = None
        try:
            import ml_dtypes

            self._bf16_dtype = numpy.dtype(ml_dtypes.bfloat16)
        except ImportError:  # pragma: no cover - ml_dtypes is a runtime dependency
            pass
        self._dummy = cupy.zeros(8, dtype=cupy.uint16)  # stands for an absent optional operand
        self._workspace = None  # decode scratch, grown on demand (eager calls only)
        # Programmatic dependent launch: while True, every launch lets the kernel start before the
        # previous kernel of the stream has finished (the kernels' pdl_wait() orders their reads and
        # writes).  The engine turns it on for the captured rows path.  Needs compute capability 9.0.
        self.pdl = False
        self.pdl_supported = int(dev.compute_capability) >= 90
        self._pdl_launcher = None

    # ------------------------------------------------------------------ checks
    def _arr(self, a: Any, name: str) -> Any:
        if not isinstance(a, self._cp.ndarray):
            raise ValueError(f"{name}: expected a cupy.ndarray, got {type(a).__name__}")
        if not a.flags.c_contiguous:
            raise ValueError(f"{name}: must be C-contiguous (shape {a.shape}, strides {a.strides})")
        if a.device.id != self.device_id:
            raise ValueError(f"{name}: on device {a.device.id}, kernels on device {self.device_id}")
        return a

    def _f32(self, a: Any, name: str, ndim: int | None = None) -> Any:
        self._arr(a, name)
        if a.dtype != self._np.float32:
            raise ValueError(f"{name}: dtype must be float32, got {a.dtype}")
        if ndim is not None and a.ndim != ndim:
            raise ValueError(f"{name}: expected {ndim} dimensions, got shape {a.shape}")
        return a

    def _i32(self, a: Any, name: str, ndim: int | None = None) -> Any:
        self._arr(a, name)
        if a.dtype != self._np.int32:
            raise ValueError(f"{name}: dtype must be int32, got {a.dtype}")
        if ndim is not None and a.ndim != ndim:
            raise ValueError(f"{name}: expected {ndim} dimensions, got shape {a.shape}")
        return a

    def _is_bf16(self, dtype: Any) -> bool:
        return dtype in (self._np.uint16, self._np.int16) or (
            self._bf16_dtype is not None and dtype == self._bf16_dtype
        )

    def _bf16(self, a: Any, name: str, ndim: int | None = None) -> Any:
        self._arr(a, name)
        if not self._is_bf16(a.dtype):
            raise ValueError(f"{name}: dtype must be bfloat16 (or uint16 raw bits), got {a.dtype}")
        if ndim is not None and a.ndim != ndim:
            raise ValueError(f"{name}: expected {ndim} dimensions, got shape {a.shape}")
        return a

    @staticmethod
    def _shape(a: Any, name: str, shape: tuple[int, ...]) -> None:
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(a.shape)}")

    @staticmethod
    def _aligned(a: Any, name: str, nbytes: int = 16) -> None:
        if a.data.ptr % nbytes:
            raise ValueError(f"{name}: device pointer must be {nbytes}-byte aligned")

    @staticmethod
    def _disjoint(a: Any, an: str, b: Any, bn: str) -> None:
        a0, b0 = a.data.ptr, b.data.ptr
        if a0 < b0 + b.nbytes and b0 < a0 + a.nbytes:
            raise ValueError(f"{an} and {bn} must not overlap")

    def _grid1d(self, n: int, block: int = 256) -> int:
        return max(1, min(_ceil_div(n, block), self.num_sms * 16))

    def load_extra(self) -> None:
        """Compile the extra instances (name_expressions(extra=True)) now; they are otherwise
        compiled on first use, which must not happen during a graph capture."""
        if self._extra_module is None:
            names = tuple(sorted(self._extra_names))
            self._extra_module = self._cp.RawModule(
                code=module_source(), options=COMPILE_OPTIONS, name_expressions=names
            )
            self._fn.update({n: self._extra_module.get_function(n) for n in names})

    def _has(self, name: str) -> bool:
        """Whether the kernel instance `name` is compiled (compiling the extra module if it is there)."""
        if name not in self._fn and name in self._extra_names:
            self.load_extra()
        return name in self._fn

    def _launch(self, name: str, grid: tuple, block: tuple, args: tuple, stream: Any) -> None:
        if self.pdl:
            if self._pdl_launcher is None:
                self._pdl_launcher = PdlLauncher(self._cp)
            self._pdl_launcher.launch(self._fn[name], grid, block, args, stream)
        else:
            self._fn[name](grid, block, args, stream=stream)

    # ------------------------------------------------------------------ kernels
    def embedding(self, ids: Any, table: Any, out: Any, *, scale: float | None = None, stream: Any = None) -> None:
        """out[m, :] = float32(table[ids[m], :]) (* scale, an fp32 value: Gemma's sqrt(hidden)).
        ids int32[M], table bf16[V, H], out f32[M, H].  An id outside [0, V) yields a row of NaN."""
        np = self._np
        self._i32(ids, "ids", 1)
        self._bf16(table, "table", 2)
        self._f32(out, "out", 2)
        (M,), (V, H) = ids.shape, table.shape
        self._shape(out, "out", (M, H))
        if M == 0:
            return
        s = np.float32(1.0 if scale is None else scale)
        self._launch("embedding_kernel", (M,), (256,), (ids, table, out, np.int32(V), np.int32(H), s), stream)

    def gemv(
        self,
        x: Any,
        w: Any,
        out: Any,
        bias: Any = None,
        *,
        accumulate: bool = False,
        config: tuple[int, int] | None = None,
        norm_weight: Any = None,
        eps: float = 1e-6,
        norm_offset: float = 0.0,
        stream: Any = None,
    ) -> None:
        """out = x @ w.T (+ bias), or out += x @ w.T (+ bias) with accumulate=True.

        x f32[M, K] (1 <= M <= 16), w bf16[N, K] (HF [out, in]), bias bf16[N] or None,
        out f32[M, N].  K must be a multiple of 8 (16-byte weight rows); N is arbitrary.
        x must not overlap out.  `config=(R, U)` picks a compiled variant (GEMV_DEFAULT, GEMV_EXTRA;
        U = 0: x staged in shared memory).
        With norm_weight bf16[K] (16-byte aligned): fused RMSNorm prologue, x is the
        un-normalised input and the result is that of rmsnorm(x, norm_weight, eps) followed by
        this GEMV (within fp32 rounding); only the GEMV_DEFAULT configs are compiled for it.
        norm_offset is added to the norm weight in fp32 (Gemma's (1 + w): 1.0)."""
        np = self._np
        M, K, N, norm = self._linear_operands("gemv", x, w, "w", out, bias, norm_weight, swiglu=False)
        r, u = config if config is not None else GEMV_DEFAULT[M]
        name = gemv_name(M, r, u, False, norm)
        if not self._has(name):
            raise ValueError(f"gemv: no compiled variant M={M}, R={r}, U={u}, norm={norm}")
        threads, rows = _gemv_block_rows(r, u)
        grid = (_ceil_div(N, rows),)
        args = (
            x, w, self._dummy if bias is None else bias, out,
            np.int32(N), np.int32(K), np.int32(1 if accumulate else 0), np.int32(0 if bias is None else 1),
            norm_weight if norm else self._dummy, np.float32(eps), np.float32(norm_offset), np.int32(0),
        )
        self._launch(name, grid, (threads,), args, stream)

    def _linear_operands(self, op: str, x: Any, w: Any, wname: str, out: Any, bias: Any, norm_weight: Any,
                         swiglu: bool) -> tuple[int, int, int, bool]:
        """Check the operands of a GEMV (gemv, gemv_swiglu, gemv_tc); returns (M, K, N, norm), N the
        output columns (I with swiglu, whose w holds 2I rows)."""
        self._f32(x, "x", 2)
        self._bf16(w, wname, 2)
        self._f32(out, "out", 2)
        M, K = x.shape
        rows = w.shape[0]
        if w.shape[1] != K:
            raise ValueError(f"{wname}: expected shape (N, {K}) to match x {x.shape}, got {w.shape}")
        if swiglu:
            if rows % 2:
                raise ValueError(f"{wname}: expected shape (2*I, {K}) with swiglu, got {w.shape}")
            if bias is not None:
                raise ValueError(f"{op}: bias is not supported with swiglu")
        N = rows // 2 if swiglu else rows
        self._shape(out, "out", (M, N))
        if not 1 <= M <= GEMV_MAX_M:
            raise ValueError(f"{op}: M = {M} rows; this kernel takes 1..{GEMV_MAX_M} (use a GEMM)")
        if K % 8:
            raise ValueError(f"{op}: K = {K} must be a multiple of 8")
        if N == 0 or K == 0:
            raise ValueError(f"{op}: empty operand (N = {N}, K = {K})")
        self._aligned(x, "x")
        self._aligned(w, wname)
        self._disjoint(x, "x", out, "out")
        if bias is not None:
            self._bf16(bias, "bias", 1)
            self._shape(bias, "bias", (N,))
        return M, K, N, self._norm_weight(norm_weight, K)

    def _norm_weight(self, norm_weight: Any, K: int) -> bool:
        """Check the optional fused-RMSNorm weight of a GEMV; True when it is given."""
        if norm_weight is None:
            return False
        self._bf16(norm_weight, "norm_weight", 1)
        self._shape(norm_weight, "norm_weight", (K,))
        self._aligned(norm_weight, "norm_weight")
        return True

    def gemv_residual(self, x: Any, w: Any, out: Any, bias: Any = None, *, stream: Any = None) -> None:
        """out += x @ w.T (+ bias): the o_proj / down_proj residual add.  Same rules as gemv."""
        self.gemv(x, w, out, bias, accumulate=True, stream=stream)

    def gemv_swiglu(
        self,
        x: Any,
        w_gate_up: Any,
        out: Any,
        *,
        config: tuple[int, int] | None = None,
        norm_weight: Any = None,
        eps: float = 1e-6,
        norm_offset: float = 0.0,
        activation: str = "silu",
        stream: Any = None,
    ) -> None:
        """out = act(x @ Wg.T) * (x @ Wu.T) in one pass over the fused weight
        w_gate_up bf16[2I, K] = concat(gate_proj.weight, up_proj.weight).  x f32[M, K], out f32[M, I];
        act: "silu" (SwiGLU) or "gelu_tanh" (GeGLU).  norm_weight bf16[K]: fused RMSNorm of x first,
        as in gemv (norm_offset likewise)."""
        np = self._np
        M, K, inter, norm = self._linear_operands("gemv_swiglu", x, w_gate_up, "w_gate_up", out, None, norm_weight,
                                                  swiglu=True)
        r, u = config if config is not None else GEMV_SWIGLU_DEFAULT[M]
        name = gemv_name(M, r, u, True, norm)
        if not self._has(name):
            raise ValueError(f"gemv_swiglu: no compiled variant M={M}, R={r}, U={u}, norm={norm}")
        threads, rows = _gemv_block_rows(r, u)
        grid = (_ceil_div(inter, rows),)
        args = (
            x, w_gate_up, self._dummy, out, np.int32(inter), np.int32(K), np.int32(0), np.int32(0),
            norm_weight if norm else self._dummy, np.float32(eps), np.float32(norm_offset), self._act(activation),
        )
        self._launch(name, grid, (threads,), args, stream)

    def gemv_tc(
        self,
        x: Any,
        w: Any,
        out: Any,
        bias: Any = None,
        *,
        accumulate: bool = False,
        swiglu: bool = False,
        norm_weight: Any = None,
        eps: float = 1e-6,
        config: tuple[int, int, int] | None = None,
        norm_offset: float = 0.0,
        activation: str = "silu",
        stream: Any = None,
    ) -> None:
        """Tensor-core version of gemv / gemv_swiglu (mma.sync bf16, x split into bf16 hi + lo,
        fp32 accumulation): out (=|+=) x @ w.T (+ bias), or with swiglu=True
        out (=|+=) silu(x @ Wg.T) * (x @ Wu.T) for w = concat(Wg, Wu) bf16[2I, K], out f32[M, I]
        (no bias with swiglu).  x f32[M, K] (1 <= M <= 16), w bf16[N, K], bias bf16[N], out f32[M, N];
        K a positive multiple of 8; x must not overlap out.  norm_weight bf16[K]: fused RMSNorm of x
        first, as in gemv.  `config=(TILES, W, U)` picks a compiled variant (GEMV_TC_DEFAULT /
        GEMV_TC_EXTRA, GEMV_TC_SWIGLU_*; norm only for the defaults).  Row m of the result is
        bit-identical whatever M is, for configs with the same W.  norm_offset and activation (the
        swiglu gate's: "silu" or "gelu_tanh") as in gemv / gemv_swiglu."""
        np = self._np
        op = "gemv_tc"
        M, K, N, norm = self._linear_operands(op, x, w, "w", out, bias, norm_weight, swiglu)
        defaults = GEMV_TC_SWIGLU_DEFAULT if swiglu else GEMV_TC_DEFAULT
        tiles, warps, u = config if config is not None else defaults[M]
        name = gemv_tc_name(2 if M > 8 else 1, tiles, warps, u, swiglu, norm)
        if not self._has(name):
            raise ValueError(
                f"{op}: no compiled variant M={M}, config=({tiles}, {warps}, {u}), swiglu={swiglu}, norm={norm}"
            )
        grid = (_ceil_div(N, 16 * tiles),)
        args = (
            x, w, self._dummy if bias is None else bias, out,
            np.int32(M), np.int32(N), np.int32(K), np.int32(1 if accumulate else 0),
            np.int32(0 if bias is None else 1), norm_weight if norm else self._dummy, np.float32(eps),
            np.float32(norm_offset), self._act(activation),
        )
        self._launch(name, grid, (warps * 32,), args, stream)

    def _act(self, activation: str) -> Any:
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: supported {', '.join(ACTIVATIONS)}")
        return self._np.int32(ACTIVATIONS[activation])

    def rmsnorm(
        self, x: Any, weight: Any, eps: float, out: Any, residual: Any = None, *, offset: float = 0.0,
        stream: Any = None
    ) -> None:
        """out = (offset + weight) * (h * rsqrt(mean(h^2) + eps)) per row, h = x, or, with residual
        given, residual += x (in place) and h = the new residual.  x, out, residual f32[M, H], weight
        bf16[H]; offset 1.0: Gemma's (1 + w), added in fp32.  out may be x itself; residual must not
        overlap x or out."""
        np = self._np
        self._f32(x, "x", 2)
        self._bf16(weight, "weight", 1)
        self._f32(out, "out", 2)
        M, H = x.shape
        self._shape(weight, "weight", (H,))
        self._shape(out, "out", (M, H))
        if residual is not None:
            self._f32(residual, "residual", 2)
            self._shape(residual, "residual", (M, H))
            self._disjoint(residual, "residual", x, "x")
            self._disjoint(residual, "residual", out, "out")
        elif out.data.ptr != x.data.ptr:
            self._disjoint(x, "x", out, "out")
        if M == 0:
            return
        block = 512 if H >= 2048 else 256 if H >= 512 else 128
        args = (
            x, weight, out, self._dummy if residual is None else residual,
            np.int32(H), np.float32(eps), np.int32(0 if residual is None else 1), np.float32(offset),
        )
        self._launch("rmsnorm_kernel", (M,), (block,), args, stream)

    def rmsnorm_add(self, x: Any, weight: Any, eps: float, residual: Any, *, offset: float = 0.0,
                    stream: Any = None) -> None:
        """residual += (offset + weight) * (x * rsqrt(mean(x^2) + eps)) per row: a sandwich block's
        post-norm before its residual add.  x, residual f32[M, H] (disjoint), weight bf16[H]."""
        np = self._np
        self._f32(x, "x", 2)
        self._bf16(weight, "weight", 1)
        self._f32(residual, "residual", 2)
        M, H = x.shape
        self._shape(weight, "weight", (H,))
        self._shape(residual, "residual", (M, H))
        self._disjoint(x, "x", residual, "residual")
        if M == 0:
            return
        block = 512 if H >= 2048 else 256 if H >= 512 else 128
        args = (x, weight, residual, np.int32(H), np.float32(eps), np.float32(offset))
        self._launch("rmsnorm_add_kernel", (M,), (block,), args, stream)

    def softcap(self, x: Any, cap: float, *, stream: Any = None) -> None:
        """x = cap * tanh(x / cap) in place, x f32[...] (final-logit softcapping)."""
        np = self._np
        self._f32(x, "x")
        if x.size == 0:
            return
        self._launch("softcap_kernel", (self._grid1d(x.size),), (256,), (x, np.int64(x.size), np.float32(cap)), stream)

    def rope(
        self,
        x: Any,
        positions: Any,
        inv_freq: Any,
        norm_weight: Any = None,
        eps: float = 1e-6,
        *,
        attention_scaling: float = 1.0,
        norm_offset: float = 0.0,
        rotary_dim: int | None = None,
        stream: Any = None,
    ) -> None:
        """In place on x f32[M, n_heads, head_dim]: optional per-head RMSNorm with
        norm_weight bf16[head_dim] (Qwen3 q_norm/k_norm; (norm_offset + w): Gemma 3's 1 + w), then HF
        rotate_half rotary embedding at positions int32[M] with inv_freq f32[rotary_dim/2] over the first
        rotary_dim dims (default head_dim; fewer: partial rotary, the rest pass through); cos/sin are
        multiplied by attention_scaling (longrope's attention factor; 1.0 otherwise).  head_dim even,
        <= 256; rotary_dim even, <= head_dim."""
        np = self._np
        self._f32(x, "x", 3)
        self._i32(positions, "positions", 1)
        self._f32(inv_freq, "inv_freq", 1)
        M, nh, hd = x.shape
        if hd % 2 or hd > 256 or hd == 0:
            raise ValueError(f"rope: head_dim = {hd} must be even and <= 256")
        rd = self._rotary_dim(hd, rotary_dim)
        self._shape(positions, "positions", (M,))
        self._shape(inv_freq, "inv_freq", (rd // 2,))
        if norm_weight is not None:
            self._bf16(norm_weight, "norm_weight", 1)
            self._shape(norm_weight, "norm_weight", (hd,))
        if M * nh == 0:
            return
        warps = 4
        args = (
            x, positions, inv_freq, self._dummy if norm_weight is None else norm_weight,
            np.int32(M), np.int32(nh), np.int32(hd), np.float32(eps),
            np.int32(0 if norm_weight is None else 1), np.float32(attention_scaling),
            np.float32(norm_offset), np.int32(rd),
        )
        self._launch("rope_kernel", (_ceil_div(M * nh, warps),), (32 * warps,), args, stream)

    def rope_kv_append(
        self,
        qkv: Any,
        positions: Any,
        inv_freq: Any,
        q_out: Any,
        k_cache: Any,
        v_cache: Any,
        q_norm: Any = None,
        k_norm: Any = None,
        eps: float = 1e-6,
        *,
        attention_scaling: float = 1.0,
        norm_offset: float = 0.0,
        rotary_dim: int | None = None,
        stream: Any = None,
    ) -> None:
        """rope on q and k plus kv_append, in one launch, from the fused QKV GEMV output
        (norm_offset, rotary_dim and attention_scaling as in rope):
        qkv f32[M, (n_heads + 2 n_kv) * head_dim] (per row: q heads, k heads, v heads).
        q_out f32[M, n_heads, head_dim] = rope(q) (optional per-head q_norm first), and
        k_cache[:, positions[m], :] = bf16(rope(k)) (optional k_norm), v_cache[...] = bf16(v):
        the same as rope(q), rope(k) and kv_append(k, v) (bit-identical up to the fp32 rounding
        of the rotation).  Caches bf16[n_kv, max_ctx, head_dim]; positions int32[M] (device; a
        position outside [0, max_ctx) skips the cache writes).  q_out must not overlap qkv,
        except that for M == 1 it may be the q part of qkv itself (rotation in place).
        qkv is not modified (except through that in-place q_out)."""
        np = self._np
        self._f32(qkv, "qkv", 2)
        self._i32(positions, "positions", 1)
        self._f32(inv_freq, "inv_freq", 1)
        self._f32(q_out, "q_out", 3)
        n_kv, max_ctx, hd = self._check_cache(k_cache, v_cache)
        M, nh, qhd = q_out.shape
        if qhd != hd:
            raise ValueError(f"q_out: head_dim {qhd} differs from the cache's {hd}")
        if hd % 2 or hd > 256 or hd == 0:
            raise ValueError(f"rope_kv_append: head_dim = {hd} must be even and <= 256")
        rd = self._rotary_dim(hd, rotary_dim)
        self._shape(qkv, "qkv", (M, (nh + 2 * n_kv) * hd))
        self._shape(positions, "positions", (M,))
        self._shape(inv_freq, "inv_freq", (rd // 2,))
        for a, an in ((q_norm, "q_norm"), (k_norm, "k_norm")):
            if a is not None:
                self._bf16(a, an, 1)
                self._shape(a, an, (hd,))
        if not (M == 1 and q_out.data.ptr == qkv.data.ptr):
            self._disjoint(q_out, "q_out", qkv, "qkv")
        for c, cn in ((k_cache, "k_cache"), (v_cache, "v_cache")):
            self._disjoint(c, cn, qkv, "qkv")
            self._disjoint(c, cn, q_out, "q_out")
        slots = nh + 2 * n_kv
        if M * slots == 0:
            return
        warps = 4
        args = (
            qkv, positions, inv_freq,
            self._dummy if q_norm is None else q_norm, self._dummy if k_norm is None else k_norm,
            q_out, k_cache, v_cache,
            np.int32(M), np.int32(nh), np.int32(n_kv), np.int32(hd), np.int32(max_ctx), np.float32(eps),
            np.int32(0 if q_norm is None else 1), np.int32(0 if k_norm is None else 1),
            np.float32(attention_scaling), np.float32(norm_offset), np.int32(rd),
        )
        self._launch("rope_kv_append_kernel", (_ceil_div(M * slots, warps),), (32 * warps,), args, stream)

    @staticmethod
    def _rotary_dim(hd: int, rotary_dim: int | None) -> int:
        rd = hd if rotary_dim is None else int(rotary_dim)
        if rd <= 0 or rd % 2 or rd > hd:
            raise ValueError(f"rotary_dim = {rd} must be even and in 2..head_dim {hd}")
        return rd

    def _check_cache(self, k_cache: Any, v_cache: Any) -> tuple[int, int, int]:
        self._bf16(k_cache, "k_cache", 3)
        self._bf16(v_cache, "v_cache", 3)
        if k_cache.shape != v_cache.shape:
            raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ in shape")
        self._disjoint(k_cache, "k_cache", v_cache, "v_cache")
        n_kv, max_ctx, hd = k_cache.shape
        return n_kv, max_ctx, hd

    def kv_append(
        self, k: Any, v: Any, k_cache: Any, v_cache: Any, positions: Any, *, stream: Any = None
    ) -> None:
        """k_cache[:, positions[m], :] = bf16(k[m]); same for v.  k, v f32[M, n_kv, head_dim];
        caches bf16[n_kv, max_ctx, head_dim]; positions int32[M] (read on the device; a position
        outside [0, max_ctx) is skipped)."""
        np = self._np
        self._f32(k, "k", 3)
        self._f32(v, "v", 3)
        self._i32(positions, "positions", 1)
        n_kv, max_ctx, hd = self._check_cache(k_cache, v_cache)
        M = k.shape[0]
        self._shape(k, "k", (M, n_kv, hd))
        self._shape(v, "v", (M, n_kv, hd))
        self._shape(positions, "positions", (M,))
        n = M * n_kv * hd
        if n == 0:
            return
        args = (k, v, k_cache, v_cache, positions, np.int32(M), np.int32(n_kv), np.int32(hd), np.int32(max_ctx))
        self._launch("kv_append_kernel", (self._grid1d(n),), (256,), args, stream)

    def decode_splits(self, max_ctx: int, n_kv: int, n_rows: int = 1, n_heads: int | None = None) -> int:
        """Number of context splits for attention_decode of n_rows query rows (any n_rows >= 1;
        pass the M the call will use: the split count is fixed in a captured graph).

        The split kernel runs n_kv * ceil(n_rows * G / R) * n_splits blocks (G = n_heads / n_kv;
        R = 8 query vectors per block when n_rows * G <= 8, else 16; head_dim 256: R <= 4 on the
        SIMT path, which this count ignores).  At the longest context we want about 2 blocks of 4
        warps per SM (each warp keeps ~8 KiB of K/V loads in flight, 64 KiB per SM covers the
        HBM latency), so n_splits = ceil(2 * SMs / (n_kv * row blocks)), but no split shorter
        than ATTN_CHUNK_ALIGN keys at max_ctx.  On the device the split size is
        ceil(L / n_splits) rounded up to ATTN_CHUNK_ALIGN for the current length L, so shorter
        contexts use fewer, still >= 64-key, splits.  Llama-3-8B on 132 SMs (n_kv 8, G 4):
        M = 1..4 -> 33 splits (264 blocks), M = 5..8 -> 17 (272), M = 16 -> 9 (288)."""
        n_heads = n_kv if n_heads is None else n_heads
        n_kv = max(1, int(n_kv))
        qvec = max(1, int(n_rows)) * max(1, int(n_heads) // n_kv)
        row_blocks = _ceil_div(qvec, 8 if qvec <= 8 else 16)
        want = _ceil_div(2 * self.num_sms, n_kv * row_blocks)
        return max(1, min(want, _ceil_div(max(1, int(max_ctx)), ATTN_CHUNK_ALIGN), 65535))

    @staticmethod
    def decode_workspace_size(n_rows: int, n_heads: int, head_dim: int, n_splits: int) -> int:
        """float32 elements of the attention_decode scratch buffer: per split and query vector
        (row x head) head_dim partial sums plus (max, sum).  Its content need not be initialised:
        every call writes what it reads."""
        return n_splits * n_rows * n_heads * (head_dim + 2)

    def attention_decode(
        self,
        q: Any,
        k_cache: Any,
        v_cache: Any,
        positions: Any,
        out: Any,
        scale: float,
        *,
        n_splits: int | None = None,
        workspace: Any = None,
        window: int | None = None,
        softcap: float | None = None,
        stream: Any = None,
    ) -> None:
        """Causal attention of M query rows (decode M=1, verify M=k) against the cache:
        row m attends to cache rows 0..positions[m] inclusive (a position >= max_ctx counts as
        max_ctx - 1; a row with a negative position gets NaN).  q, out f32[M, n_heads, head_dim];
        caches bf16[n_kv, max_ctx, head_dim], 16-byte aligned; positions int32[M] (device).
        head_dim in {32, 64, 128, 256}; n_heads a multiple of n_kv.  Flash-decoding in two
        launches (split + combine): `n_splits` (default decode_splits(max_ctx, n_kv, M, n_heads))
        fixed at capture time; the length L = max(positions) + 1 and the split size are computed
        on the device, splits past L exit at once.  head_dim <= 128 runs on tensor cores with q
        and the softmax weights each split into two bf16 terms (hi + lo): about fp32 accuracy.
        `workspace`: f32 buffer of >= decode_workspace_size(M, n_heads, head_dim, n_splits)
        elements, any content; if None an internal one is used (grown on demand: make one eager
        call before capturing, or pass your own, and pass your own when calls on different streams
        may overlap).
        `window`: row m sees only keys (positions[m] - window, positions[m]], and the split work covers
        only the keys some row sees (a long context costs what the window costs).  `softcap`: scores
        -> softcap * tanh(scores / softcap) before the mask (Gemma 2).  Both fixed at capture time."""
        np = self._np
        self._f32(q, "q", 3)
        self._f32(out, "out", 3)
        self._i32(positions, "positions", 1)
        n_kv, max_ctx, hd = self._check_cache(k_cache, v_cache)
        M, nh, qhd = q.shape
        if qhd != hd:
            raise ValueError(f"q: head_dim {qhd} differs from the cache's {hd}")
        if hd not in DECODE_HEAD_DIMS:
            raise ValueError(f"attention_decode: head_dim {hd} not in {DECODE_HEAD_DIMS}")
        if n_kv == 0 or nh % n_kv:
            raise ValueError(f"attention_decode: n_heads {nh} is not a multiple of n_kv {n_kv}")
        if M == 0 or max_ctx == 0:
            raise ValueError("attention_decode: empty q or cache")
        self._shape(out, "out", (M, nh, hd))
        self._shape(positions, "positions", (M,))
        self._disjoint(q, "q", out, "out")
        self._aligned(k_cache, "k_cache")
        self._aligned(v_cache, "v_cache")
        G = nh // n_kv
        if n_splits is None:
            n_splits = self.decode_splits(max_ctx, n_kv, M, nh)
        n_splits = int(n_splits)
        if not 1 <= n_splits <= 65535:
            raise ValueError(f"attention_decode: n_splits = {n_splits} must be in 1..65535")
        need = self.decode_workspace_size(M, nh, hd, n_splits)
        if workspace is None:
            if self._workspace is None or self._workspace.size < need:
                self._workspace = self._cp.empty(max(need, 1 << 20), dtype=self._cp.float32)
            workspace = self._workspace
        else:
            self._f32(workspace, "workspace")
            if workspace.size < need:
                raise ValueError(f"workspace: {workspace.size} float32 elements, need {need}")
        for a, an in ((q, "q"), (out, "out"), (positions, "positions"), (k_cache, "k_cache"), (v_cache, "v_cache")):
            self._disjoint(workspace, "workspace", a, an)
        ws = workspace.reshape(-1)
        n_acc = n_splits * M * nh * hd
        part_acc = ws[:n_acc]
        part_ml = ws[n_acc : n_acc + 2 * n_splits * M * nh]
        qb = _decode_qb(hd, M * G)
        win, cap2 = self._window_softcap(window, softcap)
        ext = bool(win or cap2)  # the tensor-core instance with the window / softcap code
        if hd in DECODE_TC_HEAD_DIMS:
            grid = (_ceil_div(M * G, qb), n_splits, n_kv)
            threads = ATTN_TC_WARPS * 32
        else:
            grid = (n_kv, n_splits, _ceil_div(M * G, qb))
            threads = ATTN_WARPS * 32
        qscale = np.float32(float(scale) * LOG2E)
        args = (
            q, k_cache, v_cache, positions, part_acc, part_ml,
            np.int32(M), np.int32(nh), np.int32(n_kv), np.int32(max_ctx), np.int32(n_splits), qscale,
            win, cap2,
        )
        self._launch(decode_name(hd, qb, ext), grid, (threads,), args, stream)
        args2 = (
            part_acc, part_ml, positions, out,
            np.int32(M), np.int32(nh), np.int32(hd), np.int32(max_ctx), np.int32(n_splits), win,
        )
        self._launch("attn_decode_combine_kernel", (M * nh,), (hd,), args2, stream)

    def _window_softcap(self, window: int | None, softcap: float | None) -> tuple[Any, Any]:
        """Kernel arguments: window (0 = none) and the softcap in base 2, softcap * log2(e) (0 = none)."""
        np = self._np
        if window is not None and int(window) <= 0:
            raise ValueError(f"window = {window} must be positive")
        if softcap is not None and not float(softcap) > 0:
            raise ValueError(f"softcap = {softcap} must be positive")
        return (np.int32(0 if window is None else int(window)),
                np.float32(0.0 if softcap is None else float(softcap) * LOG2E))

    def attention_prefill(
        self,
        q: Any,
        k_cache: Any,
        v_cache: Any,
        start_pos: int,
        T: int,
        out: Any,
        scale: float,
        *,
        block_q: int | None = None,
        window: int | None = None,
        softcap: float | None = None,
        stream: Any = None,
    ) -> None:
        """Causal attention of a prompt chunk: query row t (position start_pos + t) attends to
        cache rows 0..start_pos+t (with `window`: only the last `window` of them; tiles before every
        row's window are skipped), whose K/V were appended before.  `softcap` as in attention_decode.
        q, out f32[>=T, n_heads, head_dim] (rows T.. untouched); head_dim in PREFILL_HEAD_DIMS;
        start_pos + T <= max_ctx.
        Tensor cores (flash_prefill.cu): q and the softmax weights P are rounded to bf16 for the
        mma (as bf16 attention in transformers does), the softmax state and sums stay fp32.
        `block_q`: query rows per block, one of PREFILL_BQS (default PREFILL_BQ).  Eager only:
        launched without PDL, with dynamic shared memory."""
        np = self._np
        self._f32(q, "q", 3)
        self._f32(out, "out", 3)
        n_kv, max_ctx, hd = self._check_cache(k_cache, v_cache)
        start_pos, T = int(start_pos), int(T)
        if q.shape[1:] != out.shape[1:] or q.shape[2] != hd:
            raise ValueError(f"q {q.shape} / out {out.shape} do not match the cache head_dim {hd}")
        nh = q.shape[1]
        if hd not in PREFILL_HEAD_DIMS:
            raise ValueError(f"attention_prefill: head_dim {hd} not in {PREFILL_HEAD_DIMS}")
        if n_kv == 0 or nh % n_kv:
            raise ValueError(f"attention_prefill: n_heads {nh} is not a multiple of n_kv {n_kv}")
        if T < 1 or q.shape[0] < T or out.shape[0] < T:
            raise ValueError(f"attention_prefill: T = {T} rows, q has {q.shape[0]}, out {out.shape[0]}")
        if start_pos < 0 or start_pos + T > max_ctx:
            raise ValueError(f"attention_prefill: positions {start_pos}..{start_pos + T - 1} outside max_ctx {max_ctx}")
        bq = PREFILL_BQ if block_q is None else int(block_q)
        if bq not in PREFILL_BQS:
            raise ValueError(f"attention_prefill: block_q {bq} not in {PREFILL_BQS}")
        self._disjoint(q, "q", out, "out")
        for a, an, nbytes in ((q, "q", 8), (out, "out", 8), (k_cache, "k_cache", 16), (v_cache, "v_cache", 16)):
            self._aligned(a, an, nbytes)
        name = prefill_name(hd, bq)
        fn = self._fn[name]
        smem = prefill_smem_bytes(hd)
        done = self.__dict__.setdefault("_prefill_smem_set", set())
        if name not in done:  # opt in to more than 48 KiB of dynamic shared memory, once
            fn.max_dynamic_shared_size_bytes = smem
            done.add(name)
        grid = (nh, _ceil_div(T, bq))  # heads vary fastest; the kernel starts the longest blocks first
        args = (
            q, k_cache, v_cache, out, np.int32(T), np.int32(start_pos), np.int32(nh),
            np.int32(n_kv), np.int32(max_ctx), np.float32(float(scale) * LOG2E),
            *self._window_softcap(window, softcap),
        )
        fn(grid, (bq // 16 * 32,), args, shared_mem=smem, stream=stream)

    def swiglu(self, gate_up: Any, out: Any, *, activation: str = "silu", stream: Any = None) -> None:
        """out = act(gate_up[:, :I]) * gate_up[:, I:], act "silu" or "gelu_tanh".  gate_up f32[M, 2I],
        out f32[M, I]."""
        np = self._np
        self._f32(gate_up, "gate_up", 2)
        self._f32(out, "out", 2)
        M, I2 = gate_up.shape
        if I2 % 2:
            raise ValueError(f"gate_up: second dimension {I2} must be even (2 * I)")
        self._shape(out, "out", (M, I2 // 2))
        self._disjoint(gate_up, "gate_up", out, "out")
        n = M * (I2 // 2)
        if n == 0:
            return
        args = (gate_up, out, np.int32(M), np.int32(I2 // 2), self._act(activation))
        self._launch("swiglu_kernel", (self._grid1d(n),), (256,), args, stream)

    def argmax(self, rows: Any, out: Any, *, stream: Any = None) -> None:
        """out[i] = index of the first maximum of rows[i] (torch.argmax), or -1 if rows[i] holds
        any NaN or +-Inf.  rows f32 or bf16 [n, V]; out int32[n]."""
        np = self._np
        self._arr(rows, "rows")
        self._i32(out, "out", 1)
        if rows.ndim != 2:
            raise ValueError(f"rows: expected 2 dimensions, got shape {rows.shape}")
        n, V = rows.shape
        self._shape(out, "out", (n,))
        if V == 0 or V >= 2**31:
            raise ValueError(f"argmax: V = {V} must be in 1..2^31-1")
        if rows.dtype == np.float32:
            name = "argmax_f32_kernel"
        elif self._is_bf16(rows.dtype):
            name = "argmax_bf16_kernel"
        else:
            raise ValueError(f"rows: dtype must be float32 or bfloat16, got {rows.dtype}")
        if n == 0:
            return
        self._launch(name, (n,), (1024,), (rows, out, np.int32(V)), stream)

    def f32_to_bf16(self, x: Any, out: Any, *, stream: Any = None) -> None:
        """out = bf16(x), round to nearest even, NaN -> 0x7FC0 (torch CPU semantics).
        x f32[...]; out bf16 or uint16, same shape."""
        np = self._np
        self._f32(x, "x")
        self._bf16(out, "out")
        self._shape(out, "out", x.shape)
        if x.size == 0:
            return
        self._launch("f32_to_bf16_kernel", (self._grid1d(x.size),), (256,), (x, out, np.int64(x.size)), stream)

    def bf16_to_f32(self, x: Any, out: Any, *, stream: Any = None) -> None:
        """out = float32(x) (exact).  x bf16 or uint16 [...]; out f32, same shape."""
        np = self._np
        self._bf16(x, "x")
        self._f32(out, "out")
        self._shape(out, "out", x.shape)
        if x.size == 0:
            return
        self._launch("bf16_to_f32_kernel", (self._grid1d(x.size),), (256,), (x, out, np.int64(x.size)), stream)


__all__ = ["Kernels", "module_source", "name_expressions"]
