"""Pallas TPU sparse attention, backend "mosaic_tpu" (JAX's name for the Pallas TPU backend).

Two kernels, one machinery (`dsv4_jax.kernels.mosaic_tpu.rows`):

* `sparse_attention_mosaic_tpu`: FlashMLA's `flash_mla_sparse_fwd` contract (spec section 2) on a
  flat workspace kv (S, D): per token its own index row, gathered by DMA. Sink (incl. -inf),
  `topk_length`, invalid (< 0, >= S, column >= topk_length) and duplicate indices, tokens without
  a valid key (out 0, lse +inf, max_logits -inf), NaN in the rows a token reads; any H (padded to
  the dtype's sublane tile: 8 rows fp32, 16 bf16), any D (d_v = min(D, 512); 512 and 576 are what
  is compiled and checked for chips), bfloat16 and float32 (fp32 products at HIGHEST precision).
* `dsv4_jax.kernels.mosaic_tpu.prefill`: one prefill layer straight from the caches, driven by
  the plan's query tiles (see its docstring).

Design of the flat kernel: a grid step takes 8 tokens (the index rows' (8, K) block is one
sublane tile); their (token, key block) jobs run as one software pipeline: while block j is
scored, the DMAs of block j + 1 (the next token's first block at a token's end) are in flight.
A block is `block_k` index columns (128 on v4 / v5e / v5p, 256 on v6e / 7x: the MXU width), a
token's blocks stop at `ceil(topk_length / block_k)`. Per block: S = q (H, D) K^T (MXU, fp32
accumulation), invalid columns -inf, online softmax in fp32, P (rounded to bf16 for bf16 inputs,
as FlashMLA) @ V. VMEM per grid step (bf16, H = 128, D = 576, 128-wide blocks): the q / out
blocks double-buffered (2 x 1.2 MB + 2 x 1 MB), the row buffers 2 x 128 x 16 x 640 x 2 = 5.2 MB
(a bf16 row moves with its pair partner, and each pair sits in its own 16-row tile), the fp32
state 8 x 128 x 640 x 4 = 2.6 MB: about 11 MB, inside every generation's VMEM but v4's
(16 MiB: fits, with the 12 MiB limit it gets). The compile tests report Mosaic's own figure.

`interpret=True` (or a `pltpu.InterpretParams`) runs the same kernel in TPU interpret mode on CPU
(simulated HBM, VMEM, SMEM, DMAs and semaphores; jax 0.10.2 and >= 0.12); `interpret=False`
compiles for the TPU here, or for `compile_target(chip)`'s chip with libtpu on a CPU machine.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from dsv4_jax.kernels.mosaic_tpu import rows as R
from dsv4_jax.kernels.mosaic_tpu.rows import (  # noqa: F401  (re-exported)
    block_shapes,
    compile_target,
    compile_target_chip,
    override_block_k,
    target_chip,
)
from dsv4_jax.kernels.xla.attention import no_key_result
from planner.contract import backend_unavailable, value_dim

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
FLAT_TOKENS = 8  # tokens per grid step of the flat kernel


def unavailable_reason() -> str | None:
    """None if Pallas TPU is importable (interpret mode runs anywhere), else why not."""
    try:
        from jax.experimental.pallas import tpu as pltpu

        pltpu.InterpretParams  # noqa: B018
        pltpu.PrefetchScalarGridSpec  # noqa: B018
    except Exception as e:  # noqa: BLE001 - a broken or partial install
        return f"cannot import jax.experimental.pallas.tpu ({type(e).__name__}: {e})"
    return None


def compiled_unavailable_reason() -> str | None:
    """None if the compiled kernel can run or compile here (a TPU, or inside `compile_target`)."""
    if (reason := unavailable_reason()) is not None:
        return reason
    if target_chip() is None:
        platforms = sorted({d.platform for d in jax.devices()})
        return (
            f"compiles for a TPU, and JAX has none here (devices: {', '.join(platforms)}); pass interpret=True "
            "to run it in TPU interpret mode, or compile for a chip inside dsv4_jax.kernels.mosaic_tpu.attention.compile_target"
        )
    return None


def interpret_params(interpret, detect_races: bool = False):
    """None (compile) or the `pltpu.InterpretParams` a pallas_call gets."""
    from jax.experimental.pallas import tpu as pltpu

    if interpret is False or interpret is None:
        if detect_races:
            raise ValueError("detect_races: needs interpret mode (interpret=True)")
        return None
    if interpret is True:
        return pltpu.InterpretParams(detect_races=bool(detect_races))
    if isinstance(interpret, pltpu.InterpretParams):
        return interpret
    raise TypeError(f"interpret: expected a bool or a pltpu.InterpretParams, got {type(interpret).__name__}")


def races_found() -> bool:
    """Whether a kernel run in TPU interpret mode with detect_races found a race (since the last
    `reset_interpret_state`)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

    return bool(ipc.races is not None and ipc.races.races_found)


