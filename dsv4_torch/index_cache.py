"""vLLM's indexer key cache for PyTorch: `indexer_k_quant_and_cache`, the bytes of `planner.index_cache`.

    indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, kv_cache_dtype="ue8m0")

vLLM's op and argument order (`vllm._custom_ops.indexer_k_quant_and_cache`; its last argument
names the scale format): k [T, D] (bf16, or float32 rounded to bf16 first), kv_cache uint8
[num_blocks, block_size, D + 4] written in place (page: block_size x D e4m3 bytes, then
block_size float32 scales), slot_mapping [T'] (T' <= T, -1 skips a token), quant_block_size = D.
Vectorized torch ops on any device; the same bytes as the NumPy reference (tests/torch).
"""

from __future__ import annotations

import torch

SCALE_FMTS = ("ue8m0",)
FP8_MAX = 448.0


def _check(k, kv_cache, slot_mapping, quant_block_size, kv_cache_dtype) -> tuple[int, int, int]:
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dtype != torch.uint8 or kv_cache.ndim != 3:
        raise TypeError(
            f"kv_cache: expected a uint8 tensor [num_blocks, block_size, D + 4], got {getattr(kv_cache, 'dtype', kv_cache)}"
        )
    P, S, W = kv_cache.shape
    D = W - 4
    if D < 1 or kv_cache.stride(2) != 1 or kv_cache.stride(1) != W:
        raise ValueError(
            f"kv_cache: expected contiguous pages [num_blocks, block_size, D + 4], got {tuple(kv_cache.shape)}"
        )
    if (
        not isinstance(k, torch.Tensor)
        or k.ndim != 2
        or k.shape[1] != D
        or k.dtype not in (torch.bfloat16, torch.float32)
    ):
        raise ValueError(
            f"k: expected a bfloat16 / float32 tensor [T, {D}], got {getattr(k, 'dtype', k)} {tuple(getattr(k, 'shape', ()))}"
        )
    if isinstance(quant_block_size, bool) or quant_block_size != D:
        raise ValueError(
            f"quant_block_size: the cache holds one scale per key, so it must be D = {D}, got {quant_block_size!r}"
        )
    if kv_cache_dtype not in SCALE_FMTS:
        raise ValueError(f"kv_cache_dtype: expected 'ue8m0' (DeepSeek-V4's scale format), got {kv_cache_dtype!r}")
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.ndim != 1 or slot_mapping.dtype.is_floating_point:
        raise ValueError("slot_mapping: expected a 1-D integer tensor")
    if slot_mapping.shape[0] > k.shape[0]:
        raise ValueError(f"slot_mapping: {slot_mapping.shape[0]} entries for {k.shape[0]} tokens of k")
    return P, S, D


def encode_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [N, D] -> (e4m3 bytes uint8 [N, D], float32 scales [N]), `planner.index_cache.encode_keys`'s bits."""
    x = k.to(torch.bfloat16).float()
    amax = x.abs().amax(dim=1).clamp_min(1e-4)
    raw = amax * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
    bits = raw.view(torch.int32).to(torch.int64)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int64)  # ceil(log2(raw)), exactly
    scale = torch.ldexp(torch.ones_like(amax), e.to(torch.float32))
    y = x * torch.ldexp(torch.ones_like(amax), -e.to(torch.float32))[:, None]
    y = y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return y.view(torch.uint8), scale


def indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, kv_cache_dtype="ue8m0") -> None:
    """Quantize `k` and write each token into its slot of `kv_cache`, in place (see the module doc)."""
    P, S, D = _check(k, kv_cache, slot_mapping, quant_block_size, kv_cache_dtype)
    slots = slot_mapping.to(device=kv_cache.device, dtype=torch.int64)
    live = torch.nonzero(slots >= 0).flatten()
    if live.numel() == 0:
        return
    s = slots[live]
    if int(s.max()) >= P * S or int(slots.min()) < -1:
        raise ValueError(f"slot_mapping: entries must be -1 or slots below num_blocks * block_size = {P * S}")
    if torch.unique(s).numel() != s.numel():
        raise ValueError("slot_mapping: a slot appears more than once")
    data, scale = encode_keys(k[live.to(k.device)].to(kv_cache.device))
    page, pos = s // S, s % S
    W = D + 4
    off = (pos * D)[:, None] + torch.arange(D, device=kv_cache.device)
    kv_cache[page[:, None], off // W, off % W] = data
    off = (S * D + pos * 4)[:, None] + torch.arange(4, device=kv_cache.device)
    kv_cache[page[:, None], off // W, off % W] = scale.contiguous().view(torch.uint8).reshape(-1, 4)
