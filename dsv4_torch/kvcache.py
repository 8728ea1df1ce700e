"""vLLM's DeepSeek-V4 KV cache pages (`fp8_ds_mla`) on torch tensors: write and gather-dequantize.

Same functions, same argument order as vLLM 0.33.0's (and `planner.kvcache`, the NumPy
reference, whose bytes and values these match exactly):

    quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size)
    dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset)

Backends (keyword `backend=`):
  "triton"     Triton kernels (`dsv4_torch/kernels/triton/kvcache.py`): CUDA/ROCm tensors, or CPU
               tensors under TRITON_INTERPRET=1 (slow; for tests).
  "cpu"        the gather only: a C kernel for CPU tensors (`dsv4_torch/kernels/cpu/kvcache.py`,
               compiled once per machine with the system C compiler), one pass over the rows.
  "reference"  vectorized torch, any device (`dsv4_torch/kernels/reference/kvcache.py`; on a GPU its
               gather syncs once for the row count).
  "auto"       triton for CUDA tensors; on CPU tensors the gather runs "cpu" where a C compiler
               built it (else "reference": the same bits) and the writer "reference".
               `resolve_backend` says which runs.

Checks (keyword `validate=True`): every shape, dtype, device and stride, then every value that
could make a kernel read or write outside the pages (slots, block-table entries, lengths,
finiteness of k). Value checks read the small per-request arrays on the host: on a GPU that is
one device sync per call; serving loops that built the arrays themselves pass validate=False
(shapes, dtypes and devices are still checked; no sync).

Page tensors: uint8 [num_blocks, page_bytes(S)], or vLLM's nominal view uint8
[num_blocks, S, 584] whose page stride (stride(0)) is page_bytes(S).

DeepSeek-V4.1's records (mxfp8 528 B, nvfp4 288 B, index keys; both page layouts): `dsv4_torch.kvcache_v41`.
"""

from __future__ import annotations

import numbers

import torch

from dsv4_torch import backends
from dsv4_torch.kernels.reference.kvcache import (  # noqa: F401  (part of this module's API)
    decode_slots,
    encode_slots,
    exponents,
    row_views,
    scale_index,
)
from planner import kvcache as ref
from planner.kvcache import (
    HEAD_DIM,
    SLOT_DATA_BYTES,
    page_bytes,
)

BACKENDS = backends.CACHE_BACKENDS
OPS = ("gather", "insert")
_INT_DTYPES = (torch.int32, torch.int64)

__all__ = [
    "BACKENDS",
    "copy_slots",
    "cpu_unavailable_reason",
    "dequantize_and_gather_k_cache",
    "gather_slots",
    "page_bytes",
    "quantize_and_insert_k_cache",
    "resolve_backend",
]


def resolve_backend(backend: str = "auto", k_cache: torch.Tensor | None = None, op: str = "gather") -> str:
    """The backend a call (`op`: "gather" or "insert") on pages `k_cache` runs: "triton",
    "cpu" or "reference" (the table: `dsv4_torch.backends.CACHE`).

    "auto": triton for CUDA/ROCm pages; on CPU pages the C kernel for gathers where it builds,
    else reference (the same bits; the interpreter is for tests). A named backend that cannot
    run raises BackendUnavailableError saying why.
    """
    if op not in OPS:
        raise ValueError(f"op: expected one of {OPS}, got {op!r}")
    device = k_cache.device if isinstance(k_cache, torch.Tensor) else torch.device("cpu")
    return backends.resolve_cache_backend(backend, device, op)


def cpu_unavailable_reason() -> str | None:
    """Why the C gather kernel cannot run on this machine (None: it can)."""
    return backends.CACHE["cpu"].unavailable(torch.device("cpu"))


# --------------------------------------------------------------------------------------------
# writer