def reset_interpret_state() -> None:
    from jax.experimental.pallas import tpu as pltpu

    pltpu.reset_tpu_interpret_mode_state()


def check_dtype(x, name: str) -> None:
    if jnp.dtype(x.dtype) not in DTYPES:
        raise ValueError(f"{name}: backend 'mosaic_tpu' takes bfloat16 or float32, got {jnp.dtype(x.dtype)}")


# ----------------------------------------------------------------------------- the list phase


def job_table(job_ref, lengths, bk: int):
    """Write the first job of each token into job_ref (SMEM, len(lengths) + 1); return the total.
    Token t has ceil(lengths[t] / bk) jobs (key blocks)."""
    total = jnp.int32(0)
    for t, n in enumerate(lengths):
        job_ref[t] = total
        total = total + lax.div(jnp.maximum(n, 0) + bk - 1, bk)
    job_ref[len(lengths)] = total
    return total


def job_token(job_ref, k, n_tokens: int):
    """(token, block) of job k (job_table's layout)."""
    t = jnp.int32(0)
    for u in range(1, n_tokens):
        t = t + (k >= job_ref[u]).astype(jnp.int32)
    return t, k - job_ref[t]


def pipeline(num_jobs, issue, wait, compute):
    """Jobs 0 .. num_jobs-1 with double buffering: job k+1's DMAs start before job k is computed."""
    from jax.experimental import pallas as pl

    @pl.when(num_jobs > 0)
    def _():
        issue(jnp.int32(0), jnp.int32(0))

    def body(k, carry):
        slot = lax.rem(k, 2)

        @pl.when(k + 1 < num_jobs)
        def _():
            issue(k + 1, 1 - slot)

        wait(slot)
        compute(k, slot)
        return carry

    lax.fori_loop(0, num_jobs, body, 0)


# ----------------------------------------------------------------------------- the flat kernel


