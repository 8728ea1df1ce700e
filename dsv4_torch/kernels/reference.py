"""Sparse attention in plain torch: the FlashMLA contract, tiled so memory stays bounded.

Runs on any device. Tokens go through in tiles of a fixed size and keys in blocks of a fixed
width, with an online softmax across key blocks. Every matmul, reduction and elementwise op
therefore sees the same shapes whatever the call looks like, and each token's slice starts at
the same alignment, so a token's result is bitwise the same whichever other tokens share the
call and however wide its index row is padded with invalid entries (chunk plans rely on this).

Callers go through `dsv4_torch.sparse_attention`, which validates the arguments.
"""

from __future__ import annotations

import math

import torch

from planner.contract import value_dim

KEY_BLOCK = 64  # index columns per step of the online softmax
MAX_TOKEN_TILE = 64
TILE_BUDGET_BYTES = 64 << 20  # working set of one token tile
_HEAD_ALIGN = 16  # pad heads so every per-token slice starts 64-byte aligned
# On CPU, reading the indices on the host is free, so key blocks without a valid entry in the
# whole token tile are skipped (exact: such a block leaves every row as it was). On other devices
# every block runs, since the read would make the host wait for the device.
SKIP_EMPTY_BLOCKS_ON_CPU = True


def token_tile(num_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Tokens per tile: a power of two that depends only on (H, D, dtype), never on T or K.

    Keeping it independent of the call is what makes results tile invariant.
    """
    heads = _round_up(num_heads, _HEAD_ALIGN)
    d_v = value_dim(head_dim)
    elems = heads * head_dim + 2 * KEY_BLOCK * head_dim + 4 * heads * KEY_BLOCK + 3 * heads * d_v
    per_token = elems * _accum_dtype(dtype).itemsize
    tile = max(1, min(MAX_TOKEN_TILE, TILE_BUDGET_BYTES // per_token))
    return 1 << (tile.bit_length() - 1)


def sparse_attention_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashMLA sparse attention, tiled torch.

    Args:
      q: (T, H, D), float16 / bfloat16 / float32 / float64.
      kv: (S, D), q.dtype: the flat workspace; K = V = the row, V is its first d_v dims
        (d_v = 512 if D >= 512 else D).
      indices: (T, K), int32. Invalid: negative, >= S, or column >= topk_length[t].
      sm_scale: float, applied to <q, k>.
      attn_sink: optional (H,), float32 or float64: per-head logit that joins the denominator only.
      topk_length: optional (T,), int32.

    Returns:
      out: (T, H, d_v), q.dtype; 0 for rows with no valid key.
      max_logits: (T, H), float32 (float64 for float64 inputs); -inf for rows with no valid key.
      lse: (T, H), same dtype, natural log, sink excluded; +inf for rows with no valid key.

    Accumulates in float32 (float64 for float64 inputs). Any strides are accepted.
    """
    T, H, D = q.shape
    S, K = kv.shape[0], indices.shape[1]
    d_v = value_dim(D)
    acc_dtype = _accum_dtype(q.dtype)
    dev = q.device
    out = torch.empty((T, H, d_v), dtype=q.dtype, device=dev)
    max_logits = torch.empty((T, H), dtype=acc_dtype, device=dev)
    lse = torch.empty((T, H), dtype=acc_dtype, device=dev)

    tile = token_tile(H, D, q.dtype)
    heads = _round_up(H, _HEAD_ALIGN)
    sink = torch.full((heads,), -math.inf, dtype=acc_dtype, device=dev)
    if attn_sink is not None:
        sink[:H] = attn_sink.to(acc_dtype)
    limit = torch.full((T,), K, dtype=torch.int64, device=dev)
    if topk_length is not None:
        limit = topk_length.to(torch.int64).clamp(0, K)
    num_blocks = -(-K // KEY_BLOCK)
    cols = torch.arange(num_blocks * KEY_BLOCK, device=dev)

    # Per-tile buffers, reused; padded tokens have zero queries and only invalid indices.
    q_tile = torch.zeros((tile, heads, D), dtype=acc_dtype, device=dev)  # [tile, heads, D]
    idx_tile = torch.full((tile, num_blocks * KEY_BLOCK), -1, dtype=torch.int64, device=dev)
    lim_tile = torch.zeros((tile,), dtype=torch.int64, device=dev)
    for t0 in range(0, T, tile):
        n = min(tile, T - t0)
        q_tile.zero_()
        q_tile[:n, :H] = q[t0 : t0 + n]
        idx_tile.fill_(-1)
        idx_tile[:n, :K] = indices[t0 : t0 + n]
        lim_tile.zero_()
        lim_tile[:n] = limit[t0 : t0 + n]
        valid = (idx_tile >= 0) & (idx_tile < S) & (cols[None, :] < lim_tile[:, None])  # [tile, Kp]

        m = torch.full((tile, heads), -math.inf, dtype=acc_dtype, device=dev)  # running max
        l = torch.zeros((tile, heads), dtype=acc_dtype, device=dev)  # running sum of exp
        acc = torch.zeros((tile, heads, d_v), dtype=acc_dtype, device=dev)
        blocks = range(num_blocks)
        if dev.type == "cpu" and SKIP_EMPTY_BLOCKS_ON_CPU:
            active = valid.view(tile, num_blocks, KEY_BLOCK).any(dim=2).any(dim=0).tolist()
            blocks = [b for b in blocks if active[b]]
        for b in blocks:
            m, l, acc = _key_block_step(
                q_tile, kv, idx_tile[:, b * KEY_BLOCK : (b + 1) * KEY_BLOCK],
                valid[:, b * KEY_BLOCK : (b + 1) * KEY_BLOCK], sm_scale, d_v, m, l, acc,
            )
        has_key = valid.any(dim=1)[:, None]  # [tile, 1]
        o, mx, ls = _finish(m, l, acc, sink, has_key)
        out[t0 : t0 + n] = o[:n, :H]
        max_logits[t0 : t0 + n] = mx[:n, :H]
        lse[t0 : t0 + n] = ls[:n, :H]
    return out, max_logits, lse


def _key_block_step(q_tile, kv, idx, valid, sm_scale, d_v, m, l, acc):
    """One online-softmax step over KEY_BLOCK index columns of every token in the tile.

    q_tile [tile, heads, D]; idx, valid [tile, KEY_BLOCK]; m, l [tile, heads];
    acc [tile, heads, d_v]. Rows with no valid entry in this block keep m, l, acc exactly.
    """
    tile, block = idx.shape
    rows = torch.where(valid, idx, 0)
    keys = kv.index_select(0, rows.reshape(-1)).view(tile, block, -1).to(q_tile.dtype)  # [tile, block, D]
    keys.masked_fill_(~valid[:, :, None], 0)  # invalid rows add exact zeros, even if row 0 is inf/nan
    s = torch.bmm(q_tile, keys.transpose(1, 2)).mul_(sm_scale)  # [tile, heads, block]
    s.masked_fill_(~valid[:, None, :], -math.inf)
    m_new = torch.maximum(m, s.amax(dim=-1))
    has = valid.any(dim=-1)[:, None]  # [tile, 1]
    m_ref = torch.where(has, m_new, 0.0)  # finite wherever the step is kept
    alpha = torch.exp(m - m_ref)  # 0 on a row's first valid block (m = -inf)
    p = torch.exp(s - m_ref[:, :, None])
    l_new = l * alpha + p.sum(dim=-1)
    acc_new = torch.baddbmm(acc * alpha[:, :, None], p, keys[:, :, :d_v])
    return (
        torch.where(has, m_new, m),
        torch.where(has, l_new, l),
        torch.where(has[:, :, None], acc_new, acc),
    )


def _finish(m, l, acc, sink, has_key):
    """Normalise, apply the sink, and give rows with no valid key out 0, lse +inf, max -inf.

    has_key [tile, 1]: the token has a valid entry. Not `l > 0`: a NaN logit makes l NaN, and
    such a row must come out NaN, as planner.oracle gives it.
    """
    has = has_key.expand_as(m)
    lse = torch.where(has, m + torch.log(l), math.inf)
    out = acc / torch.where(has, l, 1.0)[:, :, None]
    # exp(lse) / (exp(lse) + exp(sink)), written so a large sink cannot overflow into NaN.
    out = out / (1.0 + torch.exp(sink[None, :] - lse))[:, :, None]
    out = torch.where(has[:, :, None], out, 0.0)
    return out, m, lse


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m
