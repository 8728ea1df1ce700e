"""Plain-jnp sparse attention: the reference backend ("xla") of `dsv4_jax.sparse_attention`.

Same math as the Pallas kernel (`dsv4_jax.kernels.triton.attention`), written with ordinary jnp ops so it
runs anywhere and serves as the fp32 reference on a GPU. Tiled so memory stays bounded: tokens
go through `lax.map` in blocks of `block_t`, and each block folds its index row in chunks of
`block_k` with an online softmax, so live memory is about `block_t * block_k * D` floats
whatever T and K are.

Determinism: a token's result depends only on its own q row, index row, topk_length and the
sink, never on the other tokens in the call (bitwise, fp32), because every dot has the same
shape (block_t, H, block_k, D) whatever T is. The tile sizes themselves are part of the
numerics (XLA CPU picks another dot strategy for blocks of fewer than 8 tokens): keep the
defaults wherever results must agree bitwise. Chunks past a token's last valid
column are exact no-ops (the running max stays, so alpha = exp(0) = 1, and p = 0), which also
makes results independent of trailing -1 padding: two chunk plans that place the same keys in
the same columns of wider or narrower rows agree bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from planner.contract import cdiv, value_dim

# Chunk of the index row folded per step. Fixed (not derived from K) so that rows of different
# widths accumulate in the same groups; the spec pads rows to multiples of 128 anyway.
REFERENCE_BLOCK_K = 128
REFERENCE_BLOCK_T = 16


def no_key_result(num_tokens: int, num_heads: int, d_v: int, dtype):
    """(out, max_logits, lse) for tokens without a single valid key: 0, -inf, +inf."""
    return (
        jnp.zeros((num_tokens, num_heads, d_v), dtype),
        jnp.full((num_tokens, num_heads), -jnp.inf, jnp.float32),
        jnp.full((num_tokens, num_heads), jnp.inf, jnp.float32),
    )


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_t", "block_k"))
def sparse_attention_xla(
    q,
    kv,
    indices,
    sm_scale: float,
    attn_sink=None,
    topk_length=None,
    *,
    block_t: int = REFERENCE_BLOCK_T,
    block_k: int = REFERENCE_BLOCK_K,
):
    """FlashMLA sparse attention in plain jnp, fp32 math throughout.

    Inputs are already checked by `dsv4_jax.sparse_attention`:
      q: (T, H, D), bfloat16 / float16 / float32.
      kv: (S, D), same dtype as q.
      indices: (T, K), int32; invalid if < 0, >= S, or column >= topk_length[t].
      sm_scale: Python float (static).
      attn_sink: (H,) float32 or None.
      topk_length: (T,) int32 or None.
      block_t, block_k: tile sizes (static); keep the defaults for bitwise-reproducible results.

    Returns:
      out (T, H, d_v) q.dtype, max_logits (T, H) float32, lse (T, H) float32.
    """
    T, H, D = q.shape
    S, K = kv.shape[0], indices.shape[1]
    d_v = value_dim(D)
    if T == 0 or H == 0 or S == 0 or K == 0:
        return no_key_result(T, H, d_v, q.dtype)

    n_t = cdiv(T, block_t)
    T_pad, K_pad = n_t * block_t, cdiv(K, block_k) * block_k
    q_blocks = jnp.pad(q, ((0, T_pad - T), (0, 0), (0, 0))).reshape(n_t, block_t, H, D)
    idx_blocks = jnp.pad(indices, ((0, T_pad - T), (0, K_pad - K)), constant_values=-1)
    idx_blocks = idx_blocks.reshape(n_t, block_t, K_pad)
    n_valid = jnp.full((T,), K, jnp.int32) if topk_length is None else jnp.clip(topk_length, 0, K)
    n_valid = jnp.pad(n_valid, (0, T_pad - T)).reshape(n_t, block_t)
    sink = jnp.full((H,), -jnp.inf, jnp.float32) if attn_sink is None else attn_sink
    hi = lax.Precision.HIGHEST

    def token_block(args):
        q_t, idx_t, n_t_valid = args  # (bt, H, D), (bt, K_pad), (bt,)
        q_t = q_t.astype(jnp.float32)

        def fold_chunk(j, carry):
            acc, m, l, n_keys = carry  # (bt, H, d_v), (bt, H), (bt, H), (bt,)
            start = j * block_k
            idx = lax.dynamic_slice_in_dim(idx_t, start, block_k, axis=1)  # (bt, bk)
            col = start + jnp.arange(block_k, dtype=jnp.int32)
            valid = (idx >= 0) & (idx < S) & (col[None, :] < n_t_valid[:, None])
            keys = kv[jnp.where(valid, idx, 0)].astype(jnp.float32)  # (bt, bk, D)
            keys = jnp.where(valid[..., None], keys, 0.0)  # garbage rows can't leak in
            s = jnp.einsum("thd,tkd->thk", q_t, keys, precision=hi) * sm_scale
            s = jnp.where(valid[:, None, :], s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no key yet: avoid inf - inf
            alpha = jnp.exp(m - m_safe)
            p = jnp.exp(s - m_safe[..., None])
            l = l * alpha + p.sum(axis=-1)
            acc = acc * alpha[..., None] + jnp.einsum("thk,tkv->thv", p, keys[..., :d_v], precision=hi)
            return acc, m_new, l, n_keys + valid.sum(axis=1, dtype=jnp.int32)

        init = (
            jnp.zeros((block_t, H, d_v), jnp.float32),
            jnp.full((block_t, H), -jnp.inf, jnp.float32),
            jnp.zeros((block_t, H), jnp.float32),
            jnp.zeros((block_t,), jnp.int32),
        )
        # Only chunks that can hold a valid entry for some token of the block.
        num_chunks = (n_t_valid.max() + block_k - 1) // block_k
        acc, m, l, n_keys = lax.fori_loop(0, num_chunks, fold_chunk, init)

        # "No valid key" comes from the count, not from l > 0: a NaN in q or in a gathered row
        # makes l NaN, and it must come out as NaN (as in the oracle), not as 0 / +inf. The
        # running max may have dropped the NaN (XLA's reduce-max does on CPU); l keeps it.
        has_keys = (n_keys > 0)[:, None]
        m = jnp.where(jnp.isnan(l), jnp.nan, m)
        lse = jnp.where(has_keys, m + jnp.log(l), jnp.inf)
        # The sink joins the denominator only: out *= exp(lse) / (exp(lse) + exp(sink)).
        scale = jnp.where(has_keys, 1.0 / (l * (1.0 + jnp.exp(sink - lse))), 0.0)
        return (acc * scale[..., None]).astype(q.dtype), m, lse

    out, max_logits, lse = lax.map(token_block, (q_blocks, idx_blocks, n_valid))
    return (
        out.reshape(T_pad, H, d_v)[:T],
        max_logits.reshape(T_pad, H)[:T],
        lse.reshape(T_pad, H)[:T],
    )