def _flat_kernel(
    nv_ref,  # SMEM (T_pad,) int32: valid columns per token, clipped to [0, K]
    sink_ref,  # (1, Hp) f32
    q_ref,  # (8, Hp, D)
    idx_s,  # SMEM (8, Kp) int32
    idx_v,  # (8, Kp) int32
    kv_hbm,  # (1, S_pad, D)
    zero_hbm,  # (g, D)
    out_ref,  # (8, Hp, d_v)
    mx_ref,  # (8, Hp) f32
    lse_ref,  # (8, Hp) f32
    data_buf,
    sems,
    acc_ref,
    m_ref,
    l_ref,
    cnt_ref,  # SMEM (8,)
    job_ref,  # SMEM (9,)
    *decode,  # the keys / entries buffers of R.decode_scratch (bf16 rows come in pairs)
    src: R.RowSource,
    sm_scale: float,
    num_rows: int,
    bk: int,
    d_v: int,
):
    from jax.experimental import pallas as pl

    T8 = FLAT_TOKENS
    Hp = q_ref.shape[1]
    t0 = pl.program_id(0) * T8
    nv = [nv_ref[t0 + t] for t in range(T8)]
    R.init_state(acc_ref, m_ref, l_ref)
    for t in range(T8):
        cnt_ref[t] = 0
    total = job_table(job_ref, nv, bk)
    bufs, dtype = [data_buf], q_ref.dtype

    def issue(k, slot):
        t, j = job_token(job_ref, k, T8)
        n = nv_ref[t0 + t]

        def one(i, count):
            c = j * bk + i
            row = idx_s[t, c]
            ok = (row >= 0) & (row < num_rows) & (c < n)
            R.issue_row(src, kv_hbm, [zero_hbm], bufs, sems, slot, i, ok, 0, row)
            return count + ok.astype(jnp.int32)

        cnt_ref[t] = lax.fori_loop(0, bk, one, cnt_ref[t])

    def compute(k, slot):
        t, j = job_token(job_ref, k, T8)
        n = nv_ref[t0 + t]
        entries = R.row_at(idx_v, t, pl.ds(pl.multiple_of(j * bk, bk), bk))  # (1, BK)
        cols = j * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        valid = (entries >= 0) & (entries < num_rows) & (cols < n)
        keys = R.load_rows(src, bufs, slot, R.col(entries), dtype, decode)
        rows = pl.ds(pl.multiple_of(t * Hp, Hp), Hp)
        R.softmax_update(acc_ref, m_ref, l_ref, rows, q_ref[t], keys, valid, sm_scale, d_v)

    pipeline(total, issue, lambda slot: R.wait_rows(src, bufs, sems, slot), compute)

    sink = R.col(sink_ref[...])
    for t in range(T8):
        rows = slice(t * Hp, (t + 1) * Hp)
        out, mx, lse = R.finalize(acc_ref[rows, :], m_ref[rows, :1], l_ref[rows, :1], sink, cnt_ref[t] > 0)
        out_ref[t] = out.astype(out_ref.dtype)
        mx_ref[pl.ds(t, 1), :] = R.row_of(mx)
        lse_ref[pl.ds(t, 1), :] = R.row_of(lse)


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret", "shapes"))
def _flat_call(q, kv, indices, sm_scale, attn_sink, topk_length, *, interpret, shapes: R.BlockShapes):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    T, H, D = q.shape
    S, K = kv.shape[0], indices.shape[1]
    d_v = value_dim(D)
    if T == 0 or S == 0 or K == 0:
        return no_key_result(T, H, d_v, q.dtype)
    bk = shapes.block_k
    g, sub = R.packing(q.dtype), R.sublanes(q.dtype)
    Hp, Kp = -(-H // sub) * sub, -(-K // bk) * bk
    Tp, Sp = -(-T // FLAT_TOKENS) * FLAT_TOKENS, -(-S // g) * g
    if (Tp, Hp) != (T, H):
        q = jnp.pad(q, ((0, Tp - T), (0, Hp - H), (0, 0)))
    if (Tp, Kp) != (T, K):
        indices = jnp.pad(indices, ((0, Tp - T), (0, Kp - K)), constant_values=-1)
    if Sp != S:  # a bf16 row moves with its pair partner: the last one needs a partner row
        kv = jnp.pad(kv, ((0, Sp - S), (0, 0)))
    sink = jnp.full((H,), -jnp.inf, jnp.float32) if attn_sink is None else attn_sink.astype(jnp.float32)
    sink = jnp.pad(sink, (0, Hp - H), constant_values=-jnp.inf).reshape(1, Hp)
    nv = jnp.full((T,), K, jnp.int32) if topk_length is None else jnp.clip(topk_length, 0, K).astype(jnp.int32)
    nv = jnp.pad(nv, (0, Tp - T))
    src = R.rows_source((1, Sp, D), q.dtype, paged=False)
    (zeros,) = src.zero_arrays()
    bufs, sems = R.source_scratch(src, bk)
    body = functools.partial(_flat_kernel, src=src, sm_scale=sm_scale, num_rows=S, bk=bk, d_v=d_v)
    T8 = FLAT_TOKENS
    blk = lambda *shape: pl.BlockSpec(shape, lambda i, nv: (i,) + (0,) * (len(shape) - 1))  # noqa: E731
    out, mx, lse = pl.pallas_call(
        body,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(Tp // T8,),
            in_specs=[
                pl.BlockSpec((1, Hp), lambda i, nv: (0, 0)),
                blk(T8, Hp, D),
                pl.BlockSpec((T8, Kp), lambda i, nv: (i, 0), memory_space=pltpu.SMEM),
                blk(T8, Kp),
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=[blk(T8, Hp, d_v), blk(T8, Hp), blk(T8, Hp)],
            scratch_shapes=[
                *bufs,
                sems,
                *R.state_scratch(T8 * Hp, d_v),
                pltpu.SMEM((T8,), jnp.int32),
                pltpu.SMEM((T8 + 1,), jnp.int32),
                *R.decode_scratch(src, bk, q.dtype),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((Tp, Hp, d_v), q.dtype),
            jax.ShapeDtypeStruct((Tp, Hp), jnp.float32),
            jax.ShapeDtypeStruct((Tp, Hp), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=shapes.vmem_limit),
        interpret=interpret,
        name="dsv4_sparse_attention_tpu",
    )(nv, sink, q, indices, indices, kv.reshape(1, Sp, D), zeros)
    return out[:T, :H], mx[:T, :H], lse[:T, :H]


def sparse_attention_mosaic_tpu(
    q, kv, indices, sm_scale: float, attn_sink=None, topk_length=None, *, interpret=False, detect_races=False,
    block_k: int | None = None,
):  # fmt: skip
    """FlashMLA sparse attention as a Pallas TPU kernel.

    Inputs in `dsv4_jax.sparse_attention`'s canonical form:
      q: (T, H, D) bfloat16 or float32; kv: (S, D), q's dtype; indices: (T, K) int32 (invalid if
      < 0, >= S, or column >= topk_length[t]; any K); sm_scale: Python float (static);
      attn_sink: (H,) float32 or None; topk_length: (T,) int32 or None.
      interpret: False compiles for the TPU (here, or `compile_target`'s chip); True or a
        `pltpu.InterpretParams` runs TPU interpret mode on CPU.
      detect_races: with interpret=True, let the interpreter check DMA / VMEM races (read the
        verdict with `races_found()`; jax >= 0.12 raises on a race by default).
      block_k: key rows per block (default: the chip's MXU width); tests use small ones.

    Returns:
      out (T, H, d_v) q.dtype, max_logits (T, H) float32, lse (T, H) float32.
    """
    if (reason := unavailable_reason()) is not None:
        raise backend_unavailable("mosaic_tpu", reason)
    if jnp.ndim(q) != 3 or jnp.ndim(kv) != 2 or jnp.ndim(indices) != 2:
        raise ValueError(
            f"q, kv, indices: expected (T, H, D), (S, D), (T, K), got shapes {tuple(q.shape)}, "
            f"{tuple(kv.shape)}, {tuple(indices.shape)} (call dsv4_jax.sparse_attention for other layouts)"
        )
    check_dtype(q, "q")
    check_dtype(kv, "kv")
    if kv.shape[0] >= 2**31 - 4:
        raise ValueError(f"kv: at most 2**31 - 4 rows, got {kv.shape[0]}")
    params = interpret_params(interpret, detect_races)
    chip = None
    if params is None:
        if (reason := compiled_unavailable_reason()) is not None:
            raise backend_unavailable("mosaic_tpu", reason)
        chip = target_chip()
    if block_k is not None and (block_k < 8 or block_k % 8):
        raise ValueError(f"block_k: expected a positive multiple of 8, got {block_k}")
    shapes = block_shapes(chip, block_k)
    return _flat_call(q, kv, indices, float(sm_scale), attn_sink, topk_length, interpret=params, shapes=shapes)
