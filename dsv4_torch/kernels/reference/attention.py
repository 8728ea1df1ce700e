"""Sparse attention in plain torch: the FlashMLA contract, tiled so memory stays bounded.

Runs on any device. Tokens go through in tiles of a fixed size and keys in blocks of a fixed
width, with an online softmax across key blocks. Every matmul, reduction and elementwise op
therefore sees the same shapes whatever the call looks like, and each token's slice starts at
the same alignment, so a token's result is bitwise the same whichever other tokens share the
call and however wide its index row is padded with invalid entries (chunk plans rely on this).

Backward (`sparse_attention_reference_autograd`): a `torch.autograd.Function` whose forward is the
kernel above, unchanged, and whose backward recomputes each token tile's logits from the saved q,
kv, indices and lse, FlashAttention-style: dq, kv's gradient scattered (added) through the
indices, the sink's gradient, and lse's own gradient if lse is used. Memory stays that of one
tile. Optional attention dropout (transformers' eager semantics: a probability is kept with
probability 1 - p and scaled by 1 / (1 - p); the sink is never dropped) draws its mask per
(token tile, key block) from a seed, so the backward regenerates it.

Callers go through `dsv4_torch.sparse_attention`, which validates the arguments.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from planner.contract import round_up, value_dim

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
    heads = round_up(num_heads, _HEAD_ALIGN)
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
    *,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
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
      dropout_p, dropout_seed: attention dropout (see the module doc); 0 = none, the exact kernel.

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
    heads = round_up(H, _HEAD_ALIGN)
    sink = torch.full((heads,), -math.inf, dtype=acc_dtype, device=dev)
    if attn_sink is not None:
        sink[:H] = attn_sink.to(acc_dtype)
    limit = torch.full((T,), K, dtype=torch.int64, device=dev)
    if topk_length is not None:
        limit = topk_length.to(torch.int64).clamp(0, K)
    num_blocks = -(-K // KEY_BLOCK)
    cols = torch.arange(num_blocks * KEY_BLOCK, device=dev)
    drop = _Dropout(dropout_p, dropout_seed, (tile, heads, KEY_BLOCK), acc_dtype, dev) if dropout_p > 0 else None

    def run_tiles(tiles):
        # Per-tile buffers, reused; padded tokens have zero queries and only invalid indices.
        q_tile = torch.zeros((tile, heads, D), dtype=acc_dtype, device=dev)  # [tile, heads, D]
        idx_tile = torch.full((tile, num_blocks * KEY_BLOCK), -1, dtype=torch.int64, device=dev)
        lim_tile = torch.zeros((tile,), dtype=torch.int64, device=dev)
        for t0 in tiles:
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
                    q_tile,
                    kv,
                    idx_tile[:, b * KEY_BLOCK : (b + 1) * KEY_BLOCK],
                    valid[:, b * KEY_BLOCK : (b + 1) * KEY_BLOCK],
                    sm_scale,
                    d_v,
                    m,
                    l,
                    acc,
                    None if drop is None else drop.keep_scale(t0, b),
                )
            has_key = valid.any(dim=1)[:, None]  # [tile, 1]
            o, mx, ls = _finish(m, l, acc, sink, has_key)
            out[t0 : t0 + n] = o[:n, :H]
            max_logits[t0 : t0 + n] = mx[:n, :H]
            lse[t0 : t0 + n] = ls[:n, :H]

    starts = range(0, T, tile)
    workers = min(torch.get_num_threads(), len(starts)) if dev.type == "cpu" else 1
    if workers <= 1:
        run_tiles(starts)
    else:
        _run_on_threads(run_tiles, starts, workers)
    return out, max_logits, lse


_POOL_LOCK = threading.Lock()
_POOLS: dict[int, ThreadPoolExecutor] = {}


def _run_on_threads(run_tiles, starts, workers: int) -> None:
    """CPU: token tiles on `workers` Python threads, each running its ops on one intra-op thread.

    The tile loop is hundreds of small ops per call; split across intra-op threads, every op waits
    for all of them, so a busy core (another process) stalls each op and more threads made the
    call several times slower. Here each op runs on one thread and the threads take tiles from a
    shared queue, so a slow thread takes fewer tiles. Bits are those of the one-thread loop: the
    same ops on the same tiles, each tile's results written by one thread.
    """
    with _POOL_LOCK:  # one call at a time sets the intra-op thread count
        threads = torch.get_num_threads()
        pool = _POOLS.get(workers) or _POOLS.setdefault(workers, ThreadPoolExecutor(workers, "dsv4-reference"))
        queue = iter(starts)
        lock = threading.Lock()
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()  # thread-local modes

        def worker():
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                while True:
                    with lock:
                        t0 = next(queue, None)
                    if t0 is None:
                        return
                    run_tiles((t0,))

        torch.set_num_threads(1)
        try:
            for f in [pool.submit(worker) for _ in range(workers)]:
                f.result()
        finally:
            torch.set_num_threads(threads)


def _key_block_step(q_tile, kv, idx, valid, sm_scale, d_v, m, l, acc, keep_scale=None):
    """One online-softmax step over KEY_BLOCK index columns of every token in the tile.

    q_tile [tile, heads, D]; idx, valid [tile, KEY_BLOCK]; m, l [tile, heads];
    acc [tile, heads, d_v]. Rows with no valid entry in this block keep m, l, acc exactly.
    keep_scale: optional dropout factors [tile, heads, KEY_BLOCK] (0 or 1 / (1 - p)) applied to
    the probabilities that reach acc (not to l, the denominator).
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
    p_v = p if keep_scale is None else p * keep_scale
    acc_new = torch.baddbmm(acc * alpha[:, :, None], p_v, keys[:, :, :d_v])
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


