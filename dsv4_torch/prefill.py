"""Prefill attention of one DeepSeek-V4 layer, driven by the planner's step plan.

Once per step: `build_step_metadata` plans every layer kind (or takes a `planner.StepPlan`),
copies the plan's arrays and the flat gather row maps to the device in one transfer per kind,
builds the index rows that do not depend on a layer's top-k (all of SWA's and HCA's, CSA's window
part) with device ops, and keeps the host integers the chunk loop needs. Every layer then calls
`prefill_attention` with the metadata of its kind: per chunk it gathers compressed and window rows
into one reused workspace (one index_select + index_copy_ per region), adds CSA's top-k part to
the index rows, and calls `sparse_attention`. The caches' shapes are checked on the host; nothing
in the layer loop reads device memory on the host, so nothing syncs.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Sequence, Union

import numpy as np
import torch

from dsv4_torch.attention import check_dropout, gradient_required, resolve_backend, sparse_attention
from planner import LayerKind, PlanConfig, PrefillBatch, StepPlan, layer_kind
from planner.plan import as_step_plan
from planner.layout import check_topk_rows, chunk_gather_rows, index_width
from planner.oracle import value_dim
from planner.plan import KindPlan


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


def _shape(x):
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


@dataclass(frozen=True)
class ChunkMeta:
    """Host integers of one chunk: where its tokens, segments and gathered rows sit in the kind's arrays."""

    t0: int  # planned tokens t0 .. t1 - 1
    t1: int
    s0: int  # segments s0 .. s1 - 1
    s1: int
    N: int
    M: int
    compressed_rows: int  # rows the compressed gather writes
    raw_rows: int  # rows the window gather writes
    compressed_at: int = 0  # first of them in KindMetadata.compressed_gather
    raw_at: int = 0  # first of them in KindMetadata.raw_gather
    number: int = 0  # c: this chunk is KindMetadata.chunks[c]

    @property
    def rows(self) -> int:
        return (self.s1 - self.s0) * self.M


@dataclass(frozen=True)
class GatherMap:
    """One region's gathers of every chunk of a kind, flat and chunk-major (device, int64).

    Workspace row dst[k] (chunk-local) receives entry entry[k] of batch request request[k]; chunk
    c owns k in ChunkMeta.compressed_at/raw_at .. + compressed_rows/raw_rows.
    """

    dst: torch.Tensor
    request: torch.Tensor
    entry: torch.Tensor


@dataclass(frozen=True)
class ChunkIndices:
    """The top-k-independent part of one chunk's combined indices, built once per step (device).

    rows: (T_chunk, index_width) int32: complete for SWA/HCA; for CSA the window part, with -1 in
      the columns the top-k entries fill per layer.
    topk_length: (T_chunk,) int32.
    CSA only: topk_limit (T_chunk, index_topk) int32: a top-k value v in column j is used iff
      0 <= v < topk_limit[t, j] ((p+1)//4 when j < min((p+1)//4, topk), else 0);
      row_base (T_chunk, 1) int32: b * M of each token.
    """

    rows: torch.Tensor
    topk_length: torch.Tensor
    topk_limit: torch.Tensor | None = None
    row_base: torch.Tensor | None = None


@dataclass(eq=False)
class KindMetadata:
    """Device-side plan of one layer kind for one step; reuse it for every layer of that kind.

    Everything here that only depends on the batch and the plan (gather row maps, the SWA/HCA
    index rows, the window part of CSA's) is built once by `build_step_metadata`; a layer call only
    gathers, adds CSA's top-k part and runs `sparse_attention`. Reuse is valid while the batch, the
    caches' block tables / offsets and the plan are those of this step.
    """

    plan: KindPlan
    index_width: int
    chunks: list[ChunkMeta]
    tokens_in_batch_order: bool  # planned tokens == the step's tokens in order: slices, no index
    token_index: torch.Tensor  # (T,) int64, planned order -> row of q / out
    token_request: torch.Tensor  # (T,) int64, chunk-local request b
    token_position: torch.Tensor  # (T,) int64, absolute position p
    seg_request: torch.Tensor  # (n_seg,) int64, batch request index
    seg_row_base: torch.Tensor  # (n_seg,) int64, b * M
    seg_compressed_len: torch.Tensor
    seg_gather_len: torch.Tensor
    seg_gather_start: torch.Tensor
    compressed_gather: GatherMap
    raw_gather: GatherMap
    num_requests: int  # requests in the step's batch (rows a block table / offsets need)
    raw_needed: np.ndarray  # (B,) int64, host: entries 0 .. raw_needed[i] - 1 of request i may be read
    raw_first: np.ndarray  # (B,) int64, host: the first raw entry read (seq_len for unplanned requests)
    compressed_needed: np.ndarray  # (B,) int64, host: compressed entries read per request
    index_topk: int | None  # CSA: columns of topk_indices
    step: "StepMetadata" = field(repr=False)
    chunk_indices: list[ChunkIndices] = field(default_factory=list, repr=False)
    last_backend: str | None = None  # the concrete backend the last call ran
    # source row maps, memoized per region on the identity of the block table / offsets tensor
    _row_maps: dict = field(default_factory=dict, repr=False)

    @property
    def kind(self) -> LayerKind:
        return self.plan.kind


