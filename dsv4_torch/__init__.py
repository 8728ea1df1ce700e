"""dsv4-prefill for PyTorch: DeepSeek-V4 sparse-attention prefill kernels.

`sparse_attention` implements the FlashMLA sparse-attention contract on four backends
(FlashMLA wheel, our Triton kernel, our C/C++ CPU kernel, tiled torch reference); `resolve_backend` says which one a
call runs and `available_backends` which ones this machine has, with reasons for the others.
`indexer_topk` is the Lightning Indexer's top-k (`dsv4_torch.indexer`: the fused C kernel, "cpu", or a
reference).
"""

from dsv4_torch.attention import BACKENDS, available_backends, resolve_backend, sparse_attention
from dsv4_torch.indexer import indexer_topk
from planner.contract import BackendUnavailableError

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "available_backends",
    "indexer_topk",
    "resolve_backend",
    "sparse_attention",
]
