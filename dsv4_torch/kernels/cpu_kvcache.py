"""The `fp8_ds_mla` gather-dequantize on CPU tensors: `planner.ckernel`'s C kernel through ctypes.

One pass per row (page from the block table, 448 e4m3 dims decoded, RoPE dims copied), the
NumPy reference's bits; `python -m bench.bench_kvcache` measures it beside a plain copy. Large
calls are split into row ranges on `torch.get_num_threads()` Python threads (ctypes releases
the GIL for the call). Where the kernel cannot be built, `unavailable_reason()` says why and
`dsv4_torch.kvcache` keeps its torch path (the same bits).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from planner import ckernel
from planner.contract import backend_unavailable


def unavailable_reason() -> str | None:
    return ckernel.unavailable_reason()


_pool: list = []


def _executor(n: int) -> ThreadPoolExecutor:
    if not _pool or _pool[0]._max_workers < n:
        _pool[:] = [ThreadPoolExecutor(max_workers=n, thread_name_prefix="dsv4-kvcache")]
    return _pool[0]


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
    dim 1). Rows whose page is not in k_cache come out NaN; nothing outside the tensors is read
    or written (the caller validates values when it wants errors instead)."""
    fn = ckernel.gather_function()
    if fn is None:
        raise backend_unavailable("cpu", ckernel.unavailable_reason())
    if out.dtype not in (torch.bfloat16, torch.float32) or out.stride(2) != 1:
        raise ValueError(
            f"out: expected bfloat16 or float32 with unit stride in the last dim, got {out.dtype} {out.stride()}"
        )
    if bt.dtype not in (torch.int32, torch.int64) or bt.stride(1) != 1:
        raise ValueError(f"block_table: expected int32/int64 with unit stride in dim 1, got {bt.dtype} {bt.stride()}")
    R = seq.shape[0]
    if out.shape[0] < R or bt.shape[0] < R:
        raise ValueError(f"out / block_table: {out.shape[0]} / {bt.shape[0]} rows for {R} requests")
    # the per-request arrays on the host (CPU tensors: no copy), as NumPy: O(requests)
    seq64 = np.ascontiguousarray(seq.detach().numpy(), dtype=np.int64)
    g = seq64 if glen is None else glen.detach().numpy().astype(np.int64)
    cum = np.zeros(R + 1, dtype=np.int64)
    np.cumsum(np.maximum(g, 0), out=cum[1:])
    n = int(cum[-1])
    if n == 0:
        return
    stream = int(n * out.shape[2] * out.element_size() > ckernel.STREAM_BYTES)
    args = (
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
        out.shape[1],
        int(out.dtype == torch.float32),
        stream,
        k_cache.data_ptr(),
        k_cache.stride(0),
        k_cache.shape[0],
        S,
        seq64.ctypes.data,
        cum.ctypes.data,
        bt.data_ptr(),
        int(bt.dtype == torch.int64),
        bt.stride(0),
        bt.shape[1],
        offset,
        R,
    )
    ranges = ckernel.row_ranges(n, threads or torch.get_num_threads())
    if len(ranges) == 1:
        fn(*args, 0, n)
        return
    rest = [_executor(len(ranges) - 1).submit(fn, *args, *r) for r in ranges[1:]]
    fn(*args, *ranges[0])  # the calling thread takes the first range
    for f in rest:
        f.result()
