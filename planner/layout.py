"""Workspace gathers and sparse indices for one chunk, in NumPy (spec section 3).

These are the reference that the device-side builders of both frameworks are tested against.
Index rows list the compressed part first, then the window part (vLLM's order), padded with -1;
`topk_length` counts the valid prefix of each row.
"""

from __future__ import annotations

import numpy as np

from planner import contract
from planner.contract import LayerKind
from planner.kind_plan import ChunkLayout, KindPlan


def compressed_width(plan: KindPlan, topk: int | None = None) -> int:
    """Columns of the compressed part: top-k (CSA), the step's most visible entries (HCA), 0 (SWA).

    It depends on the batch, never on how the plan chunked it, so every plan of a step builds
    rows of the same width (and a kernel sees the very same index rows whatever the plan).
    """
    return contract.compressed_index_width(plan.kind, int(plan.seg_seq_len.max(initial=0)), plan.compress_ratio, topk)


def index_width(plan: KindPlan, topk: int | None = None) -> int:
    """One index width for every chunk of this kind in the step: compressed part + W, to 128
    (`planner.contract.index_width_for` at the step's longest request)."""
    return contract.index_width_for(
        plan.kind, int(plan.seg_seq_len.max(initial=0)), plan.compress_ratio, plan.window_size, topk
    )


def check_topk_rows(
    topk_rows, token_index, token_position, compress_ratio: int, name: str = "topk_rows", *, allow_invalid=False
):
    """Refuse top-k rows whose used entries are not visible (negative, or >= (p+1)//r).

    topk_rows: (T_step, topk) integers, request-local; row token_index[t] belongs to the token at
    position token_position[t], which uses its first min((p+1)//r, topk) entries.
    allow_invalid: -1 entries among the used ones are accepted (vLLM V4.1's rows: a failed pick
      stays -1 and still counts in topk_length); other negatives are refused all the same.
    Returns (the selected rows as int64, the visible counts). Raises ValueError naming `name`.
    """
    rows = np.asarray(topk_rows)
    if rows.ndim != 2 or rows.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected a 2-D integer array (T, topk), got {rows.dtype} {rows.shape}")
    if rows.shape[0] <= int(np.max(token_index, initial=-1)):
        raise ValueError(f"{name}: {rows.shape[0]} rows, but the step has token {int(np.max(token_index))}")
    pos = np.asarray(token_position, dtype=np.int64)
    visible = contract.visible_entries(pos, compress_ratio)
    sel = rows[token_index].astype(np.int64)
    used = np.arange(rows.shape[1])[None, :] < np.minimum(visible, rows.shape[1])[:, None]
    bad = used & ((sel < (-1 if allow_invalid else 0)) | (sel >= visible[:, None]))
    if bad.any():
        t = int(np.argmax(bad.any(axis=1)))
        raise ValueError(
            f"{name}: row {int(token_index[t])} (position {int(pos[t])}) points at entries outside "
            f"0..{int(visible[t]) - 1}: {sel[t, : min(int(visible[t]), rows.shape[1])].tolist()}"
        )
    return sel, visible


def _chunk(plan: KindPlan, chunk) -> ChunkLayout:
    if isinstance(chunk, ChunkLayout):
        return chunk
    if not 0 <= int(chunk) < plan.num_chunks:
        raise ValueError(f"chunk: expected 0..{plan.num_chunks - 1}, got {chunk}")
    return plan.chunks[int(chunk)]