def quantize_and_insert_k_cache(
    k: torch.Tensor,
    k_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int = 64,
    *,
    backend: str = "auto",
    validate: bool = True,
) -> None:
    """Quantize `k` and write each token into its slot of `k_cache`, in place (vLLM's writer).

    Args:
      k: [T, 512] bfloat16 (finite).
      k_cache: uint8 pages (see the module doc), on k's device.
      slot_mapping: [T'] int64 (or int32), T' <= T; -1 skips a token; slot s -> page s // S,
        position s % S; each slot at most once, < num_blocks * S.
      block_size: slots per page S.
      backend, validate: see the module doc.
    """
    S = _block_size(block_size)
    num_blocks = check_pages(k_cache, S)
    _need_tensor(k, "k")
    if k.dtype != torch.bfloat16:
        raise TypeError(f"k: expected bfloat16, got {k.dtype}")
    if k.ndim != 2 or k.shape[1] != HEAD_DIM:
        raise ValueError(f"k: expected shape [T, {HEAD_DIM}], got {tuple(k.shape)}")
    _need_tensor(slot_mapping, "slot_mapping")
    if slot_mapping.dtype not in _INT_DTYPES:
        raise TypeError(f"slot_mapping: expected int64 (or int32), got {slot_mapping.dtype}")
    if slot_mapping.ndim != 1:
        raise ValueError(f"slot_mapping: expected a 1-D tensor, got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.shape[0] > k.shape[0]:
        raise ValueError(
            f"slot_mapping: {slot_mapping.shape[0]} entries for {k.shape[0]} tokens of k (expected <= {k.shape[0]})"
        )
    _same_device(k_cache, k=k, slot_mapping=slot_mapping)
    name = resolve_backend(backend, k_cache, op="insert")
    if validate:
        n = slot_mapping.shape[0]
        bad = ~torch.isfinite(k[:n])
        if bool(bad.any()):
            t, d = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"k: must be finite, got k[{t}, {d}] = {float(k[t, d])}")
        ref.check_slot_mapping(slot_mapping.cpu().numpy(), k.shape[0], num_blocks * S)
    if k.stride(1) != 1:
        k = k.contiguous()
    backends.CACHE[name].op("insert")(k, k_cache, slot_mapping.contiguous(), S)


# --------------------------------------------------------------------------------------------
# reader


def dequantize_and_gather_k_cache(
    out: torch.Tensor,
    k_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor | None,
    block_table: torch.Tensor,
    block_size: int,
    offset: int,
    *,
    backend: str = "auto",
    validate: bool = True,
) -> None:
    """Gather and dequantize rows of paged requests into `out`, in place (vLLM's reader).

    Args:
      out: bf16 [R', rows, 512], R' >= R, unit stride in the last dim; row i < gather_lens[b]
        of request b goes to out[b, offset + i]; other rows are left as they were.
      k_cache: uint8 pages (module doc), on out's device.
      seq_lens: [R] int32 (or int64), >= 0.
      gather_lens: [R] int32 (or int64) in [0, seq_lens[b]], or None (= seq_lens). Row i is
        position seq_lens[b] - gather_lens[b] + i.
      block_table: [R'', max_blocks] int32 (or int64), R'' >= R; the entries holding a gathered
        position must be pages of k_cache, the rest are not read.
      block_size: slots per page S.   offset: first row written, >= 0.
      backend, validate: see the module doc.
    """
    S = _block_size(block_size)
    num_blocks = check_pages(k_cache, S)
    _need_tensor(out, "out")
    if out.dtype != torch.bfloat16:
        raise TypeError(f"out: expected bfloat16, got {out.dtype}")
    if out.ndim != 3 or out.shape[2] != HEAD_DIM:
        raise ValueError(f"out: expected shape [R, rows, {HEAD_DIM}], got {tuple(out.shape)}")
    if out.stride(2) != 1:
        raise ValueError(
            f"out: expected unit stride in the last dim (it is written in place), got strides {out.stride()}"
        )
    for name, x, ndim in (("seq_lens", seq_lens, 1), ("gather_lens", gather_lens, 1), ("block_table", block_table, 2)):
        if x is None and name == "gather_lens":
            continue
        _need_tensor(x, name)
        if x.dtype not in _INT_DTYPES:
            raise TypeError(f"{name}: expected int32 (or int64), got {x.dtype}")
        if x.ndim != ndim:
            raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(x.shape)}")
    R = seq_lens.shape[0]
    ref.check_request_shapes(R, None if gather_lens is None else gather_lens.shape[0], block_table.shape, out.shape)
    if isinstance(offset, bool) or not isinstance(offset, numbers.Integral) or offset < 0:
        raise ValueError(f"offset: expected an integer >= 0, got {offset!r}")
    offset = int(offset)
    _same_device(k_cache, out=out, seq_lens=seq_lens, gather_lens=gather_lens, block_table=block_table)
    name = resolve_backend(backend, k_cache)
    if validate:
        ref.check_gather_args(
            seq_lens.cpu().numpy(),
            None if gather_lens is None else gather_lens.cpu().numpy(),
            block_table[:R].cpu().numpy(),
            S,
            num_blocks,
            tuple(out.shape),
            offset,
        )
    if R == 0:
        return
    seq = seq_lens.contiguous()
    glen = None if gather_lens is None else gather_lens.contiguous()
    bt = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    backends.CACHE[name].op("gather")(out, k_cache, seq, glen, bt, S, offset)


