"""The CUDA backend: the engine (engine.py) and its kernels (kernels/: the .cu sources and their
CuPy launch wrappers).  Importing this package imports no CuPy; `Kernels()` does so lazily."""
