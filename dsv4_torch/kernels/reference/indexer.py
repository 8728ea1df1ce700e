"""The indexer backend "reference" for torch: the Lightning Indexer's top-k in plain torch ops.

Each request's keys are dequantized to float32 (`request_keys`), scored in slices of at most
`REFERENCE_ELEMS` float32 logits (tokens x keys), and ranked by stable sorts under the tie rule
of `planner.indexer_oracle` (`rank`: larger logit first, equal logits lower entry first, NaN
last). Any device; memory O(tokens x keys) per slice. `dsv4_torch.indexer.indexer_topk` checks
the arguments and calls `indexer_topk_reference` when its backend resolves to "reference".
"""

from __future__ import annotations

import numpy as np
import torch

REFERENCE_ELEMS = 1 << 24  # logits (tokens x keys) scored at once


def request_keys(keys, b: int, n: int, offsets, block_table) -> torch.Tensor:
    """Request b's first n keys as float32 [n, D] (fp8 pages dequantized: e4m3 * scale)."""
    if keys.dtype != torch.uint8:
        if offsets is not None and b >= len(offsets):
            raise ValueError(f"offsets: request {b} has no entry ({len(offsets)} offsets)")
        start = 0 if offsets is None else int(offsets[b])
        if start < 0 or start + n > keys.shape[0]:
            raise ValueError(f"keys: request {b} needs rows {start} .. {start + n - 1}, the rows hold {keys.shape[0]}")
        return keys[start : start + n].float()
    P, S, W = keys.shape
    D = W - 4
    bt = np.asarray(block_table)
    e = np.arange(n)
    if b >= bt.shape[0] or (n and -(-n // S) > bt.shape[1]):
        raise ValueError(f"block_table: request {b} with {n} entries is outside its {tuple(bt.shape)} shape")
    page_host = bt[b, e // S].astype(np.int64)
    if n and (page_host.min() < 0 or page_host.max() >= P):
        raise ValueError(f"keys: request {b} names a page outside [0, {P})")
    page = torch.from_numpy(page_host).to(keys.device)
    e = torch.arange(n, device=keys.device)
    flat = keys.reshape(P, S * W) if keys.is_contiguous() else torch.stack([keys[p].reshape(-1) for p in range(P)])
    slot = (e % S).to(torch.int64)
    vals = (
        flat[page[:, None], slot[:, None] * D + torch.arange(D, device=keys.device)].view(torch.float8_e4m3fn).float()
    )
    sb = flat[page[:, None], S * D + slot[:, None] * 4 + torch.arange(4, device=keys.device)].contiguous()
    scale = sb.view(torch.float32).reshape(n)
    return vals * scale[:, None]


def rank(logits: torch.Tensor, visible: torch.Tensor | None = None) -> torch.Tensor:
    """Entry order per row under the tie rule: logit descending, lower index first, NaN last (and
    entries outside `visible`, a bool mask, after all). Stable sorts, least significant key first."""
    key = torch.where(torch.isnan(logits), float("-inf"), logits + 0.0)  # (+ 0.0: -0.0 ranks as 0.0)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    for late in (torch.isnan(logits),) + (() if visible is None else (~visible,)):
        order = order.gather(-1, torch.sort(late.gather(-1, order).to(torch.int8), dim=-1, stable=True).indices)
    return order


def block_picks(logits: torch.Tensor, vis: torch.Tensor, bs: int, nb: int) -> torch.Tensor:
    """Level 1 on one slice: logits [t, n] (invisible entries ignored), visible counts [t] ->
    int32 [t, nb] request-local blocks: the newest visible block, then the others by their max
    logit descending (lower block first on ties), blocks scoring -inf or NaN dropped, -1 after."""
    t, n = logits.shape
    nblk = -(-n // bs)
    cols = torch.arange(nblk * bs, device=logits.device)
    pad = torch.full((t, nblk * bs - n), float("-inf"), device=logits.device)
    lg = torch.where(cols[None] < vis[:, None], torch.cat([logits, pad], dim=1), float("-inf"))
    score = lg.view(t, nblk, bs).amax(dim=-1)  # (amax propagates NaN)
    blk = torch.arange(nblk, device=logits.device)[None]
    pin = (vis[:, None] - 1).div(bs, rounding_mode="floor")
    keep = (score > float("-inf")) & (blk < pin)  # (NaN > -inf is False: dropped)
    key = torch.where(keep, score, float("-inf"))
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices  # score desc, lower block first
    order = order.gather(-1, torch.sort((~keep).gather(-1, order).to(torch.int8), dim=-1, stable=True).indices)
    kept = keep.sum(dim=-1, keepdim=True)
    m = min(nb - 1, nblk)
    rest = torch.where(torch.arange(m, device=logits.device)[None] < kept, order[:, :m], -1)
    out = torch.full((t, nb), -1, dtype=torch.int32, device=logits.device)
    out[:, 0] = torch.where(vis > 0, pin[:, 0], -1).to(torch.int32)
    out[:, 1 : 1 + m] = rest.to(torch.int32)
    return out


def candidate_mask(cand: np.ndarray, n: int, bs: int, device) -> torch.Tensor:
    """Level 2: bool [t, n], entries of each row's candidate blocks (checked host ids, -1 = none)."""
    nblk = -(-n // bs)
    c = torch.from_numpy(np.where(cand >= 0, np.minimum(cand, nblk), nblk).astype(np.int64)).to(device)
    flags = torch.zeros((cand.shape[0], nblk + 1), dtype=torch.bool, device=device)
    flags.scatter_(1, c, True)
    return flags[:, torch.arange(n, device=device) // bs]


def indexer_topk_reference(
    q, weights, keys, req, pos, r, k, offsets, block_table, *, cand, candidates=None, elems: int = REFERENCE_ELEMS
):
    """The reference backend on checked arguments: float32 logits per request (in slices of
    REFERENCE_ELEMS), ranked by stable sorts. cand: `planner.checks.CandidateOptions` (level 1:
    the candidate blocks are returned third; level 2: only entries of `candidates`' blocks, host
    integers [T, W], are selectable)."""
    T = q.shape[0]
    idx = torch.full((T, k), -1, dtype=torch.int32, device=q.device)
    val = torch.full((T, k), float("-inf"), dtype=torch.float32, device=q.device)
    blocks = torch.full((T, cand.topk_blocks), -1, dtype=torch.int32, device=q.device) if cand.level == 1 else None
    vis_host = (pos + 1) // r
    vis = torch.from_numpy(vis_host).to(q.device)
    w = weights.detach().float()
    for b in np.unique(req).tolist():
        tok_host = np.flatnonzero(req == b)
        n = int(vis_host[tok_host].max())
        if n == 0:
            continue
        kb = request_keys(keys, b, n, offsets, block_table).to(q.device)
        step = max(1, elems // (n * q.shape[1]))
        for a in range(0, tok_host.shape[0], step):
            th = tok_host[a : a + step]
            t = torch.from_numpy(th).to(q.device)
            dots = torch.einsum("thd,nd->thn", q[t].float(), kb)
            logits = (w[t][:, :, None] * torch.relu(dots)).sum(dim=1)  # relu keeps NaN
            visible = torch.arange(n, device=q.device)[None] < vis[t][:, None]
            if cand.level == 1:
                blocks[t] = block_picks(logits, vis[t], cand.block_size, cand.topk_blocks)
            elif cand.level == 2:
                visible &= candidate_mask(candidates[th], n, cand.block_size, q.device)
            order = rank(logits, visible)[:, :k]
            m = order.shape[1]
            keep = torch.arange(m, device=q.device)[None] < visible.sum(dim=1, keepdim=True)
            idx[t, :m] = torch.where(keep, order, -1).to(torch.int32)
            val[t, :m] = torch.where(keep, logits.gather(1, order), float("-inf"))
    return idx, val, blocks
