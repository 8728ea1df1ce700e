"""The JAX sparse-attention kernels, one file each (the twins of `dsv4_torch.kernels`).

* `xla`: a tiled jnp reference (any device; the CPU default).
* `pallas_triton`: a Pallas kernel lowered through Triton on NVIDIA GPUs (interpret mode on CPU).
* `mosaic`: a Pallas Mosaic GPU kernel for Hopper, jax >= 0.12 (GPU interpret mode on CPU).

`dsv4_jax.attention.sparse_attention` chooses between them; call that, not these.
"""
