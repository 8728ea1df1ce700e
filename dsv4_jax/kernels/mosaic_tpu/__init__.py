"""Backend "mosaic_tpu": Pallas TPU kernels (the flat contract and the per-tile prefill). See `dsv4_jax.kernels`."""