class _Dropout:
    """The dropout mask of one call: a fresh generator per (token tile, key block), seeded from
    (seed, t0, block), so the backward (and a checkpoint's recomputation) draws the same mask."""

    def __init__(self, p: float, seed: int, shape, dtype, device):
        self.p, self.seed, self.shape, self.dtype, self.device = p, seed, shape, dtype, device
        self.scale = 1.0 / (1.0 - p)

    def keep_scale(self, t0: int, block: int) -> torch.Tensor:
        g = torch.Generator(device=self.device)
        g.manual_seed((self.seed * 1_000_003 + t0 * 8_191 + block) % (1 << 63))
        u = torch.rand(self.shape, generator=g, dtype=self.dtype, device=self.device)
        return (u >= self.p).to(self.dtype) * self.scale


def sparse_attention_reference_backward(
    q,
    kv,
    indices,
    sm_scale,
    attn_sink,
    topk_length,
    out,
    lse,
    d_out,
    d_lse,
    *,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
):
    """Gradients of `sparse_attention_reference` (out and lse) w.r.t. q, kv and attn_sink.

    With P_j = exp(s_j - lse) / (1 + exp(sink - lse)) (s_j = sm_scale * <q, kv[idx_j]>, the sink's
    share P_sink = sigmoid(sink - lse)) and Delta = <d_out, out>:
      ds_j = P_j * (<d_out, v_j> * keep_j - Delta) + d_lse * exp(s_j - lse),
      dq = sm_scale * sum_j ds_j k_j,  dkv[idx_j] += sm_scale * ds_j q + P_j keep_j d_out (value dims),
      dsink = -sum_t P_sink * Delta.
    Recomputed per token tile and key block, as the forward runs them (same tiles, same dropout
    mask); accumulates in float32 (float64 for float64 inputs). Returns (dq, dkv, dsink or None).
    """
    T, H, D = q.shape
    S, K = kv.shape[0], indices.shape[1]
    d_v = value_dim(D)
    acc_dtype = _accum_dtype(q.dtype)
    dev = q.device
    tile = token_tile(H, D, q.dtype)
    heads = round_up(H, _HEAD_ALIGN)
    dq = torch.empty((T, H, D), dtype=q.dtype, device=dev)
    dkv = torch.zeros((S, D), dtype=acc_dtype, device=dev)
    sink = torch.full((heads,), -math.inf, dtype=acc_dtype, device=dev)
    if attn_sink is not None:
        sink[:H] = attn_sink.to(acc_dtype)
    dsink = torch.zeros((heads,), dtype=acc_dtype, device=dev)
    limit = torch.full((T,), K, dtype=torch.int64, device=dev)
    if topk_length is not None:
        limit = topk_length.to(torch.int64).clamp(0, K)
    num_blocks = -(-K // KEY_BLOCK)
    cols = torch.arange(num_blocks * KEY_BLOCK, device=dev)
    drop = _Dropout(dropout_p, dropout_seed, (tile, heads, KEY_BLOCK), acc_dtype, dev) if dropout_p > 0 else None

    q_tile = torch.zeros((tile, heads, D), dtype=acc_dtype, device=dev)
    do_tile = torch.zeros((tile, heads, d_v), dtype=acc_dtype, device=dev)
    lse_tile = torch.full((tile, heads), math.inf, dtype=acc_dtype, device=dev)
    dlse_tile = torch.zeros((tile, heads), dtype=acc_dtype, device=dev)
    delta = torch.zeros((tile, heads), dtype=acc_dtype, device=dev)
    idx_tile = torch.full((tile, num_blocks * KEY_BLOCK), -1, dtype=torch.int64, device=dev)
    lim_tile = torch.zeros((tile,), dtype=torch.int64, device=dev)
    for t0 in range(0, T, tile):
        n = min(tile, T - t0)
        q_tile.zero_()
        q_tile[:n, :H] = q[t0 : t0 + n]
        do_tile.zero_()
        do_tile[:n, :H] = d_out[t0 : t0 + n]
        lse_tile.fill_(math.inf)
        lse_tile[:n, :H] = lse[t0 : t0 + n]
        dlse_tile.zero_()
        if d_lse is not None:
            dlse_tile[:n, :H] = d_lse[t0 : t0 + n]
        delta.zero_()
        delta[:n, :H] = (d_out[t0 : t0 + n].to(acc_dtype) * out[t0 : t0 + n].to(acc_dtype)).sum(dim=-1)
        idx_tile.fill_(-1)
        idx_tile[:n, :K] = indices[t0 : t0 + n]
        lim_tile.zero_()
        lim_tile[:n] = limit[t0 : t0 + n]
        valid = (idx_tile >= 0) & (idx_tile < S) & (cols[None, :] < lim_tile[:, None])
        # rows with no valid key have lse = +inf: every P below is 0 there, and so is the sink's share
        finite = torch.isfinite(lse_tile)
        lse_ref = torch.where(finite, lse_tile, 0.0)
        sink_share = torch.where(finite, torch.sigmoid(sink[None, :] - lse_ref), 0.0)  # [tile, heads]
        norm = torch.where(finite, 1.0 - sink_share, 0.0)  # P_j = exp(s_j - lse) * norm
        dsink += -(sink_share * delta).sum(dim=0)
        dq_tile = torch.zeros((tile, heads, D), dtype=acc_dtype, device=dev)
        blocks = range(num_blocks)
        if dev.type == "cpu" and SKIP_EMPTY_BLOCKS_ON_CPU:
            active = valid.view(tile, num_blocks, KEY_BLOCK).any(dim=2).any(dim=0).tolist()
            blocks = [b for b in blocks if active[b]]
        for b in blocks:
            sl = slice(b * KEY_BLOCK, (b + 1) * KEY_BLOCK)
            v_b, idx = valid[:, sl], idx_tile[:, sl]
            rows = torch.where(v_b, idx, 0)
            keys = kv.index_select(0, rows.reshape(-1)).view(tile, KEY_BLOCK, D).to(acc_dtype)
            keys.masked_fill_(~v_b[:, :, None], 0)
            s = torch.bmm(q_tile, keys.transpose(1, 2)).mul_(sm_scale)  # [tile, heads, block]
            e = torch.exp(s - lse_ref[:, :, None])
            e = torch.where(v_b[:, None, :] & finite[:, :, None], e, 0.0)  # exp(s_j - lse)
            p = e * norm[:, :, None]
            dp = torch.bmm(do_tile, keys[:, :, :d_v].transpose(1, 2))  # <d_out, v_j>
            p_v = p
            if drop is not None:
                ks = drop.keep_scale(t0, b)
                dp = dp * ks
                p_v = p * ks
            ds = p * (dp - delta[:, :, None]) + dlse_tile[:, :, None] * e
            dq_tile.baddbmm_(ds, keys, alpha=sm_scale)
            dkeys = torch.bmm(ds.transpose(1, 2), q_tile).mul_(sm_scale)  # [tile, block, D]
            dkeys[:, :, :d_v] += torch.bmm(p_v.transpose(1, 2), do_tile)
            dkeys.masked_fill_(~v_b[:, :, None], 0)
            dkv.index_add_(0, rows.reshape(-1), dkeys.reshape(-1, D))
        dq[t0 : t0 + n] = dq_tile[:n, :H]
    return dq, dkv.to(kv.dtype), None if attn_sink is None else dsink[:H].to(attn_sink.dtype)


class _SparseAttentionFunction(torch.autograd.Function):
    """Autograd for the reference kernel: forward = `sparse_attention_reference` (bitwise the
    no-grad result), backward = `sparse_attention_reference_backward`."""

    @staticmethod
    def forward(ctx, q, kv, attn_sink, indices, topk_length, sm_scale, dropout_p, dropout_seed):
        out, max_logits, lse = sparse_attention_reference(
            q, kv, indices, sm_scale, attn_sink, topk_length, dropout_p=dropout_p, dropout_seed=dropout_seed
        )
        ctx.save_for_backward(q, kv, attn_sink, indices, topk_length, out, lse)
        ctx.sm_scale, ctx.dropout_p, ctx.dropout_seed = sm_scale, dropout_p, dropout_seed
        ctx.mark_non_differentiable(max_logits)
        return out, max_logits, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out, d_max_logits, d_lse):
        q, kv, attn_sink, indices, topk_length, out, lse = ctx.saved_tensors
        if d_out is None:
            d_out = torch.zeros_like(out)
        dq, dkv, dsink = sparse_attention_reference_backward(
            q,
            kv,
            indices,
            ctx.sm_scale,
            attn_sink,
            topk_length,
            out,
            lse,
            d_out,
            d_lse,
            dropout_p=ctx.dropout_p,
            dropout_seed=ctx.dropout_seed,
        )
        return (
            dq if ctx.needs_input_grad[0] else None,
            dkv if ctx.needs_input_grad[1] else None,
            dsink if ctx.needs_input_grad[2] else None,
            None,
            None,
            None,
            None,
            None,
        )


def sparse_attention_reference_autograd(
    q, kv, indices, sm_scale, attn_sink=None, topk_length=None, *, dropout_p: float = 0.0, dropout_seed: int = 0
):
    """`sparse_attention_reference` with a backward (q, kv and attn_sink get gradients; lse is
    differentiable too, max_logits is not). The forward values are bitwise the no-grad kernel's."""
    return _SparseAttentionFunction.apply(q, kv, attn_sink, indices, topk_length, sm_scale, dropout_p, dropout_seed)


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32
