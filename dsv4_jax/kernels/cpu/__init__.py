"""Backend "cpu": our C/C++ library (`dsv4_cpu`) as XLA FFI calls on CPU arrays. See `dsv4_jax.kernels`."""
