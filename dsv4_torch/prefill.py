"""Prefill attention of one DeepSeek-V4 layer, driven by the planner's step plan.

Once per step: `build_step_metadata` plans every layer kind (or takes a `planner.StepPlan`),
copies the plan's arrays to the device in one transfer per kind, and keeps the host integers the
chunk loop needs. Every layer then calls `prefill_attention` with the metadata of its kind: per
chunk it gathers compressed and window rows into one reused workspace (one vectorized gather per
region), builds the combined indices on the device, and calls `sparse_attention`. Nothing in the
layer loop reads device memory on the host, so nothing syncs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, Union

import numpy as np
import torch

from dsv4_torch.attention import resolve_backend, sparse_attention
from planner import LayerKind, PlanConfig, PrefillBatch, StepPlan, layer_kind, plan_step
from planner.layout import index_width
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
            raise TypeError(f"block_table: expected int32, got {self.block_table.dtype}")
        if self.block_table.device != self.pages.device:
            raise ValueError(f"block_table: on {self.block_table.device}, pages on {self.pages.device}")


# Per-request contiguous tensors, request i's of shape (len_i, D): the simple form tests use.
LogicalKV = Sequence[torch.Tensor]
KVSource = Union[PagedKV, LogicalKV]


def _shape(x):
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


@dataclass(frozen=True)
class ChunkMeta:
    """Host integers of one chunk: where its tokens and segments sit in the kind's arrays."""

    t0: int  # planned tokens t0 .. t1 - 1
    t1: int
    s0: int  # segments s0 .. s1 - 1
    s1: int
    N: int
    M: int
    compressed_rows: int  # rows the compressed gather writes
    raw_rows: int  # rows the window gather writes

    @property
    def rows(self) -> int:
        return (self.s1 - self.s0) * self.M


@dataclass(eq=False)
class KindMetadata:
    """Device-side plan of one layer kind for one step; reuse it for every layer of that kind.

    Reuse is valid while the batch, the caches' block tables and the plan are those of this step.
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
    step: "StepMetadata" = field(repr=False)
    last_backend: str | None = None  # the concrete backend the last call ran

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

    Args:
      plan_or_batch: a `planner.StepPlan`, or a `PrefillBatch` to plan here with `config`.
      device: where the layers run.
      index_topk: the indexer's top-k (CSA index width); required when CSA is planned.
      config: the `PlanConfig` when a batch is given.
      compress_ratios: the model's per-layer ratios (or just the kinds) when a batch is given.
      planner: "adaptive", "fixed" or "per_request": overrides `config.policy`.
    """
    if isinstance(plan_or_batch, StepPlan):
        step = plan_or_batch
        if planner is not None and planner != step.config.policy:
            raise ValueError(f"planner: {planner!r} differs from the given StepPlan's policy {step.config.policy!r}")
    elif isinstance(plan_or_batch, PrefillBatch):
        if config is None:
            raise ValueError("config: a PlanConfig is required to plan a PrefillBatch")
        if planner is not None:
            config = PlanConfig(**{**config.__dict__, "policy": planner})
        step = plan_step(plan_or_batch, config, compress_ratios)
    else:
        raise TypeError(f"plan_or_batch: expected a StepPlan or PrefillBatch, got {type(plan_or_batch).__name__}")
    device = torch.device(device)
    meta = StepMetadata(step_plan=step, device=device, kinds={}, max_workspace_rows=step.max_workspace_rows)
    for kind, kp in step.kinds.items():
        if kind is LayerKind.CSA and index_topk is None:
            raise ValueError("index_topk: required when CSA (ratio-4) layers are planned")
        meta.kinds[kind] = _kind_metadata(kp, meta, device, index_topk)
    return meta


