"""metrale's CUDA kernels: the .cu sources of this folder and their Python launch wrappers (CuPy
RawModule, NVRTC).

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

Modules: nvrtc (source assembly, module compile), tuning (configuration tables, launch geometry),
names (template-instance names: the core module, the fused rows path's module behind
`Kernels.load_fused`), pdl (the driver FFI of programmatic dependent launch), checks (operand
checks), launch (`Kernels`, composing the launch wrappers of each kernel file: elementwise, norm_rope,
gemv, gemv_tc, gemv_ring, attention, flash_prefill, argmax), moe and tp (the modules of their own,
compiled only for a mixture of experts / a tensor-parallel rank).  The names below are re-exported
here: import them from this package.
"""

from .launch import Kernels
from .names import (
    PLAIN_KERNELS,
    decode_name,
    gemv_name,
    gemv_tc_name,
    name_expressions,
    prefill_name,
)
from .nvrtc import COMPILE_OPTIONS, compile_module, module_source
from .pdl import PdlLauncher
from .tuning import (
    ACTIVATIONS,
    ATTN_CHUNK_ALIGN,
    ATTN_TC_WARPS,
    ATTN_WARPS,
    DECODE_HEAD_DIMS,
    DECODE_SIMT_KB,
    DECODE_TC_HEAD_DIMS,
    GEMV_DEFAULT,
    GEMV_MAX_M,
    GEMV_SWIGLU_DEFAULT,
    GEMV_TC_DEFAULT,
    GEMV_TC_MIN_ROWS,
    GEMV_TC_P,
    GEMV_TC_SWIGLU_DEFAULT,
    GEMV_WARPS,
    LOG2E,
    PREFILL_BK,
    PREFILL_BQ,
    PREFILL_BQS,
    PREFILL_HEAD_DIMS,
    prefill_bk,
    prefill_smem_bytes,
)

__all__ = ["Kernels", "module_source", "name_expressions"]
