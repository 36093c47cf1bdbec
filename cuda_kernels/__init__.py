"""The CUDA C sources of the fused kernels (data: compiled at run time by lightning_zero.kernels)."""
