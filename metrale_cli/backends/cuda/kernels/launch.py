"""`Kernels`: the launch wrappers of every kernel of the core and fused modules, one method per kernel (see
the package docstring for the conventions they share).  The wrappers live beside their kernel file, one class
per .cu file (elementwise.py, norm_rope.py, gemv.py, gemv_tc.py, gemv_ring.py, attention.py, flash_prefill.py,
argmax.py: their methods use the operand checks of checks.py and `Kernels`' _launch, _has, _dummy and _grid1d);
`Kernels` composes them and holds what they share: the compiled modules, the device's limits, the launch (with or
without PDL) and the stand-in for an absent operand."""

from __future__ import annotations

from typing import Any

from .argmax import ArgmaxKernels
from .attention import AttentionKernels
from .checks import OperandChecks
from .elementwise import ElementwiseKernels
from .flash_prefill import FlashPrefillKernels
from .gemv import GemvKernels
from .gemv_ring import GemvRingKernels
from .gemv_tc import GemvTcKernels
from .names import PLAIN_KERNELS, fused_name_expressions, name_expressions
from .norm_rope import NormRopeKernels
from .nvrtc import compile_module
from .pdl import PdlLauncher
from .tuning import _ceil_div


class Kernels(OperandChecks, ElementwiseKernels, NormRopeKernels, GemvKernels, GemvTcKernels, GemvRingKernels,
              AttentionKernels, FlashPrefillKernels, ArgmaxKernels):
    """All kernels of the CUDA engine.  Construct once per process (after choosing the device)."""

    def __init__(self) -> None:
        import cupy  # lazily: this module is imported only when the CUDA engine is chosen
        import numpy

        self._cp = cupy
        self._np = numpy
        self._names = name_expressions()
        self._module = compile_module(cupy, self._names)
        # Fetch every function now: compiling and loading must not happen during a capture.
        self._fn = {n: self._module.get_function(n) for n in self._names + PLAIN_KERNELS}
        self._fused_names = frozenset(fused_name_expressions())
        self._fused_module = None
        dev = cupy.cuda.Device()
        self.device_id = dev.id
        self.num_sms = int(dev.attributes["MultiProcessorCount"])
        self.regs_per_sm = int(dev.attributes["MaxRegistersPerMultiprocessor"])
        self.smem_per_sm = int(dev.attributes["MaxSharedMemoryPerMultiprocessor"])
        self.smem_per_block_optin = int(dev.attributes["MaxSharedMemoryPerBlockOptin"])
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

    @property
    def cp(self) -> Any:
        """The CuPy module the kernels run on (the engine allocates its buffers with it)."""
        return self._cp

    def _grid1d(self, n: int, block: int = 256) -> int:
        return max(1, min(_ceil_div(n, block), self.num_sms * 16))

    def load_fused(self) -> None:
        """Compile the fused module (names.fused_name_expressions: the fused rows path's kernels) now; the
        engine does so when it takes the fused path, before any capture."""
        if self._fused_module is None:
            names = tuple(sorted(self._fused_names))
            self._fused_module = compile_module(self._cp, names)
            self._fn.update({n: self._fused_module.get_function(n) for n in names})

    def _has(self, name: str) -> bool:
        """Whether the kernel instance `name` is compiled (compiling the fused module if it is there)."""
        if name not in self._fn and name in self._fused_names:
            self.load_fused()
        return name in self._fn

    def _launch(self, name: str, grid: tuple, block: tuple, args: tuple, stream: Any, shared_mem: int = 0) -> None:
        """Launch with PDL while self.pdl (through cuLaunchKernelEx: CuPy's launcher does not have it)."""
        if self.pdl:
            if self._pdl_launcher is None:
                self._pdl_launcher = PdlLauncher(self._cp)
            self._pdl_launcher.launch(self._fn[name], grid, block, args, stream, shared_mem=shared_mem)
        else:
            self._fn[name](grid, block, args, stream=stream, shared_mem=shared_mem)
