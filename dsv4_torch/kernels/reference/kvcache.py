"""The torch reference kernels of vLLM's `fp8_ds_mla` cache (`dsv4_torch.kvcache`'s backend
"reference"): vectorized torch on any device, the NumPy reference's bits (`planner.kvcache`).

The twin of `dsv4_jax.kernels.xla.kvcache`. `quantize_insert` encodes whole slots (integer
exponents, RTNE e4m3) and copies them into their pages; `gather_dequant` walks the requests'
rows in chunks of CHUNK_ROWS (the intermediates stay in the caches) and decodes them with integer
math where a float multiply would flush subnormals; `row_views` / `scale_index` address a page
tensor's slot rows and scale words (the prefill's fp8 gathers use them too).
"""

from __future__ import annotations

import sys

import torch

from planner import kvcache as ref
from planner.kvcache import HEAD_DIM, N_GROUPS, NOPE_DIM, SLOT_DATA_BYTES, SLOT_SCALE_BYTES, page_bytes

_LITTLE_ENDIAN = sys.byteorder == "little"
CHUNK_ROWS = 2048  # rows decoded per step (the intermediates stay in cache)


def quantize_insert(k, k_cache, slots, S):
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


def gather_dequant(out, k_cache, seq, glen, bt, S, offset):
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
