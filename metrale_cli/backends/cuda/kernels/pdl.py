"""The ctypes driver FFI for programmatic dependent launch (PDL): CuPy's launcher does not expose
the launch attribute, so `Kernels` launches through cuLaunchKernelEx while `Kernels.pdl` is on."""

from __future__ import annotations

from typing import Any


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

        self._Attr = Attr
        self._Config = Config
        self._fn = self._lib.cuLaunchKernelEx
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.POINTER(Config), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._pdl_attr = Attr()  # built once: the array of each launch copies it
        self._pdl_attr.id = self._ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
        self._pdl_attr.value[0] = 1  # programmaticStreamSerializationAllowed (int) = 1

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

    def launch(self, fn: Any, grid: tuple, block: tuple, args: tuple, stream: Any, shared_mem: int = 0) -> None:
        """cuLaunchKernelEx with PDL."""
        ct = self._ct
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        if stream is None:
            stream = self._cp.cuda.get_current_stream()
        func = getattr(fn, "kernel", fn).ptr  # RawKernel -> cupy.cuda.function.Function -> CUfunction
        arr = (self._Attr * 1)(self._pdl_attr)
        cfg = self._Config(g[0], g[1], g[2], b[0], b[1], b[2], int(shared_mem), ct.c_void_p(stream.ptr), arr, 1)
        params = [self._param(a) for a in args]
        ptrs = (ct.c_void_p * len(params))(*[ct.cast(ct.pointer(p), ct.c_void_p) for p in params])
        rc = self._fn(ct.byref(cfg), ct.c_void_p(func), ptrs, None)
        if rc != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {rc}")
