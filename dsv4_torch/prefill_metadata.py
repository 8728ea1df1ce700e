"""Per-step prefill metadata for PyTorch, built once on the host from the planner's step plan.

The twin of `dsv4_jax.prefill_metadata`. `build_step_metadata` plans every layer kind (or takes
a `planner.StepPlan`); at the first layer call of a backend that loops over chunks it copies the
plan's per-token, per-segment and per-chunk arrays to the device in one transfer per kind and
keeps the host integers the chunk loop needs (the fused "cpu" backend never needs them). Its host work
is O(requests + tokens): nothing is sized by the context lengths (no per-row gather maps on the
host). On the device, `dsv4_torch.prefill.prefill_attention` forms each chunk's gathers from the
per-request arrays (vLLM's `(seq_lens, gather_lens, block_table)` walk) and, at the first layer
call of a kind, the index rows that do not depend on a layer's top-k (all of SWA's and HCA's,
CSA's window part), kept for every later layer of that kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from planner import V4_LAYERS, LayerKind, PlanConfig, PrefillBatch, StepPlan
from planner.checks import INT32_MAX, as_int
from planner.contract import PlanKey, index_width_for
from planner.kind_plan import KindPlan
from planner.plan import as_step_plan, band_local_plan


class ChunkMeta(NamedTuple):
    """Host integers of one chunk: where its tokens and segments sit in the kind's arrays."""

    t0: int  # planned tokens t0 .. t1 - 1
    t1: int
    s0: int  # segments s0 .. s1 - 1
    s1: int
    N: int
    M: int
    compressed_rows: int  # rows the compressed gather writes
    raw_rows: int  # rows the window gather writes
    number: int = 0  # c: this chunk is KindMetadata.chunks[c]

    @property
    def rows(self) -> int:
        return (self.s1 - self.s0) * self.M


@dataclass(frozen=True)
class GatherMap:
    """Gathers of one region of one chunk, row by row (device, int64; `gather_map` forms it).

    Workspace row dst[k] (chunk-local) receives entry entry[k] of batch request request[k].
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
      0 <= v < topk_limit[t, j] ((p+1)//r, r the layer's compress ratio, when j < min((p+1)//r, topk),
      else 0);
      row_base (T_chunk, 1) int32: b * M of each token.
    """

    rows: torch.Tensor
    topk_length: torch.Tensor
    topk_limit: torch.Tensor | None = None
    row_base: torch.Tensor | None = None


# The plan's arrays a chunked backend reads on the device, in the order of their one host buffer.
_DEVICE_ARRAYS = (
    ("token_index", "(T,) int64, planned order -> row of q / out"),
    ("token_request", "(T,) int64, chunk-local request b"),
    ("token_position", "(T,) int64, absolute position p"),
    ("seg_request", "(n_seg,) int64, batch request index"),
    ("seg_row_base", "(n_seg,) int64, b * M"),
    ("seg_compressed_len", "(n_seg,) int64: compressed entries 0 .. len - 1 are gathered"),
    ("seg_gather_len", "(n_seg,) int64: raw positions seq_len - len .. seq_len - 1"),
    ("seg_gather_start", "(n_seg,) int64, seq_len - gather_len"),
    ("seg_seq_len", "(n_seg,) int64, the segment's seq_len"),
    ("chunk_seg_start", "(num_chunks,) int64, first segment of each chunk"),
    ("chunk_tokens", "(num_chunks,) int64, planned tokens of each chunk"),
    ("chunk_N", "(num_chunks,) int64"),
)


def _device_array(name: str, doc: str) -> property:
    return property(lambda self: self.device_arrays()[name], doc=doc)


