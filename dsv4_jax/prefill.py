"""Prefill attention of one DeepSeek-V4 layer in JAX, driven by the planner's step plan.

The JAX twin of `dsv4_torch.prefill`: same inputs, outputs, names and `policy=` choices.

Once per step, on the host: `build_step_metadata` plans every layer kind (or takes a
`planner.StepPlan`) and packs each kind's plan into one int32 table `(NUM_FIELDS, L)`, copied
to the device in one transfer per step, plus a few static ints (`KindShape`). Every layer then
calls `prefill_attention` with the metadata of its kind. Nothing in a layer call reads device
memory on the host, so nothing syncs.

Under a user's `jax.jit`, pass the metadata as an argument (it is a pytree: the table is a leaf,
`KindShape` is static), never as a closure constant. Host-only checks that need the plan (token
count, cache sizes, top-k rows on the host) run when the metadata still carries it.

The design (static and dynamic sizes, buckets, the chunk loop and its tile ladder, the "cpu"
backend's one call, and why not the alternatives): `docs/kernel-design.md`, "JAX prefill under jit".
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dsv4_jax import backends
from dsv4_jax.backends import resolve_backend, run_backend
from dsv4_jax.prefill_kv import (  # noqa: F401  (the caches are part of this module's API)
    KVSource,
    LogicalKV,
    PagedKV,
    _as_source,
    _check_kv,
    _fetch,
    _flat_rows,
    _is_array,
    _shape,
)
from dsv4_jax.prefill_metadata import (  # noqa: F401  (the metadata is part of this module's API)
    CHUNK_N,
    CHUNK_SEG_START,
    CHUNK_TOKEN_START,
    MIN_WORKSPACE_ROWS,
    NUM_FIELDS,
    SCALARS,
    SEG_COMP_ROW_OFFSET,
    SEG_GATHER_START_POSITION,
    SEG_RAW_ROW_OFFSET,
    SEG_REQUEST,
    SEG_ROW_BASE,
    SIZES,
    TOK_INDEX,
    TOK_POSITION,
    TOK_REQUEST,
    KindMetadata,
    KindShape,
    StepMetadata,
    build_step_metadata,
    host_plan,
)
from planner import LayerKind
from planner import kvcache as kvcache_ref
from planner.contract import value_dim
from planner.layout import check_topk_rows
from planner.plan import KindPlan
from planner.sizes import bucket

DROP = int(np.iinfo(np.int32).max)  # a row index out of every array: scatters with mode="drop" skip it

# ----------------------------------------------------------------------------- device side


class _Fields(NamedTuple):
    """The rows of a kind's table, by name (traced)."""

    tok_index: jax.Array
    tok_request: jax.Array
    tok_position: jax.Array
    seg_request: jax.Array
    seg_row_base: jax.Array
    seg_gather_start: jax.Array
    seg_comp_start: jax.Array
    seg_raw_start: jax.Array
    chunk_seg_start: jax.Array
    chunk_token_start: jax.Array
    chunk_n: jax.Array
    num_chunks: jax.Array  # scalar
    L: int  # entries per row (static)

    @classmethod
    def of(cls, table) -> _Fields:
        return cls(*(table[i] for i in range(SCALARS)), num_chunks=table[SCALARS, 0], L=table.shape[1])


def _run_ladder(count, ladder, body, carry):
    """Cover items 0 .. count-1 with tiles of the static ladder: carry = body(carry, start, size)."""
    start = jnp.int32(0)
    rem = count
    for i, size in enumerate(ladder):
        n = (rem + size - 1) // size if i == len(ladder) - 1 else rem // size  # = buckets.ladder_counts
        carry = lax.fori_loop(0, n, lambda j, cr, size=size, start=start: body(cr, start + j * size, size), carry)
        start = start + n * size
        rem = rem - n * size
    return carry