@dataclass(eq=False)
class StepMetadata:
    """All kinds' metadata for one step, and the one workspace buffer they share."""

    step_plan: StepPlan
    device: torch.device
    kinds: dict[LayerKind, KindMetadata]
    max_workspace_rows: int
    _workspace: torch.Tensor | None = None

    def __getitem__(self, kind) -> KindMetadata:
        k = layer_kind(kind)
        if k not in self.kinds:
            raise KeyError(f"no metadata for {k.name} in this step (built: {[x.name for x in self.kinds]})")
        return self.kinds[k]

    def workspace(self, D: int, dtype: torch.dtype) -> torch.Tensor:
        """The step's workspace `(max_workspace_rows, D)`, allocated once and reused by every layer."""
        ws = self._workspace
        if ws is None or ws.shape[1] != D or ws.dtype != dtype:
            ws = torch.empty((max(1, self.max_workspace_rows), D), dtype=dtype, device=self.device)
            self._workspace = ws
        return ws


def build_step_metadata(
    plan_or_batch: StepPlan | PrefillBatch,
    *,
    device: torch.device | str = "cpu",
    index_topk: int | None = None,
    config: PlanConfig | None = None,
    compress_ratios: Sequence[int] = (0, 4, 128),
    planner: str | None = None,
) -> StepMetadata:
    """Per-step metadata for every layer kind, built once on the host and copied in one go.

    Per kind: one host -> device transfer of the plan's arrays and the flat gather row maps, then
    (device ops, no sync) the index rows that do not depend on the layer's top-k.

    Args:
      plan_or_batch: a `planner.StepPlan`, or a `PrefillBatch` to plan here with `config`.
      device: where the layers run.
      index_topk: the indexer's top-k (CSA index width); required when CSA is planned.
      config: the `PlanConfig` when a batch is given.
      compress_ratios: the model's per-layer ratios (or just the kinds) when a batch is given.
      planner: "adaptive", "fixed" or "per_request": overrides `config.policy`.
    """
    step = as_step_plan(plan_or_batch, config, compress_ratios, planner)
    device = torch.device(device)
    meta = StepMetadata(step_plan=step, device=device, kinds={}, max_workspace_rows=step.max_workspace_rows)
    for kind, kp in step.kinds.items():
        if kind is LayerKind.CSA and index_topk is None:
            raise ValueError("index_topk: required when CSA (ratio-4) layers are planned")
        meta.kinds[kind] = _kind_metadata(kp, meta, device, index_topk)
    return meta


