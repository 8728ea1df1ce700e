"""The JAX kernels, one file each (the twins of `dsv4_torch.kernels`); `dsv4_jax.backends` is their table.

* `xla`: a tiled jnp reference (any device), backend "xla".
* `cpu`: our C kernels (`dsv4_cpu`) as XLA FFI calls, backend "cpu".
* `pallas_triton`: a Pallas kernel lowered through Triton on NVIDIA GPUs, backend "triton"
  (`interpret=True`: Pallas' interpreter, any platform).
* `mosaic`: a Pallas Mosaic GPU kernel for Hopper, jax >= 0.12, backend "mosaic_gpu" (GPU interpret
  mode on CPU).
* `xla_kvcache`, `pallas_kvcache`: the fp8_ds_mla cache functions' kernels.

`dsv4_jax.sparse_attention` / `dsv4_jax.kvcache` choose between them; call those, not these.
"""