def _gather_region(ws, src, f: _Fields, region_start, s0, s1, dst_offset, src_start, ladder, gather: str):
    """One region (compressed or raw) of a chunk into the workspace, one gather per tile.

    Segment s of the chunk owns flat rows region_start[s] .. region_start[s+1] - 1; its row j
    goes to workspace row seg_row_base[s] + dst_offset + j and comes from entry
    (src_start[s] if given else 0) + j of request seg_request[s]. gather: the cache backend
    resolved for the layer call (`gather_backend`): "cpu" gathers fp8_ds_mla pages with the C
    kernel (an XLA FFI call), else the tiles' exact decode (the same bits).
    """
    if isinstance(src, PagedKV) and src.fp8 and not src.mxfp8 and gather == "cpu":  # V4.1 records: the tiles
        return backends.CACHE["cpu"].op("gather_segments")(
            ws,
            src.pages,
            src.block_table,
            region_start,
            f.seg_request,
            f.seg_row_base,
            src_start,
            s0,
            s1,
            dst_offset,
            src.page_size,
        )
    first = region_start[s0]
    count = region_start[s1] - first

    def tile(ws, off, size):
        j = off + jnp.arange(size, dtype=jnp.int32)
        valid = j < count
        flat = first + j
        owner = jnp.clip(jnp.searchsorted(region_start, flat, side="right").astype(jnp.int32) - 1, 0, f.L - 1)
        e = flat - region_start[owner]
        entry = e if src_start is None else src_start[owner] + e
        rows = _fetch(src, jnp.where(valid, f.seg_request[owner], 0), jnp.where(valid, entry, 0), ws.dtype)
        dst = jnp.where(valid, f.seg_row_base[owner] + dst_offset + e, DROP)
        return ws.at[dst].set(rows, mode="drop")

    return _run_ladder(count, ladder, tile, ws)


def gather_backend(raw, comp) -> str:
    """The cache backend that gathers a layer call's fp8_ds_mla pages, resolved once per call
    on the host: "cpu" (the C kernel) where "auto" picks it for the pages (CPU arrays, the
    library builds), else "xla" (the tiles' exact decode, the same bits). Rows in q's dtype are
    always gathered by the tiles."""
    pages = [s.pages for s in (raw, comp) if isinstance(s, PagedKV) and s.fp8 and not s.mxfp8]
    return "xla" if not pages else backends.resolve_cache_backend("auto", *pages, op="gather")


def _gather_chunk(ws, f: _Fields, c, raw, comp, shape: KindShape, gather: str):
    s0, s1 = f.chunk_seg_start[c], f.chunk_seg_start[c + 1]
    ladder = shape.gather_ladder
    if comp is not None:
        ws = _gather_region(ws, comp, f, f.seg_comp_start, s0, s1, 0, None, ladder, gather)
    return _gather_region(ws, raw, f, f.seg_raw_start, s0, s1, f.chunk_n[c], f.seg_gather_start, ladder, gather)


def _tile_indices(f: _Fields, shape: KindShape, c, k, valid, topk_rows):
    """Combined indices of planned tokens k (size,) of chunk c; invalid tokens get none.

    Same rows as `planner.build_chunk_indices` (compressed part, then window, -1 padded).
    Top-k entries outside 0 .. (p+1)//r - 1 are dropped to -1 here, never read.
    """
    kind, W, width = shape.kind, shape.window_size, shape.index_width
    seg = jnp.minimum(f.chunk_seg_start[c] + f.tok_request[k], f.L - 1)
    p = f.tok_position[k]
    base = f.seg_row_base[seg]
    gstart = f.seg_gather_start[seg]
    col = jnp.arange(width, dtype=jnp.int32)[None, :]
    if kind is LayerKind.SWA:
        visible = jnp.zeros_like(p)
    else:
        visible = (p + 1) // shape.compress_ratio
    bad = None
    if kind is LayerKind.CSA:
        topk = topk_rows.shape[1]
        ncomp = jnp.minimum(visible, topk)
        sel = topk_rows[f.tok_index[k]]  # (size, topk)
        comp_val = jnp.pad(sel, ((0, 0), (0, width - topk)))
        bad = (comp_val < 0) | (comp_val >= visible[:, None])
    else:
        ncomp = visible
        comp_val = col
    nwin = p + 1 - jnp.maximum(p - W + 1, gstart)  # window max(p - W + 1, gather_start) .. p (gstart >= 0)
    length = ncomp + nwin
    in_comp = col < ncomp[:, None]
    in_win = (col >= ncomp[:, None]) & (col < length[:, None])
    # Window position q = p - nwin + 1 + (col - ncomp); its row is N + q - gather_start.
    win_val = f.chunk_n[c] + (p - nwin + 1 - gstart)[:, None] + (col - ncomp[:, None])
    idx = jnp.where(in_comp, base[:, None] + comp_val, jnp.where(in_win, base[:, None] + win_val, -1))
    if bad is not None:
        idx = jnp.where(in_comp & bad, -1, idx)
    idx = jnp.where(valid[:, None], idx, -1)
    return idx.astype(jnp.int32), jnp.where(valid, length, 0).astype(jnp.int32)


TRACE_COUNT = {"prefill": 0}  # traces of `_prefill_jit`; each is one compilation


