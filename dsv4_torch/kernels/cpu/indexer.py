"""The indexer backend "cpu": `dsv4_cpu`'s fused Lightning Indexer (`dsv4_indexer_topk`) on CPU tensors.

One call scores every token against its request's compressed index keys and keeps the top-k,
reading vLLM's fp8 index pages (or bf16 / float32 rows) in place, on torch's intra-op threads
(`dsv4_torch.kernels.cpu.library`'s `at::parallel_for` runner). `dsv4_torch.indexer.indexer_topk` runs
it when its backend resolves to "cpu" (argument checks there).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from dsv4_cpu import binding
from dsv4_torch.kernels.cpu.library import library, parallel

Q_DTYPES = {torch.bfloat16: binding.BF16, torch.float32: binding.F32, torch.float8_e4m3fn: binding.INDEX_FP8}
ROW_DTYPES = {torch.bfloat16: binding.BF16, torch.float32: binding.F32}


def key_source(keys: torch.Tensor, offsets, block_table, keep: list) -> binding.KVSource:
    """The dsv4_kv_source of fp8 index pages (uint8 [P, S, D + 4] + block table) or key rows
    ([N, D] + offsets); tensors it points at are appended to `keep`."""
    if keys.dtype == torch.uint8:
        bt = torch.from_numpy(
            np.ascontiguousarray(block_table, dtype=np.int64 if block_table.dtype == np.int64 else np.int32)
        )
        if keys.stride(2) != 1 or keys.stride(1) != keys.shape[2]:
            raise ValueError(f"keys: each page's bytes must be contiguous, got strides {keys.stride()}")
        keep.append(bt)
        return binding.KVSource(
            binding.INDEX_FP8, 0, keys.data_ptr(), 0, 0, keys.stride(0), keys.shape[0], keys.shape[1], bt.data_ptr(),
            int(bt.dtype == torch.int64), bt.shape[1], bt.shape[1], bt.shape[0],
        )  # fmt: skip
    rows = keys if keys.stride(1) == 1 else keys.contiguous()
    off = None if offsets is None else torch.from_numpy(np.ascontiguousarray(offsets, dtype=np.int64))
    keep += [rows, off]
    return binding.KVSource(
        binding.ROWS, ROW_DTYPES[keys.dtype], rows.data_ptr(), rows.stride(0), rows.shape[0], 0, 0, 0,
        None if off is None else off.data_ptr(), 1, 1, 1, 0 if off is None else off.shape[0],
    )  # fmt: skip


def indexer_topk_cpu(
    q,
    weights,
    keys,
    token_request,
    token_position,
    compress_ratio,
    topk,
    offsets,
    block_table,
    *,
    cand,
    candidates=None,
):
    """(indices int32 [T, topk], logits float32 [T, topk], candidate blocks int32 [T,
    topk_blocks] or None): checked CPU tensors; token arrays, offsets, block table and level 2's
    candidates as host NumPy integers; cand: `planner.checks.CandidateOptions`."""
    lib = library()
    q = q if q.stride(-1) == 1 else q.contiguous()
    w = weights.detach().to(torch.float32)
    w = w if w.stride(-1) == 1 else w.contiguous()
    T, H, D = q.shape
    keep: list = []
    src = key_source(keys, offsets, block_table, keep)
    row = torch.arange(T, dtype=torch.int32)
    req = torch.from_numpy(np.ascontiguousarray(token_request, dtype=np.int32))
    pos = torch.from_numpy(np.ascontiguousarray(token_position, dtype=np.int32))
    tk = binding.PrefillTokens(
        1, 1, compress_ratio, T, row.data_ptr(), req.data_ptr(), pos.data_ptr(), None, 0, 0, 0, 0
    )
    idx = torch.empty((T, topk), dtype=torch.int32)
    val = torch.empty((T, topk), dtype=torch.float32)
    par = parallel(None)
    more, blocks = (), None
    if cand.level == 1:
        blocks = torch.empty((T, cand.topk_blocks), dtype=torch.int32)
        mode = binding.CANDIDATES_SELECT
    elif cand.level == 2:
        blocks = torch.from_numpy(np.ascontiguousarray(candidates, dtype=np.int32))
        mode = binding.CANDIDATES_RESTRICT
    if blocks is not None:
        nb = blocks.shape[1]
        more = (ctypes.byref(binding.IndexCandidates(mode, cand.block_size, nb, blocks.data_ptr(), nb)),)
    fn = lib.dsv4_indexer_topk_candidates if more else lib.dsv4_indexer_topk
    rc = fn(
        q.data_ptr(), q.stride(0), q.stride(1), Q_DTYPES[q.dtype], T, H, D, w.data_ptr(), w.stride(0),
        ctypes.byref(tk), ctypes.byref(src), topk, idx.data_ptr(), topk, val.data_ptr(), topk, ctypes.byref(par), -1,
        *more,
    )  # fmt: skip
    binding.check(rc)
    return idx, val, blocks if cand.level == 1 else None
