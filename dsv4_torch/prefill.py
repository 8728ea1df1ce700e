"""Prefill attention of one DeepSeek-V4 layer, driven by the planner's step plan.

Once per step, `build_step_metadata` (`dsv4_torch.prefill_metadata`, re-exported here) turns the
step plan into device metadata (O(requests + tokens) host work). Every layer then calls
`prefill_attention` with the metadata of its kind: per chunk it gathers compressed and window
rows into one reused workspace, walking each request's block table or offsets from the
per-request arrays on the device (one Triton kernel per region on GPUs; fp8_ds_mla pages are
dequantized on the way), adds CSA's top-k part to the index rows, and runs the backend resolved once per call (`run_backend`). The
caches' shapes are checked on the host; nothing in the layer loop reads device memory on the
host, so nothing syncs.

Backend "cpu" (what "auto" runs on CPU tensors in bf16 / float32) has no chunk loop and no
workspace: one call of the C kernel per layer reads every token's keys straight from the caches
(`dsv4_torch.kernels.cpu.prefill`; fp8_ds_mla pages dequantized inside
the kernel). Its result does not depend on the plan.
"""

from __future__ import annotations

import numpy as np
import torch

from dsv4_torch import backends, kvcache, kvcache_v41
from dsv4_torch.attention import (
    check_dropout,
    check_sink,
    check_sm_scale,
    gradient_required,
    resolve_backend,
    run_backend,
)
from dsv4_torch.prefill_kv import (  # noqa: F401  (the caches are part of this module's API)
    KVSource,
    LogicalKV,
    PagedKV,
    Rows,
    check_source_values,
)
from dsv4_torch.prefill_metadata import (  # noqa: F401  (the metadata is part of this module's API)
    ChunkIndices,
    ChunkMeta,
    GatherMap,
    KindMetadata,
    PlanStepMetadata,
    StepMetadata,
    build_step_metadata,
    gather_map,
)
from planner import LayerKind
from planner.checks import shape_of
from planner.contract import value_dim
from planner.layout import check_topk_rows

GATHER_ROWS = 1 << 16  # rows per gather step (bf16/float rows): bounds the transient copies
DEQUANT_ROWS = 1 << 13  # rows per dequantize step (fp8_ds_mla pages, device ops)