@functools.partial(
    jax.jit,
    static_argnames=("shape", "sm_scale", "backend", "gather", "interpret", "fused_options", "fill"),
    donate_argnames=("out",),
)
def _prefill_jit(
    q,
    table,
    raw,
    comp,
    topk_rows,
    attn_sink,
    out=None,
    *,
    shape: KindShape,
    sm_scale: float,
    backend: str,
    gather: str = "xla",
    interpret=False,
    fused_options: tuple = (),
    fill=0.0,
):
    """The layer call on resolved backend `backend` (and fp8 page gathers on cache backend
    `gather`, `gather_backend`). `out`: a donated buffer for the result (None:
    XLA allocates it). `fill`: the workspace's initial value (tests pass NaN: rows no chunk wrote
    must never reach an output)."""
    TRACE_COUNT["prefill"] += 1
    f = _Fields.of(table)
    T_q, H, D = q.shape
    layer = backends.ATTENTION[backend].prefill
    if layer is not None and T_q:  # a kernel that reads the caches itself: one call, no workspace, no chunk loop
        meta = KindMetadata(table, shape)
        kw = dict(sm_scale=sm_scale, attn_sink=attn_sink, topk_indices=topk_rows, out=out, **dict(fused_options))
        return layer(q, meta, raw, comp, **kw)
    out = jnp.zeros((T_q, H, value_dim(D)), q.dtype)  # a donated `out` is free for XLA to reuse here
    if T_q == 0:
        return out
    ws = jnp.full((shape.workspace_rows, D), fill, q.dtype)

    def chunk(c, carry):
        ws, out = carry
        ws = _gather_chunk(ws, f, c, raw, comp, shape, gather)
        t0, t1 = f.chunk_token_start[c], f.chunk_token_start[c + 1]

        def attend(out, off, size):
            k = t0 + off + jnp.arange(size, dtype=jnp.int32)
            valid = k < t1
            k = jnp.minimum(k, f.L - 1)
            rows = f.tok_index[k]
            idx, length = _tile_indices(f, shape, c, k, valid, topk_rows)
            o, _, _ = run_backend(backend, q[rows], ws, idx, sm_scale, attn_sink, length, interpret=interpret)
            return out.at[jnp.where(valid, rows, DROP)].set(o, mode="drop")

        return ws, _run_ladder(t1 - t0, shape.token_ladder, attend, out)

    _, out = lax.fori_loop(0, f.num_chunks, chunk, (ws, out))
    return out


# ----------------------------------------------------------------------------- public API