def build_chunk_indices(plan: KindPlan, chunk, topk_rows=None, *, width: int | None = None, allow_invalid=False):
    """Combined sparse indices of one chunk's tokens into its workspace (vLLM's row layout).

    Args:
      plan: the step's `KindPlan` for this layer kind (any ratio >= 1, any band).
      chunk: a chunk number or a `ChunkLayout` of `plan`.
      topk_rows: CSA only. (T_step, topk) integers: the indexer's request-local top-k row of every
        token of the step (rows are picked with `chunk.token_index`). For a token at position p
        the first min((p+1)//r, topk) entries are used; each must lie in 0 .. (p+1)//r - 1.
      width: columns of the result; default `index_width(plan, topk)` (round_up(topk + W, 128)
        for CSA), the same for every chunk and every plan of the step. Must hold every row.
      allow_invalid: CSA: a -1 among a row's used entries stays -1 and counts in topk_length
        (DeepSeek-V4.1's `combine_topk_swa_indices`); False refuses it (V4.0's kernel would
        offset it into the previous request's rows).

    A row is `[min((p+1)//r, topk) compressed slots] + [window slots] + [-1 ...]`: the window
    covers positions max(p - W + 1, gather_start) .. p, gather_start = seq_len - gather_len of the
    token's segment (its request's window start: `replay_start`, or the replay band's clamp).

    Returns:
      indices: (T_chunk, width) int32, compressed part then window part, -1 padded.
      topk_length: (T_chunk,) int32, valid entries per row.
    """
    c = _chunk(plan, chunk)
    kind, r, W = plan.kind, plan.compress_ratio, plan.window_size
    b = c.token_request.astype(np.int64)
    p = c.token_position.astype(np.int64)
    base = c.row_bases.astype(np.int64)[b]  # b * M
    gstart = c.gather_starts.astype(np.int64)[b]

    visible = np.zeros_like(p) if kind is LayerKind.SWA else contract.visible_entries(p, r)
    sel = None
    if kind is LayerKind.CSA:
        if topk_rows is None:
            raise ValueError("topk_rows: required for CSA layers")
        sel, _ = check_topk_rows(topk_rows, c.token_index, p, r, allow_invalid=allow_invalid)
        topk = sel.shape[1]
        ncomp = np.minimum(visible, topk)
    else:
        ncomp, topk = visible, None
    wstart = np.maximum(p - W + 1, gstart)  # gstart >= 0: the window never starts below 0
    nwin = p - wstart + 1
    lengths = ncomp + nwin
    if width is None:
        width = index_width(plan, topk)
    need = int(lengths.max(initial=0))
    if int(width) < need:
        raise ValueError(f"width: {width} columns cannot hold rows of {need} valid indices")

    col = np.arange(int(width), dtype=np.int64)[None, :]
    in_comp = col < ncomp[:, None]
    in_win = (col >= ncomp[:, None]) & (col < lengths[:, None])
    if sel is not None:
        comp_val = np.zeros((p.shape[0], int(width)), dtype=np.int64)
        k = min(sel.shape[1], int(width))
        comp_val[:, :k] = sel[:, :k]
    else:
        comp_val = np.broadcast_to(col, (p.shape[0], int(width)))
    # Window position q = wstart + (col - ncomp); its row is N + q - gather_start.
    win_val = c.N + (wstart - gstart)[:, None] + (col - ncomp[:, None])
    comp_idx = np.where(comp_val < 0, -1, base[:, None] + comp_val)  # -1: allow_invalid's failed picks
    idx = np.where(in_comp, comp_idx, np.where(in_win, base[:, None] + win_val, -1))
    return idx.astype(np.int32), lengths.astype(np.int32)


def chunk_gather_rows(plan: KindPlan, chunk):
    """Which workspace row receives which KV row, as flat arrays (the reference for device gathers).

    Returns two triples of int32 arrays:
      compressed: (dst_row, request_id, entry) for rows b*M + j, j < compressed_len_b;
      raw: (dst_row, request_id, position) for rows b*M + N + j, j < gather_len_b.
    """
    c = _chunk(plan, chunk)

    def expand(lengths, dst0, src0):
        lengths = lengths.astype(np.int64)
        owner = np.repeat(np.arange(lengths.shape[0]), lengths)
        offs = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        return (
            (dst0.astype(np.int64)[owner] + offs).astype(np.int32),
            c.request_ids[owner].astype(np.int32),
            (src0.astype(np.int64)[owner] + offs).astype(np.int32),
        )

    zeros = np.zeros_like(c.row_bases)
    return (
        expand(c.compressed_lens, c.row_bases, zeros),
        expand(c.gather_lens, c.row_bases.astype(np.int64) + c.N, c.gather_starts),
    )


def gather_workspace(plan: KindPlan, chunk, raw_kv, compressed_kv=None, *, fill=0.0) -> np.ndarray:
    """Build one chunk's workspace `(num_requests * M, D)` from per-request logical KV.

    raw_kv[i]: (seq_len_i, D) latents of request i; compressed_kv[i]: (seq_len_i // r, D) (not
    needed for SWA). Rows no index may point at are set to `fill` (tests use NaN to prove it).
    """
    c = _chunk(plan, chunk)
    D = np.asarray(raw_kv[int(c.request_ids[0])]).shape[-1]
    ws = np.full((c.workspace_rows, D), fill, dtype=np.float64)
    (cd, cr, ce), (rd, rr, rp) = chunk_gather_rows(plan, c)
    for dst, req, src, source in ((cd, cr, ce, compressed_kv), (rd, rr, rp, raw_kv)):
        if dst.size == 0:
            continue
        if source is None:
            raise ValueError("compressed_kv: required for CSA/HCA layers")
        for i in np.unique(req).tolist():
            m = req == i
            ws[dst[m]] = np.asarray(source[i], dtype=np.float64)[src[m]]
    return ws
