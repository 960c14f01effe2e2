"""CUDA kernels of the GPU engine (CuPy RawModule).  Importing this package imports no CuPy;
`metrale_cli.cuda.kernels` does so lazily, inside `Kernels()`."""
