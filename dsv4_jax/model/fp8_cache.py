"""The model's window and compressed caches as vLLM's fp8_ds_mla pages
(`DeepseekV4(..., kv_cache_dtype="fp8_ds_mla")`, `JaxGenerator(..., kv_cache_dtype=...)`).

Against the default caches (`dsv4_jax.model.attention.init_cache`, in the model's dtype):

  window   (S slots x Wc rows, Wc = max(W-1, 1)) ring of raw latents, position q of slot s at
           ring slot s * Wc + q % Wc: uint8 pages of PAGE slots.
  entries  CSA/HCA compressed entries, entry w of slot s at s * cap + w (cap =
           cdiv(max_model_len, r) rounded up to PAGE): uint8 pages of PAGE slots; a request's
           block table row is s * cap / PAGE + 0, 1, ...
  raw      per step, the pages the prefill reads: request b's positions from prefix_b - Wc (its
           ring history; negative positions are junk no index reaches) to seq_b - 1, starting at a
           page boundary (position p at slot page_base_b * PAGE + p - first_b, first_b =
           floor((prefix_b - Wc) / PAGE) * PAGE), so one block-table row per request serves
           `PagedKV`. History slots are copied as bytes from the ring; the new tokens are
           quantized once (`dsv4_jax.kvcache.quantize_and_insert_k_cache`, the bf16-rounded
           latents) and copied into the ring.
The compressor rings and the indexer's keys stay in the model's dtype. Every latent the
attention reads was written once by the fp8 writer and is read back through the prefill's
dequantizing gather (`PagedKV(kv_cache_dtype="fp8_ds_mla")`).
"""

from __future__ import annotations

import jax.numpy as jnp

from dsv4_jax import kvcache
from dsv4_jax.prefill import PagedKV
from planner.kvcache import page_bytes

FORMAT = "fp8_ds_mla"
PAGE = 64  # slots per page of every fp8 array here


def _pages(slots: int):
    return jnp.zeros((max(1, -(-slots // PAGE)), page_bytes(PAGE)), jnp.uint8)


def window_pages(num_slots: int, window_size: int):
    return _pages(num_slots * max(window_size - 1, 1))


def entry_capacity(max_model_len: int, ratio: int) -> int:
    return -(-(-(-max_model_len // ratio)) // PAGE) * PAGE


def entry_pages(num_slots: int, max_model_len: int, ratio: int):
    return _pages(num_slots * entry_capacity(max_model_len, ratio))


def window_step(ring, kv, step, window_size: int, max_model_len: int):
    """(raw `PagedKV` for this step's attention, updated ring), the fp8 twin of
    `attention._window_step` (same positions, same ring rows)."""
    Wc = max(window_size - 1, 1)
    T, B = kv.shape[0], step.slot.shape[0]
    live = step.seq_len > 0  # pad requests: seq_len 0 (a real one has >= 1 new token)
    first = jnp.floor_divide(step.prefix - Wc, PAGE) * PAGE  # page-aligned first position
    pages = jnp.where(live, -(-(step.seq_len - first) // PAGE), 0)
    page_base = jnp.cumsum(pages) - pages
    P = (B * (2 * PAGE - 2 + Wc) + T) // PAGE + B + 1  # >= sum(pages) for any step of B requests, T tokens
    raw = _pages(P * PAGE)

    # history: positions prefix - Wc .. prefix - 1 (>= 0) from the ring, as bytes
    hist = step.prefix[:, None] - Wc + jnp.arange(Wc, dtype=jnp.int32)  # (B, Wc)
    ok = live[:, None] & (hist >= 0)
    src = jnp.where(ok, step.slot[:, None] * Wc + hist % Wc, 0).reshape(-1)
    dst = jnp.where(ok, page_base[:, None] * PAGE + hist - first[:, None], -1).reshape(-1)
    raw = kvcache.copy_slots(raw, dst, ring, src, PAGE)
    # new tokens: quantized into their slots
    b = step.token_request
    new_slot = jnp.where(step.token_valid, page_base[b] * PAGE + step.positions - first[b], -1)
    raw = kvcache.quantize_and_insert_k_cache(kv.astype(jnp.bfloat16), raw, new_slot, PAGE)
    # block table: column j of request b is page page_base_b + j - first_b / PAGE
    cols = -(-max_model_len // PAGE)
    j = jnp.arange(cols, dtype=jnp.int32)[None, :]
    table = jnp.clip(page_base[:, None] + j - (first // PAGE)[:, None], 0, P - 1).astype(jnp.int32)
    # the ring keeps each request's last Wc positions
    keep = step.token_valid & (step.positions >= step.seq_len[b] - Wc)
    ring = kvcache.copy_slots(
        ring, jnp.where(keep, step.slot[b] * Wc + step.positions % Wc, -1), raw, jnp.where(keep, new_slot, 0), PAGE
    )
    return PagedKV(raw, table, kv_cache_dtype=FORMAT, block_size=PAGE), ring


def entry_writer(cap: int):
    """For `attention._compress(write=...)`: entry w of slot s (s = -1: skip) into the pages."""

    def write(pages, slot, w, entry):
        slots = jnp.where(slot >= 0, slot * cap + w, -1)
        return kvcache.quantize_and_insert_k_cache(entry.astype(jnp.bfloat16), pages, slots, PAGE)

    return write


def entries_kv(pages, step, cap: int) -> PagedKV:
    cols = cap // PAGE
    table = (step.slot[:, None] * cols + jnp.arange(cols, dtype=jnp.int32)[None, :]).astype(jnp.int32)
    return PagedKV(pages, jnp.clip(table, 0, pages.shape[0] - 1), kv_cache_dtype=FORMAT, block_size=PAGE)
