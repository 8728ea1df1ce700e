"""The Lightning Indexer's top-k for JAX: backends "cpu" (the fused C kernel as an XLA FFI call) and "xla".

    indexer_topk(q, weights, keys, token_request, token_position, compress_ratio, topk, *,
                 offsets=None, block_table=None, valid=None, num_entries=None,
                 candidate_block_size=None, candidate_topk_blocks=None, candidates=None,
                 backend="auto", reference_elems=None) -> IndexerResult

The twin of `dsv4_torch.indexer` (the same signature, contract, tie rule and key sources): token
t of request b = token_request[t] at position p = token_position[t] scores entries 0 .. (p + 1)
// compress_ratio - 1 of its request (ratio 4: V4's CSA; 2 and 1: V4.1's), logit = sum_h
weights[t, h] * relu(q[t, h] . key) (x the key's scale for fp8 keys), and keeps the `topk` best
(larger logit first, equal logits: lower entry index first, NaN last), then -1 (logits -inf).

keys: rows [N, D] bfloat16 / float32 with `offsets` [B] (entry e of request b is row offsets[b] +
e; None: one request), or vLLM's index key cache uint8 [num_blocks, block_size, D + 4] with
`block_table` [B, W] (`dsv4_jax.index_cache` writes it). Every array argument may be a jax array
or a NumPy array. valid: optional bool [T]; a token with valid False is padding (its row: -1 /
-inf). num_entries (static, xla backend): entries scored per token, at least every visible count
(default: all a request can hold; checked where the positions are not traced).

DeepSeek-V4.1's two-level top-k (rules: `planner.indexer_oracle`'s module doc):
  * level 1, at the candidate source: `candidate_block_size`, `candidate_topk_blocks` (static)
    -> `result.candidates` int32 [T, candidate_topk_blocks]: per token the request-local blocks of
    `candidate_block_size` entries with the best max logit, the newest visible block first, then
    -1. The top-k itself is the ordinary one.
  * level 2, at a later index source: `candidates` [T, W] (level 1's rows, -1 = none) and
    `candidate_block_size` -> the top-k among the visible entries of each token's candidate
    blocks only ("cpu" scores only those: its cost stops growing with the context).
  candidate_topk_blocks x candidate_block_size must hold `topk`. A candidate the token cannot see
  or listed twice is refused by name: on the host where candidates and positions are not traced,
  by the C kernel for "cpu" always (under jit too); traced, "xla" ignores such an entry.

"cpu" (CPU arrays where the C library builds; "auto" picks it there) streams the keys with a
running top-k per token (memory O(tokens x topk)); "xla" scores num_entries keys per token in
token tiles of at most `reference_elems` gathered key elements and sorts (memory O(tile x
num_entries)). Both take products of the input values in float32 and accumulate in float32:
equal up to rounding (near ties may swap). No gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dsv4_jax import backends
from planner.checks import as_int, candidate_options, check_candidates

BACKENDS = backends.INDEXER_BACKENDS
F32 = jnp.float32
MAX_POSITION = 2**31 - 2**20  # dsv4_cpu.h's DSV4_MAX_POSITION


class IndexerResult(NamedTuple):
    indices: jax.Array  # [T, topk] int32, -1 padded
    logits: jax.Array  # [T, topk] float32, -inf padded
    backend: str
    candidates: jax.Array | None = None  # level 1: [T, candidate_topk_blocks] int32 block ids, -1 padded


def resolve_backend(backend: str, q) -> str:
    return backends.resolve_indexer_backend(backend, q)


def _array(x, name: str):
    """A jax array as is (traced or not); NumPy or a list as a jax array."""
    if x is None or isinstance(x, jax.Array):
        return x
    try:
        return jnp.asarray(x)
    except TypeError as e:
        raise TypeError(f"{name}: cannot be read as an array ({e})") from None


def _host(x):
    """x as NumPy when its values are known here (NumPy, or a jax array that is not traced), else None."""
    if x is None or isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


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
        if not jnp.issubdtype(block_table.dtype, jnp.integer):
            raise ValueError(f"block_table: expected integers, got {block_table.dtype}")
        if offsets is not None:
            raise ValueError("offsets: only for key rows; fp8 pages are addressed by block_table")
    elif jnp.dtype(keys.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(F32)):
        if keys.ndim != 2 or keys.shape[1] != D:
            raise ValueError(f"keys: rows must be [N, D = {D}], got {keys.shape}")
        if block_table is not None:
            raise ValueError("block_table: only for fp8 index pages; rows are addressed by offsets")
        if offsets is not None and (offsets.ndim != 1 or not jnp.issubdtype(offsets.dtype, jnp.integer)):
            raise ValueError(f"offsets: expected integers [requests], got {offsets.dtype} {offsets.shape}")
    else:
        raise TypeError(f"keys: expected uint8 fp8 index pages or bfloat16 / float32 rows, got {keys.dtype}")
    for name, a in (("token_request", token_request), ("token_position", token_position), ("valid", valid)):
        if a is not None and tuple(a.shape) != (T,):
            raise ValueError(f"{name}: expected {T} entries (one per token of q), got shape {a.shape}")
    for name, a in (("token_request", token_request), ("token_position", token_position)):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"{name}: expected integers, got {a.dtype}")
    if isinstance(compress_ratio, bool) or not isinstance(compress_ratio, int) or compress_ratio < 1:
        raise ValueError(f"compress_ratio: expected an integer >= 1, got {compress_ratio!r}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk: expected an integer >= 1, got {topk!r}")


def _check_values(T, compress_ratio, token_position, valid, num_entries, opt, candidates):
    """The value checks of positions, num_entries and candidates (the last two: of the tokens that
    are not padding), where their values are known here (not traced)."""
    pos, ok = _host(token_position), _host(valid)
    if pos is None:
        return
    if T and (pos.min() < 0 or pos.max() >= MAX_POSITION):  # (every token's, as torch's)
        raise ValueError(
            f"token_position: positions must be in [0, {MAX_POSITION}), got {int(pos.min())} .. {int(pos.max())}"
        )
    if valid is not None and ok is None:
        return
    live = np.ones(T, bool) if ok is None else ok.astype(bool)
    if not live.any():
        return
    vis = (pos.astype(np.int64) + 1) // compress_ratio
    if num_entries is not None and int(vis[live].max()) > int(num_entries):
        t = int(np.flatnonzero(live & (vis == vis[live].max()))[0])
        raise ValueError(f"num_entries: {int(num_entries)}, but token {t} sees {int(vis[t])} entries")
    cand = _host(candidates)
    if opt.level == 2 and cand is not None:
        check_candidates(cand[live], vis[live], opt.block_size, tokens=np.flatnonzero(live))


def indexer_topk(
    q,
    weights,
    keys,
    token_request,
    token_position,
    compress_ratio: int,
    topk: int,
    *,
    offsets=None,
    block_table=None,
    valid=None,
    num_entries: int | None = None,
    candidate_block_size: int | None = None,
    candidate_topk_blocks: int | None = None,
    candidates=None,
    backend: str = "auto",
    reference_elems: int | None = None,
) -> IndexerResult:
    """The top-`topk` compressed entries per token, and level 1's candidate blocks when asked
    (see the module doc)."""
    q, weights, keys = _array(q, "q"), _array(weights, "weights"), _array(keys, "keys")
    token_request, token_position = _array(token_request, "token_request"), _array(token_position, "token_position")
    offsets, block_table = _array(offsets, "offsets"), _array(block_table, "block_table")
    valid, candidates = _array(valid, "valid"), _array(candidates, "candidates")
    _check(q, weights, keys, token_request, token_position, compress_ratio, topk, offsets, block_table, valid)
    T = q.shape[0]
    opt = candidate_options(
        topk, candidate_block_size, candidate_topk_blocks, None if candidates is None else tuple(candidates.shape)
    )
    if candidates is not None:
        if candidates.shape[0] != T:
            raise ValueError(f"candidates: expected {T} rows (one per token of q), got shape {candidates.shape}")
        if not jnp.issubdtype(candidates.dtype, jnp.integer):
            raise ValueError(f"candidates: expected integer block ids, got dtype {candidates.dtype}")
    if num_entries is not None:
        num_entries = as_int(num_entries, "num_entries", minimum=0)
    _check_values(T, compress_ratio, token_position, valid, num_entries, opt, candidates)
    name = resolve_backend(backend, q)
    req = token_request.astype(jnp.int32)
    pos = token_position.astype(jnp.int32)
    ok = jnp.ones((T,), jnp.int32) if valid is None else valid.astype(jnp.int32)
    cand = None if candidates is None else candidates.astype(jnp.int32)
    fn = backends.INDEXER[name].kernel
    kw = dict(compress_ratio=compress_ratio, topk=topk, offsets=offsets, block_table=block_table, cand=opt,
              candidates=cand)  # fmt: skip
    if name != "cpu":
        kw.update(num_entries=num_entries, tile_elems=reference_elems)
    idx, val, blocks = fn(q, weights, keys, req, pos, ok, **kw)
    blocks = None if blocks is None else lax.stop_gradient(blocks)
    return IndexerResult(lax.stop_gradient(idx), lax.stop_gradient(val), name, blocks)
