"""The `fp8_ds_mla` gather-dequantize on CPU arrays: `planner.ckernel`'s C kernel as an XLA FFI call.

The same kernel the torch package calls through ctypes, here a custom call XLA runs on the
host: usable under `jax.jit` (the per-request arrays can be traced), `out` aliased to the result
(donate it to update in place). The handler splits large calls into row ranges on `threads`
std::threads. Built once per machine with the system C and C++ compilers against jaxlib's
FFI headers (`jax.ffi.include_dir()`); where that cannot be done, `unavailable_reason()` says
why and `dsv4_jax.kvcache` keeps its xla path (the same bits).

Bounds: the kernel checks every page id and position against the arrays' sizes, so traced
values that validation could not see give NaN rows, never a stray read or write.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.kernels.cpu_ffi import FFI_SOURCE, threads, unavailable_reason  # noqa: F401  (re-exported)
from dsv4_jax.kernels.cpu_ffi import require as _require
from planner import ckernel

TARGET = "dsv4_gather_dequant"
SEGMENTS_TARGET = "dsv4_gather_segments"


def gather_dequant(out, k_cache, seq, glen, bt, S: int, offset: int):
    """out bf16 [R', rows, 512] with rows of the requests written (a new array; donate `out`
    to reuse its buffer): seq / glen / bt int32 ([R], [R], [R, B]), k_cache uint8 2-D pages."""
    _require()
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(out.shape, out.dtype), input_output_aliases={0: 0})
    return call(
        out,
        k_cache,
        seq.astype(jnp.int32),
        glen.astype(jnp.int32),
        bt.astype(jnp.int32),
        block_size=np.int64(S),
        offset=np.int64(offset),
        threads=np.int64(threads()),
        min_rows=np.int64(ckernel.PARALLEL_ROWS),
        stream_bytes=np.int64(ckernel.STREAM_BYTES),
    )


def gather_segments(
    ws, k_cache, block_table, region_start, seg_request, seg_row_base, start, s0, s1, dst_offset, S: int
):
    """The prefill's gather of one region of one chunk into the workspace `ws` (rows, 512), bf16
    or float32 (a new array, aliased): segment s in [s0, s1) owns region rows region_start[s] ..
    region_start[s + 1] - 1; its row j is entry start[s] + j (start None: j) of request
    seg_request[s], dequantized into ws row seg_row_base[s] + dst_offset + j. s0, s1,
    dst_offset may be traced; nothing outside the arrays is read or written."""
    _require()
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
        threads=np.int64(threads()),
        min_rows=np.int64(ckernel.PARALLEL_ROWS),
        stream_bytes=np.int64(ckernel.STREAM_BYTES),
    )
