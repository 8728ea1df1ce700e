"""The indexer backend "cpu" for JAX: `dsv4_cpu`'s fused Lightning Indexer as an XLA FFI call.

The handler (`dsv4_cpu/csrc/xla_indexer.cc`, registered with the other FFI targets by
`dsv4_jax.kernels.cpu.library`) calls `dsv4_indexer_topk` on XLA's intra-op threads; usable under
`jax.jit` (token arrays and the cache may be traced). `dsv4_jax.indexer.indexer_topk` runs it when
its backend resolves to "cpu" (argument checks there). No backward (an integer selection).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.kernels.cpu.library import require

TARGET = "dsv4_indexer_topk"
TARGET_SELECT, TARGET_RESTRICT = "dsv4_indexer_topk_select", "dsv4_indexer_topk_restrict"  # the two levels
LAYOUT_ROWS, LAYOUT_INDEX_FP8 = 0, 2  # xla_indexer.cc's layouts


@functools.cache
def _call(layout: int, compress_ratio: int, topk: int, cand):
    attrs = dict(layout=np.int64(layout), compress_ratio=np.int64(compress_ratio), topk=np.int64(topk))

    def impl(q, weights, keys, table, request, position, valid, *candidates):
        T = q.shape[0]
        out = (jax.ShapeDtypeStruct((T, topk), jnp.int32), jax.ShapeDtypeStruct((T, topk), jnp.float32))
        if cand.level == 1:
            out += (jax.ShapeDtypeStruct((T, cand.topk_blocks), jnp.int32),)
            extra = dict(block_size=np.int64(cand.block_size), topk_blocks=np.int64(cand.topk_blocks))
            call = jax.ffi.ffi_call(TARGET_SELECT, out, vmap_method="sequential")
        elif cand.level == 2:
            extra = dict(block_size=np.int64(cand.block_size))
            call = jax.ffi.ffi_call(TARGET_RESTRICT, out, vmap_method="sequential")
        else:
            extra = {}
            call = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")
        res = call(q, weights, keys, table, request, position, valid, *candidates, **attrs, **extra)
        return tuple(res) if cand.level == 1 else (*res, None)

    return impl


def indexer_topk_cpu(
    q, weights, keys, token_request, token_position, valid, *, compress_ratio, topk, offsets, block_table, cand,
    candidates=None,
):  # fmt: skip
    """(indices int32 [T, topk], logits float32 [T, topk], level 1's candidate blocks int32 [T,
    topk_blocks] or None) by the C kernel; checked inputs; cand: `planner.checks.CandidateOptions`
    (level 2: `candidates` int32 [T, W])."""
    require()
    if block_table is not None:
        layout, table = LAYOUT_INDEX_FP8, block_table
    else:
        layout = LAYOUT_ROWS
        table = jnp.zeros((1,), jnp.int32) if offsets is None else offsets
    i32 = jnp.int32
    extra = (candidates.astype(i32),) if cand.level == 2 else ()
    return _call(layout, int(compress_ratio), int(topk), cand)(
        q, weights.astype(jnp.float32), keys, table.astype(i32), token_request.astype(i32), token_position.astype(i32),
        valid.astype(i32), *extra,
    )  # fmt: skip