def _kind_metadata(kp: KindPlan, step: StepMetadata, device: torch.device, index_topk) -> KindMetadata:
    # One host buffer -> one transfer; the per-array tensors are views of it.
    parts = [kp.token_index, kp.token_request, kp.token_position, kp.seg_request, kp.seg_row_base,
             kp.seg_compressed_len, kp.seg_gather_len, kp.seg_gather_start]  # fmt: skip
    host = torch.from_numpy(np.concatenate(parts).astype(np.int64))
    if device.type == "cuda":
        host = host.pin_memory()
    flat = host.to(device, non_blocking=True)
    views = torch.split(flat, [p.shape[0] for p in parts])
    comp_cum = np.concatenate([[0], np.cumsum(kp.seg_compressed_len, dtype=np.int64)])
    gath_cum = np.concatenate([[0], np.cumsum(kp.seg_gather_len, dtype=np.int64)])
    chunks = []
    for c in range(kp.num_chunks):
        s0, s1 = int(kp.chunk_starts[c]), int(kp.chunk_starts[c + 1])
        chunks.append(ChunkMeta(
            t0=int(kp.chunk_token_starts[c]), t1=int(kp.chunk_token_starts[c + 1]), s0=s0, s1=s1,
            N=int(kp.chunk_N[c]), M=int(kp.chunk_M[c]),
            compressed_rows=int(comp_cum[s1] - comp_cum[s0]), raw_rows=int(gath_cum[s1] - gath_cum[s0]),
        ))  # fmt: skip
    in_order = kp.config.order == "batch" and not kp.split_requests.size
    topk = index_topk if kp.kind is LayerKind.CSA else None
    return KindMetadata(kp, index_width(kp, topk), chunks, in_order, *views, step=step)