def _kind_metadata(kp: KindPlan, step: StepMetadata, device: torch.device, index_topk) -> KindMetadata:
    gathers = [chunk_gather_rows(kp, c) for c in range(kp.num_chunks)]
    flat = lambda region, k: np.concatenate([g[region][k] for g in gathers]) if gathers else np.zeros(0, np.int32)  # noqa: E731
    # One host buffer -> one transfer; the per-array tensors are views of it.
    parts = [kp.token_index, kp.token_request, kp.token_position, kp.seg_request, kp.seg_row_base,
             kp.seg_compressed_len, kp.seg_gather_len, kp.seg_gather_start,
             *(flat(region, k) for region in (0, 1) for k in (0, 1, 2))]  # fmt: skip
    host = torch.from_numpy(np.concatenate(parts).astype(np.int64))
    if device.type == "cuda":
        host = host.pin_memory()
    views = torch.split(host.to(device, non_blocking=True), [p.shape[0] for p in parts])
    comp_cum = np.concatenate([[0], np.cumsum(kp.seg_compressed_len, dtype=np.int64)])
    gath_cum = np.concatenate([[0], np.cumsum(kp.seg_gather_len, dtype=np.int64)])
    chunks = []
    for c in range(kp.num_chunks):
        s0, s1 = int(kp.chunk_starts[c]), int(kp.chunk_starts[c + 1])
        chunks.append(ChunkMeta(
            t0=int(kp.chunk_token_starts[c]), t1=int(kp.chunk_token_starts[c + 1]), s0=s0, s1=s1,
            N=int(kp.chunk_N[c]), M=int(kp.chunk_M[c]),
            compressed_rows=int(comp_cum[s1] - comp_cum[s0]), raw_rows=int(gath_cum[s1] - gath_cum[s0]),
            compressed_at=int(comp_cum[s0]), raw_at=int(gath_cum[s0]), number=c,
        ))  # fmt: skip
    # What each request's caches must hold (host numbers, for the per-call shape checks).
    B = step.step_plan.batch.num_requests
    req = kp.seg_request.astype(np.int64)
    raw_needed = np.zeros(B, np.int64)
    np.maximum.at(raw_needed, req, kp.seg_gather_start.astype(np.int64) + kp.seg_gather_len)
    raw_first = np.asarray(step.step_plan.batch.seq_lens, np.int64).copy()
    np.minimum.at(raw_first, req, kp.seg_gather_start.astype(np.int64))
    compressed_needed = np.zeros(B, np.int64)
    np.maximum.at(compressed_needed, req, kp.seg_compressed_len.astype(np.int64))

    in_order = kp.config.order == "batch" and not kp.split_requests.size
    topk = index_topk if kp.kind is LayerKind.CSA else None
    km = KindMetadata(
        kp, index_width(kp, topk), chunks, in_order, *views[:8],
        compressed_gather=GatherMap(*views[8:11]), raw_gather=GatherMap(*views[11:14]),
        num_requests=B, raw_needed=raw_needed, raw_first=raw_first, compressed_needed=compressed_needed,
        index_topk=topk, step=step,
    )  # fmt: skip
    km.chunk_indices = [_chunk_indices(km, c) for c in chunks]
    return km


def _chunk_indices(meta: KindMetadata, chunk: ChunkMeta) -> ChunkIndices:
    """The top-k-independent index rows of one chunk (device ops, once per step).

    Per token (int64, then int32 for the (T_chunk, width) work): compressed part in columns
    0 .. ncomp-1, window position q = p - nwin + 1 + (col - ncomp) at row N + q - gather_start.
    """
    kind, W, width = meta.kind, meta.plan.window_size, meta.index_width
    b = meta.token_request[chunk.t0 : chunk.t1]
    p = meta.token_position[chunk.t0 : chunk.t1]
    base = meta.seg_row_base[chunk.s0 : chunk.s1][b]
    gstart = meta.seg_gather_start[chunk.s0 : chunk.s1][b]
    visible = torch.zeros_like(p) if kind is LayerKind.SWA else torch.div(p + 1, kind.ratio, rounding_mode="floor")
    ncomp = torch.clamp(visible, max=meta.index_topk) if kind is LayerKind.CSA else visible
    nwin = torch.clamp(p + 1, max=W)
    length = (ncomp + nwin).to(torch.int32)
    window_row0 = (base + chunk.N + p - nwin + 1 - gstart - ncomp).to(torch.int32)[:, None]  # row at col 0
    base32, ncomp32 = base.to(torch.int32)[:, None], ncomp.to(torch.int32)[:, None]
    col = torch.arange(width, dtype=torch.int32, device=p.device)[None, :]
    window = torch.where(col < length[:, None], window_row0 + col, -1)
    # HCA reads compressed entries 0 .. ncomp-1 in order; CSA's come from the layer's top-k rows.
    comp = base32 + col if kind is LayerKind.HCA else -1
    idx = torch.where(col < ncomp32, comp, window) if kind is not LayerKind.SWA else window
    if kind is not LayerKind.CSA:
        return ChunkIndices(idx, length)
    limit = torch.where(col[:, : meta.index_topk] < ncomp32, visible.to(torch.int32)[:, None], 0)
    return ChunkIndices(idx, length, limit, base32)


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
      meta: `build_step_metadata(...)[compress_ratio]` for this layer's kind.
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
    check_topk_rows(topk_indices.numpy(), meta.plan.token_index, meta.plan.token_position, 4, "topk_indices")


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

