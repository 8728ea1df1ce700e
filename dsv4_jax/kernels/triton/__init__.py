"""Backend "triton": Pallas kernels lowered through Triton on NVIDIA GPUs. See `dsv4_jax.kernels`."""
