"""The backend "cpu" for torch, its attention: the C kernels of `dsv4_cpu` on CPU tensors.

- `sparse_attention_cpu`: FlashMLA's `flash_mla_sparse_fwd` contract on a flat workspace, what
  `dsv4_torch.sparse_attention(..., backend="cpu")` runs.
- `prefill_attention`: one prefill layer straight from the caches, no workspace and no chunk loop:
  rows in q's dtype (paged or logical) or vLLM's `fp8_ds_mla` pages, dequantized inside the
  kernel. The prefill's layer call (`dsv4_torch.kernels.cpu.prefill`) and vLLM's CPU engine
  (`dsv4_torch.vllm.cpu.attention`) run it.

Numerics (the kernels'): bf16 in -> bf16 products, fp32 accumulation, probabilities rounded to
bf16 before the PV product (FlashMLA's); float32 in -> float32 throughout. A token's result
depends only on its own keys and their order: not on threads, tiles, chunk plans or the cache
layout. Threads and instruction sets: `dsv4_torch.kernels.cpu.library`. No backward and no
dropout: the backend table (`dsv4_torch.backends`) says so and the gradient path refuses it.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from dsv4_cpu import binding
from dsv4_torch.kernels.cpu.library import (
    DTYPES,
    check_cpu,
    dtype_code,
    float_sink,
    library,
    make_outputs,
    parallel,
    ptr,
    unit_last,
)
from planner.contract import value_dim
from planner.kvcache import check_page_layout, page_bytes


def sparse_attention_cpu(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    *,
    threads: int | None = None,
    isa: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashMLA's sparse attention on CPU tensors (the contract of `dsv4_torch.sparse_attention`,
    which validates the arguments and calls this for backend "cpu").

    q (T, H, D) and kv (S, D) bfloat16 or float32, indices (T, K) int32, topk_length (T,) int32
    or None, attn_sink (H,) float32/float64 or None. Inputs whose last dim is not contiguous are
    copied; other strides are read as they are. threads: default `torch.get_num_threads()`;
    isa: an instruction set name (default: the best allowed, see the module doc).

    Returns out (T, H, d_v) q.dtype, max_logits and lse (T, H) float32.
    """
    code = dtype_code(q)
    T, H, D = q.shape
    d_v = value_dim(D)
    out = torch.empty((T, H, d_v), dtype=q.dtype)
    max_logits = torch.empty((T, H), dtype=torch.float32)
    lse = torch.empty((T, H), dtype=torch.float32)
    if T == 0 or H == 0:
        return out, max_logits, lse
    for name, t in (("kv", kv), ("indices", indices), ("attn_sink", attn_sink), ("topk_length", topk_length)):
        check_cpu(t, name)
    if kv.dtype != q.dtype:
        raise TypeError(f"kv: dtype {kv.dtype} does not match q's dtype {q.dtype}")
    if kv.dim() != 2 or kv.shape[1] != D:
        raise ValueError(f"kv: expected ({kv.shape[0] if kv.dim() else 'S'}, {D}), got {tuple(kv.shape)}")
    if indices.dim() != 2 or indices.shape[0] != T:
        raise ValueError(f"indices: expected ({T}, K), got {tuple(indices.shape)}")
    if indices.dtype != torch.int32:
        raise TypeError(f"indices: expected int32, got {indices.dtype}")
    if topk_length is not None:
        if topk_length.dtype != torch.int32:
            raise TypeError(f"topk_length: expected int32, got {topk_length.dtype}")
        if tuple(topk_length.shape) != (T,):
            raise ValueError(f"topk_length: expected ({T},), got {tuple(topk_length.shape)}")
        topk_length = topk_length.contiguous()
    if attn_sink is not None and tuple(attn_sink.shape) != (H,):
        raise ValueError(f"attn_sink: expected ({H},), got {tuple(attn_sink.shape)}")
    lib = library()
    q, kv, indices = unit_last(q.detach()), unit_last(kv.detach()), unit_last(indices)
    sink = float_sink(attn_sink)
    S, K = kv.shape[0], indices.shape[1]
    outputs = make_outputs(out, max_logits, lse)
    par = parallel(threads)
    rc = lib.dsv4_sparse_attention(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        code,
        T,
        H,
        D,
        kv.data_ptr(),
        kv.stride(0) if S else D,
        S,
        indices.data_ptr(),
        indices.stride(0) if K else 0,
        K,
        ptr(topk_length),
        float(sm_scale),
        ptr(sink),
        ctypes.byref(outputs),
        ctypes.byref(par),
        binding.isa_code(isa),
    )
    binding.check(rc)
    return out, max_logits, lse


