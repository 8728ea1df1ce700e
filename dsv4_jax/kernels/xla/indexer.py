"""The indexer backend "xla" for JAX: the Lightning Indexer's top-k in plain jnp / lax, any platform.

`num_entries` keys per token are gathered (`_request_keys`: rows + offsets, or vLLM's fp8 index
pages + block table), scored in float32 in token tiles of at most `TILE_ELEMS` gathered key
elements, and ranked by one multi-key sort under the tie rule of `planner.indexer_oracle`
(`rank`). `dsv4_jax.indexer.indexer_topk` checks the arguments and calls `indexer_topk_xla`
when its backend resolves to "xla".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
TILE_ELEMS = 1 << 23  # gathered key elements per token tile


def _request_keys(keys, req, cols, offsets, block_table):
    """Float32 keys [tile, N, D] and scales [tile, N] of entries `cols` of requests `req`."""
    if block_table is None:
        start = jnp.zeros_like(req) if offsets is None else offsets.astype(jnp.int32)[req]
        rows = jnp.clip(start[:, None] + cols[None, :], 0, keys.shape[0] - 1)
        return keys[rows].astype(F32), None
    P, S, W = keys.shape
    D = W - 4
    page = block_table.astype(jnp.int32)[req[:, None], jnp.minimum(cols // S, block_table.shape[1] - 1)[None, :]]
    page = jnp.clip(page, 0, P - 1)
    slot = (cols % S)[None, :]
    flat = keys.reshape(P, S * W)
    vals = flat[page[..., None], slot[..., None] * D + jnp.arange(D)]
    vals = lax.bitcast_convert_type(vals, jnp.float8_e4m3fn).astype(F32)
    sb = flat[page[..., None], S * D + slot[..., None] * 4 + jnp.arange(4)]
    scale = lax.bitcast_convert_type(sb.reshape(*sb.shape[:-1], 4), F32)
    return vals, scale


def rank(logits, visible):
    """Entry ids per row by the tie rule (invisible entries after all, then NaN, then logit
    descending, then index ascending): one multi-key sort."""
    n = logits.shape[-1]
    idx = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), logits.shape)
    nan = jnp.isnan(logits)
    neg = jnp.where(nan, 0.0, -(logits + 0.0))  # (+ 0.0: -0.0 ranks as 0.0)
    out = lax.sort((~visible, nan, neg, idx), dimension=-1, num_keys=4)
    return out[3]


def indexer_topk_xla(q, weights, keys, req, pos, ok, *, compress_ratio, topk, offsets, block_table, num_entries):
    """The xla backend on checked inputs: float32 logits of `num_entries` keys per token, in tiles."""
    T, H, D = q.shape
    if T == 0:
        return jnp.full((0, topk), -1, jnp.int32), jnp.full((0, topk), -jnp.inf, F32)
    if num_entries is None:
        num_entries = keys.shape[0] if block_table is None else block_table.shape[1] * keys.shape[1]
    N = int(num_entries)
    k = min(topk, N)
    vis = jnp.where(ok > 0, (pos + 1) // compress_ratio, 0)
    tile = T
    while tile > 8 and tile % 2 == 0 and tile * N * D > TILE_ELEMS:
        tile //= 2
    cols = jnp.arange(N, dtype=jnp.int32)
    w = weights.astype(F32)

    def score(args):
        q_t, w_t, req_t, vis_t = args
        kt, scale = _request_keys(keys, req_t, cols, offsets, block_table)
        dots = jnp.einsum("thd,tnd->thn", q_t.astype(F32), kt, precision=lax.Precision.HIGHEST)
        logits = (w_t[:, :, None] * jnp.maximum(dots, 0.0)).sum(axis=1)  # (maximum keeps NaN)
        if scale is not None:
            logits = logits * scale
        visible = cols[None, :] < vis_t[:, None]
        order = rank(logits, visible)[:, :k]
        take = jnp.arange(k)[None, :] < vis_t[:, None]
        return jnp.where(take, order, -1), jnp.where(take, jnp.take_along_axis(logits, order, axis=1), -jnp.inf)

    args = (q, w, req, vis)
    idx, val = lax.map(score, jax.tree.map(lambda a: a.reshape(T // tile, tile, *a.shape[1:]), args))
    idx, val = idx.reshape(T, k), val.reshape(T, k)
    if k < topk:
        idx = jnp.pad(idx, ((0, 0), (0, topk - k)), constant_values=-1)
        val = jnp.pad(val, ((0, 0), (0, topk - k)), constant_values=-jnp.inf)
    return idx, val
