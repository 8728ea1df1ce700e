"""The caches a torch prefill layer reads: `PagedKV` (serving engines' pages: rows in q's dtype or
vLLM's fp8_ds_mla bytes) and `LogicalKV` (per-request rows packed in one tensor).

Part of `dsv4_torch.prefill` (which re-exports them), in its own module so the kernels that read
these caches (`dsv4_torch.kernels.cpu`) need not import the prefill. `Rows` is a cache checked
against a step's metadata (shapes on the host, values where they are free to read), ready to
gather. The twin of `dsv4_jax.prefill_kv`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dsv4_torch import backends, kvcache, kvcache_v41
from dsv4_torch.prefill_metadata import KindMetadata
from planner.checks import shape_of
from planner.kvcache import KV_CACHE_DTYPES


@dataclass(frozen=True)
class PagedKV:
    """A paged cache as serving engines keep it.

    pages: the pages, in one of two formats (`kv_cache_dtype`):
      "auto" (default): rows in q's dtype, (num_pages, page_size, D): raw tokens (page_size =
        block_size) or compressed entries (page_size = block_size // compress_ratio).
      "fp8_ds_mla": vLLM's DeepSeek-V4 cache bytes (`planner.kvcache`: 448 e4m3 dims with UE8M0
        scales per 64, 64 bf16 RoPE dims; D = 512), uint8 (num_pages, page_bytes(S)) with
        `block_size=S` slots per page, or vLLM's view (num_pages, S, 584) with page stride
        page_bytes(S) (S from the shape). A layer call dequantizes the rows it gathers into the
        bf16 (or float32) workspace, on the device: exactly `dequantize_and_gather_k_cache`'s values.
    block_table: (B, max_pages_per_request) int32/int64: row i lists request i's pages, so entry e
      of request i lives on page block_table[i, e // page_size], slot e % page_size.
    block_size: slots per page; required for 2-D fp8_ds_mla pages, else taken from the shape (a
      given value must agree).
    layout: DeepSeek-V4.1's 528-byte mxfp8 records only (kv_cache_dtype "fp8_ds_mla" with pages
      (num_pages, S, 528), vLLM's view on SM100, `planner.kvcache_v41`): "interleaved" (vLLM 0.33's,
      the default) or "split"; the page stride is pages.stride(0). 2-D pages (num_pages, page_stride)
      with block_size=S are V4.1's when the layout is named. A layer call dequantizes their rows as
      it does fp8_ds_mla's (exactly `kvcache_v41.dequantize_and_gather_k_cache`'s values).
    """

    pages: torch.Tensor
    block_table: torch.Tensor
    kv_cache_dtype: str = "auto"
    block_size: int | None = None
    layout: str | None = None

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.block_size is not None and (
            isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1
        ):
            raise ValueError(f"block_size: expected a positive int or None, got {self.block_size!r}")
        if not isinstance(self.pages, torch.Tensor):
            raise TypeError(f"pages: expected a torch.Tensor, got {type(self.pages).__name__}")
        if self.layout is not None and not self.mxfp8:
            raise ValueError(
                f"layout: only DeepSeek-V4.1's mxfp8 pages (kv_cache_dtype='fp8_ds_mla', shape (num_pages, S, 528)) "
                f"have a layout, got {self.layout!r}"
            )
        if self.mxfp8:
            if self.pages.dim() == 2 and self.block_size is None:
                raise ValueError("block_size: required for 2-D mxfp8 pages (num_pages, page_stride)")
            geo = kvcache_v41.page_geometry(
                self.pages, self.block_size, 528 if self.pages.dim() == 2 else None, "pages"
            )
            kvcache_v41.ref.check_layout(self.layout, geo.record)
            if geo.record.name != "mxfp8":
                raise ValueError(
                    f"pages: a layer call reads fp8_ds_mla (584 B) or mxfp8 (528 B) records, got {geo.record.name} "
                    f"({geo.record.bytes} B): dequantize them with dsv4_torch.kvcache_v41.dequantize_and_gather_k_cache"
                )
        elif self.kv_cache_dtype == "fp8_ds_mla":
            if self.pages.dtype != torch.uint8:
                raise TypeError(f"pages: fp8_ds_mla pages are uint8 bytes, got {self.pages.dtype}")
            if self.pages.dim() == 3:
                if self.block_size is not None and self.block_size != self.pages.shape[1]:
                    raise ValueError(
                        f"block_size: {self.block_size} differs from the pages' {self.pages.shape[1]} slots"
                    )
                S = self.pages.shape[1]
            elif self.pages.dim() == 2:
                if self.block_size is None:
                    raise ValueError("block_size: required for 2-D fp8_ds_mla pages (num_pages, page_bytes(S))")
                S = self.block_size
            else:
                raise ValueError(
                    f"pages: expected fp8_ds_mla pages (num_pages, page_bytes(S)) or (num_pages, S, 584), "
                    f"got {shape_of(self.pages)}"
                )
            kvcache.check_pages(self.pages, S, "pages")  # the page stride: round_up(S * 584, 576)
        else:
            if self.pages.dim() != 3:
                raise ValueError(f"pages: expected a (num_pages, page_size, D) tensor, got {shape_of(self.pages)}")
            if self.pages.dtype == torch.uint8:
                raise TypeError("pages: uint8 pages hold fp8_ds_mla bytes: pass kv_cache_dtype='fp8_ds_mla'")
            if self.block_size is not None and self.block_size != self.pages.shape[1]:
                raise ValueError(f"block_size: {self.block_size} differs from the pages' {self.pages.shape[1]} rows")
        if not isinstance(self.block_table, torch.Tensor) or self.block_table.dim() != 2:
            raise ValueError(f"block_table: expected a (B, max_pages) tensor, got {shape_of(self.block_table)}")
        if self.block_table.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"block_table: expected int32 or int64, got {self.block_table.dtype}")
        if self.block_table.device != self.pages.device:
            raise ValueError(f"block_table: on {self.block_table.device}, pages on {self.pages.device}")

    @property
    def mxfp8(self) -> bool:
        """Whether the pages hold DeepSeek-V4.1's records (fp8_ds_mla pages of the V4.1 widths, or 2-D
        pages with a layout named)."""
        if not (
            self.kv_cache_dtype == "fp8_ds_mla"
            and isinstance(self.pages, torch.Tensor)
            and self.pages.dtype == torch.uint8
        ):
            return False
        if self.pages.dim() == 2:  # (num_pages, page_stride): V4.1's when a layout is named
            return self.layout is not None
        return self.pages.dim() == 3 and self.pages.shape[-1] in kvcache_v41.ref.BY_BYTES

    @property
    def page_size(self) -> int:
        """Entries (slots) per page."""
        if self.kv_cache_dtype == "fp8_ds_mla" and self.pages.dim() == 2:
            return int(self.block_size)
        return int(self.pages.shape[1])

    @property
    def num_pages(self) -> int:
        return int(self.pages.shape[0])


@dataclass(frozen=True)
class LogicalKV:
    """Per-request caches packed in one tensor (the twin of `dsv4_jax.prefill.LogicalKV`).

    rows: (S, D): entry e of request i is row offsets[i] + e.
    offsets: (B,) int32/int64, on rows' device. An offset may be negative when a request keeps
      only its recent entries (e.g. a window): only the entries a plan reads must be in range.
    """

    rows: torch.Tensor
    offsets: torch.Tensor

    def __post_init__(self):
        if not isinstance(self.rows, torch.Tensor) or self.rows.dim() != 2:
            raise ValueError(f"rows: expected a (S, D) tensor, got {shape_of(self.rows)}")
        if not isinstance(self.offsets, torch.Tensor) or self.offsets.dim() != 1:
            raise ValueError(f"offsets: expected a (B,) tensor, got {shape_of(self.offsets)}")
        if self.offsets.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"offsets: expected int32 or int64, got {self.offsets.dtype}")
        if self.offsets.device != self.rows.device:
            raise ValueError(f"offsets: on {self.offsets.device}, rows on {self.rows.device}")

    @classmethod
    def from_list(cls, tensors: Sequence[torch.Tensor]) -> LogicalKV:
        """Pack per-request (len_i, D) tensors (one copy)."""
        if not isinstance(tensors, (list, tuple)) or not tensors:
            raise TypeError(
                f"tensors: expected a non-empty sequence of (len_i, D) tensors, got {type(tensors).__name__}"
            )
        lens = [t.shape[0] for t in tensors]
        offsets = torch.tensor(np.concatenate([[0], np.cumsum(lens)[:-1]]), dtype=torch.int64, device=tensors[0].device)
        return cls(torch.cat(list(tensors)), offsets)


# A PagedKV, a LogicalKV, or per-request (len_i, D) tensors (packed on every call: for tests).
KVSource = PagedKV | LogicalKV | Sequence[torch.Tensor]


# ----------------------------------------------------------------------------- checked sources


class Rows:
    """A KV source ready to gather: flat rows (or fp8 pages) and how (request, entry) finds them.

    Checks on the host, from shapes and the metadata's host numbers only (no device read), that the
    source holds every entry the plan reads; values (page ids, offsets) are checked only on CPU.
    """

    def __init__(self, src: KVSource, name: str, q: torch.Tensor, meta: KindMetadata, region: str):
        needed, first, i_most = meta.region_needs(region)
        B, D = meta.num_requests, q.shape[-1]
        self.region = region
        self.fp8 = isinstance(src, PagedKV) and src.kv_cache_dtype == "fp8_ds_mla"
        self.mxfp8 = isinstance(src, PagedKV) and src.mxfp8
        self.source = src  # a PagedKV or LogicalKV (per-request lists: packed below)
        if isinstance(src, PagedKV):
            self.page_size = src.page_size
            self.index = src.block_table
            self.num_pages = src.num_pages
            if self.fp8:
                self.pages = src.pages
                self.rows = None
                if D != kvcache.HEAD_DIM:
                    raise ValueError(f"{name}: fp8_ds_mla pages hold {kvcache.HEAD_DIM}-dim rows, but q's D is {D}")
                if q.dtype not in (torch.bfloat16, torch.float32):
                    raise TypeError(
                        f"{name}: fp8_ds_mla pages dequantize to bf16 values: q must be bfloat16 or "
                        f"float32, got {q.dtype}"
                    )
                if src.pages.device != q.device:
                    raise ValueError(f"{name}: on {src.pages.device}, q on {q.device}")
                if src.mxfp8:  # V4.1 records: decoded through a flat byte view (kernels/reference/kvcache_v41.py)
                    self.geo = kvcache_v41.page_geometry(
                        src.pages, src.page_size, 528 if src.pages.dim() == 2 else None
                    )
                    self.layout = kvcache_v41.ref.check_layout(src.layout, self.geo.record)
                else:
                    self.pb = kvcache.page_bytes(self.page_size)
                    self.data_rows, self.scale_words = kvcache.row_views(src.pages, self.pb)
            else:
                self.pages = src.pages
                self.rows = src.pages.reshape(-1, src.pages.shape[-1])
        else:
            if not isinstance(src, LogicalKV):
                if (
                    not isinstance(src, (list, tuple))
                    or not src
                    or not all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in src)
                ):
                    raise TypeError(f"{name}: expected a PagedKV, a LogicalKV or a sequence of (len_i, D) tensors")
                if len(src) < B:
                    raise ValueError(f"{name}: {len(src)} per-request tensors, but the step's batch has {B} requests")
                for i, t in enumerate(src[:B]):
                    if t.shape[0] < needed[i]:
                        raise ValueError(f"{name}[{i}]: {t.shape[0]} rows, but request {i} needs {int(needed[i])}")
                    if t.shape[1] != D:
                        raise ValueError(f"{name}[{i}]: last dim {t.shape[1]}, q's D is {D}")
                src = LogicalKV.from_list(src)
                self.source = src
            self.rows, self.page_size, self.index = src.rows, None, src.offsets
            self.pages = None
        if self.rows is not None:
            if self.rows.dtype != q.dtype:
                hint = (
                    " (fp8_ds_mla bytes come as PagedKV(..., kv_cache_dtype='fp8_ds_mla'))"
                    if self.rows.dtype == torch.uint8
                    else ""
                )
                raise TypeError(f"{name}: dtype {self.rows.dtype} differs from q's {q.dtype}{hint}")
            if self.rows.device != q.device:
                raise ValueError(f"{name}: on {self.rows.device}, q on {q.device}")
            if self.rows.shape[-1] != D:
                raise ValueError(f"{name}: last dim {self.rows.shape[-1]}, q's D is {D}")
            if self.page_size is not None:
                self.num_pages = self.rows.shape[0] // self.page_size
        field_name = "block_table" if self.page_size is not None else "offsets"
        if self.index.shape[0] < B:
            raise ValueError(f"{name}.{field_name}: {self.index.shape[0]} rows, but the step's batch has {B} requests")
        if self.page_size is not None:
            held = self.index.shape[1] * self.page_size
            i = i_most
            if needed.size and needed[i] > held:
                raise ValueError(
                    f"{name}.block_table: {self.index.shape[1]} pages of {self.page_size} entries hold {held}, "
                    f"but request {i} needs {int(needed[i])}"
                )
        if self.index.device.type == "cpu":  # values are free to check on the host
            # once per step and kind for each cache (every layer of a kind passes the same block
            # table): an in-place change to it bumps its version and is checked again
            # (an inference tensor has no version counter and may change in place under
            # inference_mode unseen: it is checked on every call)
            held_rows = self.num_pages if self.page_size is not None else self.rows.shape[0]
            if self.index.is_inference():
                check_source_values(self, name, needed, first)
            else:
                key = (region, id(self.index), self.index._version, held_rows)
                if key not in meta.checked_sources:
                    check_source_values(self, name, needed, first)
                    meta.checked_sources[key] = self.index
        # CUDA/ROCm: one Triton kernel per region walks the block table / offsets (no row maps);
        # fp8 pages on CPU: the C kernel (dsv4_torch.kernels.cpu.kvcache) where it builds
        # (resolved once here, per layer call: the gather callable, or None for index ops)
        if self.mxfp8:
            name = kvcache_v41.resolve_backend("auto", src.pages, "gather_mxfp8")
            op, geo, layout = backends.CACHE[name].op("gather_mxfp8"), self.geo, self.layout
            self.gather = (
                None if name == "reference" else lambda o, p, s, g, b, S, off: op(o, p, s, g, b, geo, layout, off)
            )
        elif self.fp8:
            name = kvcache.resolve_backend("auto", src.pages)
            self.gather = None if name == "reference" else backends.CACHE[name].op("gather")
        elif use_gather_kernel(self.pages if self.pages is not None else self.rows):
            self.gather = backends.CACHE["triton"].op("gather_rows")
        else:
            self.gather = None


def check_source_values(src: Rows, name: str, needed: np.ndarray, first: np.ndarray) -> None:
    """CPU sources only: every page id / offset the plan reads is in range (host reads are free)."""
    planned = np.flatnonzero(needed > first)
    if not planned.size:
        return
    index = src.index.numpy().astype(np.int64)[planned]
    if src.page_size is None:
        lo, hi = index + first[planned], index + needed[planned]
        bad = (lo < 0) | (hi > src.rows.shape[0])
        if bad.any():
            k = int(np.argmax(bad))
            raise ValueError(
                f"{name}.offsets: request {int(planned[k])} at offset {int(index[k])} reads rows "
                f"{int(lo[k])} .. {int(hi[k]) - 1}, outside 0 .. {src.rows.shape[0] - 1}"
            )
        return
    num_pages = src.num_pages
    col = np.arange(index.shape[1])[None, :]
    read = (col >= (first[planned] // src.page_size)[:, None]) & (col < -(-needed[planned] // src.page_size)[:, None])
    bad = read & ((index < 0) | (index >= num_pages))
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise ValueError(
            f"{name}.block_table: request {int(planned[r])} page {int(c)} is {int(index[r, c])}, "
            f"outside 0 .. {num_pages - 1}"
        )


def use_gather_kernel(t: torch.Tensor) -> bool:
    """Whether rows in q's dtype are gathered by the Triton kernel: CUDA/ROCm tensors with a
    contiguous last dim, where the Triton cache kernels run (else: device index ops)."""
    return t.device.type == "cuda" and t.stride(-1) == 1 and backends.CACHE["triton"].unavailable(t.device) is None
