"""Backend "xla": plain jnp / lax on any platform, the reference (attention, the fp8_ds_mla cache
functions, the indexer's top-k). See `dsv4_jax.kernels`."""
