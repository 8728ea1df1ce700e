"""The caches a JAX prefill layer reads: `PagedKV` (rows or vLLM's fp8_ds_mla pages) and `LogicalKV`.

Part of `dsv4_jax.prefill` (which re-exports `PagedKV`, `LogicalKV` and `KVSource`): the cache
classes (pytrees: arrays are leaves, formats and sizes static), the row lookups the xla path's
gathers use, and the host-side checks of a cache against q and the step's plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.tree_util import register_pytree_node_class

from dsv4_jax import kvcache as jax_kvcache
from dsv4_jax import kvcache_v41 as jax_kvcache_v41
from dsv4_jax.kernels.xla import kvcache as xla_kvcache
from dsv4_jax.kernels.xla import kvcache_v41 as xla_kvcache_v41
from dsv4_jax.prefill_metadata import MIN_WORKSPACE_ROWS, KindMetadata
from planner import kvcache as kvcache_ref
from planner import kvcache_v41 as kvcache_v41_ref
from planner.kvcache import KV_CACHE_DTYPES, page_bytes
from planner.sizes import bucket

# ----------------------------------------------------------------------------- caches


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _shape(x):
    return tuple(x.shape) if hasattr(x, "shape") else type(x).__name__


@register_pytree_node_class
@dataclass(frozen=True)
class PagedKV:
    """A paged cache as serving engines keep it.

    pages: the pages, in one of two formats (`kv_cache_dtype`, static under jit):
      "auto" (default): rows in q's dtype, (num_pages, page_size, D): raw tokens (page_size =
        block_size) or compressed entries (page_size = block_size // compress_ratio).
      "fp8_ds_mla": vLLM's DeepSeek-V4 cache bytes (`planner.kvcache`: 448 e4m3 dims with UE8M0
        scales per 64, 64 bf16 RoPE dims; D = 512), uint8 (num_pages, page_bytes(S)) with
        `block_size=S` slots per page. (vLLM's (num_pages, S, 584) torch view has a page stride of
        page_bytes(S) > S * 584; JAX arrays carry no strides, so a 3-D array is taken only when
        S * 584 == page_bytes(S).) A layer call dequantizes the rows it gathers into the bf16 (or
        float32) workspace: exactly `dsv4_jax.kvcache.dequantize_and_gather_k_cache`'s values
        (backend "cpu": the same values, decoded inside the kernel, no workspace).
    block_table: (B, max_pages_per_request) int32: row i lists request i's pages, so entry e of
      request i lives on page block_table[i, e // page_size], slot e % page_size.
    block_size: slots per page (static); required for fp8_ds_mla pages, else taken from the
      shape (a given value must agree).
    layout: DeepSeek-V4.1's 528-byte mxfp8 records only (kv_cache_dtype "fp8_ds_mla" with pages
      (num_pages, S, 528), `planner.kvcache_v41`; static): "interleaved" (vLLM 0.33's, the default)
      or "split". Pages with a padded stride (vLLM pads V4.1 pages beside NVFP4 ones) come 2-D,
      (num_pages, page_stride) with block_size=S, and then need the layout named. A layer call dequantizes their rows as it does fp8_ds_mla's
      (`dsv4_jax.kvcache_v41.dequantize_and_gather_k_cache`'s values; backend "cpu": in the kernel).
    """

    pages: jax.Array
    block_table: jax.Array
    kv_cache_dtype: str = "auto"
    block_size: int | None = None
    layout: str | None = None

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        bs = self.block_size
        if bs is not None and (isinstance(bs, bool) or not isinstance(bs, (int, np.integer)) or bs < 1):
            raise ValueError(f"block_size: expected a positive int or None, got {bs!r}")
        if not _is_array(self.pages):
            raise TypeError(f"pages: expected an array, got {type(self.pages).__name__}")
        if self.layout is not None and not self.mxfp8:
            raise ValueError(
                f"layout: only DeepSeek-V4.1's mxfp8 pages (kv_cache_dtype='fp8_ds_mla', shape (num_pages, S, 528)) "
                f"have a layout, got {self.layout!r}"
            )
        if self.mxfp8:
            if self.pages.ndim == 2 and bs is None:
                raise ValueError("block_size: required for 2-D mxfp8 pages (num_pages, page_stride)")
            geo = jax_kvcache_v41.page_geometry(self.pages, bs, 528 if self.pages.ndim == 2 else None, "pages")
            if geo.record.name != "mxfp8":
                raise ValueError(
                    f"pages: a layer call reads fp8_ds_mla (584 B) or mxfp8 (528 B) records, got {geo.record.name} "
                    f"({geo.record.bytes} B): dequantize them with dsv4_jax.kvcache_v41.dequantize_and_gather_k_cache"
                )
            object.__setattr__(self, "layout", kvcache_v41_ref.check_layout(self.layout, geo.record))
            object.__setattr__(self, "block_size", geo.S)
        elif self.kv_cache_dtype == "fp8_ds_mla":
            if jnp.dtype(self.pages.dtype) != jnp.dtype(jnp.uint8):
                raise TypeError(f"pages: fp8_ds_mla pages are uint8 bytes, got {jnp.dtype(self.pages.dtype)}")
            if self.pages.ndim == 3:
                S = self.pages.shape[1]
                if bs is not None and int(bs) != S:
                    raise ValueError(f"block_size: {bs} differs from the pages' {S} slots")
                if self.pages.shape[2] != kvcache_ref.SLOT_BYTES or S * kvcache_ref.SLOT_BYTES != page_bytes(S):
                    raise ValueError(
                        f"pages: a {_shape(self.pages)} array has a page stride of {S * self.pages.shape[2]} bytes, "
                        f"not page_bytes({S}) = {page_bytes(S)} (vLLM's (num_pages, S, 584) view is strided; JAX "
                        "arrays are not): pass the pages as (num_pages, page_bytes(S)) uint8 with block_size=S"
                    )
                object.__setattr__(self, "pages", self.pages.reshape(self.pages.shape[0], -1))
                object.__setattr__(self, "block_size", S)
            elif self.pages.ndim == 2:
                if bs is None:
                    raise ValueError("block_size: required for fp8_ds_mla pages (num_pages, page_bytes(S))")
                object.__setattr__(self, "block_size", int(bs))
                jax_kvcache.check_pages(self.pages, int(bs), "pages")
            else:
                raise ValueError(
                    f"pages: expected fp8_ds_mla pages (num_pages, page_bytes(S)), got {_shape(self.pages)}"
                )
        else:
            if self.pages.ndim != 3:
                raise ValueError(f"pages: expected a (num_pages, page_size, D) array, got {_shape(self.pages)}")
            if jnp.dtype(self.pages.dtype) == jnp.dtype(jnp.uint8):
                raise TypeError("pages: uint8 pages hold fp8_ds_mla bytes: pass kv_cache_dtype='fp8_ds_mla'")
            if bs is not None and int(bs) != self.pages.shape[1]:
                raise ValueError(f"block_size: {bs} differs from the pages' {self.pages.shape[1]} rows")
            object.__setattr__(self, "block_size", None)
        if not _is_array(self.block_table) or self.block_table.ndim != 2:
            raise ValueError(f"block_table: expected a (B, max_pages) array, got {_shape(self.block_table)}")
        if jnp.dtype(self.block_table.dtype) != jnp.int32:
            raise TypeError(f"block_table: expected int32, got {jnp.dtype(self.block_table.dtype)}")

    @property
    def fp8(self) -> bool:
        return self.kv_cache_dtype == "fp8_ds_mla"

    @property
    def mxfp8(self) -> bool:
        """Whether the pages hold DeepSeek-V4.1's records (fp8_ds_mla pages of the V4.1 widths)."""
        if not (self.fp8 and _is_array(self.pages) and jnp.dtype(self.pages.dtype) == jnp.dtype(jnp.uint8)):
            return False
        if self.pages.ndim == 2:  # (num_pages, page_stride): V4.1's when a layout is named
            return self.layout is not None
        return self.pages.ndim == 3 and self.pages.shape[2] in kvcache_v41_ref.BY_BYTES

    @property
    def page_size(self) -> int:
        """Entries (slots) per page."""
        return int(self.block_size) if self.fp8 else int(self.pages.shape[1])

    def tree_flatten(self):
        return (self.pages, self.block_table), (self.kv_cache_dtype, self.block_size, self.layout)

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)  # no checks: JAX unflattens with tracers and placeholders
        object.__setattr__(obj, "pages", children[0])
        object.__setattr__(obj, "block_table", children[1])
        object.__setattr__(obj, "kv_cache_dtype", aux[0])
        object.__setattr__(obj, "block_size", aux[1])
        object.__setattr__(obj, "layout", aux[2])
        return obj


@register_pytree_node_class
@dataclass(frozen=True)
class LogicalKV:
    """Per-request contiguous caches packed in one array (the bucket-friendly logical form).

    rows: (S, D), q's dtype: request i's entries are rows offsets[i] .. offsets[i] + len_i - 1.
    offsets: (B,) int32.
    lengths: optional host-side (B,) len_i (`from_list` sets it), for checks only: a request
      whose cache is shorter than its seq_len (or seq_len // r) would silently read the next
      request's rows. Not a pytree leaf: a copy rebuilt inside a trace has None.
    """

    lengths = None

    rows: jax.Array
    offsets: jax.Array

    def __post_init__(self):
        if not _is_array(self.rows) or self.rows.ndim != 2:
            raise ValueError(f"rows: expected a (S, D) array, got {_shape(self.rows)}")
        if not _is_array(self.offsets) or self.offsets.ndim != 1:
            raise ValueError(f"offsets: expected a (B,) array, got {_shape(self.offsets)}")
        if jnp.dtype(self.offsets.dtype) != jnp.int32:
            raise TypeError(f"offsets: expected int32, got {jnp.dtype(self.offsets.dtype)}")

    @classmethod
    def from_list(cls, arrays: Sequence, *, pad_rows: bool = True) -> LogicalKV:
        """Pack per-request (len_i, D) arrays (NumPy packs on the host, no device op per shape).

        pad_rows: pad the packed rows to a bucket so varied batches share compiled programs.
        """
        if not isinstance(arrays, (list, tuple)) or not arrays:
            raise TypeError(f"arrays: expected a non-empty sequence of (len_i, D) arrays, got {type(arrays).__name__}")
        for i, a in enumerate(arrays):
            if not _is_array(a) or a.ndim != 2:
                raise TypeError(f"arrays[{i}]: expected a (len_i, D) array, got {_shape(a)}")
        lens = [a.shape[0] for a in arrays]
        D = arrays[0].shape[1]
        for i, a in enumerate(arrays):
            if a.shape[1] != D:
                raise ValueError(f"arrays[{i}]: last dim {a.shape[1]} differs from arrays[0]'s {D}")
        offsets = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int32)
        total = int(sum(lens))
        pad = (bucket(total, MIN_WORKSPACE_ROWS) if pad_rows else max(total, 1)) - total
        xp = np if all(isinstance(a, np.ndarray) for a in arrays) else jnp
        rows = xp.concatenate([*arrays, xp.zeros((pad, D), arrays[0].dtype)])
        out = cls(rows, offsets if xp is np else jnp.asarray(offsets))
        object.__setattr__(out, "lengths", np.asarray(lens, dtype=np.int64))
        return out

    def tree_flatten(self):
        return (self.rows, self.offsets), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        object.__setattr__(obj, "rows", children[0])
        object.__setattr__(obj, "offsets", children[1])
        return obj


