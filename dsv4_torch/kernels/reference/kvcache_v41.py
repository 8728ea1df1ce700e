"""The torch reference kernels of DeepSeek-V4.1's cache records (`dsv4_torch.kvcache_v41`'s backend
"reference"): vectorized torch on any device, the NumPy reference's bits (`planner.kvcache_v41`).

The twin of `dsv4_jax.kernels.xla.kvcache_v41`. `encode` / `decode` are the codec (integer
exponents from float32 bits, RTNE e4m3 by torch's cast, e2m1 by thresholds); `insert` and
`gather` address slots through a flat byte view of the pages (page g at byte g * page_stride).
Callers check every argument first (`dsv4_torch.kvcache_v41`).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from planner import kvcache_v41 as ref

_E2M1 = ref.E2M1_VALUES
_E4M3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)  # NaN codes: NaN
_TABLES: dict = {}


def _table(values, device) -> torch.Tensor:
    key = (id(values), str(device))
    if key not in _TABLES:
        _TABLES[key] = torch.from_numpy(np.asarray(values, np.float32).copy()).to(device)
    return _TABLES[key]


_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def ceil_log2(y: torch.Tensor) -> torch.Tensor:
    """ceil(log2(y)) of positive normal float32 values, exactly, int32."""
    bits = y.float().contiguous().view(torch.int32)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as float32 for int32 e in [-126, 127]."""
    return ((e + 127) << 23).view(torch.float32)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float32 -> e2m1 codes (uint8): round to nearest even, saturating at 6, sign of zero kept."""
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for m, tie_up in _MIDPOINTS:
        code += (a >= m if tie_up else a > m).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _unpack(b: torch.Tensor) -> torch.Tensor:
    return torch.stack([b & 0xF, b >> 4], dim=-1).reshape(b.shape[0], -1)


def encode(x: torch.Tensor, record: ref.Record) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [N, dims] -> (data uint8 [N, data_bytes], scales uint8 [N, scale_bytes])."""
    N = x.shape[0]
    g = x.float().reshape(N, record.dims // record.group, record.group)
    amax = g.abs().amax(dim=-1)
    if record.name == "index_fp8_mx":  # one amax over the key, its exponent in all four bytes
        amax = amax.amax(dim=-1, keepdim=True).expand(-1, g.shape[1])
    if record.name in ("mxfp8", "index_fp8", "index_fp8_mx"):
        e = ceil_log2(torch.clamp_min(amax, float(ref.FP8_AMAX_FLOOR)) * float(ref.INV_FP8_MAX))
        q = torch.clamp(g * pow2(-e)[..., None], -448.0, 448.0)
        data = q.to(torch.float8_e4m3fn).view(torch.uint8).reshape(N, record.data_bytes)
        if record.name != "index_fp8":
            scales = torch.clamp(e + 127, 0, 255).to(torch.uint8)
        else:
            scales = _le_bytes(pow2(e)).reshape(N, 4)
    elif record.name == "nvfp4":
        s = torch.clamp(amax * float(ref.INV_FP4_MAX), float(ref.NVFP4_SCALE_MIN), float(ref.NVFP4_SCALE_MAX))
        s8 = s.to(torch.float8_e4m3fn)
        codes = e2m1_codes(g / s8.float()[..., None]).reshape(N, record.dims)
        data, scales = _pack(codes), s8.view(torch.uint8)
    else:  # index_mxfp4
        y = torch.clamp_min(amax, float(ref.MXFP4_AMAX_FLOOR)) * float(ref.INV_FP4_MAX)
        e = torch.clamp(ceil_log2(y), -126, 126)  # y in [2^-126, 2^126): the clamp to +-127 never binds
        codes = e2m1_codes(g * pow2(-e)[..., None]).reshape(N, record.dims)
        data, scales = _pack(codes), (e + 127).to(torch.uint8)
    return data.contiguous(), scales.contiguous()


def _le_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 -> its little-endian bytes, uint8 [..., 4]."""
    b = x.contiguous().view(torch.int32)
    return torch.stack([(b >> s) & 0xFF for s in (0, 8, 16, 24)], dim=-1).to(torch.uint8)


def _from_le_bytes(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4] little-endian -> float32 [...]."""
    w = b.to(torch.int32)
    return (w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16) | (w[..., 3] << 24)).view(torch.float32)


