"""Pallas sparse-attention kernel for the Triton lowering (backend "triton").

One program per (head block, d_v block, query token). It loads the token's q block once, then
walks the token's index row in chunks of `block_k` columns, only as far as `topk_length[t]`:
gather the chunk's KV rows (masked load, invalid rows read as 0), score them against q in bf16
with fp32 accumulation, fold them into an online softmax, accumulate P @ V. The sink joins
the denominator at the end, so lse stays the sink-free log-sum-exp of the contract.

Triton rules honoured here: every load/store has a power-of-two shape (head, column and index
blocks are powers of two; the wrapper pads heads to >= 16 and a multiple of `block_h`, the
index row to a multiple of `block_k` with -1, and D to power-of-two parts with zero columns);
dot dims are >= 16; explicit `plt.CompilerParams` selects the Triton backend on jax 0.10-0.12.
The QK dot splits D into the value part (d_v columns) and the tail (RoPE dims when D = 576),
so D = 576 needs no padding. With `block_dv < d_v` several programs share a token and head
block, each owning a slice of the output accumulator (smaller register footprint, at the price
of recomputing the scores per slice); each gathers the value part in `block_dv`-column pieces,
its own slice first, and uses that piece as V, so no KV column is gathered twice. Scores are
kept in log2 units (exp2 in the softmax); max_logits and lse come out in natural log.

On a machine without an NVIDIA GPU the same kernel runs with `interpret=True`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dsv4_jax.kernels.xla.attention import no_key_result
from planner.contract import round_up, value_dim

MIN_BLOCK = 16  # Triton's smallest dot dimension.
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def padded_dims(d_qk: int) -> tuple[int, int]:
    """(d_main, d_tail): D split into value and tail parts, each padded to a power of two >= 16."""
    d_v = value_dim(d_qk)
    d_tail = d_qk - d_v
    return max(MIN_BLOCK, _next_pow2(d_v)), (0 if d_tail == 0 else max(MIN_BLOCK, _next_pow2(d_tail)))


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Static tiling of the kernel. Each field is a power of two; see `default_tuning`."""

    block_h: int  # query heads per program (>= 16: Triton dot minimum)
    block_k: int  # index columns gathered and scored per loop step
    block_dv: int  # output columns per program (d_main = one block: no score recomputation)
    num_warps: int
    num_stages: int


def default_tuning(num_heads: int, d_qk: int, interpret: bool) -> TuningConfig:
    """Tiling for a problem shape.

    GPU (Triton): 32 heads, all of d_v and 64 gathered rows per program, 8 warps, 2 stages.
    The whole 32 x 512 fp32 accumulator fits in one program, so each chunk's scores are
    computed once (the 64-head alternative must split d_v over two programs, each scoring
    every chunk: 1.5x the MMA work). Both gather every KV row twice per token for H = 64 (two
    head blocks, or two d_v programs), the second time mostly from L2. The price of 32-row
    blocks is mma.sync instead of Hopper's wgmma (which needs 64 rows per warpgroup); a
    64 x 512 block that would get both spills about 1 KB per thread. Offline figures
    (bench/checks/triton_resources_jax.py, Triton 3.9 wheel, sm_90a; jaxlib's Triton may differ):

      tiling (bh,bk,dv,w,st)  D=512: smem  regs spill   D=576: smem  regs spill   MMA
      32,64,512,8,2 default         100 KB  255    0          112 KB  255    0   mma.sync
      32,32,512,8,2                  66 KB  173    0           74 KB  181    0   mma.sync
      64,32,256,8,3                 128 KB  255    0          144 KB  255    0   wgmma
      64,16,256,8,2                  96 KB  240    0          108 KB  253    0   wgmma
      64,32,512,8,2                 128 KB  255 1000          144 KB  255  964   wgmma

    Whether wgmma with recomputed scores beats mma.sync without is for the GPU to say:
    bench/checks/gpu_jax.py times `ALTERNATIVE_TILINGS`.

    Interpret mode (CPU): as few, as large programs as possible (one per token for H <= 128).
    """
    d_main, _ = padded_dims(d_qk)
    heads = _next_pow2(max(num_heads, MIN_BLOCK))
    if interpret:
        return TuningConfig(block_h=min(heads, 128), block_k=128, block_dv=d_main, num_warps=4, num_stages=1)
    block_h = min(heads, 32)
    big = block_h * d_main >= 32 * 512
    return TuningConfig(block_h=block_h, block_k=64, block_dv=d_main, num_warps=8 if big else 4, num_stages=2)