# ----------------------------------------------------------------------------- prefill


def paged_source(
    pages: torch.Tensor, block_table: torch.Tensor, page_size: int, fp8: bool, q_dtype, name: str, keep: list
):
    """A `dsv4_kv_source` for pages + a block table: fp8_ds_mla pages (uint8, page stride =
    pages.stride(0) bytes; 2-D or vLLM's 3-D view) or rows of q's dtype (pages, page_size, D)."""
    check_cpu(pages, name)
    check_cpu(block_table, f"{name}.block_table")
    if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{name}.block_table: expected int32/int64 (requests, pages), got {block_table.dtype} {tuple(block_table.shape)}"
        )
    table = unit_last(block_table)
    keep.append(table)
    common = dict(
        num_pages=pages.shape[0],
        page_size=int(page_size),
        table=table.data_ptr(),
        table_int64=int(table.dtype == torch.int64),
        table_stride=table.stride(0) if table.shape[1] else 0,
        table_width=table.shape[1],
        table_rows=table.shape[0],
    )
    if fp8:
        stride = fp8_page_bytes(pages, int(page_size), name, padded=True)
        return binding.KVSource(format=binding.FP8_DS_MLA, dtype=0, data=pages.data_ptr(), page_stride=stride, **common)
    if pages.dim() != 3 or pages.shape[1] != page_size:
        raise ValueError(f"{name}: expected pages (num_pages, {page_size}, D), got {tuple(pages.shape)}")
    if pages.shape[-1] > 1 and pages.stride(-1) != 1:
        pages = pages.contiguous()
        keep.append(pages)
    return binding.KVSource(
        format=binding.ROWS,
        dtype=_src_dtype(pages, q_dtype, name),
        data=pages.data_ptr(),
        row_stride=pages.stride(1),
        page_stride=pages.stride(0),
        **common,
    )


def fp8_page_bytes(pages: torch.Tensor, page_size: int, name: str, *, padded: bool = False) -> int:
    """The bytes between fp8_ds_mla pages, after the one page-layout check
    (`planner.kvcache.check_page_layout`: 2-D pages, or vLLM's nominal 3-D view): page_bytes(S),
    or with `padded` a 3-D view's own page stride (vLLM's CPU engine pads every page to one size),
    the storage checked to hold the last page's page_bytes(S)."""
    if pages.element_size() != 1:
        raise ValueError(f"{name}: expected fp8_ds_mla pages (uint8 bytes), got {pages.dtype}")
    n = check_page_layout(pages.shape, pages.stride(), page_size, name, padded=padded)
    want = page_bytes(page_size)
    stride = pages.stride(0) if pages.dim() == 3 and n > 1 else want
    if n and pages.untyped_storage().nbytes() < pages.storage_offset() + (n - 1) * stride + want:
        raise ValueError(f"{name}: the storage holds fewer than {n} pages of {want} bytes {stride} bytes apart")
    return stride


