"""vLLM's indexer key cache (the Lightning Indexer's compressed keys, fp8 with a scale per key), in NumPy.

The reference writer and reader of the bytes vLLM keeps for a CSA layer's index keys (vLLM
0.33.0: `ops.indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size,
kv_cache_dtype)`, the V4 compressor's fused writer `_fused_kv_compress_norm_rope_insert_indexer_attn`
and its CPU twin `compress_norm_rope_store_indexer_cpu`; read by `fp8_paged_mqa_logits(_cpu)`).
A page (vLLM's cache tensor `[num_blocks, block_size, D + 4]` uint8, a block = a page) holds
`S = block_size` slots, all values first, then all scales:

    bytes [p*D, p*D + D)        slot p: the key's D dims as OCP e4m3 (float8_e4m3fn)
    bytes [S*D + 4p, +4)        slot p: its float32 scale, little-endian

(D = index_head_dim = 128 on V4; one scale per key: quant_block_size = D.)

Quantization of one key x (its bf16 values, arithmetic in float32), scale format "ue8m0"
(DeepSeek-V4's):
    amax = max(max|x|, 1e-4);  e = ceil(log2(amax * (1 / 448)))
    e4m3 = cast_rtne(clamp(x * 2^-e, -448, 448));  scale = 2^e
Dequantization: key = e4m3 * scale (exact in float32). Only "ue8m0" is written (DeepSeek-V4's
`scale_fmt`; vLLM's other formats are "mxfp8", the same scale packed as four UE8M0 bytes for
Blackwell's DeepGEMM, and, for other models, amax / 448 computed by a float32 division whose
rounding differs between vLLM's kernels).

`e` is computed exactly from the bits of the float32 product (`planner.kvcache.scale_exponent`'s
rule; vLLM's Triton writer takes a float32 log2, which can differ only for a product within one
float32 ulp above a power of two).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from planner.checks import as_int
from planner.kvcache import check_slot_mapping

SCALE_BYTES = 4  # one float32 scale per slot
FP8_MAX = np.float32(448.0)
INV_FP8_MAX = np.float32(1.0) / FP8_MAX
AMAX_FLOOR = np.float32(1e-4)
SCALE_FMTS = ("ue8m0",)

__all__ = ["indexer_k_quant_and_cache", "gather_index_keys", "read_index_slots", "slot_bytes", "encode_keys"]


def slot_bytes(head_dim: int) -> int:
    """Bytes per slot in vLLM's cache tensor: D e4m3 values + a float32 scale."""
    return as_int(head_dim, "head_dim", minimum=1) + SCALE_BYTES


def _ue8m0_exponent(raw: np.ndarray) -> np.ndarray:
    """ceil(log2(raw)) of positive normal float32 values, exactly (from their bits)."""
    bits = raw.astype(np.float32).view(np.uint32).astype(np.int64)
    return (((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0)).astype(np.int32)


def encode_keys(k: np.ndarray, kv_cache_dtype: str = "ue8m0") -> tuple[np.ndarray, np.ndarray]:
    """Keys [N, D] (float32 holding bf16 values) -> (e4m3 bytes uint8 [N, D], scales float32 [N])."""
    if kv_cache_dtype not in SCALE_FMTS:
        raise ValueError(f"kv_cache_dtype: expected 'ue8m0' (DeepSeek-V4's scale format), got {kv_cache_dtype!r}")
    amax = np.maximum(np.abs(k).max(axis=1), AMAX_FLOOR).astype(np.float32)
    with np.errstate(under="ignore"):
        e = _ue8m0_exponent(amax * INV_FP8_MAX)
        scale = np.ldexp(np.float32(1.0), e).astype(np.float32)
        x = np.clip(
            (k * np.ldexp(np.float32(1.0), -e).astype(np.float32)[:, None]).astype(np.float32), -FP8_MAX, FP8_MAX
        )
    return x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), scale


def _check_cache(kv_cache, *, writable: bool) -> tuple[int, int, int]:
    if not isinstance(kv_cache, np.ndarray):
        raise TypeError(f"kv_cache: expected a numpy.ndarray, got {type(kv_cache).__name__}")
    if kv_cache.dtype != np.uint8:
        raise TypeError(f"kv_cache: expected uint8 pages (e4m3 bytes and float32 scales), got {kv_cache.dtype}")
    if kv_cache.ndim != 3 or kv_cache.shape[2] <= SCALE_BYTES:
        raise ValueError(f"kv_cache: expected shape [num_blocks, block_size, D + 4], got {kv_cache.shape}")
    if kv_cache.strides[2] != 1 or kv_cache.strides[1] != kv_cache.shape[2]:
        raise ValueError(f"kv_cache: each page's bytes must be contiguous, got strides {kv_cache.strides}")
    if writable and not kv_cache.flags.writeable:
        raise ValueError("kv_cache: is read-only; it is written in place")
    return kv_cache.shape[0], kv_cache.shape[1], kv_cache.shape[2] - SCALE_BYTES


