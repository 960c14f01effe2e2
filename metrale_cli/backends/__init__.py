"""Compute backends of the engines: `cuda/` (CuPy and metrale's own CUDA kernels).  Importing this
package imports no backend library."""
