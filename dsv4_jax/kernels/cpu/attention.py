"""The backend "cpu" for JAX, its attention: the C kernels of `dsv4_cpu` as XLA FFI custom calls
(usable under `jax.jit`; indices, lengths and the prefill's metadata may be traced; registration
and threads: `dsv4_jax.kernels.cpu.library`).

- `sparse_attention`: FlashMLA's `flash_mla_sparse_fwd` contract on a flat workspace
  (`dsv4_sparse_attention`), returning (out, max_logits, lse).
- `prefill_attention`: one prefill layer straight from the caches (`dsv4_prefill_attention`):
  no workspace and no chunk loop; rows in q's dtype (paged or logical) or fp8_ds_mla pages,
  dequantized inside the kernel.

Numerics (`dsv4_cpu/csrc/dsv4_cpu.h`): bf16 inputs: bf16 products, fp32 accumulation, the
probabilities rounded to bf16 before P @ V (FlashMLA's); float32 inputs: float32 throughout. A
token's result depends only on its own keys and their order, so torch and JAX get the same bits,
and a prefill's output does not depend on the plan. The instruction set is chosen at run time
(`DSV4_PREFILL_CPU_ISA` caps it, read on every call). Bounds: every page id, position and row is
checked by the kernels (a bad traced value gives a NaN row or an error, never a stray access).
No backward (`library.no_backward`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_cpu import binding
from dsv4_jax.kernels.cpu.library import dtype_unavailable, no_backward, require
from planner.contract import backend_unavailable

SPARSE_TARGET = "dsv4_sparse_attention"
PREFILL_TARGET = "dsv4_prefill_attention"
PREFILL_INTO_TARGET = "dsv4_prefill_attention_into"  # the same, writing into a given (donated) buffer
# Cache layouts of the prefill call (xla_ffi.cc's LAYOUT_*).
LAYOUT_LOGICAL, LAYOUT_PAGED, LAYOUT_FP8 = 0, 1, 2
LAYOUT_MXFP8_SPLIT, LAYOUT_MXFP8_INTERLEAVED = 3, 4  # DeepSeek-V4.1's 528-byte records


@functools.cache
def _sparse_call(sm_scale: float):
    def impl(q, kv, indices, topk_length, sink):
        T, H, D = q.shape
        dv = 512 if D >= 512 else D
        stat = jax.ShapeDtypeStruct((T, H), jnp.float32)
        call = jax.ffi.ffi_call(
            SPARSE_TARGET, (jax.ShapeDtypeStruct((T, H, dv), q.dtype), stat, stat), vmap_method="sequential"
        )
        return call(q, kv, indices, topk_length, sink, sm_scale=np.float32(sm_scale))

    return no_backward(impl, "sparse_attention")


def sparse_attention(q, kv, indices, sm_scale: float, attn_sink=None, topk_length=None):
    """(out, max_logits, lse) of `dsv4_jax.sparse_attention` by the C kernel. Inputs in the
    canonical form of `dsv4_jax.attention.check_inputs` (q (T, H, D) and kv (S, D) both bf16 or
    both float32, indices (T, K) int32, sink (H,) float32 or None, topk_length (T,) int32 or None)."""
    require()
    if (reason := dtype_unavailable(q.dtype)) is not None:
        raise backend_unavailable("cpu", reason)
    topk = jnp.zeros((0,), jnp.int32) if topk_length is None else topk_length.astype(jnp.int32)
    sink = jnp.zeros((0,), jnp.float32) if attn_sink is None else attn_sink.astype(jnp.float32)
    return _sparse_call(float(sm_scale))(q, kv, indices.astype(jnp.int32), topk, sink)


@functools.cache
def _prefill_call(attrs: tuple, into: bool):
    def impl(q, tokens, count, raw_data, raw_table, comp_data, comp_table, topk, sink, *out):
        T, H, D = q.shape
        dv = 512 if D >= 512 else D
        result = jax.ShapeDtypeStruct((T, H, dv), q.dtype)
        if into:
            call = jax.ffi.ffi_call(PREFILL_INTO_TARGET, result, vmap_method="sequential", input_output_aliases={9: 0})
        else:
            call = jax.ffi.ffi_call(PREFILL_TARGET, result, vmap_method="sequential")
        kw = {k: (np.float32(v) if k == "sm_scale" else np.int64(v)) for k, v in attrs}
        return call(q, tokens, count, raw_data, raw_table, comp_data, comp_table, topk, sink, *out, **kw)

    return no_backward(impl, "prefill_attention")


def source_arrays(src):
    """(data, table, layout, block_size) of a prefill cache: a `dsv4_jax.prefill.PagedKV` (rows
    or fp8_ds_mla pages) or `LogicalKV` (rows + offsets); None: an empty stand-in (SWA's
    compressed cache)."""
    if src is None:
        return jnp.zeros((0,), jnp.uint8), jnp.zeros((0,), jnp.int32), LAYOUT_LOGICAL, 0
    if hasattr(src, "block_table"):
        if getattr(src, "mxfp8", False):
            layout = LAYOUT_MXFP8_INTERLEAVED if src.layout == "interleaved" else LAYOUT_MXFP8_SPLIT
            return src.pages.reshape(src.pages.shape[0], -1), src.block_table, layout, src.page_size
        if src.fp8:
            return src.pages, src.block_table, LAYOUT_FP8, src.page_size
        return src.pages, src.block_table, LAYOUT_PAGED, 0
    return src.rows, src.offsets, LAYOUT_LOGICAL, 0


def prefill_attention(
    q,
    tokens,
    count,
    raw,
    comp,
    topk_rows,
    attn_sink,
    *,
    kind: str,
    window: int,
    compress_ratio: int,
    sm_scale: float,
    out=None,
):
    """One prefill layer by the C kernel: out (T_q, H, d_v) in q's dtype.

    tokens: (3, n) or (4, n) int32, per token: q row, batch request (block-table row / offsets
    entry), absolute position, and (4 rows) its lowest window position (the window is
    max(0, p - W + 1, that) .. p: DeepSeek-V4.1's replay_start and replay band); the first `count` (a traced int32 scalar) are real, the rest padding
    (their rows, and every q row no real token names, come out 0). raw / comp: `PagedKV` or
    `LogicalKV` (comp None for SWA); topk_rows (rows, topk)
    int32 for CSA, else None; attn_sink (H,) float32 or None. out: optional (T_q, H, d_v) array in
    q's dtype that the kernel writes into (aliased to the result: donate it to reuse its memory)."""
    require()
    if (reason := dtype_unavailable(q.dtype)) is not None:
        raise backend_unavailable("cpu", reason)
    raw_data, raw_table, raw_layout, raw_bs = source_arrays(raw)
    comp_data, comp_table, comp_layout, comp_bs = source_arrays(comp)
    topk = jnp.zeros((0, 0), jnp.int32) if topk_rows is None else topk_rows.astype(jnp.int32)
    sink = jnp.zeros((0,), jnp.float32) if attn_sink is None else attn_sink.astype(jnp.float32)
    attrs = (
        ("kind", binding.kind_code(kind)),
        ("window", window),
        ("compress_ratio", compress_ratio),
        ("sm_scale", sm_scale),
        ("raw_layout", raw_layout),
        ("raw_block_size", raw_bs),
        ("comp_layout", comp_layout),
        ("comp_block_size", comp_bs),
    )
    count = jnp.reshape(jnp.asarray(count, jnp.int32), (1,))
    extra = () if out is None else (out,)
    return _prefill_call(attrs, out is not None)(
        q,
        tokens.astype(jnp.int32),
        count,
        raw_data,
        raw_table.astype(jnp.int32),
        comp_data,
        comp_table.astype(jnp.int32),
        topk,
        sink,
        *extra,
    )