def _as_keys(k, D: int) -> np.ndarray:
    if not isinstance(k, np.ndarray):
        raise TypeError(f"k: expected a numpy.ndarray, got {type(k).__name__}")
    if k.dtype not in (np.float32, np.dtype(ml_dtypes.bfloat16)):
        raise TypeError(f"k: expected float32 or bfloat16 keys, got {k.dtype}")
    if k.ndim != 2 or k.shape[1] != D:
        raise ValueError(f"k: expected shape [T, {D}] (the cache's D = {D}), got {k.shape}")
    k32 = k.astype(ml_dtypes.bfloat16).astype(np.float32)  # the writers quantize the bf16 value
    bad = ~np.isfinite(k32)
    if bad.any():
        t, d = (int(v) for v in np.argwhere(bad)[0])
        raise ValueError(f"k: must be finite, got k[{t}, {d}] = {float(k32[t, d])}")
    return k32


def indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size: int, kv_cache_dtype: str = "ue8m0"):
    """Quantize index keys `k` [T, D] and write slot s (page s // block_size) of `kv_cache`, in place.

    vLLM's `indexer_k_quant_and_cache` (same arguments, its `kv_cache_dtype` being the scale
    format): k float32 or bfloat16 (float32 values are rounded to bf16 first, as vLLM's writers
    take bf16 keys); kv_cache uint8 [num_blocks, block_size, D + 4]; slot_mapping [T'] integers,
    T' <= T, -1 skips a token, slots unique; quant_block_size must be D (one scale per key).
    Bytes of slots not written stay as they were.
    """
    num_blocks, S, D = _check_cache(kv_cache, writable=True)
    qb = as_int(quant_block_size, "quant_block_size", minimum=1)
    if qb != D:
        raise ValueError(f"quant_block_size: the cache holds one scale per key, so it must be D = {D}, got {qb}")
    k32 = _as_keys(k, D)
    slots = check_slot_mapping(slot_mapping, k32.shape[0], num_blocks * S)
    live = np.flatnonzero(slots >= 0)
    if live.size == 0:
        return
    data, scale = encode_keys(k32[live], kv_cache_dtype)
    page, pos = slots[live] // S, slots[live] % S
    _set_bytes(kv_cache, page, (pos * D)[:, None] + np.arange(D), data)
    sb = scale.astype("<f4").view(np.uint8).reshape(-1, SCALE_BYTES)
    _set_bytes(kv_cache, page, (S * D + pos * SCALE_BYTES)[:, None] + np.arange(SCALE_BYTES), sb)


def _set_bytes(kv_cache, page, offsets, values) -> None:
    """Bytes at `offsets` within pages `page` (per row), whatever the stride between pages."""
    row, col = np.divmod(offsets, kv_cache.shape[2])
    kv_cache[page[:, None], row, col] = values


def _get_bytes(kv_cache, page, offsets) -> np.ndarray:
    row, col = np.divmod(offsets, kv_cache.shape[2])
    return kv_cache[page[:, None], row, col]


def read_index_slots(kv_cache, slots) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 values as float32 [N, D], scales float32 [N]) of global slots (page * block_size + p)."""
    num_blocks, S, D = _check_cache(kv_cache, writable=False)
    s = np.asarray(slots, dtype=np.int64).reshape(-1)
    if s.size and (s.min() < 0 or s.max() >= num_blocks * S):
        raise ValueError(f"slots: entries must be in [0, {num_blocks * S}) (num_blocks * block_size)")
    page, pos = s // S, s % S
    vals = _get_bytes(kv_cache, page, (pos * D)[:, None] + np.arange(D)).view(ml_dtypes.float8_e4m3fn)
    sb = np.ascontiguousarray(_get_bytes(kv_cache, page, (S * D + pos * SCALE_BYTES)[:, None] + np.arange(SCALE_BYTES)))
    return vals.astype(np.float32), sb.view("<f4").reshape(-1).astype(np.float32)


def gather_index_keys(kv_cache, block_table, lengths) -> list[np.ndarray]:
    """Each request's dequantized keys: [lengths[b], D] float32 (e4m3 * scale, exact), entry e of
    request b read from slot e % block_size of page block_table[b, e // block_size]."""
    num_blocks, S, D = _check_cache(kv_cache, writable=False)
    bt = np.asarray(block_table)
    if bt.dtype.kind not in "iu" or bt.ndim != 2:
        raise ValueError(f"block_table: expected a 2-D integer array, got {bt.dtype} {bt.shape}")
    n = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if n.shape[0] > bt.shape[0]:
        raise ValueError(f"lengths: {n.shape[0]} requests, block_table has {bt.shape[0]} rows")
    out = []
    for b, nb in enumerate(n.tolist()):
        e = np.arange(nb)
        if nb and -(-nb // S) > bt.shape[1]:
            raise ValueError(f"lengths: request {b} has {nb} entries, beyond its {bt.shape[1]} blocks of {S}")
        pages = bt[b, e // S].astype(np.int64)
        if nb and (pages.min() < 0 or pages.max() >= num_blocks):
            raise ValueError(f"block_table: request {b} names a page outside [0, {num_blocks})")
        vals, scale = read_index_slots(kv_cache, pages * S + e % S)
        out.append(vals * scale[:, None])
    return out
