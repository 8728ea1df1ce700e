"""transformers DeepSeek-V4 helpers: tiny checkpoints and attention capture.

Nothing heavy is imported here (no torch, no transformers); the submodules load on first use:
`dsv4_torch.hf.tiny_checkpoint` (numpy, tokenizers, safetensors) and `dsv4_torch.hf.capture`
(torch, transformers).
"""

import importlib

_LAZY = {
    "write_tiny_checkpoint": "tiny_checkpoint",
    "tiny_config": "tiny_checkpoint",
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