class _Rows:
    """A KV source flattened to (rows, D) with a (request, entry) -> row map."""

    def __init__(self, src: KVSource, name: str, dtype: torch.dtype, device: torch.device):
        if isinstance(src, PagedKV):
            self.rows = src.pages.reshape(-1, src.pages.shape[-1])
            self.page_size = src.pages.shape[1]
            self.block_table = src.block_table.long()
            self.offsets = None
        else:
            if not isinstance(src, (list, tuple)) or not all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in src):
                raise TypeError(f"{name}: expected a PagedKV or a sequence of (len_i, D) tensors")
            lens = [t.shape[0] for t in src]
            self.rows = torch.cat(list(src)) if src else torch.empty(0, 0, dtype=dtype, device=device)
            self.offsets = torch.tensor(np.concatenate([[0], np.cumsum(lens)[:-1]]), dtype=torch.int64, device=device)
        if self.rows.dtype != dtype:
            raise TypeError(f"{name}: dtype {self.rows.dtype} differs from q's {dtype}")
        if self.rows.device != device:
            raise ValueError(f"{name}: on {self.rows.device}, q on {device}")

    def row_of(self, request: torch.Tensor, entry: torch.Tensor) -> torch.Tensor:
        if self.offsets is not None:
            return self.offsets[request] + entry
        page = self.block_table[request, entry // self.page_size]
        return page * self.page_size + entry % self.page_size


def _gather(ws, src: _Rows, seg_request, lengths, dst_start, src_start, total: int):
    """ws[dst_start[s] + j] = src row of (seg_request[s], src_start[s] + j) for j < lengths[s]."""
    if total == 0:
        return
    n = lengths.shape[0]
    owner = torch.repeat_interleave(torch.arange(n, device=ws.device), lengths, output_size=total)
    first = torch.cumsum(lengths, 0) - lengths
    offset = torch.arange(total, device=ws.device) - first[owner]
    ws[dst_start[owner] + offset] = src.rows[src.row_of(seg_request[owner], src_start[owner] + offset)]


def build_indices(meta: KindMetadata, chunk: ChunkMeta, topk_indices: torch.Tensor | None = None):
    """Combined indices of one chunk on the device; equal to `planner.build_chunk_indices`.

    Returns (indices (T_chunk, index_width) int32, topk_length (T_chunk,) int32). Top-k entries
    outside 0 .. (p+1)//4 - 1 (future or negative) are dropped to -1 on the device, never read.
    """
    kind, W, width = meta.kind, meta.plan.window_size, meta.index_width
    b = meta.token_request[chunk.t0 : chunk.t1]
    p = meta.token_position[chunk.t0 : chunk.t1]
    base = meta.seg_row_base[chunk.s0 : chunk.s1][b]
    gstart = meta.seg_gather_start[chunk.s0 : chunk.s1][b]
    col = torch.arange(width, device=p.device)[None, :]
    visible = torch.zeros_like(p) if kind is LayerKind.SWA else torch.div(p + 1, kind.ratio, rounding_mode="floor")
    if kind is LayerKind.CSA:
        topk = topk_indices.shape[1]
        ncomp = torch.clamp(visible, max=topk)
        rows = topk_indices[meta.token_index[chunk.t0 : chunk.t1]].long()
        k = min(topk, width)
        comp_val = torch.zeros((p.shape[0], width), dtype=torch.long, device=p.device)
        comp_val[:, :k] = rows[:, :k]
        bad = (comp_val < 0) | (comp_val >= visible[:, None])
    else:
        ncomp = visible
        comp_val = col.expand(p.shape[0], width)
        bad = None
    nwin = torch.clamp(p + 1, max=W)
    length = ncomp + nwin
    in_comp = col < ncomp[:, None]
    in_win = (col >= ncomp[:, None]) & (col < length[:, None])
    win_val = chunk.N + (p - nwin + 1 - gstart)[:, None] + (col - ncomp[:, None])
    idx = torch.where(in_comp, base[:, None] + comp_val, torch.where(in_win, base[:, None] + win_val, -1))
    if bad is not None:
        idx = torch.where(in_comp & bad, -1, idx)
    return idx.to(torch.int32), length.to(torch.int32)


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
) -> torch.Tensor:
    """Sparse prefill attention of one layer for all prefill tokens of the step.

    Args:
      q: (T, H, D): the step's prefill query tokens, request-major (batch order), after all
        query-side processing. D = 512 in DeepSeek-V4.
      meta: `build_step_metadata(...)[compress_ratio]` for this layer's kind.
      raw_kv: the raw-token latents: a `PagedKV` (page_size tokens per page) or per-request
        (seq_len_i, D) tensors. Must hold positions gather_start .. seq_len - 1 of each request.
      compressed_kv: CSA/HCA only: compressed entries, `PagedKV` (block_size // r entries per
        page) or per-request (seq_len_i // r, D) tensors.
      sm_scale: softmax scale. attn_sink: optional (H,) float32.
      topk_indices: CSA only: (T, topk) int32, the indexer's request-local top-k entries per token
        (the first min((p+1)//4, topk) are used).
      backend: passed to `sparse_attention`; the concrete one is recorded in `meta.last_backend`.
      out: optional (T, H, d_v) q.dtype output buffer.

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
        if not isinstance(topk_indices, torch.Tensor) or topk_indices.dim() != 2 or topk_indices.shape[0] != T:
            raise ValueError(f"topk_indices: expected ({T}, topk) for a CSA layer, got {_shape(topk_indices)}")
        if topk_indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"topk_indices: expected int32, got {topk_indices.dtype}")
        if topk_indices.shape[1] + meta.plan.window_size > meta.index_width:
            raise ValueError(f"topk_indices: top-k {topk_indices.shape[1]} does not fit index width {meta.index_width}")
        if topk_indices.device.type == "cpu":  # free to check on the host: refuse future entries
            _check_topk_on_host(topk_indices, meta)
    raw = _Rows(raw_kv, "raw_kv", q.dtype, q.device)
    comp = None
    if kind is not LayerKind.SWA:
        if compressed_kv is None:
            raise ValueError(f"compressed_kv: required for {kind.name} layers")
        comp = _Rows(compressed_kv, "compressed_kv", q.dtype, q.device)
    name = resolve_backend(backend, q)
    meta.last_backend = name
    ws_all = meta.step.workspace(D, q.dtype)
    for chunk in meta.chunks:
        ws = ws_all[: chunk.rows]
        segs = slice(chunk.s0, chunk.s1)
        seg_req = meta.seg_request[segs]
        base = meta.seg_row_base[segs]
        if comp is not None:
            _gather(ws, comp, seg_req, meta.seg_compressed_len[segs], base, torch.zeros_like(base), chunk.compressed_rows)
        _gather(ws, raw, seg_req, meta.seg_gather_len[segs], base + chunk.N, meta.seg_gather_start[segs], chunk.raw_rows)
        idx, length = build_indices(meta, chunk, topk_indices)
        if meta.tokens_in_batch_order:
            q_c = q[chunk.t0 : chunk.t1]
        else:
            q_c = q.index_select(0, meta.token_index[chunk.t0 : chunk.t1])
        o, _, _ = sparse_attention(q_c, ws, idx, sm_scale, attn_sink, length, backend=name)
        if meta.tokens_in_batch_order:
            out[chunk.t0 : chunk.t1] = o
        else:
            out.index_copy_(0, meta.token_index[chunk.t0 : chunk.t1], o)
    return out


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


def _check_topk_on_host(topk_indices: torch.Tensor, meta: KindMetadata):
    plan = meta.plan
    pos = plan.token_position.astype(np.int64)
    visible = (pos + 1) // plan.compress_ratio
    rows = topk_indices.numpy()[plan.token_index]
    used = np.arange(rows.shape[1])[None, :] < np.minimum(visible, rows.shape[1])[:, None]
    bad = used & ((rows < 0) | (rows >= visible[:, None]))
    if bad.any():
        t = int(np.argmax(bad.any(axis=1)))
        raise ValueError(
            f"topk_indices: row {int(plan.token_index[t])} (position {int(pos[t])}) points at entries outside "
            f"0..{int(visible[t]) - 1}"
        )