# --------------------------------------------------------------------------------------------
# moving whole slots (bytes, no requantization)


def copy_slots(
    src_cache: torch.Tensor, src_slots: torch.Tensor, dst_cache: torch.Tensor, dst_slots: torch.Tensor, block_size: int
) -> None:
    """dst slot dst_slots[i] = src slot src_slots[i] (its 576 data and 8 scale bytes), in place.

    Both caches hold pages of `block_size` slots (module doc), on one device; the slot tensors are
    1-D integer tensors of equal length there (slot s = page s // S, position s % S), each
    destination at most once. Device ops only: callers keep the slots in range.
    """
    S = _block_size(block_size)
    check_pages(src_cache, S, "src_cache")
    check_pages(dst_cache, S, "dst_cache")
    for name, x in (("src_slots", src_slots), ("dst_slots", dst_slots)):
        _need_tensor(x, name)
        if x.dtype not in _INT_DTYPES or x.ndim != 1:
            raise TypeError(f"{name}: expected a 1-D int64 (or int32) tensor, got {x.dtype} {tuple(x.shape)}")
    if src_slots.shape != dst_slots.shape:
        raise ValueError(f"dst_slots: {dst_slots.shape[0]} slots for {src_slots.shape[0]} source slots")
    _same_device(src_cache, src_slots=src_slots, dst_cache=dst_cache, dst_slots=dst_slots)
    if src_slots.numel() == 0:
        return
    pb = page_bytes(S)
    (src_rows, src_words), (dst_rows, dst_words) = row_views(src_cache, pb), row_views(dst_cache, pb)
    if src_rows.dtype != dst_rows.dtype:  # one of them not 8-byte aligned: move bytes
        src_rows, src_words = (t.view(torch.uint8).view(t.shape[0], -1) for t in (src_rows, src_words))
        dst_rows, dst_words = (t.view(torch.uint8).view(t.shape[0], -1) for t in (dst_rows, dst_words))
    sp, ss = torch.div(src_slots.long(), S, rounding_mode="floor"), src_slots.long() % S
    dp, ds = torch.div(dst_slots.long(), S, rounding_mode="floor"), dst_slots.long() % S
    per_page = pb // SLOT_DATA_BYTES
    dst_rows.index_copy_(0, dp * per_page + ds, src_rows.index_select(0, sp * per_page + ss))
    dst_words.index_copy_(0, scale_index(dp, ds, pb, S), src_words.index_select(0, scale_index(sp, ss, pb, S)))


def gather_slots(k_cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """New pages (uint8 [cdiv(n, S), page_bytes(S)]) whose slot i is slot slots[i] of k_cache.

    Slots past n and the page padding are zero. Device ops only (see `copy_slots`).
    """
    S = _block_size(block_size)
    n = slots.shape[0]
    out = torch.zeros((max(1, -(-n // S)), page_bytes(S)), dtype=torch.uint8, device=k_cache.device)
    copy_slots(k_cache, slots, out, torch.arange(n, device=k_cache.device), S)
    return out


# --------------------------------------------------------------------------------------------
# checks and views


def check_pages(k_cache, S: int, name: str = "k_cache") -> int:
    """num_blocks of a valid page tensor (module doc: `planner.kvcache.check_page_layout`'s
    layouts); errors name the argument `name`."""
    _need_tensor(k_cache, name)
    if k_cache.dtype != torch.uint8:
        raise TypeError(f"{name}: expected uint8 pages (fp8_ds_mla bytes), got {k_cache.dtype}")
    n = ref.check_page_layout(k_cache.shape, k_cache.stride(), S, name)
    want = page_bytes(S)
    if k_cache.ndim == 3 and n >= 1 and k_cache.untyped_storage().nbytes() < k_cache.storage_offset() + n * want:
        raise ValueError(f"{name}: the storage holds fewer than {n} whole pages of {want} bytes")
    return n


def _block_size(block_size) -> int:
    return ref.check_block_size(block_size, "block_size")


def _need_tensor(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")


def _same_device(k_cache: torch.Tensor, **tensors) -> None:
    for name, x in tensors.items():
        if x is not None and x.device != k_cache.device:
            raise ValueError(f"{name}: on {x.device}, but k_cache is on {k_cache.device}")