# A cache argument: paged, packed logical, or a per-request list (packed on each call: tests).
KVSource = PagedKV | LogicalKV | Sequence[jax.Array]


def _fetch(src, request, entry, dtype):
    """Rows (n, D) in `dtype` of entries `entry` of requests `request` (n,) of a PagedKV or
    LogicalKV; fp8_ds_mla pages are dequantized (`dsv4_jax.kvcache`'s exact decode)."""
    if isinstance(src, PagedKV) and src.mxfp8:  # DeepSeek-V4.1's records
        stride = src.pages.shape[1] if src.pages.ndim == 2 else src.page_size * 528
        geo = kvcache_v41_ref.Geometry(src.pages.shape[0], src.page_size, kvcache_v41_ref.RECORDS["mxfp8"], stride)
        page = src.block_table[request, entry // geo.S]
        di, si = xla_kvcache_v41.slot_bytes(geo, src.layout, page, entry % geo.S)
        flat = src.pages.reshape(-1)
        return xla_kvcache_v41.decode(
            jnp.take(flat, di, mode="clip"), jnp.take(flat, si, mode="clip"), geo.record, dtype
        )
    if isinstance(src, PagedKV) and src.fp8:
        S, pages = src.page_size, src.pages
        pb = pages.shape[1]
        page = src.block_table[request, entry // S]
        slot = entry % S
        data_row = page * (pb // kvcache_ref.SLOT_DATA_BYTES) + slot  # page_bytes is a multiple of 576
        scale_row = (
            page * (pb // kvcache_ref.SLOT_SCALE_BYTES)
            + S * (kvcache_ref.SLOT_DATA_BYTES // kvcache_ref.SLOT_SCALE_BYTES)
            + slot
        )
        data = jnp.take(pages.reshape(-1, kvcache_ref.SLOT_DATA_BYTES), data_row, axis=0, mode="clip")
        sc = jnp.take(pages.reshape(-1, kvcache_ref.SLOT_SCALE_BYTES), scale_row, axis=0, mode="clip")
        bits = xla_kvcache.decode_rows(data, sc)
        return lax.bitcast_convert_type(bits, jnp.bfloat16).astype(dtype)
    rows, lookup = _flat_rows(src)
    return rows[lookup(request, entry)].astype(dtype)


def _flat_rows(src):
    """(rows (S, D), lookup(request, entry) -> row) of a PagedKV (rows in q's dtype) or LogicalKV."""
    if isinstance(src, PagedKV):
        page_size = src.pages.shape[1]
        rows = src.pages.reshape(-1, src.pages.shape[2])

        def lookup(request, entry):
            page = src.block_table[request, entry // page_size]
            return page * page_size + entry % page_size

        return rows, lookup
    return src.rows, lambda request, entry: src.offsets[request] + entry


# ----------------------------------------------------------------------------- checks


def _as_source(src, name: str):
    if isinstance(src, (PagedKV, LogicalKV)):
        return src
    if isinstance(src, (list, tuple)) and src and all(_is_array(a) and a.ndim == 2 for a in src):
        return LogicalKV.from_list(list(src), pad_rows=False)
    raise TypeError(
        f"{name}: expected a PagedKV, a LogicalKV or a sequence of (len_i, D) arrays, got {type(src).__name__}"
    )


def _check_kv(src, name: str, q, meta: KindMetadata):
    """Check a cache against q and, when the metadata carries the host plan, against the rows each
    request needs (raw: seq_len; compressed: seq_len // r). Host-side only: a `PagedKV` block
    table or `LogicalKV` offsets are read only when they are NumPy arrays (free), never synced
    from the device; under a user's `jax.jit` the plan is gone and only shapes are checked."""
    D = q.shape[2]
    need = _needed_entries(meta, name) if meta.plan is not None else None
    if isinstance(src, (list, tuple)):
        if meta.num_requests is not None and len(src) != meta.num_requests:
            raise ValueError(f"{name}: {len(src)} per-request arrays, but the batch has {meta.num_requests} requests")
        for i, a in enumerate(src):
            if not (_is_array(a) and a.ndim == 2):
                continue  # _as_source names it
            if a.shape[1] != D:
                raise ValueError(f"{name}[{i}]: last dim {a.shape[1]} differs from q's head dim {D}")
            if need is not None and a.shape[0] < need[i]:
                raise ValueError(f"{name}[{i}]: {a.shape[0]} rows, but request {i} needs {need[i]}")
    src = _as_source(src, name)
    paged = isinstance(src, PagedKV)
    if paged and src.fp8:
        if D != kvcache_ref.HEAD_DIM:
            raise ValueError(f"{name}: fp8_ds_mla pages hold {kvcache_ref.HEAD_DIM}-dim rows, but q's head dim is {D}")
        if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
            raise TypeError(
                f"{name}: fp8_ds_mla pages dequantize to bf16 values: q must be bfloat16 or float32, "
                f"got {jnp.dtype(q.dtype)}"
            )
    else:
        rows, _ = _flat_rows(src)
        if jnp.dtype(rows.dtype) != jnp.dtype(q.dtype):
            hint = (
                " (fp8_ds_mla bytes come as PagedKV(..., kv_cache_dtype='fp8_ds_mla'))"
                if jnp.dtype(rows.dtype) == jnp.dtype(jnp.uint8)
                else ""
            )
            raise TypeError(f"{name}: dtype {jnp.dtype(rows.dtype)} differs from q's {jnp.dtype(q.dtype)}{hint}")
        if rows.shape[1] != D:
            raise ValueError(f"{name}: last dim {rows.shape[1]} differs from q's head dim {D}")
    requests = src.block_table.shape[0] if paged else src.offsets.shape[0]
    if meta.num_requests is not None and requests < meta.num_requests:
        what = "block_table rows" if paged else "offsets"
        raise ValueError(f"{name}: {requests} {what}, but the batch has {meta.num_requests} requests")
    if need is None:
        return src
    if paged:
        page_size, num_pages = src.page_size, src.pages.shape[0]
        have = src.block_table.shape[1] * page_size
        i = int(np.argmax(need)) if need.size else 0
        if need.size and have < need[i]:
            raise ValueError(
                f"{name}: block_table covers {have} entries per request "
                f"({src.block_table.shape[1]} pages of {page_size}), but request {i} needs {need[i]}"
            )
        if isinstance(src.block_table, np.ndarray):  # host table: check every page a request reads
            table = src.block_table[: need.size]
            read = np.arange(table.shape[1])[None, :] < -(-need // page_size)[:, None]
            bad = read & ((table < 0) | (table >= num_pages))
            if bad.any():
                i, j = np.argwhere(bad)[0]
                raise ValueError(f"{name}: block_table[{i}] lists page {int(table[i, j])}, outside 0..{num_pages - 1}")
    else:
        S = rows.shape[0]
        if src.lengths is not None:
            short = np.flatnonzero(np.asarray(src.lengths[: need.size]) < need)
            if short.size:
                i = int(short[0])
                raise ValueError(f"{name}: request {i} has {src.lengths[i]} rows, but needs {need[i]}")
        if isinstance(src.offsets, np.ndarray):  # host offsets: every request's rows lie inside rows
            off = src.offsets[: need.size].astype(np.int64)
            for i in np.flatnonzero((off < 0) | (off + need > S)).tolist()[:1]:
                raise ValueError(
                    f"{name}: request {i} at offset {off[i]} needs rows up to {off[i] + need[i]}, but rows has {S}"
                )
    return src


def _needed_entries(meta: KindMetadata, name: str) -> np.ndarray:
    """Entries each batch request's cache must hold for this kind (host)."""
    batch_seq = np.zeros(meta.num_requests, dtype=np.int64)
    kp = meta.plan
    np.maximum.at(batch_seq, kp.seg_request.astype(np.int64), kp.seg_seq_len.astype(np.int64))
    return batch_seq // kp.compress_ratio if name == "compressed_kv" else batch_seq
