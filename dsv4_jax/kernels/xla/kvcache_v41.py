"""DeepSeek-V4.1's cache records on `jax.Array`s in plain jnp / lax: the codec and the xla backend.

The twin of `dsv4_torch.kernels.reference.kvcache_v41`, the NumPy reference's bits
(`planner.kvcache_v41`). Integer math wherever XLA on CPU would flush a float32 subnormal or
rewrite a NaN payload: the e4m3 cast (`kvcache.e4m3_code`), the exponents, the mxfp8 decode
(`kvcache.dequant_bits_exact`) and the index_mxfp4 decode. The index_fp8 decode multiplies in
float32 (exact for every page the writers produce: a power-of-two scale in [2^-22, 2^120]).
`insert` and `gather` address slots through the pages as one flat byte array. Callers check
every argument first (`dsv4_jax.kvcache_v41`); out-of-range slots and pages are dropped / read NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from dsv4_jax.kernels.xla.kvcache import dequant_bits_exact, e4m3_code
from planner import kvcache_v41 as ref

_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def ceil_log2(y):
    bits = lax.bitcast_convert_type(y.astype(jnp.float32), jnp.int32)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)


def pow2(e):
    """2^e as float32, int32 e in [-126, 127]."""
    return lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def e2m1_codes(x):
    a = jnp.abs(x)
    code = jnp.zeros(x.shape, jnp.int32)
    for m, tie_up in _MIDPOINTS:
        code = code + (a >= m if tie_up else a > m).astype(jnp.int32)
    return code | (jnp.signbit(x).astype(jnp.int32) << 3)


def e4m3_value(code):
    """e4m3 codes (int32 0..255) -> float32 (NaN codes NaN)."""
    c = code & 0x7F
    sign = (code & 0x80) << 24
    normal = lax.bitcast_convert_type(sign | ((c << 20) + (120 << 23)), jnp.float32)
    sub = lax.bitcast_convert_type(
        lax.bitcast_convert_type(c.astype(jnp.float32) * jnp.float32(2.0**-9), jnp.int32) | sign, jnp.float32
    )
    x = jnp.where(c >= 8, normal, sub)
    return jnp.where(c == 0x7F, jnp.float32(jnp.nan), x)


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_value(code):
    mag = jnp.asarray(E2M1, jnp.float32)[code & 7]
    return jnp.where(code >= 8, -mag, mag)


def _pack(codes):
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(jnp.uint8)


def _unpack(b):
    b = b.astype(jnp.int32)
    return jnp.stack([b & 0xF, b >> 4], axis=-1).reshape(b.shape[0], -1)


def encode(x, record: ref.Record):
    """float32 [N, dims] -> (data uint8 [N, data_bytes], scales uint8 [N, scale_bytes])."""
    N = x.shape[0]
    g = x.astype(jnp.float32).reshape(N, record.dims // record.group, record.group)
    amax = jnp.max(jnp.abs(g), axis=-1)
    if record.name == "index_fp8_mx":  # one amax over the key, its exponent in all four bytes
        amax = jnp.broadcast_to(jnp.max(amax, axis=-1, keepdims=True), amax.shape)
    if record.name in ("mxfp8", "index_fp8", "index_fp8_mx"):
        e = ceil_log2(jnp.maximum(amax, ref.FP8_AMAX_FLOOR) * ref.INV_FP8_MAX)
        q = jnp.clip(g * pow2(-e)[..., None], -ref.FP8_MAX, ref.FP8_MAX)
        data = e4m3_code(q).astype(jnp.uint8).reshape(N, record.data_bytes)
        if record.name != "index_fp8":
            scales = jnp.clip(e + 127, 0, 255).astype(jnp.uint8)
        else:
            w = (e + 127) << 23  # the float32 bits of 2^e, little-endian bytes
            scales = jnp.stack([(w >> s) & 0xFF for s in (0, 8, 16, 24)], axis=-1).reshape(N, 4).astype(jnp.uint8)
    elif record.name == "nvfp4":
        s = jnp.clip(amax * ref.INV_FP4_MAX, ref.NVFP4_SCALE_MIN, ref.NVFP4_SCALE_MAX)
        code = e4m3_code(s)
        codes = e2m1_codes(g / e4m3_value(code)[..., None]).reshape(N, record.dims)
        data, scales = _pack(codes), code.astype(jnp.uint8)
    else:  # index_mxfp4
        e = jnp.clip(ceil_log2(jnp.maximum(amax, ref.MXFP4_AMAX_FLOOR) * ref.INV_FP4_MAX), -126, 126)
        codes = e2m1_codes(g * pow2(-e)[..., None]).reshape(N, record.dims)
        data, scales = _pack(codes), (e + 127).astype(jnp.uint8)
    return data, scales


def _mxfp4_bits(code, sb):
    """e2m1 code and UE8M0 byte (int32) -> float32 bits of e2m1 * 2^(sb - 127), exactly
    (subnormal results built in integers; byte 255 gives inf, and NaN for a zero value)."""
    c = code & 7
    m = c & 1
    k = jnp.where(c >= 2, (c >> 1) - 1, -1)  # nonzero value = (1 + m / 2) * 2^k (code 1: m = 0, k = -1)
    m = jnp.where(c == 1, 0, m)
    field = k + sb
    normal = (field << 23) | (m << 22)
    sub = (2 + m) << jnp.clip(field + 21, 0, 31)  # (2 + m) * 2^(field - 128), in units of 2^-149
    bits = jnp.where(field >= 1, normal, sub)
    bits = jnp.where((field >= 255) | (sb == 255), 0x7F800000, bits)  # 2^128 is inf in float32
    bits = jnp.where(c == 0, jnp.where(sb == 255, 0x7FC00000, 0), bits)
    return bits | ((code & 8) << 28)


def _e4m3_pow2_bits(code, sb):
    """e4m3 code and UE8M0 byte (int32) -> float32 bits of e4m3 * 2^(sb - 127), exactly (the value
    M * 2^(E + sb - 127), M the code's integer significand, is a float32, subnormal ones built in
    integers; byte 255 gives inf, NaN for a zero value; NaN codes NaN)."""
    c = code & 0x7F
    sub = c < 8
    M = jnp.where(sub, c, 8 + (c & 7))
    E = jnp.where(sub, -9, (c >> 3) - 10)
    s = jnp.where(M >= 8, 0, jnp.where(M >= 4, 1, jnp.where(M >= 2, 2, 3)))  # normalize M to 8..15
    field = E - s + 3 + sb  # the float32 biased exponent of (M << s) / 8 * 2^(E - s + 3 + sb - 127)
    normal = (field << 23) | (((M << s) - 8) << 20)
    subnormal = M << jnp.clip(E + sb + 22, 0, 31)  # in units of 2^-149 (E + sb + 22 >= 13)
    bits = jnp.where(field >= 1, normal, subnormal)
    bits = jnp.where((field >= 255) | (sb == 255), 0x7F800000, bits)
    bits = jnp.where(c == 0, jnp.where(sb == 255, 0x7FC00000, 0), bits)
    return jnp.where(c == 0x7F, 0x7FC00000, bits | ((code & 0x80) << 24))


def decode(data, scales, record: ref.Record, dtype):
    """Slot bytes -> [N, dims] in `dtype` (main records through bf16 bits; index keys float32)."""
    N = data.shape[0]
    G = record.dims // record.group
    if record.name == "mxfp8":
        bits = dequant_bits_exact(data.astype(jnp.int32).reshape(N, G, -1), scales.astype(jnp.int32)[..., None])
        y = lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16).reshape(N, record.dims)
    elif record.name == "nvfp4":
        v = e2m1_value(_unpack(data)).reshape(N, G, -1)
        y = (v * e4m3_value(scales.astype(jnp.int32))[..., None]).reshape(N, record.dims).astype(jnp.bfloat16)
    elif record.name == "index_fp8":
        w = scales.astype(jnp.uint32)
        s = lax.bitcast_convert_type(w[:, 0] | (w[:, 1] << 8) | (w[:, 2] << 16) | (w[:, 3] << 24), jnp.float32)
        y = e4m3_value(data.astype(jnp.int32)) * s[:, None]
    elif record.name == "index_fp8_mx":
        bits = _e4m3_pow2_bits(data.astype(jnp.int32).reshape(N, G, -1), scales.astype(jnp.int32)[..., None])
        y = lax.bitcast_convert_type(bits, jnp.float32).reshape(N, record.dims)
    else:
        bits = _mxfp4_bits(_unpack(data).reshape(N, G, -1), scales.astype(jnp.int32)[..., None])
        y = lax.bitcast_convert_type(bits, jnp.float32).reshape(N, record.dims)
    return y.astype(dtype)


# --------------------------------------------------------------------------------------------
# pages


def slot_bytes(geo: ref.Geometry, layout: str, page, pos):
    r = geo.record
    if layout == "interleaved":
        d0 = pos * r.bytes
        s0 = d0 + r.data_bytes
    else:
        d0, s0 = pos * r.data_bytes, geo.S * r.data_bytes + pos * r.scale_bytes
    base = page * geo.page_stride
    return (base + d0)[:, None] + jnp.arange(r.data_bytes), (base + s0)[:, None] + jnp.arange(r.scale_bytes)


@functools.partial(jax.jit, static_argnames=("geo", "layout"))
def insert(x, k_cache, slots, geo: ref.Geometry, layout: str):
    """Rows x (float32 [n, dims]) into slots [n] (< 0 or out of range: dropped); the new pages."""
    data, scales = encode(x, geo.record)
    live = (slots >= 0) & (slots < geo.num_blocks * geo.S)
    page = jnp.where(live, slots // geo.S, geo.num_blocks)  # past the pages: dropped
    di, si = slot_bytes(geo, layout, page, jnp.where(live, slots % geo.S, 0))
    flat = k_cache.reshape(-1)
    flat = flat.at[di.reshape(-1)].set(data.reshape(-1), mode="drop")
    flat = flat.at[si.reshape(-1)].set(scales.reshape(-1), mode="drop")
    return flat.reshape(k_cache.shape)


_BITS = {jnp.dtype(jnp.bfloat16): (jnp.uint16, 0x7FC0), jnp.dtype(jnp.float32): (jnp.uint32, 0x7FC00000)}


@functools.partial(jax.jit, static_argnames=("geo", "layout", "offset"))
def gather(out, k_cache, seq, glen, bt, geo: ref.Geometry, layout: str, offset: int):
    """vLLM's gather-dequantize; the new `out` (rows not gathered keep their bits)."""
    R = seq.shape[0]
    n = out.shape[1] - offset
    i = jnp.arange(n, dtype=jnp.int32)[None, :]
    want = i < glen[:, None]
    pos = (seq - glen)[:, None] + i
    col = pos // geo.S
    max_blocks = bt.shape[1]
    page = jnp.take_along_axis(bt, jnp.clip(col, 0, max_blocks - 1), axis=1)
    good = (pos >= 0) & (col < max_blocks) & (page >= 0) & (page < geo.num_blocks)
    page = jnp.where(good, page, 0).reshape(-1)
    di, si = slot_bytes(geo, layout, page, jnp.where(good, pos % geo.S, 0).reshape(-1))
    flat = k_cache.reshape(-1)
    rows = decode(jnp.take(flat, di, mode="clip"), jnp.take(flat, si, mode="clip"), geo.record, out.dtype)
    utype, nan = _BITS[jnp.dtype(out.dtype)]
    rows = lax.bitcast_convert_type(rows, utype).reshape(R, n, -1)
    rows = jnp.where(good[..., None], rows, utype(nan))
    bits = lax.bitcast_convert_type(out, utype)
    bits = bits.at[:R, offset:].set(jnp.where(want[..., None], rows, bits[:R, offset:]))
    return lax.bitcast_convert_type(bits, out.dtype)
