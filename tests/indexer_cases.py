"""Lightning Indexer test cases (NumPy) and the C indexer (`dsv4_cpu/csrc/indexer.cc`) called on NumPy arrays.

`make_batch` writes random keys as vLLM's fp8 index pages (`planner.index_cache`) with queries,
weights and token arrays; `indexer_topk` calls `dsv4_indexer_topk` through the ctypes binding
(what the C layer's tests check against the float64 oracle, `planner.indexer_oracle`). Keys come as:

* `IndexKeys.fp8_pages(kv_cache, block_table)`: vLLM's index key cache bytes (uint8
  `[num_blocks, block_size, D + 4]`, `planner.index_cache`), read in place;
* `IndexKeys.rows(keys, offsets)`: bf16 (ml_dtypes) or float32 rows `[rows, D]`, request b's
  entry e at row `offsets[b] + e` (offsets None: one request, entry e = row e).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from dsv4_cpu import binding as C
from planner import index_cache
from planner.checks import as_int, as_int_vector

FP8 = C.INDEX_FP8
_DTYPES = {np.dtype(ml_dtypes.bfloat16): C.BF16, np.dtype(np.float32): C.F32}


def q_dtype_code(dtype) -> int:
    dt = np.dtype(dtype)
    if dt == np.dtype(ml_dtypes.float8_e4m3fn) or dt == np.uint8:
        return FP8
    if dt not in _DTYPES:
        raise TypeError(f"q: expected bfloat16, float32 or float8_e4m3fn, got {dt}")
    return _DTYPES[dt]


@dataclass
class IndexKeys:
    """A key source for the C call (keeps its arrays alive)."""

    source: C.KVSource
    D: int
    arrays: tuple
    kind: str  # "fp8" or "rows"

    @classmethod
    def fp8_pages(cls, kv_cache: np.ndarray, block_table) -> IndexKeys:
        if not isinstance(kv_cache, np.ndarray) or kv_cache.dtype != np.uint8 or kv_cache.ndim != 3:
            raise TypeError("kv_cache: expected a uint8 numpy array [num_blocks, block_size, D + 4]")
        nb, S, width = kv_cache.shape
        D = width - 4
        if D < 1 or kv_cache.strides[2] != 1 or kv_cache.strides[1] != width:
            raise ValueError(
                f"kv_cache: expected contiguous pages [num_blocks, block_size, D + 4], got {kv_cache.shape}"
            )
        bt = np.ascontiguousarray(np.asarray(block_table))
        if bt.ndim != 2 or bt.dtype not in (np.int32, np.int64):
            raise ValueError(f"block_table: expected a 2-D int32 / int64 array, got {bt.dtype} {bt.shape}")
        src = C.KVSource(
            format=FP8,
            dtype=0,
            data=kv_cache.ctypes.data,
            row_stride=0,
            num_rows=0,
            page_stride=kv_cache.strides[0],
            num_pages=nb,
            page_size=S,
            table=bt.ctypes.data,
            table_int64=int(bt.dtype == np.int64),
            table_stride=bt.shape[1],
            table_width=bt.shape[1],
            table_rows=bt.shape[0],
        )
        return cls(src, D, (kv_cache, bt), "fp8")

    @classmethod
    def rows(cls, keys: np.ndarray, offsets=None) -> IndexKeys:
        if not isinstance(keys, np.ndarray) or keys.ndim != 2 or np.dtype(keys.dtype) not in _DTYPES:
            raise TypeError("keys: expected a 2-D bfloat16 or float32 numpy array [rows, D]")
        keys = np.ascontiguousarray(keys)
        off = None if offsets is None else np.ascontiguousarray(as_int_vector(offsets, "offsets"))
        src = C.KVSource(
            format=0,
            dtype=_DTYPES[np.dtype(keys.dtype)],
            data=keys.ctypes.data,
            row_stride=keys.shape[1],
            num_rows=keys.shape[0],
            page_stride=0,
            num_pages=0,
            page_size=0,
            table=None if off is None else off.ctypes.data,
            table_int64=1,
            table_stride=1,
            table_width=1,
            table_rows=0 if off is None else off.shape[0],
        )
        return cls(src, keys.shape[1], (keys, off), "rows")


def tokens_struct(token_row, token_request, token_position, compress_ratio):
    """(dsv4_prefill_tokens for the indexer, the int32 arrays it points at)."""
    req = np.ascontiguousarray(as_int_vector(token_request, "token_request"), dtype=np.int32)
    pos = np.ascontiguousarray(as_int_vector(token_position, "token_position"), dtype=np.int32)
    row = np.ascontiguousarray(as_int_vector(token_row, "token_row"), dtype=np.int32)
    tk = C.PrefillTokens(
        kind=1,
        window=1,
        compress_ratio=as_int(compress_ratio, "compress_ratio", minimum=1),
        num_tokens=req.shape[0],
        token_row=row.ctypes.data,
        token_request=req.ctypes.data,
        token_position=pos.ctypes.data,
        topk=None,
        topk_int64=0,
        topk_stride=0,
        topk_width=0,
        topk_rows=0,
    )
    return tk, (req, pos, row)


def indexer_topk(
    q,
    weights,
    keys: IndexKeys,
    token_request,
    token_position,
    compress_ratio,
    topk,
    *,
    threads=1,
    isa=None,
    candidate_block_size=None,
    candidate_topk_blocks=None,
    candidates=None,
):
    """(indices int32 [T, topk], logits float32 [T, topk]) from the C kernel; q [T, H, D] bfloat16,
    float32 or float8_e4m3fn, weights float32 [T, H]; token t uses row t of q / weights / outputs.
    The two-level top-k (`dsv4_indexer_topk_candidates`): with candidate_block_size and
    candidate_topk_blocks (level 1) a third result, the candidate blocks int32 [T, topk_blocks];
    with candidate_block_size and candidates [T, W] (level 2) the top-k inside them."""
    q = np.ascontiguousarray(q)
    code = q_dtype_code(q.dtype)
    if q.ndim != 3 or q.shape[2] != keys.D:
        raise ValueError(f"q: expected [T, H, {keys.D}], got {q.shape}")
    T, H, D = q.shape
    w = np.ascontiguousarray(weights, dtype=np.float32)
    if w.shape != (T, H):
        raise ValueError(f"weights: expected ({T}, {H}), got {w.shape}")
    k = as_int(topk, "topk", minimum=1)
    tk, keep = tokens_struct(np.arange(T), token_request, token_position, compress_ratio)
    if keep[0].shape[0] != T or keep[1].shape[0] != T:
        raise ValueError(f"token_request / token_position: expected {T} entries each")
    idx = np.empty((T, k), np.int32)
    val = np.empty((T, k), np.float32)
    lib = C.library()
    par = C.parallel(threads)
    cand = None
    if candidates is not None:
        blocks = np.ascontiguousarray(candidates, dtype=np.int32)
        cand = C.IndexCandidates(C.CANDIDATES_RESTRICT, candidate_block_size, blocks.shape[1], blocks.ctypes.data,
                                 blocks.shape[1])  # fmt: skip
    elif candidate_block_size is not None:
        blocks = np.full((T, candidate_topk_blocks), -7, np.int32)
        cand = C.IndexCandidates(C.CANDIDATES_SELECT, candidate_block_size, candidate_topk_blocks, blocks.ctypes.data,
                                 candidate_topk_blocks)  # fmt: skip
    fn = lib.dsv4_indexer_topk if cand is None else lib.dsv4_indexer_topk_candidates
    more = () if cand is None else (ctypes.byref(cand),)
    rc = fn(
        q.ctypes.data,
        H * D,
        D,
        code,
        T,
        H,
        D,
        w.ctypes.data,
        H,
        ctypes.byref(tk),
        ctypes.byref(keys.source),
        k,
        idx.ctypes.data,
        k,
        val.ctypes.data,
        k,
        ctypes.byref(par),
        C.isa_code(isa),
        *more,
    )
    C.check(rc)
    if cand is not None and cand.mode == C.CANDIDATES_SELECT:
        return idx, val, blocks
    return idx, val


def indexer_isa(q_dtype, key_kind: str, isa=None) -> str:
    """The instruction set `indexer_topk` runs for q of `q_dtype` and keys "fp8" / "bf16" / "float32"."""
    key = {"fp8": FP8, "bf16": C.BF16, "float32": C.F32}[key_kind]
    got = C.library().dsv4_indexer_isa(q_dtype_code(q_dtype), key, C.isa_code(isa))
    if got < 0:
        C.check(2)
    return C.ISAS[got]


def make_batch(rng, seq, qry, H, D, r, q_dtype=ml_dtypes.bfloat16, page=16, dup=0):
    """Keys per request (written as vLLM's fp8 pages, scattered), q, weights and token arrays."""
    n = [s // r for s in seq]
    keys = [rng.standard_normal((m, D)).astype(np.float32) * rng.uniform(0.5, 4) for m in n]
    for k in keys:  # exact duplicates: logits tie exactly
        for _ in range(dup if len(k) > 2 else 0):
            a, b = rng.choice(len(k), 2, replace=False)
            k[b] = k[a]
    pages = [-(-m // page) for m in n]
    perm = rng.permutation(sum(pages) + 3)  # pages in random order, some unused
    cache = np.full((len(perm), page, D + 4), 0xAB, np.uint8)
    bt = np.full((len(seq), max(pages + [1]) + 1), -7, np.int32)
    at = 0
    for b, m in enumerate(n):
        bt[b, : pages[b]] = perm[at : at + pages[b]]
        at += pages[b]
        e = np.arange(m)
        index_cache.indexer_k_quant_and_cache(keys[b], cache, bt[b, e // page].astype(np.int64) * page + e % page, D)
    deq = index_cache.gather_index_keys(cache, bt, n)
    req = np.repeat(np.arange(len(seq)), qry)
    pos = np.concatenate([np.arange(s - q, s) for s, q in zip(seq, qry)]).astype(np.int64)
    T = int(sum(qry))
    q = (rng.standard_normal((T, H, D)) * rng.uniform(0.5, 2)).astype(q_dtype)
    w = (rng.standard_normal((T, H)) * 0.3 + 0.5).astype(np.float32)  # mostly positive, some negative
    return dict(cache=cache, bt=bt, deq=deq, req=req, pos=pos, q=q, w=w, n=n)