def _kv_source(src, name: str, q: torch.Tensor, keep: list) -> binding.KVSource:
    """A `dsv4_kv_source` for a `dsv4_torch.prefill.PagedKV` (pages + block table) or
    `LogicalKV` (rows + offsets)."""
    if hasattr(src, "block_table") and getattr(src, "mxfp8", False):  # DeepSeek-V4.1's 528-byte records
        return mxfp8_source(src, name, keep)
    if hasattr(src, "block_table"):
        fp8 = src.kv_cache_dtype == "fp8_ds_mla"
        return paged_source(src.pages, src.block_table, src.page_size, fp8, q.dtype, name, keep)
    if hasattr(src, "offsets"):
        rows, offsets = unit_last(src.rows), src.offsets.contiguous()
        check_cpu(rows, name)
        if rows.dim() != 2 or offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"{name}: expected rows (S, D) and int offsets (B,), got {tuple(rows.shape)} {offsets.dtype}"
            )
        keep += [rows, offsets]
        return binding.KVSource(
            format=binding.ROWS,
            dtype=_src_dtype(rows, q.dtype, name),
            data=rows.data_ptr(),
            row_stride=rows.stride(0),
            num_rows=rows.shape[0],
            table=offsets.data_ptr(),
            table_int64=int(offsets.dtype == torch.int64),
            table_stride=1,
            table_width=1,
            table_rows=offsets.shape[0],
        )
    raise TypeError(f"{name}: expected a PagedKV or a LogicalKV, got {type(src).__name__}")


def mxfp8_source(src, name: str, keep: list) -> binding.KVSource:
    """A `dsv4_kv_source` (format 3 / 4) for a PagedKV of mxfp8 pages (its layout, page stride)."""
    from dsv4_torch import kvcache_v41

    pages = src.pages
    geo = kvcache_v41.page_geometry(pages, src.page_size, 528 if pages.dim() == 2 else None, name=name)
    check_cpu(pages, name)
    check_cpu(src.block_table, f"{name}.block_table")
    table = unit_last(src.block_table)
    keep.append(table)
    interleaved = kvcache_v41.ref.check_layout(src.layout, geo.record) == "interleaved"
    return binding.KVSource(
        format=binding.MXFP8_INTERLEAVED if interleaved else binding.MXFP8_SPLIT,
        dtype=0,
        data=pages.data_ptr(),
        page_stride=geo.page_stride,
        num_pages=geo.num_blocks,
        page_size=geo.S,
        table=table.data_ptr(),
        table_int64=int(table.dtype == torch.int64),
        table_stride=table.stride(0) if table.shape[1] else 0,
        table_width=table.shape[1],
        table_rows=table.shape[0],
    )


def _src_dtype(rows: torch.Tensor, q_dtype, name: str) -> int:
    if rows.dtype != q_dtype:
        raise TypeError(f"{name}: dtype {rows.dtype} differs from q's {q_dtype}")
    return DTYPES[q_dtype]


