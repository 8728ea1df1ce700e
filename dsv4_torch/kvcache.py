"""vLLM's DeepSeek-V4 KV cache pages (`fp8_ds_mla`) on torch tensors: write and gather-dequantize.

Same functions, same argument order as vLLM 0.33.0's (and `planner.kvcache`, the NumPy
reference, whose bytes and values these match exactly):

    quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size)
    dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset)

Backends (keyword `backend=`):
  "triton"     Triton kernels (`dsv4_torch/kernels/triton_kvcache.py`): CUDA/ROCm tensors, or CPU
               tensors under TRITON_INTERPRET=1 (slow; for tests).
  "cpu"        the gather only: a C kernel for CPU tensors (`dsv4_torch/kernels/cpu.py`,
               compiled once per machine with the system C compiler), one pass over the rows.
  "reference"  vectorized torch, any device (on a GPU its gather syncs once for the row count).
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
"""

from __future__ import annotations

import numbers
import sys

import torch

from dsv4_torch import backends
from planner import kvcache as ref
from planner.kvcache import (
    HEAD_DIM,
    N_GROUPS,
    NOPE_DIM,
    SLOT_DATA_BYTES,
    SLOT_SCALE_BYTES,
    page_bytes,
)

BACKENDS = backends.CACHE_BACKENDS
OPS = ("gather", "insert")
_INT_DTYPES = (torch.int32, torch.int64)
_LITTLE_ENDIAN = sys.byteorder == "little"
CHUNK_ROWS = 2048  # reference gather: rows decoded per step (the intermediates stay in cache)

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
    slots = slot_mapping.contiguous()
    if name == "triton":
        from dsv4_torch.kernels import triton_kvcache

        triton_kvcache.quantize_insert(k, k_cache, slots, S)
        return
    _quantize_insert_reference(k, k_cache, slots, S)