def _gather(ws: torch.Tensor, src: Rows, meta: KindMetadata, chunk: ChunkMeta, in_place: bool = True) -> torch.Tensor:
    """One chunk's region of `src` into the workspace `ws` (chunk rows x D), from the per-request
    arrays on the device: vLLM's walk, `(seq_lens, gather_lens, block_table)` per request.
    Returns ws; in_place=False (a gradient is needed): a new tensor per step, through
    differentiable index ops (no kernel), so autograd sees every chunk's workspace and gradients
    reach the caches' rows.

    On a GPU: one Triton kernel per region reads the block table (or offsets) and writes the
    rows (`dsv4_torch.kernels.triton.gather`; fp8 pages: the cache backend's `gather_dequant`,
    which dequantizes: Triton on GPUs, the C kernel on CPU, the same walk), resolved once per
    layer call (`Rows.gather`);
    elsewhere the row maps of a block of rows are formed on the device
    (`gather_map`) and the rows copied (or dequantized) with index ops. Nothing reads
    device values on the host; every step's size is a host number from the plan.
    """
    compressed = src.region == "compressed"
    n = chunk.compressed_rows if compressed else chunk.raw_rows
    if n == 0:
        return ws
    if src.gather is not None and in_place:
        s0, s1 = chunk.s0, chunk.s1
        R = s1 - s0
        out = ws[: R * chunk.M].view(R, chunk.M, ws.shape[1])
        idx = src.index.index_select(0, meta.seg_request[s0:s1])  # block-table rows / offsets of the segments
        if compressed:
            seq, glen, offset = meta.seg_compressed_len[s0:s1], None, 0
        else:
            seq, glen, offset = meta.seg_seq_len[s0:s1], meta.seg_gather_len[s0:s1], chunk.N
        # (fp8 pages: the resolved cache backend's gather_dequant; rows: the Triton row gather)
        src.gather(out, src.pages if src.pages is not None else src.rows, seq, glen, idx, src.page_size, offset)
        return ws
    step = DEQUANT_ROWS if src.fp8 else GATHER_ROWS
    for a in range(0, n, step):
        g = gather_map(meta, chunk, src.region, a, min(step, n - a))
        if src.page_size is None:
            rows = src.rows.index_select(0, src.index.long()[g.request] + g.entry)
        else:
            page = src.index[g.request, torch.div(g.entry, src.page_size, rounding_mode="floor")].long()
            slot = g.entry % src.page_size
            if not src.fp8:
                rows = src.rows.index_select(0, page * src.page_size + slot)
            elif src.mxfp8:  # DeepSeek-V4.1's records
                rows = kvcache_v41.read_slots(src.pages, src.geo, src.layout, page, slot, ws.dtype)
            else:
                data = src.data_rows.index_select(0, page * (src.pb // kvcache.SLOT_DATA_BYTES) + slot)
                sc = src.scale_words.index_select(0, kvcache.scale_index(page, slot, src.pb, src.page_size))
                rows = kvcache.decode_slots(
                    data.view(torch.uint8).view(data.shape[0], -1),
                    sc.view(torch.uint8).view(sc.shape[0], -1),
                    branch_free=True,
                )
                rows = rows if rows.dtype == ws.dtype else rows.to(ws.dtype)
        ws = ws.index_copy_(0, g.dst, rows) if in_place else ws.index_copy(0, g.dst, rows)
    return ws


def gather_workspace(
    meta: KindMetadata,
    chunk,
    raw_kv: KVSource,
    compressed_kv: KVSource | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One chunk's workspace `(num_requests * M, D)` after its gathers, by the layer call's code.

    chunk: a `ChunkMeta` of `meta` or its number. Rows the chunk does not write are 0. dtype: the
    workspace's (q's in a layer call); default the rows' dtype, bfloat16 for fp8_ds_mla pages.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer, ChunkMeta)):
        raise TypeError(f"chunk: expected a ChunkMeta or a chunk number, got {type(chunk).__name__}")
    if not isinstance(chunk, ChunkMeta):
        if not 0 <= int(chunk) < len(meta.chunks):
            raise ValueError(f"chunk: expected 0..{len(meta.chunks) - 1}, got {chunk}")
        chunk = meta.chunks[int(chunk)]
    if isinstance(raw_kv, PagedKV) and raw_kv.kv_cache_dtype == "fp8_ds_mla":
        D, device, default = kvcache.HEAD_DIM, raw_kv.pages.device, torch.bfloat16
    else:
        first = (
            raw_kv.pages if isinstance(raw_kv, PagedKV) else raw_kv.rows if isinstance(raw_kv, LogicalKV) else raw_kv[0]
        )
        D, device, default = first.shape[-1], first.device, first.dtype
    like = torch.empty((0, 1, D), dtype=dtype or default, device=device)  # what Rows checks against
    ws = torch.zeros((chunk.rows, D), dtype=like.dtype, device=device)
    if meta.kind is not LayerKind.SWA:
        if compressed_kv is None:
            raise ValueError(f"compressed_kv: required for {meta.kind.name} layers")
        _gather(ws, Rows(compressed_kv, "compressed_kv", like, meta, "compressed"), meta, chunk)
    _gather(ws, Rows(raw_kv, "raw_kv", like, meta, "raw"), meta, chunk)
    return ws


def build_indices(meta: KindMetadata, chunk: ChunkMeta, topk_indices: torch.Tensor | None = None):
    """Combined indices of one chunk on the device; equal to `planner.build_chunk_indices`.

    Returns (indices (T_chunk, index_width) int32, topk_length (T_chunk,) int32). SWA/HCA rows come
    from the metadata as they are; CSA adds the layer's top-k part: entries outside
    0 .. (p+1)//r - 1 (future or negative) are dropped to -1 on the device, never read.
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
      meta: `build_step_metadata(...)[kind]` for this layer's kind; for a DeepSeek-V4.1 step (a
        `StepPlan` of a `planner.Schedule`), `build_step_metadata(step).for_layer(layer_id)` (or
        `[plan_key]`): its band's metadata, run on the band's rows only ("cut" / "replay": each
        request's last min(query_len, W) new tokens; q, topk_indices and the result hold those
        rows, `step.bands[band].token_index` of the step's), windows from the band's floors.
        A ratio-2 / ratio-1 layer is a CSA layer of that ratio: entry j visible iff
        j < (p + 1) // r; compressed_kv is its KV source's shared cache, topk_indices its index
        source's rows (a -1 among the used entries is no key, as vLLM V4.1 keeps a failed pick).
      raw_kv: the raw-token latents: a `PagedKV` (page_size tokens per page; rows in q's dtype,
        or vLLM's fp8_ds_mla bytes, dequantized while gathered), a `LogicalKV` or per-request
        (seq_len_i, D) tensors. Must hold positions gather_start .. seq_len - 1 of each request
        with queries.
      compressed_kv: CSA/HCA only: compressed entries, `PagedKV` (block_size // r entries per
        page; either format), `LogicalKV` or per-request (seq_len_i // r, D) tensors.
        Both caches are checked on the host from shapes alone (last dim == D, a block table /
        offsets row per request, block_table width * page_size and per-request lengths covering
        the entries read); page ids and offsets only when on CPU, as reading them would sync.
        A bad cache raises ValueError naming the argument and field.
      sm_scale: softmax scale. attn_sink: optional (H,) float32.
      topk_indices: CSA only: (T, index_topk) int32 or int64, on q's device: the indexer's
        request-local top-k entries per token (the first min((p+1)//r, topk) are used).
      backend: `sparse_attention`'s, resolved once per call; the concrete one is recorded in
        `meta.last_backend`. "cpu" runs the whole layer in one fused kernel call (no chunks).
      out: optional (T, H, d_v) q.dtype output buffer.
      dropout_p: attention dropout (`sparse_attention`'s; reference backend only).

    Differentiable (reference backend) when grad mode is on and q, a cache or attn_sink requires
    grad: each chunk then gathers into a fresh workspace instead of the step's shared one, and
    gradients flow back through the gathers into the caches' rows.

    Returns:
      (T, H, d_v), q.dtype (d_v = 512 for D >= 512). Tokens of `query_len == 0` requests: none.
    """
    if not isinstance(meta, KindMetadata):
        raise TypeError(f"meta: expected a KindMetadata (build_step_metadata(...)[kind]), got {type(meta).__name__}")
    kind = meta.kind
    T, H, D = _check_q(q, meta)
    d_v = value_dim(D)
    if out is None:
        out = torch.empty((T, H, d_v), dtype=q.dtype, device=q.device)
    elif out.shape != (T, H, d_v) or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out: expected ({T}, {H}, {d_v}) {q.dtype} on {q.device}, got {shape_of(out)} {out.dtype} on {out.device}"
        )
    if kind is LayerKind.CSA:
        _check_topk(topk_indices, meta, q)
    raw = Rows(raw_kv, "raw_kv", q, meta, "raw")
    comp = None
    if kind is not LayerKind.SWA:
        if compressed_kv is None:
            raise ValueError(f"compressed_kv: required for {kind.name} layers")
        comp = Rows(compressed_kv, "compressed_kv", q, meta, "compressed")
    dropout_p = check_dropout(dropout_p)
    grad = gradient_required(q, raw.rows, None if comp is None else comp.rows, attn_sink)
    key = (backend, q.dtype, q.device, q.shape[1:], grad, dropout_p) if isinstance(backend, str) else None
    name = meta.step.resolved_backends.get(key)
    if name is None:  # resolved at the step's first call with these properties (a bad name raises here)
        name = resolve_backend(backend, q, needs_grad=grad, dropout_p=dropout_p)
        meta.step.resolved_backends[key] = name
    meta.last_backend = name
    sm_scale = check_sm_scale(sm_scale)  # checked once per layer call, not per chunk
    check_sink(attn_sink, H, q.device)
    fused = backends.ATTENTION[name].prefill  # no such backend serves gradients or dropout
    if fused is not None:  # a kernel that reads the caches itself: one call, no workspace, no chunk loop
        return fused(
            q,
            meta,
            raw.source,
            None if comp is None else comp.source,
            sm_scale=sm_scale,
            attn_sink=attn_sink,
            topk_indices=topk_indices,
            out=out,
        )
    ws_all = None if grad else meta.step.workspace(D, q.dtype)
    for chunk in meta.chunks:
        ws = q.new_zeros((chunk.rows, D)) if grad else ws_all[: chunk.rows]
        if comp is not None:
            ws = _gather(ws, comp, meta, chunk, not grad)
        ws = _gather(ws, raw, meta, chunk, not grad)
        idx, length = build_indices(meta, chunk, topk_indices)
        if meta.tokens_in_batch_order:
            q_c = q[chunk.t0 : chunk.t1]
        else:
            q_c = q.index_select(0, meta.token_index[chunk.t0 : chunk.t1])
        o, _, _ = run_backend(name, q_c, ws, idx, sm_scale, attn_sink, length, grad=grad, dropout_p=dropout_p)
        if meta.tokens_in_batch_order:
            out[chunk.t0 : chunk.t1] = o
        else:
            out.index_copy_(0, meta.token_index[chunk.t0 : chunk.t1], o)
    return out


def _check_topk(topk_indices, meta: KindMetadata, q: torch.Tensor) -> None:
    T, k = q.shape[0], meta.index_topk
    if not isinstance(topk_indices, torch.Tensor) or topk_indices.dim() != 2 or topk_indices.shape != (T, k):
        raise ValueError(
            f"topk_indices: expected ({T}, {k}) (tokens, index_topk) for a CSA layer, got {shape_of(topk_indices)}"
        )
    if topk_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_indices: expected int32 or int64, got {topk_indices.dtype}")
    if topk_indices.device != q.device:
        raise ValueError(f"topk_indices: on {topk_indices.device}, q on {q.device}")
    if topk_indices.device.type == "cpu":  # free to check on the host: refuse future entries
        _check_topk_values(topk_indices, meta)


def _check_topk_values(topk_indices: torch.Tensor, meta: KindMetadata) -> None:
    """CPU only (a host read): every used top-k entry is visible to its token (the visibility of
    the step's tokens formed once per kind; `check_topk_rows` words the error)."""
    token_index, visible, used = meta.topk_visibility()
    rows = topk_indices.numpy()
    sel = rows if meta.tokens_in_batch_order else rows[token_index]
    floor = -1 if allows_invalid_picks(meta) else 0
    if (used & ((sel < floor) | (sel >= visible[:, None]))).any():
        check_topk_rows(
            rows,
            meta.plan.token_index,
            meta.plan.token_position,
            meta.plan.compress_ratio,
            "topk_indices",
            allow_invalid=floor < 0,
        )


def allows_invalid_picks(meta: KindMetadata) -> bool:
    """Whether a used top-k entry may be -1 (no key): DeepSeek-V4.1 steps (vLLM V4.1's index rows
    keep a failed pick as -1), not V4's (its kernel would read the previous request's rows)."""
    return meta.step.step_plan.schedule is not None


def _check_q(q, meta: KindMetadata):
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q: expected (T, H, D), got shape {tuple(q.shape)}")
    T = meta.plan.batch.num_tokens  # a V4.1 band's metadata: the band's rows
    if q.shape[0] != T:
        if meta.plan.band != "full" or meta.step.step_plan.schedule is not None:
            full = meta.step.step_plan.batch.num_tokens
            raise ValueError(
                f"q: {q.shape[0]} rows, but this layer's plan {meta.plan.key} computes {T} rows (its band "
                f"{meta.plan.band!r}; the step has {full} new tokens): pass the band's rows, "
                "step_plan.bands[band].token_index of the step's"
            )
        raise ValueError(f"q: {q.shape[0]} tokens, but the step's batch has {T}")
    if q.device != meta.step.device:
        raise ValueError(f"q: on {q.device}, but the metadata was built for {meta.step.device}")
    return q.shape
