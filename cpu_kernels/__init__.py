"""The C sources of the host (CPU) kernels (data: compiled at run time by lightning_zero.kernels.host)."""
