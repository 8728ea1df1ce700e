"""The V4.1 model's window and compressed caches as DeepSeek-V4.1's 528-byte mxfp8 records
(`DeepseekV41(..., kv_cache_dtype="fp8_ds_mla")`): vLLM 0.33.0's V4.1 cache pages (512 e4m3
dims, RoPE applied first, a UE8M0 scale per 32 dims, interleaved: slot p's record at p * 528),
`planner.kvcache_v41`. The twin of V4's `dsv4_jax.model.fp8_cache` (same slots, same rings):

  window   (S slots x Wc rows, Wc = max(W-1, 1)) ring of the window latents, position q of slot s
           at ring slot s * Wc + q % Wc: uint8 pages (num_pages, PAGE, 528).
  entries  a KV source's compressed entries, entry w of slot s at s * cap + w (cap =
           cdiv(max_model_len, r) rounded up to PAGE): uint8 pages (num_pages, PAGE, 528); a
           request's block table row is s * cap / PAGE + 0, 1, ...
  raw      per step, the pages the prefill reads: request b's positions from prefix_b - Wc (its
           ring history) to seq_b - 1, from a page boundary on, so that one block-table row per
           request serves `PagedKV`. History records are copied as bytes from the ring; the new
           rows are quantized once (`dsv4_jax.kvcache_v41.insert_records`: float32 rows, no bf16
           rounding first) and copied into the ring.
Every window latent and compressed entry the attention reads was written once by the V4.1
writer and is read in place by the prefill (`PagedKV(..., kv_cache_dtype="fp8_ds_mla",
layout="interleaved")`: the fused CPU prefill decodes the records it stages; other backends
gather and dequantize). The compressor's ratio-2 rings and the index keys stay in the model dtype.

With fake quantization on, the window latents arrive on the mxfp8 grid already (transformers'
FP8 fake quantization per 32 dims is this record's rounding), so the record holds them exactly;
compressed entries arrive on the FP4 grid (e2m1 with an e4m3 scale per 16), which an e4m3 record
per 32 dims does not hold exactly in general (docs/jax-model.md states the measured difference).
"""

from __future__ import annotations

import jax.numpy as jnp

from dsv4_jax import kvcache_v41
from dsv4_jax.prefill import PagedKV

FORMAT = "fp8_ds_mla"  # the model option's name; the pages hold mxfp8 records
LAYOUT = "interleaved"
RECORD = 528
PAGE = 64  # slots per page


def _pages(slots: int):
    return jnp.zeros((max(1, -(-slots // PAGE)), PAGE, RECORD), jnp.uint8)


def window_pages(num_slots: int, window_size: int):
    return _pages(num_slots * max(window_size - 1, 1))


def entry_capacity(max_model_len: int, ratio: int) -> int:
    return -(-(-(-max_model_len // ratio)) // PAGE) * PAGE


def entry_pages(num_slots: int, max_model_len: int, ratio: int):
    return _pages(num_slots * entry_capacity(max_model_len, ratio))


def copy_slots(dst, dst_slots, src, src_slots):
    """dst with slot dst_slots[i] = slot src_slots[i] of src (interleaved records: a slot is one
    528-byte row); a destination outside dst (e.g. -1) is dropped."""
    rows = jnp.take(src.reshape(-1, RECORD), src_slots, axis=0, mode="clip")
    flat = dst.reshape(-1, RECORD)
    n = flat.shape[0]
    at = jnp.where((dst_slots >= 0) & (dst_slots < n), dst_slots, n)
    return flat.at[at].set(rows, mode="drop").reshape(dst.shape)


def insert(pages, slots, rows):
    """Rows (n, 512) quantized into `slots` (-1: skipped), float32 in: the new pages."""
    return kvcache_v41.insert_records(rows.astype(jnp.float32), pages, slots, layout=LAYOUT, validate=False)


def window_step(ring, kv, step, window_size: int, max_model_len: int):
    """(raw `PagedKV` for this step's attention, updated ring): the mxfp8 twin of
    `dsv4_jax.model.attention._window_step` (same positions, same ring rows)."""
    Wc = max(window_size - 1, 1)
    T, B = kv.shape[0], step.slot.shape[0]
    live = step.seq_len > 0  # pad requests: seq_len 0 (a real one has >= 1 new token)
    first = jnp.floor_divide(step.prefix - Wc, PAGE) * PAGE  # page-aligned first position
    pages = jnp.where(live, -(-(step.seq_len - first) // PAGE), 0)
    page_base = jnp.cumsum(pages) - pages
    P = (B * (2 * PAGE - 2 + Wc) + T) // PAGE + B + 1  # >= sum(pages) for any step of B requests, T tokens
    raw = _pages(P * PAGE)

    hist = step.prefix[:, None] - Wc + jnp.arange(Wc, dtype=jnp.int32)  # (B, Wc)
    ok = live[:, None] & (hist >= 0)
    src = jnp.where(ok, step.slot[:, None] * Wc + hist % Wc, 0).reshape(-1)
    dst = jnp.where(ok, page_base[:, None] * PAGE + hist - first[:, None], -1).reshape(-1)
    raw = copy_slots(raw, dst, ring, src)
    b = step.token_request
    new_slot = jnp.where(step.token_valid, page_base[b] * PAGE + step.positions - first[b], -1)
    raw = insert(raw, new_slot, kv)
    cols = -(-max_model_len // PAGE)
    j = jnp.arange(cols, dtype=jnp.int32)[None, :]
    table = jnp.clip(page_base[:, None] + j - (first // PAGE)[:, None], 0, P - 1).astype(jnp.int32)
    keep = step.token_valid & (step.positions >= step.seq_len[b] - Wc)
    ring = copy_slots(
        ring, jnp.where(keep, step.slot[b] * Wc + step.positions % Wc, -1), raw, jnp.where(keep, new_slot, 0)
    )
    return PagedKV(raw, table, kv_cache_dtype=FORMAT, layout=LAYOUT), ring


def write_entries(pages, slot, w, entry, cap: int):
    """Entry w of cache slot `slot` (>= the pages' slots: skipped) into the pages."""
    n = pages.shape[0] * PAGE // cap
    slots = jnp.where(slot < n, slot * cap + w, -1)
    return insert(pages, slots, entry)


def entries_kv(pages, step, cap: int) -> PagedKV:
    cols = cap // PAGE
    table = (step.slot[:, None] * cols + jnp.arange(cols, dtype=jnp.int32)[None, :]).astype(jnp.int32)
    return PagedKV(pages, jnp.clip(table, 0, pages.shape[0] - 1), kv_cache_dtype=FORMAT, layout=LAYOUT)


def read_rows(pages, first: int, n: int):
    """Float32 values of slots first .. first + n - 1 (tests, tools): the records dequantized."""
    out = jnp.zeros((1, n, 512), jnp.float32)
    page0 = first // PAGE
    table = (page0 + jnp.arange(-(-(first % PAGE + n) // PAGE), dtype=jnp.int32))[None]
    out = kvcache_v41.dequantize_and_gather_k_cache(
        out,
        pages,
        jnp.asarray([first % PAGE + n], jnp.int32),
        jnp.asarray([n], jnp.int32),
        jnp.clip(table, 0, pages.shape[0] - 1),
        layout=LAYOUT,
        backend="xla",
    )
    return out[0]