# GPU tilings worth timing against the default, as (block_h, block_k, block_dv, num_warps,
# num_stages); None = `default_tuning`. Offline resource figures in `default_tuning`.
ALTERNATIVE_TILINGS = [
    None,  # 32, 64, 512, 8, 2 for D >= 512
    (32, 32, 512, 8, 2),  # no score recomputation, 173 registers: headroom if 255 spills
    (64, 32, 256, 8, 3),  # the former default: wgmma, scores computed in both d_v halves
    (64, 16, 256, 8, 2),  # wgmma, smaller steps
    (64, 32, 128, 8, 2),  # wgmma, four accumulator slices (210 registers)
]


def _sparse_attention_kernel(
    topk_length_ref,  # [] int32: columns >= this are invalid
    sink_ref,  # [block_h] float32
    q_ref,  # [block_h, d_main + d_tail]
    kv_ref,  # [S, d_main + d_tail]: the whole workspace, gathered by row
    indices_ref,  # [K_pad] int32
    out_ref,  # [block_h, block_dv]
    max_logits_ref,  # [block_h] float32
    lse_ref,  # [block_h] float32
    *,
    sm_scale: float,
    num_rows: int,  # S
    num_cols: int,  # K before padding
    block_k: int,
    d_main: int,
    d_tail: int,
    block_dv: int,
):
    block_h = q_ref.shape[0]
    # fp32 inputs: full-precision dots (Triton would otherwise use TF32). bf16/fp16: native MMA.
    precision = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None
    dot = functools.partial(lax.dot_general, precision=precision, preferred_element_type=jnp.float32)
    contract_last = (((1,), (1,)), ((), ()))  # [m, d] x [n, d] -> [m, n]
    contract_mid = (((1,), (0,)), ((), ()))  # [m, k] x [k, n] -> [m, n]
    # Scores in log2 units (sm_scale * log2(e) folded into the one scaling multiply) so the
    # softmax uses exp2: on CUDA Pallas lowers exp to libdevice's full-precision expf, exp2
    # to the much shorter exp2f. max_logits and lse go back to natural log at the end.
    score_scale = sm_scale * LOG2_E

    # The value part of K in `block_dv`-column pieces, starting with this program's output
    # slice: the scores need every piece, the first one is also V, so each KV column is
    # gathered once per step (no second gather of V when block_dv < d_main).
    d_v_block = pl.program_id(1)
    num_pieces = d_main // block_dv
    if num_pieces == 1:
        piece_starts = [0]
    else:
        piece_starts = [pl.multiple_of(((d_v_block + i) % num_pieces) * block_dv, block_dv) for i in range(num_pieces)]
    q_pieces = [q_ref[:, pl.ds(first, block_dv)] for first in piece_starts]  # [block_h, block_dv] each
    q_tail = q_ref[:, pl.ds(d_main, d_tail)] if d_tail else None
    n_valid = jnp.clip(topk_length_ref[()], 0, num_cols)

    def gather(rows, valid, first_col, width):
        # All-array indexers with a mask: one gathered load that lowers to Triton and also
        # runs in interpret mode. Invalid rows read as 0 and never touch memory.
        cols = first_col + lax.broadcasted_iota(jnp.int32, (1, width), 1)
        return plt.load(kv_ref.at[rows[:, None], cols], mask=valid[:, None], other=0)

    def fold_chunk(j, carry):
        acc, m, l, n_keys = carry  # [block_h, block_dv], [block_h], [block_h], []
        start = pl.multiple_of(j * block_k, block_k)
        idx = indices_ref[pl.ds(start, block_k)]
        col = start + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        valid = (idx >= 0) & (idx < num_rows) & (col < n_valid)
        rows = jnp.where(valid, idx, 0)
        k_pieces = [gather(rows, valid, first, block_dv) for first in piece_starts]  # [block_k, block_dv]
        s = dot(q_pieces[0], k_pieces[0], contract_last)
        for q_piece, k_piece in zip(q_pieces[1:], k_pieces[1:]):
            s += dot(q_piece, k_piece, contract_last)
        if d_tail:
            s += dot(q_tail, gather(rows, valid, d_main, d_tail), contract_last)
        s = jnp.where(valid[None, :], s * score_scale, -jnp.inf)  # [block_h, block_k], log2 units
        m_new = jnp.maximum(m, s.max(axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no key yet: avoid inf - inf
        alpha = jnp.exp2(m - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        l = l * alpha + p.sum(axis=1)
        v = k_pieces[0]  # this program's slice of V, already gathered for the scores
        acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v, contract_mid)
        return acc, m_new, l, n_keys + valid.astype(jnp.int32).sum()

    init = (
        jnp.zeros((block_h, block_dv), jnp.float32),
        jnp.full((block_h,), -jnp.inf, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
        jnp.int32(0),
    )
    # Loop only over chunks that can hold a valid column: the trip count is data dependent.
    acc, m, l, n_keys = lax.fori_loop(0, (n_valid + block_k - 1) // block_k, fold_chunk, init)

    # NaN in q or in a gathered row must come out as NaN, as in the oracle. So "no valid key"
    # comes from the count (l > 0 is False for NaN), and m is set to NaN wherever l is: Triton
    # lowers max to maxnumf, which drops NaN, so m alone may miss it; l (a plain sum) keeps it.
    has_keys = n_keys > 0
    m = jnp.where(jnp.isnan(l), jnp.nan, m) * LN_2  # natural-log units from here on
    lse = jnp.where(has_keys, m + jnp.log(l), jnp.inf)
    # The sink joins the denominator only: out *= exp(lse) / (exp(lse) + exp(sink)). Applied
    # here rather than by starting the running max at the sink and the sum at 1: then the
    # sink-free lse would be m + log(l - exp(sink - m)), which cancels to nothing in fp32 for
    # a large sink (sink = 30 against logits near 0), and exp(s - sink) underflows.
    scale = jnp.where(has_keys, 1.0 / (l * (1.0 + jnp.exp(sink_ref[...] - lse))), 0.0)
    out_ref[...] = (acc * scale[:, None]).astype(out_ref.dtype)

    def write_row_stats():
        max_logits_ref[...] = m
        lse_ref[...] = lse

    if num_pieces == 1:
        write_row_stats()
    else:
        # The d_v programs sum their score pieces in different orders (last bits differ), so
        # one of them writes the row statistics: no race, the same bits on every run.
        pl.when(d_v_block == 0)(write_row_stats)


def _check_tuning(cfg: TuningConfig, d_main: int) -> None:
    for name in ("block_h", "block_k", "block_dv"):
        value = getattr(cfg, name)
        if value < MIN_BLOCK or value & (value - 1):
            raise ValueError(f"{name}: must be a power of two >= {MIN_BLOCK}, got {value}")
    if cfg.block_dv > d_main:
        raise ValueError(f"block_dv: {cfg.block_dv} exceeds the padded value dim {d_main}")
    if cfg.num_warps < 1 or cfg.num_warps & (cfg.num_warps - 1):
        raise ValueError(f"num_warps: must be a power of two, got {cfg.num_warps}")
    if cfg.num_stages < 1:
        raise ValueError(f"num_stages: must be >= 1, got {cfg.num_stages}")


def _pad_columns(x, d_v: int, d_main: int, d_tail_pad: int):
    """[..., D] -> [..., d_main + d_tail_pad]: zero columns after the value part and the tail."""
    if x.shape[-1] == d_main + d_tail_pad and d_v == d_main:
        return x
    widths = [(0, 0)] * (x.ndim - 1)
    main = jnp.pad(x[..., :d_v], widths + [(0, d_main - d_v)])
    if not d_tail_pad:
        return main
    tail = x[..., d_v:]
    return jnp.concatenate([main, jnp.pad(tail, widths + [(0, d_tail_pad - tail.shape[-1])])], axis=-1)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "block_h", "block_k", "block_dv", "num_warps", "num_stages", "interpret"),
)
def sparse_attention_pallas(
    q,
    kv,
    indices,
    sm_scale: float,
    attn_sink=None,
    topk_length=None,
    *,
    block_h: int | None = None,
    block_k: int | None = None,
    block_dv: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
):
    """FlashMLA sparse attention as a Pallas kernel.

    Inputs are already checked by `dsv4_jax.sparse_attention`:
      q: (T, H, D), bfloat16 (fast path) / float16 / float32.
      kv: (S, D), same dtype as q.
      indices: (T, K), int32; invalid if < 0, >= S, or column >= topk_length[t].
      sm_scale: Python float (static).
      attn_sink: (H,) float32 or None.
      topk_length: (T,) int32 or None.
      block_h, block_k, block_dv, num_warps, num_stages: static tiling; None = `default_tuning`.
      interpret: run the kernel with Pallas' interpreter (any platform) instead of Triton.

    Returns:
      out (T, H, d_v) q.dtype, max_logits (T, H) float32, lse (T, H) float32.
    """
    T, H, D = q.shape
    S, K = kv.shape[0], indices.shape[1]
    d_v = value_dim(D)
    if T == 0 or H == 0 or S == 0 or K == 0:
        return no_key_result(T, H, d_v, q.dtype)

    d_main, d_tail = padded_dims(D)
    default = default_tuning(H, D, interpret)
    cfg = TuningConfig(
        block_h=default.block_h if block_h is None else block_h,
        block_k=default.block_k if block_k is None else block_k,
        block_dv=default.block_dv if block_dv is None else block_dv,
        num_warps=default.num_warps if num_warps is None else num_warps,
        num_stages=default.num_stages if num_stages is None else num_stages,
    )
    _check_tuning(cfg, d_main)

    H_pad = round_up(max(H, MIN_BLOCK), cfg.block_h)
    K_pad = round_up(K, cfg.block_k)
    q = jnp.pad(_pad_columns(q, d_v, d_main, d_tail), ((0, 0), (0, H_pad - H), (0, 0)))
    kv = _pad_columns(kv, d_v, d_main, d_tail)
    indices = jnp.pad(indices, ((0, 0), (0, K_pad - K)), constant_values=-1)
    sink = jnp.full((H,), -jnp.inf, jnp.float32) if attn_sink is None else attn_sink
    sink = jnp.pad(sink, (0, H_pad - H), constant_values=-jnp.inf)
    n_valid = jnp.full((T,), K, jnp.int32) if topk_length is None else topk_length

    kernel = functools.partial(
        _sparse_attention_kernel,
        sm_scale=sm_scale,
        num_rows=S,
        num_cols=K,
        block_k=cfg.block_k,
        d_main=d_main,
        d_tail=d_tail,
        block_dv=cfg.block_dv,
    )
    d_pad = d_main + d_tail
    # Head blocks vary fastest (grid axis 0 is CUDA's x), so the programs of one token run
    # together and read its KV rows once from HBM, then from L2.
    grid = (H_pad // cfg.block_h, d_main // cfg.block_dv, T)
    out, max_logits, lse = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((pl.squeezed,), lambda h, c, t: (t,)),
            pl.BlockSpec((cfg.block_h,), lambda h, c, t: (h,)),
            pl.BlockSpec((pl.squeezed, cfg.block_h, d_pad), lambda h, c, t: (t, h, 0)),
            pl.BlockSpec((S, d_pad), lambda h, c, t: (0, 0)),
            pl.BlockSpec((pl.squeezed, K_pad), lambda h, c, t: (t, 0)),
        ],
        out_specs=[
            pl.BlockSpec((pl.squeezed, cfg.block_h, cfg.block_dv), lambda h, c, t: (t, h, c)),
            pl.BlockSpec((pl.squeezed, cfg.block_h), lambda h, c, t: (t, h)),
            pl.BlockSpec((pl.squeezed, cfg.block_h), lambda h, c, t: (t, h)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((T, H_pad, d_main), q.dtype),
            jax.ShapeDtypeStruct((T, H_pad), jnp.float32),
            jax.ShapeDtypeStruct((T, H_pad), jnp.float32),
        ],
        compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="dsv4_sparse_attention",
    )(n_valid, sink, q, kv, indices)
    return out[:, :H, :d_v], max_logits[:, :H], lse[:, :H]
