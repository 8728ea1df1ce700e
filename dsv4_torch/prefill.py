"""Prefill attention of one DeepSeek-V4 layer, driven by the planner's step plan.

Once per step, `build_step_metadata` (`dsv4_torch.prefill_metadata`, re-exported here) turns the
step plan into device metadata. Every layer then calls `prefill_attention` with the metadata of
its kind: per chunk it gathers compressed and window rows into one reused workspace (one
index_select + index_copy_ per region), adds CSA's top-k part to the index rows, and calls
`sparse_attention`. The caches' shapes are checked on the host; nothing in the layer loop reads
device memory on the host, so nothing syncs.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np
import torch

from dsv4_torch.attention import check_dropout, gradient_required, resolve_backend, sparse_attention
from dsv4_torch.prefill_metadata import (  # noqa: F401  (the metadata is part of this module's API)
    ChunkIndices,
    ChunkMeta,
    GatherMap,
    KindMetadata,
    StepMetadata,
    _chunk_indices,
    _shape,
    build_step_metadata,
)
from planner import LayerKind
from planner.contract import value_dim
from planner.layout import check_topk_rows


@dataclass(frozen=True)
class PagedKV:
    """A paged cache as serving engines keep it.

    pages: (num_pages, page_size, D): raw tokens (page_size = block_size) or compressed entries
      (page_size = block_size // compress_ratio).
    block_table: (B, max_pages_per_request) int32: row i lists request i's pages, so entry e of
      request i lives at pages[block_table[i, e // page_size], e % page_size].
    """

    pages: torch.Tensor
    block_table: torch.Tensor

    def __post_init__(self):
        if not isinstance(self.pages, torch.Tensor) or self.pages.dim() != 3:
            raise ValueError(f"pages: expected a (num_pages, page_size, D) tensor, got {_shape(self.pages)}")
        if not isinstance(self.block_table, torch.Tensor) or self.block_table.dim() != 2:
            raise ValueError(f"block_table: expected a (B, max_pages) tensor, got {_shape(self.block_table)}")
        if self.block_table.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"block_table: expected int32 or int64, got {self.block_table.dtype}")
        if self.block_table.device != self.pages.device:
            raise ValueError(f"block_table: on {self.block_table.device}, pages on {self.pages.device}")


@dataclass(frozen=True)
class LogicalKV:
    """Per-request caches packed in one tensor (the twin of `dsv4_jax.prefill.LogicalKV`).

    rows: (S, D): entry e of request i is row offsets[i] + e.
    offsets: (B,) int32/int64, on rows' device. An offset may be negative when a request keeps
      only its recent entries (e.g. a window): only the entries a plan reads must be in range.
    """

    rows: torch.Tensor
    offsets: torch.Tensor

    def __post_init__(self):
        if not isinstance(self.rows, torch.Tensor) or self.rows.dim() != 2:
            raise ValueError(f"rows: expected a (S, D) tensor, got {_shape(self.rows)}")
        if not isinstance(self.offsets, torch.Tensor) or self.offsets.dim() != 1:
            raise ValueError(f"offsets: expected a (B,) tensor, got {_shape(self.offsets)}")
        if self.offsets.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"offsets: expected int32 or int64, got {self.offsets.dtype}")
        if self.offsets.device != self.rows.device:
            raise ValueError(f"offsets: on {self.offsets.device}, rows on {self.rows.device}")

    @classmethod
    def from_list(cls, tensors: Sequence[torch.Tensor]) -> "LogicalKV":
        """Pack per-request (len_i, D) tensors (one copy)."""
        if not isinstance(tensors, (list, tuple)) or not tensors:
            raise TypeError(f"tensors: expected a non-empty sequence of (len_i, D) tensors, got {type(tensors).__name__}")
        lens = [t.shape[0] for t in tensors]
        offsets = torch.tensor(np.concatenate([[0], np.cumsum(lens)[:-1]]), dtype=torch.int64, device=tensors[0].device)
        return cls(torch.cat(list(tensors)), offsets)


# A PagedKV, a LogicalKV, or per-request (len_i, D) tensors (packed on every call: for tests).
KVSource = Union[PagedKV, LogicalKV, Sequence[torch.Tensor]]



class _Rows:
    """A KV source flattened to (rows, D) with a (request, entry) -> row map.

    Checks on the host, from shapes and the metadata's host numbers only (no device read), that the
    source holds every entry the plan reads; values (page ids, offsets) are checked only on CPU.
    """

    def __init__(self, src: KVSource, name: str, q: torch.Tensor, meta: KindMetadata, region: str):
        needed = meta.raw_needed if region == "raw" else meta.compressed_needed
        first = meta.raw_first if region == "raw" else np.zeros_like(needed)
        B, D = meta.num_requests, q.shape[-1]
        self.region = region
        if isinstance(src, PagedKV):
            self.rows = src.pages.reshape(-1, src.pages.shape[-1])
            self.page_size = src.pages.shape[1]
            self.index = src.block_table  # what the row map depends on
        else:
            if not isinstance(src, LogicalKV):
                if not isinstance(src, (list, tuple)) or not src or not all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in src):
                    raise TypeError(f"{name}: expected a PagedKV, a LogicalKV or a sequence of (len_i, D) tensors")
                if len(src) < B:
                    raise ValueError(f"{name}: {len(src)} per-request tensors, but the step's batch has {B} requests")
                for i, t in enumerate(src[:B]):
                    if t.shape[0] < needed[i]:
                        raise ValueError(f"{name}[{i}]: {t.shape[0]} rows, but request {i} needs {int(needed[i])}")
                    if t.shape[1] != D:
                        raise ValueError(f"{name}[{i}]: last dim {t.shape[1]}, q's D is {D}")
                src = LogicalKV.from_list(src)
            self.rows, self.page_size, self.index = src.rows, None, src.offsets
        if self.rows.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {self.rows.dtype} differs from q's {q.dtype}")
        if self.rows.device != q.device:
            raise ValueError(f"{name}: on {self.rows.device}, q on {q.device}")
        if self.rows.shape[-1] != D:
            raise ValueError(f"{name}: last dim {self.rows.shape[-1]}, q's D is {D}")
        field_name = "block_table" if self.page_size is not None else "offsets"
        if self.index.shape[0] < B:
            raise ValueError(f"{name}.{field_name}: {self.index.shape[0]} rows, but the step's batch has {B} requests")
        if self.page_size is not None:
            held = self.index.shape[1] * self.page_size
            i = int(np.argmax(needed)) if needed.size else 0
            if needed.size and needed[i] > held:
                raise ValueError(
                    f"{name}.block_table: {self.index.shape[1]} pages of {self.page_size} entries hold {held}, "
                    f"but request {i} needs {int(needed[i])}"
                )
        if self.index.device.type == "cpu":  # values are free to check on the host
            _check_source_values(self, name, needed, first)

    def row_map(self, meta: KindMetadata) -> torch.Tensor:
        """Source row of every gathered entry of the kind (all chunks): memoized per step on the
        block table / offsets tensor, so layers sharing it compute it once."""
        key = (self.page_size, _version(self.index))
        hit = meta._row_maps.get(self.region)
        if hit is not None and hit[0]() is self.index and hit[1] == key:
            return hit[2]
        g = meta.raw_gather if self.region == "raw" else meta.compressed_gather
        if self.page_size is None:
            rows = self.index.long()[g.request] + g.entry
        else:
            page = self.index[g.request, torch.div(g.entry, self.page_size, rounding_mode="floor")].long()
            rows = page * self.page_size + g.entry % self.page_size
        meta._row_maps[self.region] = (weakref.ref(self.index), key, rows)
        return rows


def _version(t: torch.Tensor):
    try:
        return t._version  # bumped by in-place writes
    except RuntimeError:  # inference tensors keep no version counter
        return None


def _check_source_values(src: _Rows, name: str, needed: np.ndarray, first: np.ndarray) -> None:
    """CPU sources only: every page id / offset the plan reads is in range (host reads are free)."""
    planned = np.flatnonzero(needed > first)
    if not planned.size:
        return
    index = src.index.numpy().astype(np.int64)[planned]
    if src.page_size is None:
        lo, hi = index + first[planned], index + needed[planned]
        bad = (lo < 0) | (hi > src.rows.shape[0])
        if bad.any():
            k = int(np.argmax(bad))
            raise ValueError(
                f"{name}.offsets: request {int(planned[k])} at offset {int(index[k])} reads rows "
                f"{int(lo[k])} .. {int(hi[k]) - 1}, outside 0 .. {src.rows.shape[0] - 1}"
            )
        return
    num_pages = src.rows.shape[0] // src.page_size
    col = np.arange(index.shape[1])[None, :]
    read = (col >= (first[planned] // src.page_size)[:, None]) & (col < -(-needed[planned] // src.page_size)[:, None])
    bad = read & ((index < 0) | (index >= num_pages))
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise ValueError(
            f"{name}.block_table: request {int(planned[r])} page {int(c)} is {int(index[r, c])}, "
            f"outside 0 .. {num_pages - 1}"
        )


def _gather(ws: torch.Tensor, src: _Rows, g: GatherMap, row_map: torch.Tensor, at: int, count: int,
            in_place: bool = True) -> torch.Tensor:  # fmt: skip
    """ws[dst[k]] = src row row_map[k] for the chunk's k in at .. at + count - 1; returns ws.

    in_place=False (a gradient is needed): a new tensor, so autograd sees every chunk's workspace
    (the reused buffer would be overwritten before the backward reads it)."""
    if count == 0:
        return ws
    rows = src.rows.index_select(0, row_map[at : at + count])
    if in_place:
        return ws.index_copy_(0, g.dst[at : at + count], rows)
    return ws.index_copy(0, g.dst[at : at + count], rows)


def build_indices(meta: KindMetadata, chunk: ChunkMeta, topk_indices: torch.Tensor | None = None):
    """Combined indices of one chunk on the device; equal to `planner.build_chunk_indices`.

    Returns (indices (T_chunk, index_width) int32, topk_length (T_chunk,) int32). SWA/HCA rows come
    from the metadata as they are; CSA adds the layer's top-k part: entries outside
    0 .. (p+1)//4 - 1 (future or negative) are dropped to -1 on the device, never read.
    """
    ci = meta.chunk_indices[chunk.number]
    if meta.kind is not LayerKind.CSA:
        return ci.rows, ci.topk_length
    if meta.tokens_in_batch_order:
        rows = topk_indices[chunk.t0 : chunk.t1]
    else:
        rows = topk_indices.index_select(0, meta.token_index[chunk.t0 : chunk.t1])
    k = meta.index_topk
    used = (rows >= 0) & (rows < ci.topk_limit)
    comp = torch.where(used, rows + ci.row_base, ci.rows[:, :k]).to(torch.int32)
    return torch.cat([comp, ci.rows[:, k:]], dim=1), ci.topk_length


def prefill_attention(
    q: torch.Tensor,
    meta: KindMetadata,
    raw_kv: KVSource,
    compressed_kv: KVSource | None = None,
    *,
    sm_scale: float,
    attn_sink: torch.Tensor | None = None,
    topk_indices: torch.Tensor | None = None,
    backend: str = "auto",
    out: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Sparse prefill attention of one layer for all prefill tokens of the step.

    Args:
      q: (T, H, D): the step's prefill query tokens, request-major (batch order), after all
        query-side processing. D = 512 in DeepSeek-V4.
      meta: `build_step_metadata(...)[kind]` for this layer's kind.
      raw_kv: the raw-token latents: a `PagedKV` (page_size tokens per page), a `LogicalKV` or
        per-request (seq_len_i, D) tensors. Must hold positions gather_start .. seq_len - 1 of each
        request with queries.
      compressed_kv: CSA/HCA only: compressed entries, `PagedKV` (block_size // r entries per
        page), `LogicalKV` or per-request (seq_len_i // r, D) tensors.
        Both caches are checked on the host from shapes alone (last dim == D, a block table /
        offsets row per request, block_table width * page_size and per-request lengths covering
        the entries read); page ids and offsets only when on CPU, as reading them would sync.
        A bad cache raises ValueError naming the argument and field.
      sm_scale: softmax scale. attn_sink: optional (H,) float32.
      topk_indices: CSA only: (T, index_topk) int32 or int64, on q's device: the indexer's
        request-local top-k entries per token (the first min((p+1)//4, topk) are used).
      backend: passed to `sparse_attention`; the concrete one is recorded in `meta.last_backend`.
      out: optional (T, H, d_v) q.dtype output buffer.
      dropout_p: attention dropout (`sparse_attention`'s; reference backend only).

    Differentiable (reference backend) when grad mode is on and q, a cache or attn_sink requires
    grad: each chunk then gathers into a fresh workspace instead of the step's shared one, and
    gradients flow back through the gathers into the caches' rows.

    Returns:
      (T, H, d_v), q.dtype (d_v = 512 for D >= 512). Tokens of `query_len == 0` requests: none.
    """
    kind = meta.kind
    T, H, D = _check_q(q, meta)
    d_v = value_dim(D)
    if out is None:
        out = torch.empty((T, H, d_v), dtype=q.dtype, device=q.device)
    elif out.shape != (T, H, d_v) or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out: expected ({T}, {H}, {d_v}) {q.dtype} on {q.device}, got {_shape(out)} {out.dtype} on {out.device}")
    if kind is LayerKind.CSA:
        _check_topk(topk_indices, meta, q)
    raw = _Rows(raw_kv, "raw_kv", q, meta, "raw")
    comp = None
    if kind is not LayerKind.SWA:
        if compressed_kv is None:
            raise ValueError(f"compressed_kv: required for {kind.name} layers")
        comp = _Rows(compressed_kv, "compressed_kv", q, meta, "compressed")
    dropout_p = check_dropout(dropout_p)
    grad = gradient_required(q, raw.rows, None if comp is None else comp.rows, attn_sink)
    name = resolve_backend(backend, q, needs_grad=grad, dropout_p=dropout_p)
    meta.last_backend = name
    ws_all = None if grad else meta.step.workspace(D, q.dtype)
    raw_map = raw.row_map(meta)
    comp_map = comp.row_map(meta) if comp is not None else None
    for chunk in meta.chunks:
        ws = q.new_zeros((chunk.rows, D)) if grad else ws_all[: chunk.rows]
        if comp is not None:
            ws = _gather(ws, comp, meta.compressed_gather, comp_map, chunk.compressed_at, chunk.compressed_rows, not grad)
        ws = _gather(ws, raw, meta.raw_gather, raw_map, chunk.raw_at, chunk.raw_rows, not grad)
        idx, length = build_indices(meta, chunk, topk_indices)
        if meta.tokens_in_batch_order:
            q_c = q[chunk.t0 : chunk.t1]
        else:
            q_c = q.index_select(0, meta.token_index[chunk.t0 : chunk.t1])
        o, _, _ = sparse_attention(q_c, ws, idx, sm_scale, attn_sink, length, backend=name, dropout_p=dropout_p)
        if meta.tokens_in_batch_order:
            out[chunk.t0 : chunk.t1] = o
        else:
            out.index_copy_(0, meta.token_index[chunk.t0 : chunk.t1], o)
    return out


def _check_topk(topk_indices, meta: KindMetadata, q: torch.Tensor) -> None:
    T, k = q.shape[0], meta.index_topk
    if not isinstance(topk_indices, torch.Tensor) or topk_indices.dim() != 2 or topk_indices.shape != (T, k):
        raise ValueError(f"topk_indices: expected ({T}, {k}) (tokens, index_topk) for a CSA layer, got {_shape(topk_indices)}")
    if topk_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_indices: expected int32 or int64, got {topk_indices.dtype}")
    if topk_indices.device != q.device:
        raise ValueError(f"topk_indices: on {topk_indices.device}, q on {q.device}")
    if topk_indices.device.type == "cpu":  # free to check on the host: refuse future entries
        _check_topk_values(topk_indices, meta)


def _check_topk_values(topk_indices: torch.Tensor, meta: KindMetadata) -> None:
    """CPU only (a host read): every used top-k entry is visible to its token."""
    check_topk_rows(topk_indices.numpy(), meta.plan.token_index, meta.plan.token_position, meta.plan.compress_ratio, "topk_indices")


def _check_q(q, meta: KindMetadata):
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q: expected (T, H, D), got shape {tuple(q.shape)}")
    T = meta.step.step_plan.batch.num_tokens
    if q.shape[0] != T:
        raise ValueError(f"q: {q.shape[0]} tokens, but the step's batch has {T}")
    if q.device != meta.step.device:
        raise ValueError(f"q: on {q.device}, but the metadata was built for {meta.step.device}")
    return q.shape

