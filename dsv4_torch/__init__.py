"""dsv4-prefill for PyTorch: DeepSeek-V4 sparse-attention prefill kernels.

`sparse_attention` implements the FlashMLA sparse-attention contract on four backends
(FlashMLA wheel, our Triton kernel, our C/C++ CPU kernel, tiled torch reference); `resolve_backend` says which one a
call runs and `available_backends` which ones this machine has, with reasons for the others.
"""

from dsv4_torch.attention import BACKENDS, available_backends, resolve_backend, sparse_attention
from planner.contract import BackendUnavailableError

__all__ = ["BACKENDS", "BackendUnavailableError", "available_backends", "resolve_backend", "sparse_attention"]