def _ue8m0(b: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> 2^(byte - 127) as float32 (byte 0: the subnormal 2^-127; 255: inf)."""
    b = b.to(torch.int32)
    return torch.where(b == 0, torch.full_like(b, 0x400000), b << 23).view(torch.float32)


def decode(data: torch.Tensor, scales: torch.Tensor, record: ref.Record, dtype: torch.dtype) -> torch.Tensor:
    """Slot bytes -> [N, dims] in `dtype`: the float32 product (main records rounded to bf16 first)."""
    N = data.shape[0]
    G = record.dims // record.group
    if record.name in ("mxfp8", "index_fp8", "index_fp8_mx"):  # a 256-entry table: torch's float8 cast is slow on CPU
        v = torch.index_select(_table(_E4M3, data.device), 0, data.reshape(-1).int()).view(data.shape)
    else:
        codes = _unpack(data)
        v = torch.index_select(_table(_E2M1, data.device), 0, codes.reshape(-1).int()).view(codes.shape)
    if record.name in ("mxfp8", "index_mxfp4", "index_fp8_mx"):
        s = _ue8m0(scales)
    elif record.name == "nvfp4":
        s = scales.contiguous().view(torch.float8_e4m3fn).float()
    else:
        s = _from_le_bytes(scales.reshape(N, 1, 4))
    y = (v.reshape(N, G, -1) * s.reshape(N, G, 1)).reshape(N, record.dims)
    if record.main:
        y = y.to(torch.bfloat16)
    return y.to(dtype)


# --------------------------------------------------------------------------------------------
# pages


def flat_bytes(k_cache: torch.Tensor, geo: ref.Geometry) -> torch.Tensor:
    """The pages' bytes as one 1-D uint8 view (page g at g * page_stride), sharing k_cache's memory."""
    n = (geo.num_blocks - 1) * geo.page_stride + geo.S * geo.record.bytes if geo.num_blocks else 0
    return k_cache.as_strided((n,), (1,), k_cache.storage_offset())


def slot_bytes(geo: ref.Geometry, layout: str, page: torch.Tensor, pos: torch.Tensor):
    r = geo.record
    if layout == "interleaved":
        d0 = pos * r.bytes
        s0 = d0 + r.data_bytes
    else:
        d0, s0 = pos * r.data_bytes, geo.S * r.data_bytes + pos * r.scale_bytes
    base = page * geo.page_stride
    dev = page.device
    data = (base + d0)[:, None] + torch.arange(r.data_bytes, device=dev)
    scales = (base + s0)[:, None] + torch.arange(r.scale_bytes, device=dev)
    return data, scales


def insert(x, k_cache, slots, geo: ref.Geometry, layout: str) -> None:
    """Rows x (float32 [n, dims]) into slots [n] (int64; < 0 skips), in place."""
    live = (slots >= 0).nonzero()[:, 0]
    if live.numel() == 0:
        return
    s = slots[live].long()
    data, scales = encode(x[live], geo.record)
    di, si = slot_bytes(geo, layout, s // geo.S, s % geo.S)
    flat = flat_bytes(k_cache, geo)
    flat[di.reshape(-1)] = data.reshape(-1)
    flat[si.reshape(-1)] = scales.reshape(-1)


def _select(flat: torch.Tensor, offsets: torch.Tensor, width: int) -> torch.Tensor | None:
    """uint8 [n, width]: the `width` bytes at each offset, by index_select on the bytes seen as rows
    of `width` (8-byte words where aligned: torch moves int64 rows far faster than bytes), or None
    when some offset is not a multiple of `width`."""
    rows = flat.numel() // width
    if not rows:
        return None
    view = flat[: rows * width]
    w = 8 if width % 8 == 0 and view.data_ptr() % 8 == 0 else 1
    table = view.view(torch.int64 if w == 8 else torch.uint8).view(rows, width // w)
    out = torch.empty((offsets.shape[0], width // w), dtype=table.dtype, device=flat.device)
    torch.index_select(table, 0, torch.div(offsets, width, rounding_mode="floor"), out=out)  # out=: the fast path
    return out.view(torch.uint8).view(offsets.shape[0], width)


def read_bytes(k_cache: torch.Tensor, geo: ref.Geometry, layout: str, page: torch.Tensor, pos: torch.Tensor):
    """(data uint8 [n, D], scales uint8 [n, C]) of slots (page, pos): whole records (interleaved)
    or data and scale rows (split) by `_select` where the page stride allows it, else bytes."""
    r = geo.record
    flat = flat_bytes(k_cache, geo)
    base = page * geo.page_stride
    if layout == "interleaved" and geo.page_stride % r.bytes == 0:
        rec = _select(flat, base + pos * r.bytes, r.bytes)
        if rec is not None:
            return rec[:, : r.data_bytes], rec[:, r.data_bytes :]
    if layout == "split" and geo.page_stride % r.data_bytes == 0 and geo.page_stride % r.scale_bytes == 0:
        data = _select(flat, base + pos * r.data_bytes, r.data_bytes)
        scales = _select(flat, base + geo.S * r.data_bytes + pos * r.scale_bytes, r.scale_bytes)
        if data is not None and scales is not None and (geo.S * r.data_bytes) % r.scale_bytes == 0:
            return data, scales
    di, si = slot_bytes(geo, layout, page, pos)
    return flat[di], flat[si]


def gather(out, k_cache, seq, glen, bt, geo: ref.Geometry, layout: str, offset: int) -> None:
    """vLLM's gather-dequantize (checked arguments), in place."""
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
    page = bt[req, pos // geo.S].long()
    for c0 in range(0, n, CHUNK_ROWS):  # bounded intermediates
        c1 = min(n, c0 + CHUNK_ROWS)
        data, scales = read_bytes(k_cache, geo, layout, page[c0:c1], pos[c0:c1] % geo.S)
        out[req[c0:c1], offset + i[c0:c1]] = decode(data, scales, geo.record, out.dtype)


CHUNK_ROWS = 4096  # rows decoded per step