@dataclass(eq=False)
class KindMetadata:
    """Device-side plan of one layer kind for one step; reuse it for every layer of that kind.

    The per-token, per-segment and per-chunk arrays of the plan go to the device in one copy,
    made at the first layer call of a backend that loops over chunks (a fused backend, such as
    "cpu", reads the caches itself and never needs them); a layer call gathers each chunk's rows
    from them (device ops or one kernel per region), adds CSA's top-k part to the index rows and
    runs `sparse_attention`. The top-k-independent index rows are formed on the device at the
    first chunked layer call of the kind and kept (`chunk_indices`). Reuse is valid while the
    batch and the plan are those of this step.
    """

    plan: KindPlan
    index_width: int
    tokens_in_batch_order: bool  # planned tokens == the step's tokens in order: slices, no index
    num_requests: int  # requests in the step's batch (rows a block table / offsets need)
    raw_needed: np.ndarray  # (B,) int64, host: entries 0 .. raw_needed[i] - 1 of request i may be read
    raw_first: np.ndarray  # (B,) int64, host: the first raw entry read (seq_len for unplanned requests)
    compressed_needed: np.ndarray  # (B,) int64, host: compressed entries read per request
    index_topk: int | None  # CSA: columns of topk_indices
    step: StepMetadata = field(repr=False)
    last_backend: str | None = None  # the concrete backend the last call ran
    _index_rows: list | None = field(default=None, repr=False)
    _arrays: dict | None = field(default=None, repr=False)
    _chunks: list | None = field(default=None, repr=False)
    # CPU caches whose page ids / offsets this step's plan was checked against (`prefill_kv.Rows`):
    # (region, id, version, rows) -> the index tensor, kept so that its id is not reused this step
    checked_sources: dict = field(default_factory=dict, repr=False)
    _needs: dict = field(default_factory=dict, repr=False)
    _topk_visibility: tuple | None = field(default=None, repr=False)

    @property
    def kind(self) -> LayerKind:
        return self.plan.kind

    @property
    def chunks(self) -> list[ChunkMeta]:
        """The chunks' host integers (`ChunkMeta`), formed on first use, then kept."""
        if self._chunks is None:
            self._chunks = _chunk_metas(self.plan)
        return self._chunks

    def device_arrays(self) -> dict[str, torch.Tensor]:
        """The plan's device arrays by name (one host -> device copy, at the first use)."""
        if self._arrays is None:
            self._arrays = _copy_arrays(self.plan, self.step.device)
        return self._arrays

    def region_needs(self, region: str) -> tuple[np.ndarray, np.ndarray, int]:
        """(needed, first, i) of a region ("raw" / "compressed"): entries first[b] .. needed[b] - 1
        of request b may be read, request i needs the most (host numbers, formed once)."""
        got = self._needs.get(region)
        if got is None:
            if region == "raw":
                needed, first = self.raw_needed, self.raw_first
            else:
                needed, first = self.compressed_needed, np.zeros_like(self.compressed_needed)
            got = (needed, first, int(np.argmax(needed)) if needed.size else 0)
            self._needs[region] = got
        return got

    def topk_visibility(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """CSA: (token_index, visible (T,), used (T, index_topk) bool) of the planned tokens, the
        host arrays `planner.layout.check_topk_rows` checks a layer's top-k rows against (formed once)."""
        if self._topk_visibility is None:
            tok = np.asarray(self.plan.token_index, np.int64)
            visible = (np.asarray(self.plan.token_position, np.int64) + 1) // self.plan.compress_ratio
            used = np.arange(self.index_topk)[None, :] < np.minimum(visible, self.index_topk)[:, None]
            self._topk_visibility = (tok, visible, used)
        return self._topk_visibility

    @property
    def chunk_indices(self) -> list[ChunkIndices]:
        """Per chunk, the top-k-independent index rows (device), formed on first use, then kept."""
        if self._index_rows is None:
            self._index_rows = chunk_index_rows(self)
        return self._index_rows


for _name, _doc in _DEVICE_ARRAYS:  # KindMetadata.token_index, ... (device tensors, copied on first use)
    setattr(KindMetadata, _name, _device_array(_name, _doc))


@dataclass(eq=False)
class StepMetadata:
    """All kinds' metadata for one step, and the one workspace buffer they share."""

    step_plan: StepPlan
    device: torch.device
    kinds: dict[LayerKind, KindMetadata]
    _workspace: torch.Tensor | None = None
    # backend "cpu": (3, T) int32 host arrays (q row, batch request, position), made on first use
    cpu_tokens: np.ndarray | None = field(default=None, repr=False)
    # the concrete backend of each (asked backend, q's dtype / device / head shape, gradient,
    # dropout) of this step's layer calls: resolved at the first such call, then reused
    resolved_backends: dict = field(default_factory=dict, repr=False)

    @property
    def max_workspace_rows(self) -> int:
        """Rows of the one workspace every chunked layer call of the step shares (its plans' largest)."""
        return self.step_plan.max_workspace_rows

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

    Per kind: the host numbers the layer calls check caches against now; the plan's per-token,
    per-segment and per-chunk arrays (one host -> device transfer) and the chunks' host integers
    at the first layer call of a chunked backend: O(requests + tokens) host work and memory,
    whatever the context lengths. Gathers and index rows are formed from these on the device.

    Args:
      plan_or_batch: a `planner.StepPlan`, or a `PrefillBatch` to plan here with `config`.
      device: where the layers run.
      index_topk: the indexer's top-k (CSA index width); required when CSA is planned.
      config: the `PlanConfig` when a batch is given.
      layers: the model's layer specs (`{kind: ratio}` or (kind, ratio) pairs) when a batch is given.
      policy: "adaptive", "fixed" or "per_request": overrides `config.policy`.
    """
    step = as_step_plan(plan_or_batch, config, layers, policy)
    if index_topk is not None:
        index_topk = as_int(index_topk, "index_topk", minimum=1, maximum=INT32_MAX)
    device = torch.device(device)
    if step.schedule is not None:  # DeepSeek-V4.1: one metadata per PlanKey
        return build_plan_metadata(step, device, index_topk)
    meta = StepMetadata(step_plan=step, device=device, kinds={})
    for kind, kp in step.kinds.items():
        if kind is LayerKind.CSA and index_topk is None:
            raise ValueError("index_topk: required when CSA layers are planned")
        meta.kinds[kind] = _kind_metadata(kp, meta, index_topk)
    return meta


def _copy_arrays(kp: KindPlan, device: torch.device) -> dict[str, torch.Tensor]:
    # One host buffer -> one transfer; the per-array tensors are views of it. Every array is per
    # token, per segment or per chunk: nothing here grows with the context lengths.
    cs, cts = kp.chunk_starts, kp.chunk_token_starts
    parts = [
        kp.token_index,
        kp.token_request,
        kp.token_position,
        kp.seg_request,
        kp.seg_row_base,
        kp.seg_compressed_len,
        kp.seg_gather_len,
        kp.seg_gather_start,
        kp.seg_seq_len,
        cs[:-1],
        np.diff(cts),
        kp.chunk_N,
    ]
    host = torch.from_numpy(np.concatenate(parts).astype(np.int64))
    if device.type == "cuda":
        host = host.pin_memory()
    views = torch.split(host.to(device, non_blocking=True), [p.shape[0] for p in parts])
    return {name: v for (name, _), v in zip(_DEVICE_ARRAYS, views)}


def _chunk_metas(kp: KindPlan) -> list[ChunkMeta]:
    cs, cts = kp.chunk_starts, kp.chunk_token_starts
    comp_cum = np.zeros(kp.seg_request.shape[0] + 1, np.int64)
    gath_cum = np.zeros_like(comp_cum)
    np.cumsum(kp.seg_compressed_len, out=comp_cum[1:])
    np.cumsum(kp.seg_gather_len, out=gath_cum[1:])
    return [
        ChunkMeta(*v, c)
        for c, v in enumerate(
            zip(
                cts[:-1].tolist(),
                cts[1:].tolist(),
                cs[:-1].tolist(),
                cs[1:].tolist(),
                kp.chunk_N.tolist(),
                kp.chunk_M.tolist(),
                (comp_cum[cs[1:]] - comp_cum[cs[:-1]]).tolist(),
                (gath_cum[cs[1:]] - gath_cum[cs[:-1]]).tolist(),
            )
        )
    ]


def _kind_metadata(kp: KindPlan, step: StepMetadata, index_topk) -> KindMetadata:
    # What each request's caches must hold (host numbers, for the per-call shape checks), from the
    # planner's int64 segment sources (no int32 copies: the fused backend never reads those). A
    # request has one segment unless budget_rows split it: then the extremes over its segments.
    B = step.step_plan.batch.num_requests
    req, seq, _, _, comp, gath = kp.seg_source
    req = np.asarray(req, np.int64)
    seq = np.asarray(seq, np.int64)
    start = seq - np.asarray(gath, np.int64)
    comp = np.zeros_like(seq) if comp is None else np.asarray(comp, np.int64)
    raw_needed = np.zeros(B, np.int64)
    raw_first = np.asarray(step.step_plan.batch.seq_lens, np.int64).copy()
    compressed_needed = np.zeros(B, np.int64)
    if kp.split_requests.size:
        np.maximum.at(raw_needed, req, seq)
        np.minimum.at(raw_first, req, start)
        np.maximum.at(compressed_needed, req, comp)
    else:  # one segment per planned request
        raw_needed[req] = seq
        raw_first[req] = np.minimum(raw_first[req], start)
        compressed_needed[req] = comp

    in_order = kp.config.order == "batch" and not kp.split_requests.size
    topk = index_topk if kp.kind is LayerKind.CSA else None
    return KindMetadata(
        kp,
        # planner.layout.index_width(kp, topk), from the int64 source
        index_width_for(kp.kind, int(seq.max(initial=0)), kp.compress_ratio, kp.window_size, topk),
        in_order,
        num_requests=B,
        raw_needed=raw_needed,
        raw_first=raw_first,
        compressed_needed=compressed_needed,
        index_topk=topk,
        step=step,
    )


def chunk_index_rows(meta: KindMetadata) -> list[ChunkIndices]:
    """The top-k-independent index rows of every chunk (device ops, once per step and kind).

    For all planned tokens at once (int64, then int32 for the (T, width) work): compressed part
    in columns 0 .. ncomp-1, window position q = p - nwin + 1 + (col - ncomp) at row
    N + q - gather_start of the token's request; the chunks' rows are slices of the result.
    """
    kind, W, width = meta.kind, meta.plan.window_size, meta.index_width
    T, nc = meta.token_position.shape[0], len(meta.chunks)
    if nc == 0:
        return []
    dev = meta.token_position.device
    tc = torch.repeat_interleave(torch.arange(nc, device=dev), meta.chunk_tokens, output_size=T)  # token -> chunk
    seg = meta.chunk_seg_start[tc] + meta.token_request
    p = meta.token_position
    base = meta.seg_row_base[seg]
    gstart = meta.seg_gather_start[seg]
    visible = (
        torch.zeros_like(p)
        if kind is LayerKind.SWA
        else torch.div(p + 1, meta.plan.compress_ratio, rounding_mode="floor")
    )
    ncomp = torch.clamp(visible, max=meta.index_topk) if kind is LayerKind.CSA else visible
    nwin = p + 1 - torch.clamp(p - W + 1, min=gstart)  # window max(p - W + 1, gather_start) .. p (>= 0)
    length = (ncomp + nwin).to(torch.int32)
    window_row0 = (base + meta.chunk_N[tc] + p - nwin + 1 - gstart - ncomp).to(torch.int32)[:, None]  # row at col 0
    base32, ncomp32 = base.to(torch.int32)[:, None], ncomp.to(torch.int32)[:, None]
    col = torch.arange(width, dtype=torch.int32, device=dev)[None, :]
    window = torch.where(col < length[:, None], window_row0 + col, -1)
    # HCA reads compressed entries 0 .. ncomp-1 in order; CSA's come from the layer's top-k rows.
    comp = base32 + col if kind is LayerKind.HCA else -1
    idx = torch.where(col < ncomp32, comp, window) if kind is not LayerKind.SWA else window
    bounds = [(c.t0, c.t1) for c in meta.chunks]
    if kind is not LayerKind.CSA:
        return [ChunkIndices(idx[a:b], length[a:b]) for a, b in bounds]
    limit = torch.where(col[:, : meta.index_topk] < ncomp32, visible.to(torch.int32)[:, None], 0)
    return [ChunkIndices(idx[a:b], length[a:b], limit[a:b], base32[a:b]) for a, b in bounds]


def gather_map(
    meta: KindMetadata, chunk: ChunkMeta, region: str, start: int = 0, count: int | None = None
) -> GatherMap:
    """Rows start .. start + count - 1 of one region ("compressed" or "raw") of a chunk, formed
    on the device from the per-segment arrays (no host sync; the sizes are host numbers).

    Segment b of the chunk owns the region's rows cum[b] .. cum[b+1] - 1 (cum: the running sum
    of its compressed_len / gather_len); its row j goes to workspace row b*M + j (compressed) or
    b*M + N + j (raw) and comes from entry j / raw position gather_start + j of its request.
    Equal to `planner.layout.chunk_gather_rows` (chunk-local dst, batch request, entry).
    """
    if region not in ("compressed", "raw"):
        raise ValueError(f"region: expected 'compressed' or 'raw', got {region!r}")
    compressed = region == "compressed"
    total = chunk.compressed_rows if compressed else chunk.raw_rows
    count = total - start if count is None else count
    s0, s1 = chunk.s0, chunk.s1
    lens = (meta.seg_compressed_len if compressed else meta.seg_gather_len)[s0:s1]
    dev = lens.device
    incl = torch.cumsum(lens, 0)
    k = torch.arange(start, start + count, device=dev)
    owner = torch.searchsorted(incl, k, right=True)
    j = k - (incl - lens)[owner]
    dst = meta.seg_row_base[s0:s1][owner] + j
    if compressed:
        entry = j
    else:
        dst = dst + chunk.N
        entry = meta.seg_gather_start[s0:s1][owner] + j
    return GatherMap(dst, meta.seg_request[s0:s1][owner], entry)


# ----------------------------------------------------------------------------- DeepSeek-V4.1 steps


@dataclass(eq=False)
class PlanStepMetadata(StepMetadata):
    """A DeepSeek-V4.1 step's metadata (a `StepPlan` planned from a `planner.Schedule`): one
    `KindMetadata` per distinct `PlanKey` of the step, built once and shared by every layer that
    reads that plan, mirroring `StepPlan`: index it with a `PlanKey`, or with a kind where the
    step has one plan of it (`kinds`), or ask per layer (`for_layer`).

    A "cut" / "replay" plan's metadata runs on the band's rows only: its layer call takes q (and
    top-k rows) holding each request's kept rows, in the step's order
    (`step_plan.bands[band].token_index` of the step's tokens), and returns those rows; its
    windows start at the band's floors (`planner.band_local_plan`).
    """

    plans: dict = field(default_factory=dict)  # {PlanKey: KindMetadata}

    def __getitem__(self, key) -> KindMetadata:
        if isinstance(key, PlanKey):
            if key not in self.plans:
                raise KeyError(f"no metadata for {key} in this step (built: {[str(k) for k in self.plans]})")
            return self.plans[key]
        k = LayerKind.of(key)
        if k in self.kinds:
            return self.kinds[k]
        several = [str(x) for x in self.plans if x.kind is k]
        if several:
            raise KeyError(
                f"{k.name}: this step has {len(several)} {k.name} plans ({several}); index it with a PlanKey or "
                "ask meta.for_layer(layer_id)"
            )
        raise KeyError(f"no metadata for {k.name} in this step (built: {[str(x) for x in self.plans]})")

    def for_layer(self, layer_id: int) -> KindMetadata:
        """The metadata layer `layer_id` of the schedule runs on (`StepPlan.for_layer`)."""
        return self.plans[self.step_plan.schedule.plan_key(layer_id, self.step_plan.replay)]

    @property
    def sharing(self) -> dict:
        """{PlanKey: the schedule's layers running on that metadata} (`StepPlan.sharing`)."""
        return self.step_plan.sharing


def build_plan_metadata(step: StepPlan, device: torch.device, index_topk: int | None) -> PlanStepMetadata:
    """`build_step_metadata` of a DeepSeek-V4.1 step: a `KindMetadata` per PlanKey, band plans on
    their own rows (`planner.band_local_plan`). Host work O(requests + tokens) per plan."""
    meta = PlanStepMetadata(step_plan=step, device=device, kinds={})
    for key, kp in step.plans.items():
        if key.kind is LayerKind.CSA and index_topk is None:
            raise ValueError(f"index_topk: required when CSA layers are planned (this step plans {key})")
        meta.plans[key] = _kind_metadata(band_local_plan(kp), meta, index_topk)
    meta.kinds = {k: meta.plans[p.key] for k, p in step.kinds.items()}
    return meta
