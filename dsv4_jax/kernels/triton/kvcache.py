"""Pallas kernels for vLLM's `fp8_ds_mla` KV cache pages (layout: `planner/kvcache.py`).

`dsv4_jax.kvcache`'s "triton" backend (lowered through Triton, NVIDIA GPUs; with
`interpret=True` the same kernels under Pallas' interpreter, any platform, for tests):

- `quantize_insert`: one program per token: its 512 bf16 dims as an [8, 64] tile (rows 0..6 the
  e4m3 groups, row 7 the RoPE dims), written into the token's slot with its 8 scale bytes.
- `gather_dequant`: grid (requests, workers); each program walks blocks of rows of one request,
  reads their pages from the block table and writes bf16 rows. The per-request arrays are all
  it reads: no per-row metadata exists anywhere.

The elementwise codec is `dsv4_jax.kernels.xla.kvcache`'s (integer math; the GPU's decode takes
float32 math by default, `exact=True` the integer one). Callers check arguments first.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from dsv4_jax.kernels.xla.kvcache import (
    NAN_BITS,
    bits_to_bf16,
    dequant_bits_exact,
    dequant_float,
    quantize_groups,
    scale_bytes,
)
from planner.kvcache import HEAD_DIM, N_GROUPS, NOPE_DIM, SLOT_DATA_BYTES, SLOT_SCALE_BYTES

# --------------------------------------------------------------------------------------------
# writer


def _quantize_insert_kernel(slot_ref, k_ref, cache_in_ref, cache_ref, *, S, num_blocks):
    from jax.experimental.pallas import triton as plt

    del cache_in_ref  # aliased with cache_ref
    slot = slot_ref[()]
    live = (slot >= 0) & (slot < num_blocks * S)
    page = jnp.where(live, slot // S, 0)
    pos = jnp.where(live, slot % S, 0)
    kb = k_ref[...]  # [8, 64] bf16
    codes, e = quantize_groups(kb.astype(jnp.float32))
    grp = lax.broadcasted_iota(jnp.int32, (8, 64), 0)
    lane = lax.broadcasted_iota(jnp.int32, (8, 64), 1)
    base = pos * SLOT_DATA_BYTES
    pages = jnp.full((8, 64), page, jnp.int32)
    plt.store(cache_ref.at[pages, base + grp * 64 + lane], codes.astype(jnp.uint8), mask=(grp < N_GROUPS) & live)
    bits = lax.bitcast_convert_type(kb, jnp.uint16).astype(jnp.int32)  # row 7: the RoPE dims
    rope_cols = base + NOPE_DIM + 2 * lane
    rope_mask = (grp == N_GROUPS) & live
    plt.store(cache_ref.at[pages, rope_cols], (bits & 0xFF).astype(jnp.uint8), mask=rope_mask)
    plt.store(cache_ref.at[pages, rope_cols + 1], (bits >> 8).astype(jnp.uint8), mask=rope_mask)
    g8 = lax.broadcasted_iota(jnp.int32, (8,), 0)
    plt.store(
        cache_ref.at[jnp.full((8,), page, jnp.int32), S * SLOT_DATA_BYTES + pos * SLOT_SCALE_BYTES + g8],
        scale_bytes(e).astype(jnp.uint8),
        mask=jnp.full((8,), live),
    )


@functools.partial(jax.jit, static_argnames=("S", "interpret"))
def quantize_insert(k, k_cache, slots, S, interpret):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    T = k.shape[0]
    nb, pb = k_cache.shape
    kernel = functools.partial(_quantize_insert_kernel, S=S, num_blocks=nb)
    return pl.pallas_call(
        kernel,
        grid=(T,),
        in_specs=[
            pl.BlockSpec((pl.squeezed,), lambda t: (t,)),
            pl.BlockSpec((pl.squeezed, 8, 64), lambda t: (t, 0, 0)),
            pl.BlockSpec((nb, pb), lambda t: (0, 0)),
        ],
        out_specs=pl.BlockSpec((nb, pb), lambda t: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((nb, pb), jnp.uint8),
        input_output_aliases={2: 0},
        compiler_params=plt.CompilerParams(num_warps=2, num_stages=1),
        interpret=interpret,
        name="dsv4_kvcache_insert",
    )(slots, k.reshape(T, 8, 64), k_cache)


# --------------------------------------------------------------------------------------------
# reader


def _gather_dequant_kernel(
    seq_ref, glen_ref, bt_ref, cache_ref, out_in_ref, out_ref, *, S, offset, num_blocks, block_r, workers, exact
):
    from jax.experimental.pallas import triton as plt

    del out_in_ref  # aliased with out_ref
    rows, max_blocks = out_ref.shape[0], bt_ref.shape[0]
    w = _program_id(1)
    seq = seq_ref[()]
    g = glen_ref[()]
    n_blocks = (g + block_r - 1) // block_r
    trips = jnp.maximum(n_blocks - w + workers - 1, 0) // workers
    d = lax.broadcasted_iota(jnp.int32, (1, HEAD_DIM), 1)
    is_nope = d < NOPE_DIM
    lo_col = jnp.where(is_nope, d, NOPE_DIM + 2 * (d - NOPE_DIM))  # byte of dim d (RoPE: low byte)
    grp_col = jnp.minimum(d // 64, N_GROUPS - 1)

    def body(j, carry):
        blk = w + j * workers
        i = blk * block_r + lax.broadcasted_iota(jnp.int32, (block_r,), 0)
        want = (i < g) & (offset + i < rows)
        pos = seq - g + i
        col = pos // S
        ok = want & (pos >= 0) & (col < max_blocks)
        page = plt.load(bt_ref.at[jnp.where(ok, col, 0)], mask=ok, other=0)
        good = ok & (page >= 0) & (page < num_blocks)
        page = jnp.where(good, page, 0)[:, None]
        base = (jnp.where(good, pos % S, 0) * SLOT_DATA_BYTES)[:, None]
        sbase = (S * SLOT_DATA_BYTES + jnp.where(good, pos % S, 0) * SLOT_SCALE_BYTES)[:, None]
        m = good[:, None]
        lo = plt.load(cache_ref.at[page, base + lo_col], mask=m, other=0).astype(jnp.int32)
        hi = plt.load(cache_ref.at[page, base + lo_col + 1], mask=m & ~is_nope, other=0).astype(jnp.int32)
        sb = plt.load(cache_ref.at[page, sbase + grp_col], mask=m, other=127).astype(jnp.int32)
        if exact:
            nope = dequant_bits_exact(lo, sb)
        else:
            nope = lax.bitcast_convert_type(dequant_float(lo, sb), jnp.uint16).astype(jnp.int32)
        y = jnp.where(is_nope, nope, lo | (hi << 8))  # bf16 bits: NaN payloads of RoPE dims kept
        y = bits_to_bf16(jnp.where(m, y, NAN_BITS))  # rows whose page is not in k_cache: NaN
        # Masked lanes still name distinct in-bounds rows (block_r <= rows): the interpreter
        # stores them as read-modify-write, so a shared dummy row would race with a real one.
        orow = ((offset + i) % rows)[:, None]
        plt.store(out_ref.at[orow, jnp.broadcast_to(d, (block_r, HEAD_DIM))], y, mask=want[:, None])
        return carry

    lax.fori_loop(0, trips, body, 0)


def _program_id(axis):
    from jax.experimental import pallas as pl

    return pl.program_id(axis)


def default_workers(num_requests: int, interpret: bool) -> int:
    """Programs per request: ~8 per SM over the whole grid on GPUs, one in interpret mode."""
    if interpret or num_requests == 0:
        return 1
    try:
        sms = int(getattr(jax.devices()[0], "core_count", 132) or 132)
    except Exception:  # noqa: BLE001 - any device query failure: a sane default
        sms = 132
    return max(1, min(1024, -(-8 * sms // num_requests)))


@functools.partial(jax.jit, static_argnames=("S", "offset", "interpret", "exact", "block_r", "workers", "num_warps"))
def gather_dequant(
    out, k_cache, seq, glen, bt, S, offset, interpret, exact=None, block_r=None, workers=None, num_warps=4
):
    """The Pallas reader. exact: integer decode (default in interpret mode, where XLA on CPU flushes
    subnormals) or float32 decode (default on GPUs). block_r rows per step, `workers` programs
    per request (static; None = `default_workers`)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    R = seq.shape[0]
    Rp, rows, _ = out.shape
    nb, pb = k_cache.shape
    max_blocks = bt.shape[1]
    br = block_r or (64 if interpret else 16)
    br = min(br, 1 << (rows.bit_length() - 1))  # a power of two <= rows (see the kernel's stores)
    nw = workers or default_workers(R, interpret)
    exact = interpret if exact is None else exact
    kernel = functools.partial(
        _gather_dequant_kernel, S=S, offset=offset, num_blocks=nb, block_r=br, workers=nw, exact=exact
    )
    return pl.pallas_call(
        kernel,
        grid=(R, nw),
        in_specs=[
            pl.BlockSpec((pl.squeezed,), lambda b, w: (b,)),
            pl.BlockSpec((pl.squeezed,), lambda b, w: (b,)),
            pl.BlockSpec((pl.squeezed, max_blocks), lambda b, w: (b, 0)),
            pl.BlockSpec((nb, pb), lambda b, w: (0, 0)),
            pl.BlockSpec((pl.squeezed, rows, HEAD_DIM), lambda b, w: (b, 0, 0)),
        ],
        out_specs=pl.BlockSpec((pl.squeezed, rows, HEAD_DIM), lambda b, w: (b, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((Rp, rows, HEAD_DIM), jnp.bfloat16),
        input_output_aliases={4: 0},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="dsv4_kvcache_gather",
    )(seq, glen, bt, k_cache, out)
