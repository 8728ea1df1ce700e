"""The prefill layer call on backend "cpu": one C kernel call per layer, straight from the caches.

Part of `dsv4_jax.prefill`: where the other backends loop over the plan's chunks (gather a
workspace, build index rows, attend), the C kernel (`dsv4_cpu`, `dsv4_prefill_attention`,
an XLA FFI call) reads every token's keys from the caches itself: rows in q's dtype (`PagedKV`,
`LogicalKV`) or fp8_ds_mla pages, dequantized inside the kernel. No workspace, no chunk loop,
no index rows. It takes per token the q row, the batch request (its block-table row / offsets
entry), the absolute position and the lowest window position; they come from the kind's metadata table (traced) here.

A token's result depends only on its own keys in a fixed order (compressed part, then window),
so the output is the same, bit for bit, for every plan of the batch.
"""

from __future__ import annotations

import jax.numpy as jnp

from dsv4_jax.kernels.cpu import attention as cpu
from dsv4_jax.prefill_metadata import (
    CHUNK_SEG_START,
    CHUNK_TOKEN_START,
    SCALARS,
    SEG_GATHER_START_POSITION,
    SEG_REQUEST,
    TOK_INDEX,
    TOK_POSITION,
    TOK_REQUEST,
    KindMetadata,
)


def step_tokens(table):
    """(tokens (4, L) int32: q row, batch request, absolute position and lowest window position
    (its segment's gather start: the window is max(p - W + 1, gather_start) .. p, as the index
    rows have it) per planned token; the token count, a traced int32 scalar) from a kind's
    metadata table (traced).

    `TOK_REQUEST` is chunk-local (the token's segment is its chunk's first segment plus it), so
    the batch request is seg_request[chunk_seg_start[chunk] + tok_request], the chunk found in
    chunk_token_start. Entries past the count are padding (the kernel call skips them)."""
    L = table.shape[1]
    k = jnp.arange(L, dtype=jnp.int32)
    chunk = jnp.searchsorted(table[CHUNK_TOKEN_START], k, side="right").astype(jnp.int32) - 1
    chunk = jnp.clip(chunk, 0, L - 1)
    seg = jnp.clip(table[CHUNK_SEG_START][chunk] + table[TOK_REQUEST], 0, L - 1)
    request = table[SEG_REQUEST][seg]
    start = table[SEG_GATHER_START_POSITION][seg]
    return jnp.stack([table[TOK_INDEX], request, table[TOK_POSITION], start]), table[SCALARS, 1]


def layer(
    q,
    meta: KindMetadata,
    raw_kv,
    compressed_kv=None,
    *,
    sm_scale: float,
    attn_sink=None,
    topk_indices=None,
    out=None,
):
    """The layer's output (T_q, H, d_v) in q's dtype; rows of no planned token are 0. The
    arguments are `dsv4_jax.prefill.prefill_attention`'s, checked there (the caches as `PagedKV`
    or `LogicalKV`); meta the layer kind's `KindMetadata` (traced: its table and static shape).
    out: a buffer the kernel writes into (aliased to the result)."""
    shape = meta.shape
    tokens, count = step_tokens(meta.table)
    return cpu.prefill_attention(
        q,
        tokens,
        count,
        raw_kv,
        compressed_kv,
        topk_indices,
        attn_sink,
        kind=shape.kind.name,
        window=shape.window_size,
        compress_ratio=shape.compress_ratio,
        sm_scale=sm_scale,
        out=out,
    )