def prefill_attention(
    q,
    meta: KindMetadata,
    raw_kv: KVSource,
    compressed_kv: KVSource | None = None,
    *,
    sm_scale: float,
    attn_sink=None,
    topk_indices=None,
    backend: str = "auto",
    interpret=False,
    out=None,
):
    """Sparse prefill attention of one layer for all prefill tokens of the step. Jit-compatible.

    Args:
      q: (T_q, H, D), bfloat16 / float16 / float32: the step's prefill query tokens,
        request-major (batch order), after all query-side processing; D = 512 in DeepSeek-V4.
        T_q >= T; rows past T are padding. Pad to `padded_tokens` (`StepMetadata.pad_tokens`)
        so that varied batches share compiled programs.
      meta: `build_step_metadata(...)[kind]` for this layer's kind; for a DeepSeek-V4.1 step (a
        `StepPlan` of a `planner.Schedule`), `build_step_metadata(step).for_layer(layer_id)` (or
        `[plan_key]`): its band's metadata, run on the band's rows only ("cut" / "replay": each
        request's last min(query_len, W) new tokens; q, topk_indices and the result hold those
        rows, `step.bands[band].token_index` of the step's, padded or not), windows from the
        band's floors. A ratio-2 / ratio-1 layer is a CSA layer of that ratio: entry j visible iff
        j < (p + 1) // r; compressed_kv is its KV source's shared cache, topk_indices its index
        source's rows (a -1 among the used entries is no key, as vLLM V4.1 keeps a failed pick).
      raw_kv: the raw-token latents: a `PagedKV` (page_size tokens per page; rows in q's dtype,
        or vLLM's fp8_ds_mla bytes, dequantized while gathered), a `LogicalKV` (q's dtype), or
        per-request (seq_len_i, D) arrays (packed on every call: for tests). Must hold positions
        gather_start .. seq_len - 1 of each request.
      compressed_kv: CSA/HCA only: compressed entries in the same forms (block_size // r entries
        per page; seq_len_i // r rows per request).
      sm_scale: softmax scale, a Python float. attn_sink: optional (H,) float32.
      topk_indices: CSA only: (T_q', topk) int32 (other dtypes: TypeError) with T_q' >= T, the indexer's request-local top-k
        entries per token (the first min((p+1)//r, topk) are used).
      backend: `sparse_attention`'s ("cpu": one C kernel call for the whole layer, see the
        module docstring), resolved once per call (`dsv4_jax.backends`); the backend that ran is
        recorded in `meta.last_backend` when `meta` is the caller's object (outside `jax.jit`).
        Inside a user's `jax.jit` the call gets a copy of `meta` that JAX rebuilt, so the
        caller's `last_backend` is not set; `dsv4_jax.resolve_backend(backend, q)`, which this
        call uses, says which backend runs.
      interpret: run a Pallas backend in its interpreter (`sparse_attention`'s).
      out: optional (T_q, H, d_v) array in q's dtype, DONATED: the result is written into its
        memory (`out = prefill_attention(..., out=out)`; the array passed in is deleted). Saves
        allocating the output per call (outside a jitted model each call would otherwise get
        fresh pages, which the OS must zero: about a quarter of a long CPU prefill's time).

    Returns:
      (T_q, H, d_v), q.dtype (d_v = 512 for D >= 512); padding rows are 0.
    """
    if not isinstance(meta, KindMetadata):
        raise TypeError(f"meta: expected a KindMetadata (build_step_metadata(...)[kind]), got {type(meta).__name__}")
    shape = meta.shape
    kind = shape.kind
    T_q, H, D = _check_q(q, meta)
    q = jnp.asarray(q)
    raw = _check_kv(raw_kv, "raw_kv", q, meta)
    comp = None
    if kind is not LayerKind.SWA:
        if compressed_kv is None:
            raise ValueError(f"compressed_kv: required for {kind.name} layers")
        comp = _check_kv(compressed_kv, "compressed_kv", q, meta)
    topk_rows = None
    if kind is LayerKind.CSA:
        topk_rows = _check_topk(topk_indices, meta)
    if attn_sink is not None:
        if not hasattr(attn_sink, "shape") or tuple(attn_sink.shape) != (H,):
            raise ValueError(f"attn_sink: expected shape ({H},), got {_shape(attn_sink)}")
        attn_sink = jnp.asarray(attn_sink, jnp.float32)
    if (
        isinstance(sm_scale, jax.core.Tracer)
        or isinstance(sm_scale, bool)
        or not isinstance(sm_scale, (int, float, np.number))
    ):
        raise TypeError(f"sm_scale: expected a Python float (a compile-time constant), got {type(sm_scale).__name__}")
    if out is not None:
        want = (T_q, H, value_dim(D))
        if not _is_array(out) or tuple(out.shape) != want or jnp.dtype(out.dtype) != jnp.dtype(q.dtype):
            raise ValueError(
                f"out: expected a {want} {jnp.dtype(q.dtype)} array, got {_shape(out)} "
                f"{getattr(out, 'dtype', type(out).__name__)}"
            )
    name = resolve_backend(backend, q, interpret=interpret)
    meta.last_backend = name
    entry = backends.ATTENTION[name]
    return _prefill_jit(
        q,
        meta.table,
        raw,
        comp,
        topk_rows,
        attn_sink,
        out,
        shape=shape,
        sm_scale=float(sm_scale),
        backend=name,
        gather=gather_backend(raw, comp),
        interpret=interpret,
        fused_options=entry.prefill_options(interpret) if entry.fused_prefill else (),
    )


def build_indices(meta: KindMetadata, chunk: int, topk_indices=None):
    """Combined indices of one chunk, built on the device by the code the layer call runs.

    Equal to `planner.build_chunk_indices(meta.plan, chunk, topk_rows, width=meta.index_width)`.
    Needs the host plan (call it outside `jax.jit`). Returns (indices (T_chunk, index_width)
    int32, topk_length (T_chunk,) int32) as jax arrays.
    """
    kp = host_plan(meta, "build_indices")
    c = _check_chunk(kp, chunk)
    topk_rows = _check_topk(topk_indices, meta) if meta.kind is LayerKind.CSA else None
    t0, t1 = int(kp.chunk_token_starts[c]), int(kp.chunk_token_starts[c + 1])
    # A bucketed tile, as in the layer call; the rows past the chunk are cut off here.
    bounds = (jnp.int32(c), jnp.int32(t0), jnp.int32(t1))
    idx, length = _indices_jit(meta.table, topk_rows, *bounds, size=bucket(t1 - t0), shape=meta.shape)
    return idx[: t1 - t0], length[: t1 - t0]


@functools.partial(jax.jit, static_argnames=("size", "shape"))
def _indices_jit(table, topk_rows, c, t0, t1, *, size, shape):
    f = _Fields.of(table)
    k = t0 + jnp.arange(size, dtype=jnp.int32)
    return _tile_indices(f, shape, c, jnp.minimum(k, f.L - 1), k < t1, topk_rows)


