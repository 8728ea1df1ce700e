"""The backend "cpu" of `dsv4_jax.kvcache_v41`: vLLM's `dequantize_and_gather_k_cache` on
DeepSeek-V4.1's 528-byte mxfp8 pages (both layouts) as one XLA FFI call (`dsv4_gather_mxfp8`,
`dsv4_cpu/csrc/xla_kvcache_v41.cc`) on XLA's threads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.kernels.cpu.library import require
from planner import kvcache_v41 as ref

TARGET = "dsv4_gather_mxfp8"


def gather(out, k_cache, seq, glen, bt, geo: ref.Geometry, layout: str, offset: int):
    """Checked arguments (`dsv4_jax.kvcache_v41`): out bf16 / float32 [R', rows, 512] (a new array,
    aliased: donate `out` to reuse its buffer), k_cache uint8 mxfp8 pages of `geo`, seq / glen /
    bt int32 ([R], [R], [R, B])."""
    if geo.record.name != "mxfp8":
        raise ValueError(f"k_cache: the C gather reads mxfp8 (528-byte) records, got {geo.record.name}")
    require()
    pages = k_cache.reshape(geo.num_blocks, geo.page_stride)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(out.shape, out.dtype), input_output_aliases={0: 0})
    i32 = jnp.int32
    return call(
        out,
        pages,
        seq.astype(i32),
        glen.astype(i32),
        bt.astype(i32),
        block_size=np.int64(geo.S),
        offset=np.int64(offset),
        interleaved=np.int64(layout == "interleaved"),
    )
