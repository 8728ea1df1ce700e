"""The indexer backend "xla" for JAX: the Lightning Indexer's top-k in plain jnp / lax, any platform.

`num_entries` keys per token are gathered (`_request_keys`: rows + offsets, or vLLM's fp8 index
pages + block table), scored in float32 in token tiles of at most `TILE_ELEMS` gathered key
elements, and ranked by one multi-key sort under the tie rule of `planner.indexer_oracle`
(`rank`). `dsv4_jax.indexer.indexer_topk` checks the arguments and calls `indexer_topk_xla`
when its backend resolves to "xla".
"""

from __future__ import annotations

import functools

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


def block_picks(logits, vis, bs: int, nb: int):
    """Level 1 on a tile: logits [t, N] (entries at or past `vis` ignored), visible counts [t] ->
    int32 [t, nb] request-local blocks: the newest visible block, then the others by their max
    logit descending (lower block first on ties), blocks scoring -inf or NaN dropped, -1 after."""
    t, n = logits.shape
    nblk = -(-n // bs)
    cols = jnp.arange(nblk * bs)
    lg = jnp.pad(logits, ((0, 0), (0, nblk * bs - n)), constant_values=-jnp.inf)
    lg = jnp.where(cols[None] < vis[:, None], lg, -jnp.inf).reshape(t, nblk, bs)
    score = lg.max(axis=-1)  # (propagates NaN)
    blk = jnp.broadcast_to(jnp.arange(nblk, dtype=jnp.int32), (t, nblk))
    pin = (vis - 1) // bs  # (floor: -1 where nothing is visible)
    keep = (score > -jnp.inf) & (blk < pin[:, None])  # (NaN > -inf is False: dropped)
    neg = jnp.where(keep, -(score + 0.0), 0.0)
    order = lax.sort((~keep, neg, blk), dimension=-1, num_keys=3)[2]
    m = min(nb - 1, nblk)
    rest = jnp.where(jnp.arange(m)[None] < keep.sum(axis=-1, keepdims=True), order[:, :m], -1)
    first = jnp.where(vis > 0, pin, -1)[:, None]
    out = jnp.concatenate([first, rest, jnp.full((t, nb - 1 - m), -1, jnp.int32)], axis=1)
    return out.astype(jnp.int32)


def candidate_mask(cand, n: int, bs: int):
    """Level 2: bool [t, n], the entries of each row's candidate blocks (-1 or a block outside
    the n entries: none)."""
    t = cand.shape[0]
    nblk = -(-n // bs)
    c = jnp.where((cand >= 0) & (cand < nblk), cand, nblk)
    flags = jnp.zeros((t, nblk + 1), bool).at[jnp.arange(t)[:, None], c].set(True)
    return flags[:, jnp.arange(n) // bs]


@functools.partial(
    jax.jit, static_argnames=("compress_ratio", "topk", "num_entries", "cand", "tile_elems")
)  # one compile per shape and options, reused across eager calls
def indexer_topk_xla(
    q, weights, keys, req, pos, ok, *, compress_ratio, topk, offsets, block_table, num_entries, cand, candidates,
    tile_elems=None,
):  # fmt: skip
    """The xla backend on checked inputs: float32 logits of `num_entries` keys per token, in tiles;
    (indices, logits, level 1's candidate blocks or None). cand: `planner.checks.CandidateOptions`."""
    T, H, D = q.shape
    nb = cand.topk_blocks
    if T == 0:
        blocks = jnp.full((0, nb), -1, jnp.int32) if cand.level == 1 else None
        return jnp.full((0, topk), -1, jnp.int32), jnp.full((0, topk), -jnp.inf, F32), blocks
    if num_entries is None:
        num_entries = keys.shape[0] if block_table is None else block_table.shape[1] * keys.shape[1]
    N = int(num_entries)
    k = min(topk, N)
    vis = jnp.where(ok > 0, (pos + 1) // compress_ratio, 0)
    limit = TILE_ELEMS if tile_elems is None else int(tile_elems)
    tile = T
    while tile > 8 and tile % 2 == 0 and tile * N * D > limit:
        tile //= 2
    cols = jnp.arange(N, dtype=jnp.int32)
    w = weights.astype(F32)

    def score(args):
        q_t, w_t, req_t, vis_t = args[:4]
        kt, scale = _request_keys(keys, req_t, cols, offsets, block_table)
        dots = jnp.einsum("thd,tnd->thn", q_t.astype(F32), kt, precision=lax.Precision.HIGHEST)
        logits = (w_t[:, :, None] * jnp.maximum(dots, 0.0)).sum(axis=1)  # (maximum keeps NaN)
        if scale is not None:
            logits = logits * scale
        visible = cols[None, :] < vis_t[:, None]
        if cand.level == 2:
            visible &= candidate_mask(args[4], N, cand.block_size)
        order = rank(logits, visible)[:, :k]
        take = jnp.arange(k)[None, :] < visible.sum(axis=1, keepdims=True)
        idx = jnp.where(take, order, -1)
        val = jnp.where(take, jnp.take_along_axis(logits, order, axis=1), -jnp.inf)
        if cand.level == 1:
            return idx, val, block_picks(logits, vis_t, cand.block_size, nb)
        return idx, val

    args = (q, w, req, vis) + ((candidates,) if cand.level == 2 else ())
    out = lax.map(score, jax.tree.map(lambda a: a.reshape(T // tile, tile, *a.shape[1:]), args))
    idx, val = out[0].reshape(T, k), out[1].reshape(T, k)
    if k < topk:
        idx = jnp.pad(idx, ((0, 0), (0, topk - k)), constant_values=-1)
        val = jnp.pad(val, ((0, 0), (0, topk - k)), constant_values=-jnp.inf)
    return idx, val, out[2].reshape(T, nb) if cand.level == 1 else None
