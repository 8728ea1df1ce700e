"""Backend "mosaic_gpu": a Pallas Mosaic GPU kernel for Hopper (jax >= 0.12). See `dsv4_jax.kernels`."""
