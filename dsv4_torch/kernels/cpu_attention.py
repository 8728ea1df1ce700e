"""The sparse-attention backend "cpu": `planner.ckernel`'s C/C++ kernel on CPU tensors, through ctypes.

Two calls, one per C entry point (`planner/csrc/dsv4_cpu.h`):

- `sparse_attention_cpu`: FlashMLA's `flash_mla_sparse_fwd` contract on a flat workspace
  (`lib.dsv4_sparse_attention`), what `dsv4_torch.sparse_attention(..., backend="cpu")` runs.
- `prefill_attention`: one prefill layer straight from the caches, no workspace and no chunk
  loop (`lib.dsv4_prefill_attention`): rows in q's dtype (paged or logical) or vLLM's
  `fp8_ds_mla` pages, dequantized inside the kernel. `dsv4_torch.prefill.prefill_attention`
  runs it (through `dsv4_torch.prefill_cpu`) when its backend resolves to "cpu".

Numerics (the kernel's): bf16 in -> bf16 products, fp32 accumulation, probabilities rounded to
bf16 before the PV product (FlashMLA's); float32 in -> float32 throughout. A token's result
depends only on its own keys and their order: not on threads, tiles, chunk plans or the cache
layout. Threads: `torch.get_num_threads()`. Instruction set: the best this machine runs
(`planner.ckernel.isa_supported()`), capped by the environment variable
`DSV4_PREFILL_CPU_ISA=generic|avx2|avx512|avx512bf16` (read by the C code on every call).
ctypes releases the GIL for the call. No backward and no dropout: `dsv4_torch.attention`
refuses such calls for this backend.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from planner import ckernel
from planner.contract import LayerKind, backend_unavailable, value_dim

DTYPES = {torch.bfloat16: ckernel.BF16, torch.float32: ckernel.F32}


def unavailable_reason() -> str | None:
    """None when the kernel builds (or is built) on this machine, else why it cannot run."""
    return ckernel.attention_unavailable_reason()


def _library():
    try:
        return ckernel.library()
    except RuntimeError as e:
        raise backend_unavailable("cpu", str(e)) from None


def _dtype_code(q: torch.Tensor) -> int:
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    if q.device.type != "cpu":
        raise ValueError(f"q: the cpu backend takes CPU tensors, q is on {q.device}")
    if q.dtype not in DTYPES:
        raise TypeError(f"q: the cpu backend takes bfloat16 or float32, got {q.dtype}")
    return DTYPES[q.dtype]


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim is contiguous (any other strides are passed on), else a copy."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _sink(attn_sink: torch.Tensor | None) -> torch.Tensor | None:
    if attn_sink is None:
        return None
    return attn_sink.detach().to(torch.float32).contiguous()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _outputs(out: torch.Tensor, max_logits: torch.Tensor | None, lse: torch.Tensor | None) -> ckernel.Outputs:
    stat = max_logits if max_logits is not None else lse
    return ckernel.Outputs(
        out.data_ptr(), out.stride(0), out.stride(1), _ptr(max_logits), _ptr(lse), 0 if stat is None else stat.stride(0)
    )


def _isa(isa: str | None) -> int:
    return ckernel.isa_code(isa)


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
    code = _dtype_code(q)
    T, H, D = q.shape
    d_v = value_dim(D)
    out = torch.empty((T, H, d_v), dtype=q.dtype)
    max_logits = torch.empty((T, H), dtype=torch.float32)
    lse = torch.empty((T, H), dtype=torch.float32)
    if T == 0 or H == 0:
        return out, max_logits, lse
    for name, t in (("kv", kv), ("indices", indices), ("attn_sink", attn_sink), ("topk_length", topk_length)):
        if t is not None and t.device.type != "cpu":
            raise ValueError(f"{name}: the cpu backend takes CPU tensors, {name} is on {t.device}")
    if kv.dtype != q.dtype:
        raise TypeError(f"kv: dtype {kv.dtype} does not match q's dtype {q.dtype}")
    lib = _library()
    q = _unit_last(q.detach())
    kv = _unit_last(kv.detach())
    indices = _unit_last(indices)
    if indices.dtype != torch.int32:
        raise TypeError(f"indices: expected int32, got {indices.dtype}")
    if topk_length is not None:
        if topk_length.dtype != torch.int32:
            raise TypeError(f"topk_length: expected int32, got {topk_length.dtype}")
        topk_length = topk_length.contiguous()
    sink = _sink(attn_sink)
    S, K = kv.shape[0], indices.shape[1]
    outputs = _outputs(out, max_logits, lse)
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
        _ptr(topk_length),
        float(sm_scale),
        _ptr(sink),
        ctypes.byref(outputs),
        int(threads or torch.get_num_threads()),
        _isa(isa),
    )
    ckernel.check(rc)
    return out, max_logits, lse


# ----------------------------------------------------------------------------- prefill


def _kv_source(src, name: str, q: torch.Tensor, keep: list) -> ckernel.KVSource:
    """A `dsv4_kv_source` for a `dsv4_torch.prefill.PagedKV` (pages + block table) or
    `LogicalKV` (rows + offsets)."""
    if hasattr(src, "block_table"):
        table = _unit_last(src.block_table)
        keep.append(table)
        pages = src.pages
        if pages.device.type != "cpu":
            raise ValueError(f"{name}: the cpu backend reads CPU tensors, pages are on {pages.device}")
        common = dict(
            data=pages.data_ptr(),
            num_pages=pages.shape[0],
            page_size=src.page_size,
            table=table.data_ptr(),
            table_int64=int(table.dtype == torch.int64),
            table_stride=table.stride(0) if table.shape[1] else 0,
            table_width=table.shape[1],
            table_rows=table.shape[0],
        )
        if src.kv_cache_dtype == "fp8_ds_mla":
            return ckernel.KVSource(format=1, dtype=0, page_stride=pages.stride(0) * pages.element_size(), **common)
        if pages.shape[-1] > 1 and pages.stride(-1) != 1:
            pages = pages.contiguous()
            keep.append(pages)
            common["data"] = pages.data_ptr()
        return ckernel.KVSource(
            format=0,
            dtype=_src_dtype(pages, q, name),
            row_stride=pages.stride(1),
            page_stride=pages.stride(0),
            **common,
        )
    if hasattr(src, "offsets"):
        rows, offsets = _unit_last(src.rows), src.offsets.contiguous()
        keep += [rows, offsets]
        if rows.device.type != "cpu":
            raise ValueError(f"{name}: the cpu backend reads CPU tensors, rows are on {rows.device}")
        return ckernel.KVSource(
            format=0,
            dtype=_src_dtype(rows, q, name),
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


def _src_dtype(rows: torch.Tensor, q: torch.Tensor, name: str) -> int:
    if rows.dtype != q.dtype:
        raise TypeError(f"{name}: dtype {rows.dtype} differs from q's {q.dtype}")
    return DTYPES[q.dtype]


def prefill_attention(
    q: torch.Tensor,
    tokens: np.ndarray,
    raw_kv,
    compressed_kv=None,
    topk_indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    *,
    kind: LayerKind,
    window: int,
    compress_ratio: int,
    sm_scale: float,
    out: torch.Tensor | None = None,
    threads: int | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """One prefill layer (all the step's tokens) in one kernel call, straight from the caches.

    q (T, H, D) bf16/float32 CPU tensor; tokens (3, T) int32 host array: per token its q row,
    batch request (block-table row / offsets entry) and absolute position (`dsv4_torch.prefill_cpu`
    builds them once per step); raw_kv / compressed_kv a `PagedKV` (rows in q's dtype, or
    fp8_ds_mla pages: 2-D or vLLM's 3-D view, page stride = pages.stride(0) bytes) or a
    `LogicalKV` (compressed_kv None for SWA); topk_indices (T, index_topk) int32/int64 for CSA;
    kind, window, compress_ratio: the layer's. A key the caches do not hold reads as NaN (never
    out of bounds). Returns out (T, H, d_v) q.dtype (written into `out` when given).
    """
    code = _dtype_code(q)
    T, H, D = q.shape
    d_v = value_dim(D)
    if out is None:
        out = torch.empty((T, H, d_v), dtype=q.dtype)
    elif tuple(out.shape) != (T, H, d_v) or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out: expected ({T}, {H}, {d_v}) {q.dtype} on cpu, got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if T == 0 or H == 0:
        return out
    lib = _library()
    keep: list = []
    q = _unit_last(q.detach())
    raw = _kv_source(raw_kv, "raw_kv", q, keep)
    comp = None
    if kind.has_compressed:
        if compressed_kv is None:
            raise ValueError(f"compressed_kv: required for {kind.name} layers")
        comp = _kv_source(compressed_kv, "compressed_kv", q, keep)
    tok = tokens
    if not isinstance(tok, np.ndarray) or tok.dtype != np.int32 or tok.shape != (3, T) or not tok.flags.c_contiguous:
        raise ValueError(
            f"tokens: expected a C-contiguous (3, {T}) int32 array, got "
            f"{getattr(tok, 'shape', type(tok).__name__)} {getattr(tok, 'dtype', '')}"
        )
    topk_ptr, topk_int64, topk_stride, topk_width = None, 0, 0, 0
    if kind is LayerKind.CSA:
        if not isinstance(topk_indices, torch.Tensor) or topk_indices.dim() != 2 or topk_indices.shape[0] != T:
            raise ValueError(f"topk_indices: expected ({T}, index_topk) for a CSA layer")
        if topk_indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"topk_indices: expected int32 or int64, got {topk_indices.dtype}")
        topk = _unit_last(topk_indices)
        keep.append(topk)
        topk_width = topk.shape[1]
        topk_ptr, topk_int64, topk_stride = (
            topk.data_ptr(),
            int(topk.dtype == torch.int64),
            topk.stride(0) if topk_width else 0,
        )
    tokens = ckernel.PrefillTokens(
        kind=ckernel.KIND_CODES[kind.name],
        window=int(window),
        compress_ratio=int(compress_ratio) if kind.has_compressed else 1,
        num_tokens=T,
        token_row=tok[0].ctypes.data,
        token_request=tok[1].ctypes.data,
        token_position=tok[2].ctypes.data,
        topk=topk_ptr,
        topk_int64=topk_int64,
        topk_stride=topk_stride,
        topk_width=topk_width,
    )
    dst = out if out.stride(-1) == 1 or d_v == 1 else torch.empty((T, H, d_v), dtype=q.dtype)
    sink = _sink(attn_sink)
    outputs = _outputs(dst, None, None)
    rc = lib.dsv4_prefill_attention(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        code,
        H,
        D,
        ctypes.byref(tokens),
        ctypes.byref(raw),
        None if comp is None else ctypes.byref(comp),
        float(sm_scale),
        _ptr(sink),
        ctypes.byref(outputs),
        int(threads or torch.get_num_threads()),
        _isa(isa),
    )
    ckernel.check(rc)
    if dst is not out:
        out.copy_(dst)
    return out