def _quantize_insert_reference(k, k_cache, slots, S):
    n = slots.shape[0]
    live = (slots >= 0).nonzero()[:, 0]
    if live.numel() == 0:
        return
    s = slots[live].long()
    data, scales = encode_slots(k[:n][live])
    pb = page_bytes(S)
    rows, words = row_views(k_cache, pb)
    page, pos = s // S, s % S
    rows.index_copy_(0, page * (pb // SLOT_DATA_BYTES) + pos, data.view(rows.dtype).view(-1, rows.shape[1]))
    words.index_copy_(0, scale_index(page, pos, pb, S), scales.view(words.dtype).view((-1,) + words.shape[1:]))


def exponents(amax: torch.Tensor) -> torch.Tensor:
    """e = ceil(log2(max(amax, 1e-4) / 448)) exactly, int32, for float32 amax of bf16 values.

    amax = (1 + f) 2^(E - 127) and 448 = 1.75 * 2^8, so e = E - 135, plus 1 when f > 0.75.
    (Equal to planner.kvcache.scale_exponent's for every bf16 amax and for the 1e-4 floor.)
    """
    bits = torch.clamp_min(amax.float(), float(ref.AMAX_FLOOR)).view(torch.int32)
    return ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)


def encode_slots(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [N, 512] -> (data uint8 [N, 576], scales uint8 [N, 8]), on k's device."""
    N = k.shape[0]
    x = k[:, :NOPE_DIM].float().view(N, N_GROUPS, -1)
    e = exponents(x.abs().amax(dim=-1))  # [N, 7]
    inv = ((127 - e) << 23).view(torch.float32)  # 2^-e, exact
    q = (x * inv[..., None]).clamp_(-ref.FP8_MAX, ref.FP8_MAX)
    data = torch.empty((N, SLOT_DATA_BYTES), dtype=torch.uint8, device=k.device)
    data[:, :NOPE_DIM] = q.to(torch.float8_e4m3fn).view(torch.uint8).view(N, NOPE_DIM)
    data[:, NOPE_DIM:] = _bf16_bytes_le(k[:, NOPE_DIM:])
    scales = torch.zeros((N, SLOT_SCALE_BYTES), dtype=torch.uint8, device=k.device)
    scales[:, :N_GROUPS] = (e + 127).clamp_(0, 255).to(torch.uint8)
    return data, scales


def _bf16_bytes_le(x: torch.Tensor) -> torch.Tensor:
    """bf16 [N, 64] -> its little-endian bytes, uint8 [N, 128]."""
    if _LITTLE_ENDIAN:
        return x.contiguous().view(torch.uint8)
    bits = x.contiguous().view(torch.int16)  # pragma: no cover - big-endian hosts
    lo, hi = (bits & 0xFF).to(torch.uint8), ((bits >> 8) & 0xFF).to(torch.uint8)  # pragma: no cover
    return torch.stack([lo, hi], dim=-1).reshape(x.shape[0], -1)  # pragma: no cover


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
    if name == "triton":
        from dsv4_torch.kernels import triton_kvcache

        triton_kvcache.gather_dequant(out, k_cache, seq, glen, bt, S, offset)
        return
    if name == "cpu":
        from dsv4_torch.kernels import cpu

        cpu.gather_dequant(out, k_cache, seq, glen, bt, S, offset)
        return
    _gather_dequant_reference(out, k_cache, seq, glen, bt, S, offset)


def _gather_dequant_reference(out, k_cache, seq, glen, bt, S, offset):
    dev = out.device
    seq = seq.long()
    g = seq if glen is None else glen.long()
    n = int(g.sum())  # the row count: a device sync on GPUs (this backend's one)
    if n == 0:
        return
    R = seq.shape[0]
    req = torch.repeat_interleave(torch.arange(R, device=dev), g, output_size=n)
    i = torch.arange(n, device=dev) - torch.repeat_interleave(torch.cumsum(g, 0) - g, g, output_size=n)
    pos = (seq - g)[req] + i
    page = bt[req, pos // S].long()
    slot = pos % S
    pb = page_bytes(S)
    rows, words = row_views(k_cache, pb)
    row_idx = page * (pb // SLOT_DATA_BYTES) + slot
    scale_idx = scale_index(page, slot, pb, S)
    flat_out = out.view(-1, HEAD_DIM).view(torch.int64) if out.is_contiguous() else None
    dest = req * out.shape[1] + offset + i if flat_out is not None else None
    m = min(n, CHUNK_ROWS)
    buf = torch.empty((m, HEAD_DIM), dtype=torch.bfloat16, device=dev)
    data_buf = torch.empty((m,) + rows.shape[1:], dtype=rows.dtype, device=dev)
    sc_buf = torch.empty((m,) + words.shape[1:], dtype=words.dtype, device=dev)
    for c0, c1, b, r0 in _segments(g.tolist(), direct=out.stride(1) == HEAD_DIM):
        # index_select with out=: without it torch 2.13 takes a path ~500x slower on these views
        data = torch.index_select(rows, 0, row_idx[c0:c1], out=data_buf[: c1 - c0])
        sc = torch.index_select(words, 0, scale_idx[c0:c1], out=sc_buf[: c1 - c0])
        data, sc = data.view(torch.uint8).view(c1 - c0, -1), sc.view(torch.uint8).view(c1 - c0, -1)
        if b is not None:  # rows of one request: decode straight into out's (contiguous) rows
            decode_slots(data, sc, out[b, offset + r0 : offset + r0 + c1 - c0])
            continue
        y = decode_slots(data, sc, buf[: c1 - c0])
        if flat_out is not None:
            flat_out.index_copy_(0, dest[c0:c1], y.view(torch.int64))
        else:
            out.index_put_((req[c0:c1], offset + i[c0:c1]), y)


DIRECT_ROWS = 128  # requests gathering at least this many rows are decoded in place


def _segments(g: list[int], direct: bool):
    """Split the row list (requests' rows back to back) into chunks of <= CHUNK_ROWS rows:
    (c0, c1, b, r0) = rows [c0, c1) of the list, all of request b from its row r0 (decoded in
    place), or b = None for runs of short requests (decoded into a buffer, then scattered)."""
    segs, c, run = [], 0, None
    for b, gb in enumerate(g):
        if gb == 0:
            continue
        if direct and gb >= DIRECT_ROWS:
            if run is not None:
                segs += [(r, min(run[1], r + CHUNK_ROWS), None, 0) for r in range(run[0], run[1], CHUNK_ROWS)]
                run = None
            segs += [(c + r, c + min(gb, r + CHUNK_ROWS), b, r) for r in range(0, gb, CHUNK_ROWS)]
        else:
            run = (c, c + gb) if run is None else (run[0], c + gb)
        c += gb
    if run is not None:
        segs += [(r, min(run[1], r + CHUNK_ROWS), None, 0) for r in range(run[0], run[1], CHUNK_ROWS)]
    return segs


_NAN_CODE = 0x7F
_BF16_SIGN_AND_CODE = 0x87F0 - 0x10000  # int16: the sign bit and bits 4..10


def decode_slots(
    data: torch.Tensor, scales: torch.Tensor, buf: torch.Tensor | None = None, *, branch_free: bool = False
) -> torch.Tensor:
    """Slot bytes (uint8 [N, 576] data, [N, 8] scales) -> bf16 [N, 512] (into `buf` when given).

    An e4m3 byte b is sign | code (7 bits); the bf16 with bits sign << 15 | code << 4 is exactly
    e4m3(b) * 2^-120 (subnormal codes included), so one bf16 multiply by 2^(byte - 7) gives
    e4m3(b) * 2^(byte - 127), rounded to bf16 as float32 math would (exact for bytes this
    writer produces). Scale bytes above 134 (2^(byte - 7) past bf16's range) take two
    multiplies; NaN codes (0x7F, 0xFF) are patched in. Integer and bf16 passes only: torch's own
    float8 conversion is several times slower on CPU.

    branch_free: always take the two multiplies and the NaN patches (the same bits: the second
    multiply is by 1.0 for bytes <= 134, and no NaN arises there), so that nothing reads device
    values on the host (what a layer call on a GPU needs; the default looks first, faster on CPU).
    """
    N = data.shape[0]
    y = torch.empty((N, HEAD_DIM), dtype=torch.bfloat16, device=data.device) if buf is None else buf
    v = data[:, :NOPE_DIM].view(torch.int8).to(torch.int16)
    v <<= 4
    v &= _BF16_SIGN_AND_CODE
    sb = scales[:, :N_GROUPS].to(torch.int16)
    hi = True if branch_free else bool((sb > 134).any())
    s1 = ((sb.clamp(max=134) + 120) << 7).view(torch.bfloat16)  # 2^(min(byte, 134) - 7)
    nope = y[:, :NOPE_DIM].view(N, N_GROUPS, -1)
    torch.mul(v.view(torch.bfloat16).view(N, N_GROUPS, -1), s1[..., None], out=nope)
    if hi:  # the rest of the scale: 2^(byte - 134); byte 255 -> inf (2^128 is inf in float32)
        s2 = torch.where(sb > 134, ((sb - 7) << 7), torch.full_like(sb, 127 << 7))
        s2 = torch.where(sb == 255, torch.full_like(sb, 0x7F80), s2).view(torch.bfloat16)
        nope.mul_(s2[..., None])
        nope.masked_fill_(torch.isnan(nope), float("nan"))  # 0 * inf: the canonical NaN, as JAX's
    if branch_free or _has_nan_code(data):
        y[:, :NOPE_DIM].masked_fill_((data[:, :NOPE_DIM] & _NAN_CODE) == _NAN_CODE, float("nan"))
    y[:, NOPE_DIM:] = _bf16_from_le_bytes(data[:, NOPE_DIM:])
    return y


_LOW7 = 0x7F7F7F7F7F7F7F7F
_ONES = 0x0101010101010101
_HIGH = 0x8080808080808080 - (1 << 64)  # as int64


def _has_nan_code(data: torch.Tensor) -> bool:
    """Whether any of the 448 e4m3 bytes per row is a NaN code (0x7F / 0xFF).

    Eight bytes at a time where rows are 8-byte aligned: with t = word & 0x7F7F.., a byte of t
    is 0x7F exactly where t + 0x0101.. sets that byte's top bit (no carry crosses bytes)."""
    nope = data[:, :NOPE_DIM]
    if data.stride(0) % 8 == 0 and data.storage_offset() % 8 == 0 and data.data_ptr() % 8 == 0:
        w = nope.view(torch.int64) & _LOW7
        return bool(((w + _ONES) & _HIGH).any())
    return bool(((nope & _NAN_CODE) == _NAN_CODE).any())


def _bf16_from_le_bytes(b: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 128] little-endian bf16 bytes -> bf16 [N, 64]."""
    if _LITTLE_ENDIAN:
        return b.contiguous().view(torch.bfloat16) if b.stride(1) != 1 else b.view(torch.bfloat16)
    lo, hi = b[:, 0::2].to(torch.int16), b[:, 1::2].to(torch.int16)
    return (lo | (hi << 8)).view(torch.bfloat16)


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


def row_views(k_cache: torch.Tensor, pb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages as rows of 576 bytes and as 8-byte words (int64 where the pages start 8-byte
    aligned, else uint8), sharing k_cache's memory.

    page_bytes is a multiple of 576, so slot p of page g is row g * (page_bytes / 576) + p and
    its 8 scale bytes are word (g * page_bytes + S * 576) / 8 + p. (Torch's index kernels move
    int64 elements far faster than uint8 ones.)
    """
    nb = k_cache.shape[0]
    flat = k_cache.as_strided((nb * pb,), (1,), k_cache.storage_offset())
    if k_cache.storage_offset() % 8 == 0 and k_cache.untyped_storage().data_ptr() % 8 == 0:
        words = flat.view(torch.int64)
        return words.view(-1, SLOT_DATA_BYTES // 8), words
    return flat.view(-1, SLOT_DATA_BYTES), flat.view(-1, SLOT_SCALE_BYTES)


def scale_index(page, slot, stride, S):
    """Index of each slot's 8 scale bytes in `words` (8-byte words, or rows of 8 bytes)."""
    return page * (stride // SLOT_SCALE_BYTES) + S * (SLOT_DATA_BYTES // SLOT_SCALE_BYTES) + slot


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
