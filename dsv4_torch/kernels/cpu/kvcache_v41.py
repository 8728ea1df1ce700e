"""The backend "cpu" of `dsv4_torch.kvcache_v41`: vLLM's `dequantize_and_gather_k_cache` on
DeepSeek-V4.1's 528-byte mxfp8 pages (both layouts) in CPU tensors, one C kernel call
(`dsv4_gather_mxfp8`) on torch's threads."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from dsv4_cpu import binding
from dsv4_torch.kernels.cpu.library import library, parallel
from planner import kvcache_v41 as ref


def gather(out, k_cache, seq, glen, bt, geo: ref.Geometry, layout: str, offset: int, *, threads: int | None = None):
    """Checked arguments (`dsv4_torch.kvcache_v41`): out bf16 / float32 [R', rows, 512] (unit last
    stride), k_cache uint8 mxfp8 pages of `geo`, seq / glen int [R], bt int32 / int64 [R'', B]."""
    if geo.record.name != "mxfp8":
        raise ValueError(f"k_cache: the C gather reads mxfp8 (528-byte) records, got {geo.record.name}")
    lib = library()
    R = seq.shape[0]
    seq64 = np.ascontiguousarray(seq.detach().numpy(), dtype=np.int64)
    g64 = None if glen is None else np.ascontiguousarray(glen.detach().numpy(), dtype=np.int64)
    par = parallel(threads)
    rc = lib.dsv4_gather_mxfp8(
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
        out.shape[1],
        int(out.dtype == torch.float32),
        k_cache.data_ptr(),
        geo.page_stride,
        geo.num_blocks,
        geo.S,
        int(layout == "interleaved"),
        seq64.ctypes.data,
        None if g64 is None else g64.ctypes.data,
        bt.data_ptr(),
        int(bt.dtype == torch.int64),
        bt.stride(0),
        bt.shape[1],
        int(offset),
        R,
        ctypes.byref(par),
    )
    binding.check(rc)
