"""dsv4-prefill, JAX path: sparse attention (Pallas kernel for Triton, jnp reference)."""

from dsv4_jax.attention import available_backends, resolve_backend, sparse_attention

__all__ = ["available_backends", "resolve_backend", "sparse_attention"]
