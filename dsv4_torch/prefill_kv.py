"""The caches a torch prefill layer reads: `PagedKV` (serving engines' pages: rows in q's dtype or
vLLM's fp8_ds_mla bytes) and `LogicalKV` (per-request rows packed in one tensor).

Part of `dsv4_torch.prefill` (which re-exports them), in its own module so the kernels that read
these caches (`dsv4_torch.kernels.cpu`) need not import the prefill. The twin of
`dsv4_jax.prefill_kv`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dsv4_torch import kvcache
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
    """

    pages: torch.Tensor
    block_table: torch.Tensor
    kv_cache_dtype: str = "auto"
    block_size: int | None = None

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.block_size is not None and (
            isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1
        ):
            raise ValueError(f"block_size: expected a positive int or None, got {self.block_size!r}")
        if not isinstance(self.pages, torch.Tensor):
            raise TypeError(f"pages: expected a torch.Tensor, got {type(self.pages).__name__}")
        if self.kv_cache_dtype == "fp8_ds_mla":
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
