"""The backend "cpu" of `dsv4_torch.kvcache`: vLLM's `dequantize_and_gather_k_cache` on
fp8_ds_mla pages in CPU tensors, one C kernel call (`dsv4_gather_dequant`) on torch's threads."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from dsv4_cpu import binding
from dsv4_torch.kernels.cpu.attention import fp8_page_bytes
from dsv4_torch.kernels.cpu.library import library, parallel


def gather_dequant(
    out: torch.Tensor,
    k_cache: torch.Tensor,
    seq: torch.Tensor,
    glen: torch.Tensor | None,
    bt: torch.Tensor,
    S: int,
    offset: int,
    *,
    threads: int | None = None,
) -> None:
    """`dequantize_and_gather_k_cache` on CPU tensors, in place: out bf16 or float32
    [R', rows, 512] (last dim unit stride), k_cache uint8 pages (stride(0) the page stride),
    seq / glen int [R] (glen None: all seq positions), bt int32/int64 [R'', B] (unit stride in
    dim 1). Rows whose page (or position: a gather length above the sequence length) is not in
    k_cache come out NaN; nothing outside the tensors is read or written."""
    lib = library()
    if out.dtype not in (torch.bfloat16, torch.float32) or out.dim() != 3 or out.shape[2] != 512 or out.stride(2) != 1:
        raise ValueError(
            f"out: expected bfloat16 or float32 (R, rows, 512) with unit stride in the last dim, got {out.dtype} "
            f"{tuple(out.shape)} {out.stride()}"
        )
    if bt.dim() != 2 or bt.dtype not in (torch.int32, torch.int64) or (bt.shape[1] > 1 and bt.stride(1) != 1):
        raise ValueError(
            f"block_table: expected int32/int64 (R, B) with unit stride in dim 1, got {bt.dtype} {bt.stride()}"
        )
    R = seq.shape[0]
    if out.shape[0] < R or bt.shape[0] < R:
        raise ValueError(f"out / block_table: {out.shape[0]} / {bt.shape[0]} rows for {R} requests")
    k_page_bytes = fp8_page_bytes(k_cache, int(S), "k_cache")
    # the per-request arrays on the host (CPU tensors: no copy), as NumPy: O(requests)
    seq64 = np.ascontiguousarray(seq.detach().numpy(), dtype=np.int64)
    g64 = None if glen is None else np.ascontiguousarray(glen.detach().numpy(), dtype=np.int64)
    par = parallel(threads)
    rc = lib.dsv4_gather_dequant(
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
        out.shape[1],
        int(out.dtype == torch.float32),
        k_cache.data_ptr(),
        k_page_bytes,
        k_cache.shape[0],
        int(S),
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
