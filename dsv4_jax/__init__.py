"""dsv4-prefill for JAX: DeepSeek-V4 sparse-attention prefill kernels (the twin of `dsv4_torch`).

`sparse_attention` implements the FlashMLA sparse-attention contract on the JAX backends
(`dsv4_jax.backends`, the table of the kernels in `dsv4_jax.kernels`: Mosaic GPU on Hopper,
Pallas lowered through Triton on NVIDIA GPUs, a tiled XLA reference, and the C++ CPU kernel of
`dsv4_cpu` as XLA FFI calls);
`resolve_backend` says which one a call runs and `available_backends` which ones this machine
has, with reasons for the others. `dsv4_jax.prefill` runs whole layers from a planner step plan;
`dsv4_jax.model` is a JAX DeepSeek-V4 model on that path. `indexer_topk` is the Lightning
Indexer's top-k (`dsv4_jax.indexer`: the fused C kernel as an XLA FFI call, "cpu", or "xla").
"""

from dsv4_jax.attention import BACKENDS, available_backends, resolve_backend, sparse_attention
from dsv4_jax.indexer import indexer_topk
from planner.contract import BackendUnavailableError

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "available_backends",
    "indexer_topk",
    "resolve_backend",
    "sparse_attention",
]
