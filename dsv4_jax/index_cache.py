"""vLLM's indexer key cache for JAX: `indexer_k_quant_and_cache`, the bytes of `planner.index_cache`.

    kv_cache = indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, kv_cache_dtype="ue8m0")

The twin of `dsv4_torch.index_cache` (vLLM's op and argument order), functional: returns the
updated cache. k [T, D] (bf16, or float32 rounded to bf16 first); kv_cache uint8
[num_blocks, block_size, D + 4] (page: block_size x D e4m3 bytes, then block_size float32
scales); slot_mapping [T'] int (T' <= T), -1 skips a token (and so does a slot outside the cache:
under jit the slots cannot be checked, `validate=True` checks concrete ones); quant_block_size = D.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

SCALE_FMTS = ("ue8m0",)
FP8_MAX = 448.0


def encode_keys(k):
    """Keys [N, D] -> (e4m3 bytes uint8 [N, D], float32 scales [N]), `planner.index_cache.encode_keys`'s bits."""
    x = k.astype(jnp.bfloat16).astype(jnp.float32)
    amax = jnp.maximum(jnp.abs(x).max(axis=1), jnp.float32(1e-4))
    raw = amax * jnp.float32(1.0 / FP8_MAX)
    bits = lax.bitcast_convert_type(raw, jnp.int32)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)  # ceil(log2(raw)), exactly
    scale = lax.bitcast_convert_type((e + 127) << 23, jnp.float32)  # 2^e (e in [-22, 120]: normal)
    y = x * lax.bitcast_convert_type((127 - e) << 23, jnp.float32)[:, None]
    y = jnp.clip(y, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return lax.bitcast_convert_type(y, jnp.uint8), scale


def indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, kv_cache_dtype="ue8m0", *, validate=True):
    """The cache with each token of `k` written into its slot (see the module doc)."""
    if getattr(kv_cache, "ndim", None) != 3 or jnp.dtype(kv_cache.dtype) != jnp.uint8:
        raise TypeError(
            f"kv_cache: expected a uint8 array [num_blocks, block_size, D + 4], got {getattr(kv_cache, 'dtype', kv_cache)}"
        )
    P, S, W = kv_cache.shape
    D = W - 4
    if D < 1 or getattr(k, "ndim", None) != 2 or k.shape[1] != D:
        raise ValueError(f"k: expected [T, {D}], got {getattr(k, 'shape', None)}")
    if jnp.dtype(k.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise TypeError(f"k: expected bfloat16 or float32, got {k.dtype}")
    if isinstance(quant_block_size, bool) or quant_block_size != D:
        raise ValueError(
            f"quant_block_size: the cache holds one scale per key, so it must be D = {D}, got {quant_block_size!r}"
        )
    if kv_cache_dtype not in SCALE_FMTS:
        raise ValueError(f"kv_cache_dtype: expected 'ue8m0' (DeepSeek-V4's scale format), got {kv_cache_dtype!r}")
    if getattr(slot_mapping, "ndim", None) != 1 or slot_mapping.shape[0] > k.shape[0]:
        raise ValueError(
            f"slot_mapping: expected [T'] with T' <= {k.shape[0]}, got {getattr(slot_mapping, 'shape', None)}"
        )
    if validate:
        try:
            s = np.asarray(slot_mapping)
        except Exception:  # noqa: BLE001 - traced under jit: nothing to check here
            s = None
        if s is not None:
            if ((s < -1) | (s >= P * S)).any():
                raise ValueError(f"slot_mapping: entries must be -1 or slots below num_blocks * block_size = {P * S}")
            live = s[s >= 0]
            if np.unique(live).size != live.size:
                raise ValueError("slot_mapping: a slot appears more than once")
    n = slot_mapping.shape[0]
    data, scale = encode_keys(k[:n])
    slots = slot_mapping.astype(jnp.int32)
    live = (slots >= 0) & (slots < P * S)
    page = jnp.where(live, slots // S, P)  # out of range: dropped
    pos = slots % S
    off = (pos * D)[:, None] + jnp.arange(D)
    kv_cache = kv_cache.at[page[:, None], off // W, off % W].set(data, mode="drop")
    sb = lax.bitcast_convert_type(scale, jnp.uint8)  # [n, 4], little-endian on every JAX platform
    off = (S * D + pos * 4)[:, None] + jnp.arange(4)
    return kv_cache.at[page[:, None], off // W, off % W].set(sb, mode="drop")
