"""The Lightning Indexer's top-k for JAX: backends "cpu" (the fused C kernel as an XLA FFI call) and "xla".

    indexer_topk(q, weights, keys, token_request, token_position, *, compress_ratio, topk,
                 offsets=None, block_table=None, valid=None, num_entries=None, backend="auto")
        -> IndexerResult(indices, logits, backend)

The twin of `dsv4_torch.indexer` (same contract, tie rule and key sources): token t of request
b = token_request[t] at position p = token_position[t] scores entries 0 .. (p + 1) //
compress_ratio - 1 of its request, logit = sum_h weights[t, h] * relu(q[t, h] . key) (x the
key's scale for fp8 keys), and keeps the `topk` best (larger logit first, equal logits: lower
entry index first, NaN last), then -1 (logits -inf).

keys: rows [N, D] bfloat16 / float32 with `offsets` [B] (entry e of request b is row offsets[b] +
e; None: one request), or vLLM's index key cache uint8 [num_blocks, block_size, D + 4] with
`block_table` [B, W] (`dsv4_jax.index_cache` writes it). valid: optional bool [T]; a token with
valid False is padding (its row: -1 / -inf). num_entries (static, xla backend): entries scored
per token, at least every visible count (default: all a request can hold).

"cpu" (CPU arrays where the C library builds; "auto" picks it there) streams the keys with a
running top-k per token (memory O(tokens x topk)); "xla" scores num_entries keys per token in
token tiles and sorts (memory O(tile x num_entries)). Both take products of the input values in
float32 and accumulate in float32: equal up to rounding (near ties may swap). No gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dsv4_jax import backends

BACKENDS = backends.INDEXER_BACKENDS
F32 = jnp.float32


class IndexerResult(NamedTuple):
    indices: jax.Array  # [T, topk] int32, -1 padded
    logits: jax.Array  # [T, topk] float32, -inf padded
    backend: str


def resolve_backend(backend: str, q) -> str:
    return backends.resolve_indexer_backend(backend, q)


def _check(q, weights, keys, token_request, token_position, compress_ratio, topk, offsets, block_table, valid):
    if getattr(q, "ndim", None) != 3:
        raise ValueError(f"q: expected [T, H, D], got shape {getattr(q, 'shape', None)}")
    T, H, D = q.shape
    if jnp.dtype(q.dtype) not in backends.INDEXER["xla"].dtypes:
        raise TypeError(f"q: expected bfloat16, float32 or float8_e4m3fn, got {q.dtype}")
    if tuple(weights.shape) != (T, H) or not jnp.issubdtype(weights.dtype, jnp.floating):
        raise ValueError(
            f"weights: expected a float [{T}, {H}] array (tokens, heads), got {weights.dtype} {weights.shape}"
        )
    if jnp.dtype(keys.dtype) == jnp.uint8:
        if keys.ndim != 3 or keys.shape[2] != D + 4:
            raise ValueError(
                f"keys: fp8 index pages must be [num_blocks, block_size, D + 4 = {D + 4}], got {keys.shape}"
            )
        if block_table is None or block_table.ndim != 2:
            raise ValueError("block_table: fp8 index pages need a block table [requests, blocks]")
        if offsets is not None:
            raise ValueError("offsets: only for key rows; fp8 pages are addressed by block_table")
    elif jnp.dtype(keys.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(F32)):
        if keys.ndim != 2 or keys.shape[1] != D:
            raise ValueError(f"keys: rows must be [N, D = {D}], got {keys.shape}")
        if block_table is not None:
            raise ValueError("block_table: only for fp8 index pages; rows are addressed by offsets")
        if offsets is not None and offsets.ndim != 1:
            raise ValueError(f"offsets: expected [requests], got {offsets.shape}")
    else:
        raise TypeError(f"keys: expected uint8 fp8 index pages or bfloat16 / float32 rows, got {keys.dtype}")
    for name, a in (("token_request", token_request), ("token_position", token_position), ("valid", valid)):
        if a is not None and tuple(a.shape) != (T,):
            raise ValueError(f"{name}: expected {T} entries (one per token of q), got shape {a.shape}")
    if isinstance(compress_ratio, bool) or not isinstance(compress_ratio, int) or compress_ratio < 1:
        raise ValueError(f"compress_ratio: expected an integer >= 1, got {compress_ratio!r}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk: expected an integer >= 1, got {topk!r}")


def indexer_topk(
    q,
    weights,
    keys,
    token_request,
    token_position,
    *,
    compress_ratio: int,
    topk: int,
    offsets=None,
    block_table=None,
    valid=None,
    num_entries: int | None = None,
    backend: str = "auto",
) -> IndexerResult:
    """The top-`topk` compressed entries per token (see the module doc)."""
    _check(q, weights, keys, token_request, token_position, compress_ratio, topk, offsets, block_table, valid)
    name = resolve_backend(backend, q)
    T = q.shape[0]
    req = jnp.asarray(token_request, jnp.int32)
    pos = jnp.asarray(token_position, jnp.int32)
    ok = jnp.ones((T,), jnp.int32) if valid is None else jnp.asarray(valid).astype(jnp.int32)
    fn = backends.INDEXER[name].kernel()
    if name == "cpu":
        idx, val = fn(q, weights, keys, req, pos, ok, compress_ratio=compress_ratio, topk=topk, offsets=offsets,
                      block_table=block_table)  # fmt: skip
    else:
        idx, val = fn(q, weights, keys, req, pos, ok, compress_ratio=compress_ratio, topk=topk, offsets=offsets,
                      block_table=block_table, num_entries=num_entries)  # fmt: skip
    return IndexerResult(lax.stop_gradient(idx), lax.stop_gradient(val), name)


# ----------------------------------------------------------------------------- xla
