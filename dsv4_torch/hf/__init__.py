"""transformers DeepSeek-V4 helpers: our sparse prefill inside the model, capture.

Nothing heavy is imported here (no transformers); the submodules load on first use:
`dsv4_torch.hf.integration` (`enable_sparse_prefill` and friends; torch, transformers) and
`dsv4_torch.hf.capture` (torch, transformers). Tiny random checkpoints for tests and demos are
written by `tools.tiny_checkpoint` (outside the library; no torch).
"""

import importlib

_LAZY = {
    "enable_sparse_prefill": "integration",
    "disable_sparse_prefill": "integration",
    "is_sparse_prefill_enabled": "integration",
    "last_step_plan": "integration",
    "last_forward": "integration",
    "ForwardRecord": "integration",
    "capture_attention": "capture",
    "capture_attention_layers": "capture",
    "AttentionCapture": "capture",
    "require_supported_transformers": "versions",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