def prefill_attention(
    q: torch.Tensor,
    tokens: np.ndarray,
    raw_kv,
    compressed_kv=None,
    topk_indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    *,
    kind: str,
    window: int,
    compress_ratio: int,
    sm_scale: float,
    out: torch.Tensor | None = None,
    threads: int | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """One prefill layer (all the step's tokens) in one kernel call, straight from the caches.

    q (T, H, D) bf16/float32 CPU tensor; tokens (3, n) int32 host array: per token its q row,
    batch request (block-table row / offsets entry) and absolute position (`dsv4_torch.kernels.cpu.prefill`
    builds them once per step), with an optional fourth row: each token's lowest window position
    (its window is max(0, p - W + 1, that) .. p; DeepSeek-V4.1's replay_start and replay band); raw_kv / compressed_kv a `PagedKV` (rows in q's dtype, or
    fp8_ds_mla pages: 2-D or vLLM's 3-D view, page stride = pages.stride(0) bytes), a `LogicalKV`,
    or a ready `dsv4_cpu.binding.KVSource` (compressed_kv None for SWA); topk_indices (rows,
    index_topk) int32/int64 for CSA (read at each token's q row); kind "SWA" / "CSA" / "HCA",
    window, compress_ratio: the layer's. Every token's row, request and position are checked by
    the kernel before it reads anything (ValueError naming the token). Returns out (T, H, d_v)
    q.dtype (written into `out` when given; rows no token names are left as they were).
    """
    code = dtype_code(q)
    T, H, D = q.shape
    d_v = value_dim(D)
    kind_code = binding.kind_code(kind)
    if out is None:
        out = torch.empty((T, H, d_v), dtype=q.dtype)
    elif tuple(out.shape) != (T, H, d_v) or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out: expected ({T}, {H}, {d_v}) {q.dtype} on cpu, got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    tok = tokens
    if not isinstance(tok, np.ndarray) or tok.dtype != np.int32 or tok.ndim != 2 or tok.shape[0] not in (3, 4):
        raise ValueError(
            f"tokens: expected a (3, n) or (4, n) int32 array, got {getattr(tok, 'shape', type(tok).__name__)} {getattr(tok, 'dtype', '')}"
        )
    tok = np.ascontiguousarray(tok)
    n = tok.shape[1]
    if n == 0 or H == 0:
        return out
    lib = library()
    keep: list = []
    q = unit_last(q.detach())
    raw = raw_kv if isinstance(raw_kv, binding.KVSource) else _kv_source(raw_kv, "raw_kv", q, keep)
    comp = None
    if kind != "SWA":
        if compressed_kv is None:
            raise ValueError(f"compressed_kv: required for {kind} layers")
        if isinstance(compressed_kv, binding.KVSource):
            comp = compressed_kv
        else:
            comp = _kv_source(compressed_kv, "compressed_kv", q, keep)
    topk_ptr, topk_int64, topk_stride, topk_width, topk_rows = None, 0, 0, 0, 0
    if kind == "CSA":
        if not isinstance(topk_indices, torch.Tensor) or topk_indices.dim() != 2:
            raise ValueError("topk_indices: expected a (rows, index_topk) tensor for a CSA layer")
        check_cpu(topk_indices, "topk_indices")
        if topk_indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"topk_indices: expected int32 or int64, got {topk_indices.dtype}")
        topk = unit_last(topk_indices)
        keep.append(topk)
        topk_rows, topk_width = topk.shape
        topk_ptr, topk_int64, topk_stride = topk.data_ptr(), int(topk.dtype == torch.int64), topk.stride(0)
    if attn_sink is not None and tuple(attn_sink.shape) != (H,):
        raise ValueError(f"attn_sink: expected ({H},), got {tuple(attn_sink.shape)}")
    ratio = int(compress_ratio) if kind != "SWA" else 1
    base, row = tok.__array_interface__["data"][0], tok.strides[0]  # (cheaper than ndarray.ctypes)
    tokens_c = binding.PrefillTokens(
        kind_code,
        int(window),
        ratio,
        n,
        base,
        base + row,
        base + 2 * row,
        topk_ptr,
        topk_int64,
        topk_stride,
        topk_width,
        topk_rows,
        base + 3 * row if tok.shape[0] == 4 else None,
    )
    dst = out if out.stride(-1) == 1 or d_v == 1 else torch.empty((T, H, d_v), dtype=q.dtype)
    sink = float_sink(attn_sink)
    outputs = make_outputs(dst, None, None)
    par = parallel(threads)
    rc = lib.dsv4_prefill_attention(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        code,
        T,
        H,
        D,
        ctypes.byref(tokens_c),
        ctypes.byref(raw),
        None if comp is None else ctypes.byref(comp),
        float(sm_scale),
        ptr(sink),
        ctypes.byref(outputs),
        ctypes.byref(par),
        binding.isa_code(isa),
    )
    binding.check(rc)
    if dst is not out:
        out.copy_(dst)
    return out
