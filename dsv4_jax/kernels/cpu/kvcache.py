"""The backend "cpu" of `dsv4_jax.kvcache` and the prefill's gathers: the C gathers of `dsv4_cpu`
as XLA FFI calls (vLLM's `dequantize_and_gather_k_cache`; one workspace region of a chunk)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.kernels.cpu.library import require

GATHER_TARGET = "dsv4_gather_dequant"
SEGMENTS_TARGET = "dsv4_gather_segments"


def gather_dequant(out, k_cache, seq, glen, bt, S: int, offset: int):
    """out bf16 [R', rows, 512] with rows of the requests written (a new array; donate `out`
    to reuse its buffer): seq / glen / bt int32 ([R], [R], [R, B]), k_cache uint8 2-D pages."""
    require()
    call = jax.ffi.ffi_call(GATHER_TARGET, jax.ShapeDtypeStruct(out.shape, out.dtype), input_output_aliases={0: 0})
    i32 = jnp.int32
    return call(
        out, k_cache, seq.astype(i32), glen.astype(i32), bt.astype(i32), block_size=np.int64(S), offset=np.int64(offset)
    )


def gather_segments(
    ws, k_cache, block_table, region_start, seg_request, seg_row_base, start, s0, s1, dst_offset, S: int
):
    """The prefill's gather of one region of one chunk into the workspace `ws` (rows, 512), bf16
    or float32 (a new array, aliased): segment s in [s0, s1) owns region rows region_start[s] ..
    region_start[s + 1] - 1; its row j is entry start[s] + j (start None: j) of request
    seg_request[s], dequantized into ws row seg_row_base[s] + dst_offset + j. s0, s1,
    dst_offset may be traced; nothing outside the arrays is read or written."""
    require()
    i32 = jnp.int32
    start = jnp.zeros((1,), i32) if start is None else start.astype(i32)
    bounds = jnp.stack([jnp.asarray(s0, i32), jnp.asarray(s1, i32), jnp.asarray(dst_offset, i32)])
    call = jax.ffi.ffi_call(SEGMENTS_TARGET, jax.ShapeDtypeStruct(ws.shape, ws.dtype), input_output_aliases={0: 0})
    return call(
        ws,
        k_cache,
        block_table.astype(i32),
        region_start.astype(i32),
        seg_request.astype(i32),
        seg_row_base.astype(i32),
        start,
        bounds,
        block_size=np.int64(S),
    )
