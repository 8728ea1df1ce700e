"""dsv4-prefill, JAX path: sparse attention (Mosaic GPU and Pallas-Triton kernels, jnp reference)."""

from dsv4_jax.attention import BackendUnavailableError, available_backends, resolve_backend, sparse_attention

__all__ = ["BackendUnavailableError", "available_backends", "resolve_backend", "sparse_attention"]