def gather_workspace(
    meta: KindMetadata, chunk: int, raw_kv: KVSource, compressed_kv: KVSource | None = None, *, dtype=None
):
    """The workspace `(workspace_rows, D)` after one chunk's gathers, by the layer call's code.

    Rows the chunk does not write stay 0. dtype: the workspace's (q's in a layer call); default
    the rows' dtype, bfloat16 for fp8_ds_mla pages. Needs the host plan (call it outside `jax.jit`).
    """
    kp = host_plan(meta, "gather_workspace")
    c = _check_chunk(kp, chunk)
    raw = _as_source(raw_kv, "raw_kv")
    comp = None
    if meta.kind is not LayerKind.SWA:
        if compressed_kv is None:
            raise ValueError(f"compressed_kv: required for {meta.kind.name} layers")
        comp = _as_source(compressed_kv, "compressed_kv")
    if isinstance(raw, PagedKV) and raw.fp8:
        D, default = kvcache_ref.HEAD_DIM, jnp.bfloat16
    else:
        rows, _ = _flat_rows(raw)
        D, default = rows.shape[1], rows.dtype
    dtype = jnp.dtype(default if dtype is None else dtype)
    gather = gather_backend(raw, comp)
    return _gather_jit(meta.table, raw, comp, jnp.int32(c), shape=meta.shape, D=D, dtype=dtype, gather=gather)


@functools.partial(jax.jit, static_argnames=("shape", "D", "dtype", "gather"))
def _gather_jit(table, raw, comp, c, *, shape, D, dtype, gather):
    ws = jnp.zeros((shape.workspace_rows, D), dtype)
    return _gather_chunk(ws, _Fields.of(table), c, raw, comp, shape, gather)


# ----------------------------------------------------------------------------- checks


def _check_chunk(kp: KindPlan, chunk) -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or not 0 <= int(chunk) < kp.num_chunks:
        raise ValueError(f"chunk: expected 0..{kp.num_chunks - 1}, got {chunk!r}")
    return int(chunk)


def _check_q(q, meta: KindMetadata):
    if not _is_array(q):
        raise TypeError(f"q: expected a jax.Array, got {type(q).__name__}")
    if q.ndim != 3:
        raise ValueError(f"q: expected (T, H, D), got shape {tuple(q.shape)}")
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        raise TypeError(f"q: expected bfloat16, float16 or float32, got {jnp.dtype(q.dtype)}")
    if meta.num_tokens is not None and q.shape[0] < meta.num_tokens:
        raise ValueError(f"q: {q.shape[0]} tokens, but the step's batch has {meta.num_tokens}")
    if meta.plan is not None and meta.allow_invalid:  # DeepSeek-V4.1: q holds the layer's band's rows
        T, padded = meta.num_tokens, meta.shape.padded_tokens
        if q.shape[0] not in (T, padded):
            raise ValueError(
                f"q: {q.shape[0]} rows, but this layer's plan {meta.plan.key} computes {T} rows (its band "
                f"{meta.plan.band!r}; the step has {meta.step_tokens} new tokens): pass the band's rows, "
                f"step_plan.bands[band].token_index of the step's, padded or not to padded_tokens = {padded}"
            )
    return q.shape


def _check_topk(topk_indices, meta: KindMetadata):
    if not _is_array(topk_indices) or topk_indices.ndim != 2:
        raise ValueError(f"topk_indices: expected (T, topk) for a CSA layer, got {_shape(topk_indices)}")
    if jnp.dtype(topk_indices.dtype) != jnp.int32:  # never cast silently: int64 ids could wrap
        raise TypeError(f"topk_indices: expected int32, got {jnp.dtype(topk_indices.dtype)}")
    if meta.num_tokens is not None and topk_indices.shape[0] < meta.num_tokens:
        raise ValueError(
            f"topk_indices: {topk_indices.shape[0]} rows, but the step's batch has {meta.num_tokens} tokens"
        )
    if topk_indices.shape[1] + meta.shape.window_size > meta.index_width:
        raise ValueError(f"topk_indices: top-k {topk_indices.shape[1]} does not fit index width {meta.index_width}")
    if isinstance(topk_indices, np.ndarray) and meta.plan is not None:  # on the host: free to check
        check_topk_rows(
            topk_indices,
            meta.plan.token_index,
            meta.plan.token_position,
            meta.plan.compress_ratio,
            "topk_indices",
            allow_invalid=meta.allow_invalid,
        )
    return jnp.asarray(topk_indices)
