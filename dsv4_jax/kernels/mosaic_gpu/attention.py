"""Mosaic GPU sparse-attention kernel for Hopper (sm_90a), backend "mosaic_gpu".

The FlashMLA `flash_mla_sparse_fwd` contract (spec section 2) as a Pallas Mosaic GPU kernel
(`plgpu.kernel`, warpgroup-level code, `wgmma`), with no Triton in the way. Needs jax >= 0.12;
on a machine without an NVIDIA GPU the same kernel runs in Mosaic GPU's interpret mode, and the
compiled kernel can be lowered for sm_90a there (tests/jax/test_mosaic.py does both). It has not
yet run on a GPU: speed is unmeasured (bench/checks/gpu_jax.py measures it).

Its design (CTA layout, warpgroups, shared-memory budget, expected cost) is in
`docs/kernel-design.md`, "Mosaic GPU sparse attention".
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from dsv4_jax.kernels.xla.attention import no_key_result
from planner.contract import (
    D_V,  # FlashMLA's value dim
    backend_unavailable,
)
from planner.contract import FLASHMLA_HEAD_DIMS as HEAD_DIMS

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)

BLOCK_H = 64  # heads per CTA (wgmma M)
SWIZZLE = 64  # bytes: the swizzle of every wgmma operand (P's 32 bf16 columns are 64 bytes)
TILE_COLS = SWIZZLE // 2  # bf16 columns per (8, TILE_COLS) tile
ROW_PIECE = 64  # a gathered row is one (1, D // 64, 64) TMA box
HEADS = (16, 32, 64, 128)
SMEM_LIMIT = 232_448  # bytes of shared memory one sm_90a block may use (227 KB)

_MIN_JAX = (0, 12)


def jax_version() -> tuple[int, ...]:
    parts = []
    for piece in jax.__version__.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def unavailable_reason() -> str | None:
    """None if this jax can build the kernel (jax >= 0.12 with Pallas Mosaic GPU), else why not."""
    if jax_version()[:2] < _MIN_JAX:
        return f"needs jax >= 0.12 (Pallas Mosaic GPU with GPU interpret mode), found jax {jax.__version__}"
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: F401

        plgpu.InterpretGPUParams  # noqa: B018
    except Exception as e:  # noqa: BLE001 - a broken or partial install
        return f"cannot import jax.experimental.pallas.mosaic_gpu ({type(e).__name__}: {e})"
    return None


BLOCK_K = 32  # index columns gathered and scored per step (wgmma N of QK^T)
NUM_STAGES = 2  # depth of the staging and tiled rings


def smem_bytes(d_qk: int) -> int:
    """Shared memory one CTA allocates before Mosaic's alignment padding (the docstring's table)."""
    q = BLOCK_H * d_qk * 2
    rings = 2 * NUM_STAGES * BLOCK_K * d_qk * 2
    p = 2 * BLOCK_H * BLOCK_K * 2
    indices = NUM_STAGES * BLOCK_K * 4
    barriers = (1 + 4 * NUM_STAGES + 1) * 8
    return q + rings + p + indices + barriers + 4


def check_shapes(q, kv, indices) -> None:
    """ValueError naming the argument for anything outside what this kernel serves."""
    T, H, D = q.shape
    if jnp.dtype(q.dtype) != jnp.bfloat16:
        raise ValueError(f"q: backend 'mosaic_gpu' takes bfloat16 only, got {jnp.dtype(q.dtype)}")
    if jnp.dtype(kv.dtype) != jnp.bfloat16:
        raise ValueError(f"kv: backend 'mosaic_gpu' takes bfloat16 only, got {jnp.dtype(kv.dtype)}")
    if H not in HEADS:
        raise ValueError(f"q: backend 'mosaic_gpu' serves {HEADS} heads, got H={H} (shape {tuple(q.shape)})")
    if D not in HEAD_DIMS:
        raise ValueError(f"q: backend 'mosaic_gpu' serves head dims {HEAD_DIMS}, got D={D} (shape {tuple(q.shape)})")
    if kv.shape[0] >= 2**31 - 1:
        raise ValueError(f"kv: at most 2**31 - 2 rows, got {kv.shape[0]}")


def _kernel_body(
    nv_ref,  # [T] int32: valid columns per token, already clipped to [0, K]
    sink_ref,  # [H_pad] float32
    q_ref,  # [T, H_pad, D] bf16
    kv_ref,  # [S, D // ROW_PIECE, ROW_PIECE] bf16 (a free reshape of [S, D]: TMA boxes are <= 256 wide)
    idx_ref,  # [T, K_pad] int32
    out_ref,  # [T, H_pad, 512] bf16
    max_ref,  # [T, H_pad] float32
    lse_ref,  # [T, H_pad] float32
    q_smem,
    k_smem,
    st_smem,
    p_smem,
    idx_smem,
    cnt_smem,
    barriers,
    *,
    sm_scale: float,
    num_rows: int,
    num_head_blocks: int,
    block_k: int,
    num_stages: int,
    d_qk: int,
):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    q_bar, idx_bar, st_bar, kfull_bar, kfree_bar, done_bar = barriers
    cta = lax.axis_index("cta")
    t = cta // num_head_blocks
    hb = cta % num_head_blocks
    h0 = hb * BLOCK_H
    wg = lax.axis_index("wg")
    n_valid = nv_ref[t]
    num_blocks = (n_valid + block_k - 1) // block_k
    score_scale = sm_scale * LOG2_E
    copy_layout = plgpu.Layout.SMEM_GMEM_COPY((block_k, TILE_COLS), jnp.bfloat16, SWIZZLE)

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        plgpu.copy_gmem_to_smem(q_ref.at[t, pl.ds(h0, BLOCK_H)], q_smem, q_bar.at[0])

        def load_indices(j):
            slot = lax.rem(j, num_stages)
            plgpu.commit_smem()  # order the scalar reads of block j - stages before TMA overwrites them
            plgpu.copy_gmem_to_smem(idx_ref.at[t, pl.ds(j * block_k, block_k)], idx_smem.at[slot], idx_bar.at[slot])

        def gather(j, count):
            slot = lax.rem(j, num_stages)

            @pl.when(j + 1 < num_blocks)
            def _():
                load_indices(j + 1)

            plgpu.barrier_wait(idx_bar.at[slot])

            def one_row(i, count):
                row = idx_smem[slot, i]
                ok = (row >= 0) & (row < num_rows) & (j * block_k + i < n_valid)
                # Invalid entries read row S: out of bounds, so TMA fills zeros.
                src = jnp.where(ok, row, num_rows)
                plgpu.copy_gmem_to_smem(kv_ref.at[pl.ds(src, 1)], st_smem.at[slot, pl.ds(i, 1)], st_bar.at[slot])
                return count + ok.astype(jnp.int32)

            return lax.fori_loop(0, block_k, one_row, count)

        def relayout(j):
            slot = lax.rem(j, num_stages)
            plgpu.barrier_wait(st_bar.at[slot])

            @pl.when(j >= num_stages)
            def _():
                plgpu.barrier_wait(kfree_bar.at[slot])  # consumers are done with block j - stages

            for c in range(d_qk // TILE_COLS):
                piece, first = divmod(TILE_COLS * c, ROW_PIECE)
                staged = st_smem.at[slot, :, piece, pl.ds(first, TILE_COLS)]
                # Reading 64-byte row pieces of 1152/1024-byte staged rows: two rows per bank
                # group, a 2-way conflict Mosaic's planner refuses unless told (optimized=False).
                k_smem[slot, :, pl.ds(TILE_COLS * c, TILE_COLS)] = plgpu.load(
                    staged, layout=copy_layout, optimized=False
                )
            plgpu.commit_smem()  # generic-proxy stores -> visible to wgmma
            plgpu.barrier_arrive(kfull_bar.at[slot])

        @pl.when(num_blocks > 0)
        def _():
            load_indices(0)

        def step(j, count):
            count = gather(j, count)

            @pl.when(j >= 1)
            def _():
                relayout(j - 1)

            return count

        count = lax.fori_loop(0, num_blocks, step, jnp.int32(0))

        @pl.when(num_blocks > 0)
        def _():
            relayout(num_blocks - 1)

        cnt_smem[0] = count
        plgpu.barrier_arrive(done_bar.at[0])

    def consumer(w: int):
        plgpu.set_max_registers(232, action="increase")
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        col_layout = plgpu.Layout.WGMMA.reduce(0)
        my_p = p_smem.at[w]
        plgpu.barrier_wait(q_bar.at[0])

        def load_block_indices(j):
            j = jnp.minimum(j, jnp.maximum(num_blocks - 1, 0))
            return plgpu.load(idx_ref.at[t, pl.ds(j * block_k, block_k)], layout=col_layout, optimized=False)

        def matmul(a, b, shape):
            def run(acc_ref):
                plgpu.wgmma(acc_ref, a, b)
                return acc_ref[...]  # waits for the wgmma

            return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))

        def block(j, carry):
            acc_lo, acc_hi, m, l, idx = carry
            slot = lax.rem(j, num_stages)
            idx_next = load_block_indices(j + 1)  # prefetch: used one iteration later
            plgpu.barrier_wait(kfull_bar.at[slot])
            s = matmul(q_smem, k_smem.at[slot].T, (BLOCK_H, block_k))
            col = j * block_k + plgpu.broadcasted_iota(jnp.int32, (block_k,), 0, layout=col_layout)
            valid = (idx >= 0) & (idx < num_rows) & (col < n_valid)
            valid = lax.broadcast_in_dim(valid, s.shape, [1])
            s = jnp.where(valid, s * score_scale, -jnp.inf)  # log2 units
            m_new = jnp.maximum(m, s.max(axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no key yet: avoid inf - inf
            alpha = jnp.exp2(m - m_safe)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            my_p[...] = p.astype(jnp.bfloat16)
            plgpu.commit_smem()  # P stores -> visible to wgmma
            # acc = acc * alpha + P @ V in two 128-column halves, each into a fresh wgmma
            # accumulator: 128 + 64 live accumulator registers instead of 2 x 128.
            alpha = lax.broadcast_in_dim(alpha, acc_lo.shape, [0])
            acc_lo = acc_lo * alpha + matmul(my_p, k_smem.at[slot, :, pl.ds(256 * w, 128)], acc_lo.shape)
            acc_hi = acc_hi * alpha + matmul(my_p, k_smem.at[slot, :, pl.ds(256 * w + 128, 128)], acc_hi.shape)
            plgpu.barrier_arrive(kfree_bar.at[slot])  # this block's K/V slot and P are read
            return acc_lo, acc_hi, m_new, l, idx_next

        zeros = plgpu.layout_cast(jnp.zeros((BLOCK_H, 128), jnp.float32), plgpu.Layout.WGMMA)
        init = (
            zeros,
            zeros,
            plgpu.layout_cast(jnp.full((BLOCK_H,), -jnp.inf, jnp.float32), row_layout),
            plgpu.layout_cast(jnp.zeros((BLOCK_H,), jnp.float32), row_layout),
            load_block_indices(0),
        )
        acc_lo, acc_hi, m, l, _ = lax.fori_loop(0, num_blocks, block, init)

        plgpu.barrier_wait(done_bar.at[0])
        # (broadcast by hand: warpgroup-semantics lowering has no implicit broadcast in select)
        has_keys = lax.broadcast_in_dim(cnt_smem[0] > 0, (BLOCK_H,), ())
        # NaN in q or in a gathered row must come out as NaN (as in the oracle): l keeps it even
        # where the running max dropped it.
        m = jnp.where(jnp.isnan(l), jnp.nan, m) * LN_2  # natural log from here on
        lse = jnp.where(has_keys, m + jnp.log(l), jnp.inf)
        max_logits = jnp.where(has_keys, m, -jnp.inf)
        sink = plgpu.load(sink_ref.at[pl.ds(h0, BLOCK_H)], layout=row_layout, optimized=False)
        scale = jnp.where(has_keys, 1.0 / (l * (1.0 + jnp.exp(sink - lse))), 0.0)
        scale = lax.broadcast_in_dim(scale, acc_lo.shape, [0])
        for half, acc in ((0, acc_lo), (1, acc_hi)):
            cols = pl.ds(256 * w + 128 * half, 128)
            plgpu.store(out_ref.at[t, pl.ds(h0, BLOCK_H), cols], (acc * scale).astype(jnp.bfloat16), optimized=False)
        if w == 0:
            plgpu.store(max_ref.at[t, pl.ds(h0, BLOCK_H)], max_logits, optimized=False)
            plgpu.store(lse_ref.at[t, pl.ds(h0, BLOCK_H)], lse, optimized=False)

    pl.when(wg == 0)(lambda: consumer(0))
    pl.when(wg == 1)(lambda: consumer(1))


def _build_call(T, H_pad, D, S, K_pad, sm_scale, interpret):
    from jax.experimental import pallas as pl  # noqa: F401
    from jax.experimental.pallas import mosaic_gpu as plgpu

    tiled = (plgpu.TilingTransform((8, TILE_COLS)), plgpu.SwizzleTransform(SWIZZLE))
    ns, bk = NUM_STAGES, BLOCK_K
    num_head_blocks = H_pad // BLOCK_H
    body = functools.partial(
        _kernel_body,
        sm_scale=sm_scale,
        num_rows=S,
        num_head_blocks=num_head_blocks,
        block_k=bk,
        num_stages=ns,
        d_qk=D,
    )
    return plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((T, H_pad, D_V), jnp.bfloat16),
            jax.ShapeDtypeStruct((T, H_pad), jnp.float32),
            jax.ShapeDtypeStruct((T, H_pad), jnp.float32),
        ),
        scratch_types=[
            plgpu.SMEM((BLOCK_H, D), jnp.bfloat16, transforms=tiled),
            plgpu.SMEM((ns, bk, D), jnp.bfloat16, transforms=tiled),
            plgpu.SMEM((ns, bk, D // ROW_PIECE, ROW_PIECE), jnp.bfloat16),  # staging: gathered rows
            plgpu.SMEM((2, BLOCK_H, bk), jnp.bfloat16, transforms=tiled),  # P, one per consumer
            plgpu.SMEM((ns, bk), jnp.int32),
            plgpu.SMEM((1,), jnp.int32),
            (
                plgpu.Barrier(num_barriers=1),  # q
                plgpu.Barrier(num_barriers=ns),  # index block
                plgpu.Barrier(num_arrivals=bk, num_barriers=ns),  # staged rows (one TMA each)
                plgpu.Barrier(num_barriers=ns),  # tiled block ready (producer)
                plgpu.Barrier(num_arrivals=2, num_barriers=ns),  # tiled block free (both consumers)
                plgpu.Barrier(num_barriers=1),  # count of valid entries written
            ),
        ],
        grid=(T * num_head_blocks,),
        grid_names=("cta",),
        num_threads=3,
        thread_name="wg",
        # No cross-warp reductions (WGMMA rows live in one warp): no reduction scratch, which
        # keeps D = 576 inside 227 KB.
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
        interpret=interpret,
    )


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret", "detect_races"))
def _sparse_attention_mosaic(q, kv, indices, sm_scale, attn_sink, topk_length, *, interpret, detect_races):
    T, H, D = q.shape
    S, K = kv.shape[0], indices.shape[1]
    if T == 0 or S == 0 or K == 0:
        return no_key_result(T, H, D_V, q.dtype)
    H_pad = -(-H // BLOCK_H) * BLOCK_H
    K_pad = -(-K // BLOCK_K) * BLOCK_K
    if H_pad != H:
        q = jnp.pad(q, ((0, 0), (0, H_pad - H), (0, 0)))
    if K_pad != K:
        indices = jnp.pad(indices, ((0, 0), (0, K_pad - K)), constant_values=-1)
    sink = jnp.full((H,), -jnp.inf, jnp.float32) if attn_sink is None else attn_sink.astype(jnp.float32)
    sink = jnp.pad(sink, (0, H_pad - H), constant_values=-jnp.inf)
    n_valid = jnp.full((T,), K, jnp.int32) if topk_length is None else jnp.clip(topk_length, 0, K)

    params = None
    if interpret:
        from jax.experimental.pallas import mosaic_gpu as plgpu

        params = plgpu.InterpretGPUParams(detect_races=detect_races)
    call = _build_call(T, H_pad, D, S, K_pad, sm_scale, params)
    out, max_logits, lse = call(n_valid, sink, q, kv.reshape(S, D // ROW_PIECE, ROW_PIECE), indices)
    return out[:, :H], max_logits[:, :H], lse[:, :H]


def sparse_attention_mosaic(
    q,
    kv,
    indices,
    sm_scale: float,
    attn_sink=None,
    topk_length=None,
    *,
    interpret: bool = False,
    detect_races: bool = False,
):
    """FlashMLA sparse attention as a Mosaic GPU kernel (Hopper).

    Inputs as checked by `dsv4_jax.sparse_attention` (canonical form):
      q: (T, H, D) bfloat16, H in {16, 32, 64, 128}, D in {512, 576}.
      kv: (S, D) bfloat16.
      indices: (T, K) int32; invalid if < 0, >= S, or column >= topk_length[t]; any K.
      sm_scale: Python float (static).
      attn_sink: (H,) float32 or None.
      topk_length: (T,) int32 or None.
      interpret: run in Mosaic GPU's interpret mode (CPU; simulated shared memory, warpgroups,
        barriers, TMA and wgmma) instead of compiling for the GPU.
      detect_races: with `interpret`, let the interpreter look for shared-memory races (read the
        verdict with `races_found()`).

    Returns:
      out (T, H, 512) bfloat16, max_logits (T, H) float32, lse (T, H) float32.
    """
    reason = unavailable_reason()
    if reason:
        raise backend_unavailable("mosaic_gpu", reason)
    if jnp.ndim(q) != 3 or jnp.ndim(kv) != 2 or jnp.ndim(indices) != 2:
        raise ValueError(
            f"q, kv, indices: expected (T, H, D), (S, D), (T, K), got shapes {tuple(q.shape)}, "
            f"{tuple(kv.shape)}, {tuple(indices.shape)} (call dsv4_jax.sparse_attention for other layouts)"
        )
    check_shapes(q, kv, indices)
    return _sparse_attention_mosaic(
        q,
        kv,
        indices,
        float(sm_scale),
        attn_sink,
        topk_length,
        interpret=bool(interpret),
        detect_races=bool(detect_races),
    )


def races_found() -> bool:
    """Whether a kernel run in interpret mode with detect_races=True found a race (since the last
    `reset_interpret_state`)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    if getattr(gpu_callbacks, "_races", None) is None:  # no kernel ran since the last reset
        return False
    return bool(gpu_callbacks.get_races().races_found)


def reset_interpret_state() -> None:
    """Clear Mosaic GPU interpret mode's global state (race records, simulated memory)."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    interpret_pallas_call.gpu_callbacks.reset_gpu_interpret_mode_state()
