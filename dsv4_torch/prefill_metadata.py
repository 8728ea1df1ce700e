"""Per-step prefill metadata for PyTorch, built once on the host from the planner's step plan.

The twin of `dsv4_jax.prefill_metadata`. `build_step_metadata` plans every layer kind (or takes
a `planner.StepPlan`), copies the plan's arrays and the flat gather row maps to the device in one
transfer per kind, builds the index rows that do not depend on a layer's top-k (all of SWA's and
HCA's, CSA's window part) with device ops, and keeps the host integers the chunk loop needs.
`dsv4_torch.prefill.prefill_attention` consumes it, once per layer of each kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from planner import V4_LAYERS, LayerKind, PlanConfig, PrefillBatch, StepPlan
from planner.layout import chunk_gather_rows, index_width
from planner.plan import KindPlan, as_step_plan


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
        k = LayerKind.of(kind)
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
    layers=V4_LAYERS,
    policy: str | None = None,
) -> StepMetadata:
    """Per-step metadata for every layer kind, built once on the host and copied in one go.

    Per kind: one host -> device transfer of the plan's arrays and the flat gather row maps, then
    (device ops, no sync) the index rows that do not depend on the layer's top-k.

    Args:
      plan_or_batch: a `planner.StepPlan`, or a `PrefillBatch` to plan here with `config`.
      device: where the layers run.
      index_topk: the indexer's top-k (CSA index width); required when CSA is planned.
      config: the `PlanConfig` when a batch is given.
      layers: the model's layer specs (`{kind: ratio}` or (kind, ratio) pairs) when a batch is given.
      policy: "adaptive", "fixed" or "per_request": overrides `config.policy`.
    """
    step = as_step_plan(plan_or_batch, config, layers, policy)
    device = torch.device(device)
    meta = StepMetadata(step_plan=step, device=device, kinds={}, max_workspace_rows=step.max_workspace_rows)
    for kind, kp in step.kinds.items():
        if kind is LayerKind.CSA and index_topk is None:
            raise ValueError("index_topk: required when CSA layers are planned")
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
    visible = torch.zeros_like(p) if kind is LayerKind.SWA else torch.div(p + 1, meta.plan.compress_ratio, rounding_mode="floor")
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
