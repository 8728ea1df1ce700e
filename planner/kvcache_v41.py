"""DeepSeek-V4.1's cache records, written and read in NumPy: the reference.

Four records, each a token's (or compressed entry's, or index key's) data bytes and its scale
bytes (`RECORDS`; vLLM 0.33.0 reads the record off the page view's last dim, as here):

    mxfp8        528 B  512 e4m3 over all dims (RoPE applied first) + 16 UE8M0, one per 32 dims
    nvfp4        288 B  256 B of e2m1 pairs (even element in the low nibble) + 32 e4m3, one per 16
    index_fp8    132 B  128 e4m3 + one little-endian float32 scale (a power of two); with
                        `mx_scales=True` (vLLM on SM100: `mqa_logits_use_mx_scales`) the same
                        scale as four equal UE8M0 bytes, one per 32 dims (`MX_INDEX_FP8`)
    index_mxfp4   68 B  64 B of e2m1 pairs + 4 UE8M0, one per 32

and two page layouts (`LAYOUTS`), for a page of S slots:

    "interleaved"  slot p's data at p * W, its scales right after (W = the record's bytes): the
                   layout vLLM 0.33.0 writes for mxfp8 and nvfp4 and FlashMLA's V4.1 kernels read
    "split"        all S slots' data first (slot p at p * D), then all scales (at S * D + p * C):
                   vLLM 0.33.0's index-key pages; also mxfp8 / nvfp4 pages of vLLM's earlier V4.1
                   kernels and of FlashMLA's legacy path

A slot's bytes never depend on the layout, only where they sit. `default_layout(record)` is what
vLLM 0.33.0 uses for it (what every function here takes when `layout` is None).

Quantization (x: the record's float32 input row; vLLM's Triton kernels, op for op):
  mxfp8       per 32 dims: amax = max(max|x|, 1e-4); e = ceil(log2(amax * fl(1/448)));
              e4m3 = rtne(clamp(x * 2^-e, +-448)); scale byte = clamp(e + 127, 0, 255)
  nvfp4       per 16 dims: s = e4m3(rtne(clamp(amax * fl(1/6), 2^-9, 448))) (no floor on amax);
              e2m1 = rtne_sat(x / s) (IEEE division); scale byte = s's e4m3 bits
  index_fp8   one group of 128: as mxfp8 (floor 1e-4, fl(1/448)); the scale is the float32 2^e
  index_mxfp4 per 32 dims: amax = max(max|x|, 6 * 2^-126); e = clamp(ceil(log2(amax * fl(1/6))),
              -127, 127); e2m1 = rtne_sat(x * 2^-e); scale byte = e + 127
fl(1/c) is the float32 reciprocal (the kernels multiply by it); ceil(log2(.)) is exact here, from
the float32 bits (vLLM's Triton takes a float32 log2, which can differ only for a product within
one float32 ulp above a power of two). rtne_sat onto e2m1 {0, .5, 1, 1.5, 2, 3, 4, 6} saturates
at 6 and keeps the sign of zero (PTX `cvt.rn.satfinite.e2m1x2.f32`).

Dequantization (what vLLM's gathers return): mxfp8 e4m3 * 2^(byte - 127) and nvfp4 e2m1 * e4m3
scale, float32 products rounded to bf16 (returned as float32 holding bf16 values); index keys
e4m3 * scale and e2m1 * 2^(byte - 127) as float32 (exact for every page these writers produce).

The writers mirror vLLM 0.33.0's signatures (`vllm/models/deepseek_v41/common/ops/`):
  quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size)     bf16 rows -> mxfp8 / nvfp4
  rope_quant_insert(latent, positions, cos_sin_cache, kv_cache, slot_mapping, compress_ratio)
  indexer_k_norm_rope_store(k_pre, positions, cos_sin_cache, rms_norm_weight, rms_norm_eps,
                            k_cache, kv_slot_mapping, compress_ratio, use_fp4_cache)
  insert_records(x, k_cache, slot_mapping, block_size)                  float32 rows, any record
and the reader `dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table,
block_size, offset)` (any record). Pages: uint8 [num_blocks, S, W] (vLLM's view: record and S
read off the shape; the page stride, strides[0], may exceed S * W, as vLLM pads it) or
[num_blocks, page_stride] with `block_size` and `bytes_per_token` given.
"""

from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np

from planner.checks import as_int
from planner.kvcache import _int_vector, check_block_size, check_gather_args, check_slot_mapping


class Record(NamedTuple):
    name: str
    dims: int  # values per record
    data_bytes: int
    scale_bytes: int
    group: int  # dims per scale

    @property
    def bytes(self) -> int:
        return self.data_bytes + self.scale_bytes

    @property
    def main(self) -> bool:
        """A KV record (512 dims, read into bf16), not an index key."""
        return self.dims == 512


RECORDS = {
    r.name: r
    for r in (
        Record("mxfp8", 512, 512, 16, 32),
        Record("nvfp4", 512, 256, 32, 16),
        Record("index_fp8", 128, 128, 4, 128),
        Record("index_mxfp4", 128, 64, 4, 32),
    )
}
BY_BYTES = {r.bytes: r for r in RECORDS.values()}  # 528, 288, 132, 68
LAYOUTS = ("interleaved", "split")
# FP8 index keys with their scale as four UE8M0 bytes (one per 32 dims; the writer's four are
# equal: one amax over 128): 132 bytes too, so chosen by `mx_scales=True`, never by the width.
MX_INDEX_FP8 = Record("index_fp8_mx", 128, 128, 4, 32)
_VLLM_LAYOUT = {
    "mxfp8": "interleaved",
    "nvfp4": "interleaved",
    "index_fp8": "split",
    "index_fp8_mx": "split",
    "index_mxfp4": "split",
}

FP8_MAX = np.float32(448.0)
INV_FP8_MAX = np.float32(1.0 / 448.0)
INV_FP4_MAX = np.float32(1.0 / 6.0)
FP8_AMAX_FLOOR = np.float32(1e-4)
MXFP4_AMAX_FLOOR = np.float32(6.0 * 2.0**-126)
NVFP4_SCALE_MIN, NVFP4_SCALE_MAX = np.float32(2.0**-9), np.float32(448.0)
ROPE_DIM = 64  # the last 64 dims of a record's input are RoPE'd (GPT-J pairs)
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)

__all__ = [
    "BY_BYTES",
    "LAYOUTS",
    "MX_INDEX_FP8",
    "RECORDS",
    "decode",
    "default_layout",
    "dequantize_and_gather_k_cache",
    "encode",
    "indexer_k_norm_rope_store",
    "insert_records",
    "page_geometry",
    "quantize_and_insert_k_cache",
    "read_slots",
    "rope_quant_insert",
    "slot_offsets",
]


def default_layout(record: Record | str) -> str:
    """The layout vLLM 0.33.0 gives this record's pages."""
    return _VLLM_LAYOUT[record if isinstance(record, str) else record.name]


def check_layout(layout, record: Record) -> str:
    if layout is None:
        return default_layout(record)
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS} (or None: vLLM's), got {layout!r}")
    return layout


def slot_offsets(S: int, pos, record: Record, layout: str):
    """Byte offsets of slot `pos`'s data and scales within its page."""
    pos = np.asarray(pos, np.int64)
    if layout == "interleaved":
        return pos * record.bytes, pos * record.bytes + record.data_bytes
    return pos * record.data_bytes, S * record.data_bytes + pos * record.scale_bytes


# --------------------------------------------------------------------------------------------
# the codec


def ceil_log2(y: np.ndarray) -> np.ndarray:
    """ceil(log2(y)) of positive normal float32 values, exactly (from their bits), int32."""
    bits = np.asarray(y, np.float32).view(np.uint32).astype(np.int64)
    return (((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0)).astype(np.int32)


def pow2(e) -> np.ndarray:
    """2^e as float32 (e int, in [-149, 127])."""
    return np.ldexp(np.float32(1.0), np.asarray(e, np.int32)).astype(np.float32)


def e2m1_codes(x: np.ndarray) -> np.ndarray:
    """float32 -> e2m1 codes (uint8 0..15): round to nearest even, saturating at 6, sign kept."""
    a = np.abs(x)
    # midpoints between codes c and c + 1; a tie goes to the even code
    code = (
        (a > 0.25).astype(np.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0)
    ).astype(np.uint8)
    return code | (np.signbit(x).astype(np.uint8) << 3)


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 codes [N, 2m] -> [N, m], element 2i in the low nibble of byte i."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def _unpack_nibbles(b: np.ndarray) -> np.ndarray:
    out = np.empty((b.shape[0], 2 * b.shape[1]), np.uint8)
    out[:, 0::2], out[:, 1::2] = b & 0xF, b >> 4
    return out


def _e4m3_bytes(q: np.ndarray) -> np.ndarray:
    return q.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def encode(x: np.ndarray, record: Record) -> tuple[np.ndarray, np.ndarray]:
    """float32 rows [N, dims] (finite) -> (data uint8 [N, data_bytes], scales uint8 [N, scale_bytes])."""
    x = np.asarray(x, np.float32)
    N = x.shape[0]
    g = x.reshape(N, record.dims // record.group, record.group)
    amax = np.abs(g).max(axis=-1)
    with np.errstate(under="ignore", over="ignore"):
        if record.name == "index_fp8_mx":  # one amax over the key, its exponent in all four bytes
            amax = np.repeat(amax.max(axis=-1, keepdims=True), g.shape[1], axis=-1)
        if record.name in ("mxfp8", "index_fp8", "index_fp8_mx"):
            e = ceil_log2(np.maximum(amax, FP8_AMAX_FLOOR) * INV_FP8_MAX)
            q = np.clip(g * pow2(-e)[..., None], -FP8_MAX, FP8_MAX)
            data = _e4m3_bytes(q).reshape(N, record.data_bytes)
            if record.name != "index_fp8":
                scales = np.clip(e + 127, 0, 255).astype(np.uint8)
            else:
                scales = pow2(e).astype("<f4").view(np.uint8).reshape(N, 4)
        elif record.name == "nvfp4":
            s = np.clip(amax * INV_FP4_MAX, NVFP4_SCALE_MIN, NVFP4_SCALE_MAX).astype(ml_dtypes.float8_e4m3fn)
            codes = e2m1_codes(g / s.astype(np.float32)[..., None]).reshape(N, record.dims)
            data, scales = _pack_nibbles(codes), s.view(np.uint8)
        else:  # index_mxfp4
            e = np.clip(ceil_log2(np.maximum(amax, MXFP4_AMAX_FLOOR) * INV_FP4_MAX), -127, 127)
            codes = e2m1_codes(g * pow2(-e)[..., None]).reshape(N, record.dims)
            data, scales = _pack_nibbles(codes), (e + 127).astype(np.uint8)
    return np.ascontiguousarray(data), np.ascontiguousarray(scales)


def decode(data: np.ndarray, scales: np.ndarray, record: Record) -> np.ndarray:
    """Slot bytes -> float32 [N, dims]: main records rounded to bf16 (as vLLM's gathers), index
    keys exact float32."""
    N = data.shape[0]
    G = record.dims // record.group
    if record.name in ("mxfp8", "index_fp8", "index_fp8_mx"):
        v = np.ascontiguousarray(data).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    else:
        v = E2M1_VALUES[_unpack_nibbles(data)]
    if record.name in ("mxfp8", "index_mxfp4", "index_fp8_mx"):
        with np.errstate(over="ignore"):  # byte 255: 2^128 = inf in float32
            s = np.ldexp(np.float64(1.0), scales.astype(np.int32) - 127).astype(np.float32)
    elif record.name == "nvfp4":
        s = np.ascontiguousarray(scales).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    else:
        s = np.ascontiguousarray(scales).view("<f4").astype(np.float32)
    with np.errstate(under="ignore", over="ignore", invalid="ignore"):
        y = (v.reshape(N, G, record.group) * s.reshape(N, G, 1)).reshape(N, record.dims)
    if record.main:
        y = y.astype(ml_dtypes.bfloat16).astype(np.float32)
    return y


# --------------------------------------------------------------------------------------------
# pages


class Geometry(NamedTuple):
    num_blocks: int
    S: int  # slots per page
    record: Record
    page_stride: int  # bytes from one page to the next


def page_geometry(
    shape, strides, block_size=None, bytes_per_token=None, name: str = "k_cache", mx_scales: bool = False
) -> Geometry:
    """The geometry of V4.1 pages with this shape and these byte strides (the one page check of
    the NumPy reference, torch and JAX): uint8 [num_blocks, S, W] with strides (P, W, 1), W a
    record's bytes, P >= S * W (the record and S read off the shape; `block_size` /
    `bytes_per_token` when given must agree), or [num_blocks, P] with unit stride and both given.
    mx_scales: 132-byte records are FP8 index keys with UE8M0 scales (`MX_INDEX_FP8`). Raises
    ValueError naming `name`."""
    shape, strides = tuple(int(v) for v in shape), tuple(int(v) for v in strides)
    S = None if block_size is None else check_block_size(block_size, "block_size")
    W = None if bytes_per_token is None else as_int(bytes_per_token, "bytes_per_token")
    if W is not None and W not in BY_BYTES:
        raise ValueError(f"bytes_per_token: expected one of {sorted(BY_BYTES)} (a V4.1 record), got {W}")
    many = shape[0] > 1 if shape else False
    if len(shape) == 3:
        if shape[2] not in BY_BYTES:
            raise ValueError(
                f"{name}: the last dim {shape[2]} is not a V4.1 record's bytes {sorted(BY_BYTES)} (got shape {shape})"
            )
        if W is not None and W != shape[2]:
            raise ValueError(f"bytes_per_token: {W}, but {name} holds {shape[2]}-byte records (shape {shape})")
        if S is not None and S != shape[1]:
            raise ValueError(f"block_size: {S}, but {name} holds {shape[1]} slots per page (shape {shape})")
        S, W = check_block_size(shape[1], f"{name}.shape[1]"), shape[2]
        if strides[1:] != (W, 1):
            raise ValueError(
                f"{name}: each page's bytes must be contiguous (strides (P, {W}, 1)), got strides {strides}"
            )
        P = strides[0] if many else S * W
    elif len(shape) == 2:
        if S is None or W is None:
            raise ValueError(
                f"{name}: 2-D pages [num_blocks, page_stride] need block_size and bytes_per_token "
                f"(or pass the [num_blocks, block_size, record_bytes] view), got shape {shape}"
            )
        if strides[1] != 1 or (many and strides[0] != shape[1]):
            raise ValueError(f"{name}: 2-D pages must be row-major bytes, got strides {strides}")
        P = shape[1]
    else:
        raise ValueError(f"{name}: expected uint8 [num_blocks, block_size, record_bytes] pages, got shape {shape}")
    if P < S * W:
        raise ValueError(f"{name}: page stride {P} bytes is below block_size * record bytes = {S} * {W} = {S * W}")
    if not isinstance(mx_scales, (bool, np.bool_)):
        raise TypeError(f"mx_scales: expected a bool, got {mx_scales!r}")
    if mx_scales and W != MX_INDEX_FP8.bytes:
        raise ValueError(
            f"mx_scales: only FP8 index keys (132-byte records) have UE8M0 scales, {name} holds {W}-byte records"
        )
    return Geometry(shape[0], S, MX_INDEX_FP8 if mx_scales else BY_BYTES[W], P)


def _pages(k_cache, block_size, bytes_per_token, *, writable: bool, mx_scales: bool = False) -> Geometry:
    if not isinstance(k_cache, np.ndarray):
        raise TypeError(f"k_cache: expected a numpy.ndarray, got {type(k_cache).__name__}")
    if k_cache.dtype != np.uint8:
        raise TypeError(f"k_cache: expected uint8 pages (V4.1 record bytes), got {k_cache.dtype}")
    geo = page_geometry(k_cache.shape, k_cache.strides, block_size, bytes_per_token, mx_scales=mx_scales)
    if writable and not k_cache.flags.writeable:
        raise ValueError("k_cache: is read-only; it is written in place")
    return geo


def _byte_index(k_cache: np.ndarray, page, offsets):
    """Index tuple for bytes `offsets` ([N, w], within each page) of pages `page` ([N])."""
    if k_cache.ndim == 3:
        row, col = np.divmod(offsets, k_cache.shape[2])
        return page[:, None], row, col
    return page[:, None], offsets


def read_slots(k_cache, geo: Geometry, layout: str, page, pos) -> tuple[np.ndarray, np.ndarray]:
    """(data [N, D], scales [N, C]) bytes of slots (page[n], pos[n])."""
    d0, s0 = slot_offsets(geo.S, pos, geo.record, layout)
    r = geo.record
    data = k_cache[_byte_index(k_cache, page, d0[:, None] + np.arange(r.data_bytes))]
    scales = k_cache[_byte_index(k_cache, page, s0[:, None] + np.arange(r.scale_bytes))]
    return np.ascontiguousarray(data), np.ascontiguousarray(scales)


# --------------------------------------------------------------------------------------------
# writers


def insert_records(
    x, k_cache, slot_mapping, block_size=None, *, bytes_per_token=None, layout=None, mx_scales=False
) -> None:
    """Quantize float32 rows `x` [T, dims] (finite) into their slots of `k_cache`, in place.

    slot_mapping: [T'] integers, T' <= T; -1 skips a token; slot s -> page s // S, position
    s % S; each slot at most once, < num_blocks * S. Bytes no written slot owns stay as they were.
    mx_scales: 132-byte pages hold FP8 index keys with UE8M0 scales (`MX_INDEX_FP8`).
    """
    geo = _pages(k_cache, block_size, bytes_per_token, writable=True, mx_scales=mx_scales)
    layout = check_layout(layout, geo.record)
    x = _check_rows(x, "x", geo.record.dims, np.float32)
    _write(x, k_cache, geo, layout, check_slot_mapping(slot_mapping, x.shape[0], geo.num_blocks * geo.S))


def _write(x, k_cache, geo: Geometry, layout: str, slots: np.ndarray, keep=None) -> None:
    live = slots >= 0
    if keep is not None:
        live &= keep
    live = np.flatnonzero(live)
    if live.size == 0:
        return
    data, scales = encode(x[live], geo.record)
    page, pos = slots[live] // geo.S, slots[live] % geo.S
    d0, s0 = slot_offsets(geo.S, pos, geo.record, layout)
    k_cache[_byte_index(k_cache, page, d0[:, None] + np.arange(data.shape[1]))] = data
    k_cache[_byte_index(k_cache, page, s0[:, None] + np.arange(scales.shape[1]))] = scales


def quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size=None, *, bytes_per_token=None, layout=None):
    """vLLM's writer of bf16 rows (no RoPE): `k` [T, 512] float32 holding bf16 values (or
    bfloat16) into mxfp8 (528 B) or nvfp4 (288 B) records of `k_cache`, in place
    (vLLM 0.33.0 `quantize_and_insert_k_cache(..., bytes_per_token=528)`; nvfp4 is ours)."""
    geo = _pages(k_cache, block_size, bytes_per_token, writable=True)
    if not geo.record.main:
        raise ValueError(f"k_cache: holds {geo.record.name} records; this writer takes mxfp8 or nvfp4 pages")
    layout = check_layout(layout, geo.record)
    k32 = _check_bf16_rows(k, "k", 512)
    _write(k32, k_cache, geo, layout, check_slot_mapping(slot_mapping, k32.shape[0], geo.num_blocks * geo.S))


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """GPT-J RoPE on the last 64 dims of float32 rows x [N, D] (pairs 2i, 2i + 1; cos, sin [N, 32]),
    in float32 as the kernels compute it: even * c - odd * s, odd * c + even * s."""
    y = x.copy()
    even, odd = x[:, -ROPE_DIM::2], x[:, -ROPE_DIM + 1 :: 2]
    y[:, -ROPE_DIM::2] = even * cos - odd * sin
    y[:, -ROPE_DIM + 1 :: 2] = odd * cos + even * sin
    return y


def rope_quant_insert(
    latent,
    positions,
    cos_sin_cache,
    kv_cache,
    slot_mapping,
    compress_ratio,
    *,
    block_size=None,
    bytes_per_token=None,
    layout=None,
) -> None:
    """vLLM 0.33.0's compressed-cache writer, in place: token t with slot_mapping[t] >= 0 and
    (positions[t] + 1) % compress_ratio == 0 gets latent[t] (bf16 values [T, 512]) RoPE'd at
    position (positions[t] // ratio) * ratio (cos_sin_cache [max_pos, 64]: 32 cos then 32 sin,
    float32 or bf16 values), then quantized whole into an mxfp8 or nvfp4 record."""
    geo = _pages(kv_cache, block_size, bytes_per_token, writable=True)
    if not geo.record.main:
        raise ValueError(f"kv_cache: holds {geo.record.name} records; rope_quant_insert writes mxfp8 or nvfp4 pages")
    layout = check_layout(layout, geo.record)
    x = _check_bf16_rows(latent, "latent", 512)
    slots, pos, keep, cs = _rope_args(x.shape[0], positions, cos_sin_cache, slot_mapping, compress_ratio, geo)
    rows = rope(x[: slots.shape[0]], cs[:, :32], cs[:, 32:])
    _write(rows, kv_cache, geo, layout, slots, keep)


def indexer_k_norm_rope_store(
    k_pre,
    positions,
    cos_sin_cache,
    rms_norm_weight,
    rms_norm_eps,
    k_cache,
    kv_slot_mapping,
    compress_ratio,
    use_fp4_cache,
    *,
    block_size=None,
    layout=None,
    mx_scales=False,
) -> None:
    """vLLM 0.33.0's index-key writer, in place: k_pre [T, 128] bf16 values -> RMSNorm (float32:
    k * (1 / sqrt(sum(k * k) / 128 + eps)) * w, rounded to bf16) -> RoPE as `rope_quant_insert`
    (each half rounded to bf16) -> index_mxfp4 (use_fp4_cache) or index_fp8 records (`rms_norm`);
    mx_scales: the FP8 keys' scale as four UE8M0 bytes (vLLM on SM100)."""
    geo = _pages(k_cache, block_size, None, writable=True, mx_scales=bool(mx_scales) and not use_fp4_cache)
    want = "index_mxfp4" if use_fp4_cache else MX_INDEX_FP8.name if mx_scales else "index_fp8"
    if not isinstance(use_fp4_cache, (bool, np.bool_)):
        raise TypeError(f"use_fp4_cache: expected a bool, got {use_fp4_cache!r}")
    if geo.record.name != want:
        raise ValueError(
            f"k_cache: holds {geo.record.name} records ({geo.record.bytes} B), but use_fp4_cache={bool(use_fp4_cache)} "
            f"writes {want} ({RECORDS[want].bytes} B)"
        )
    layout = check_layout(layout, geo.record)
    x = _check_bf16_rows(k_pre, "k_pre", 128)
    w = _check_weight(rms_norm_weight)
    eps = check_eps(rms_norm_eps)
    slots, pos, keep, cs = _rope_args(x.shape[0], positions, cos_sin_cache, kv_slot_mapping, compress_ratio, geo)
    k = rms_norm(x[: slots.shape[0]], w, eps)
    k = bf16(rope(k, cs[:, :32], cs[:, 32:]))
    _write(k, k_cache, geo, layout, slots, keep)


def tree_sum(x: np.ndarray) -> np.ndarray:
    """Row sums of float32 [N, 2^k] by halving (s[:, :h] + s[:, h:] until one column): one fixed
    order of float32 adds that torch and JAX repeat exactly."""
    while x.shape[1] > 1:
        h = x.shape[1] // 2
        x = x[:, :h] + x[:, h:]
    return x[:, 0]


def rms_norm(x: np.ndarray, w: np.ndarray, eps: np.float32) -> np.ndarray:
    """The index key's norm in float32, rounded to bf16: (x * (1 / sqrt(sum(x * x) / 128 + eps))) * w,
    the sum in `tree_sum`'s order (vLLM's kernel sums in its own float32 order: the two agree
    wherever that order's rounding does not move a bf16 result)."""
    var = tree_sum(x * x) / np.float32(x.shape[1])
    r = np.float32(1.0) / np.sqrt(var + eps)
    return bf16(x * r[:, None] * w)


def bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _rope_args(T, positions, cos_sin_cache, slot_mapping, compress_ratio, geo: Geometry):
    """Checked (slots [T'], positions [T'], written [T'], cos/sin rows [T', 64] float32)."""
    ratio = as_int(compress_ratio, "compress_ratio")
    if ratio not in (1, 2):
        raise ValueError(f"compress_ratio: V4.1's compressed caches have ratio 1 or 2, got {ratio}")
    slots = check_slot_mapping(slot_mapping, T, geo.num_blocks * geo.S)
    n = slots.shape[0]
    pos = _int_vector(positions, "positions")
    if pos.shape[0] < n:
        raise ValueError(f"positions: {pos.shape[0]} entries for {n} slots (expected >= {n})")
    pos = pos[:n]
    cs = np.asarray(cos_sin_cache)
    if cs.dtype not in (np.float32, np.dtype(ml_dtypes.bfloat16)):
        raise TypeError(f"cos_sin_cache: expected float32 (or bfloat16), got {cs.dtype}")
    if cs.ndim != 2 or cs.shape[1] != ROPE_DIM:
        raise ValueError(f"cos_sin_cache: expected shape [max_position, {ROPE_DIM}] (32 cos, 32 sin), got {cs.shape}")
    keep = (slots >= 0) & ((pos + 1) % ratio == 0)
    row = (pos // ratio) * ratio
    bad = np.flatnonzero(keep & ((pos < 0) | (row >= cs.shape[0])))
    if bad.size:
        t = int(bad[0])
        raise ValueError(
            f"positions: positions[{t}] = {int(pos[t])} has no row of cos_sin_cache ({cs.shape[0]} positions)"
        )
    rows = cs[np.where(keep, row, 0)].astype(np.float32) if cs.shape[0] else np.zeros((n, ROPE_DIM), np.float32)
    if not np.isfinite(rows[keep]).all():
        raise ValueError("cos_sin_cache: the rows of the written positions must be finite")
    return slots, pos, keep, rows


def _check_weight(w) -> np.ndarray:
    if isinstance(w, np.ndarray) and w.dtype == np.dtype(ml_dtypes.bfloat16):
        w = w.astype(np.float32)
    if isinstance(w, np.ndarray) and w.ndim == 1:
        return _check_rows(w[None], "rms_norm_weight", 128, np.float32)[0]
    shape = getattr(w, "shape", None)
    raise ValueError(f"rms_norm_weight: expected a float32 (or bfloat16) numpy array of shape [128], got {shape}")


def check_eps(eps) -> np.float32:
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, (int, float, np.floating, np.integer)):
        raise TypeError(f"rms_norm_eps: expected a float, got {eps!r}")
    e = np.float32(eps)
    if not np.isfinite(e) or e < 0:
        raise ValueError(f"rms_norm_eps: expected a finite float >= 0, got {eps!r}")
    return e


def _check_rows(x, name: str, dims: int, dtype) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a numpy.ndarray, got {type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"{name}: expected {np.dtype(dtype)}, got {x.dtype}")
    if x.ndim != 2 or x.shape[1] != dims:
        raise ValueError(f"{name}: expected shape [T, {dims}], got {x.shape}")
    x = np.ascontiguousarray(x, np.float32)
    bad = ~np.isfinite(x)
    if bad.any():
        t, d = (int(v) for v in np.argwhere(bad)[0])
        raise ValueError(f"{name}: must be finite, got {name}[{t}, {d}] = {float(x[t, d])}")
    return x


def _check_bf16_rows(x, name: str, dims: int) -> np.ndarray:
    """float32 rows holding bf16 values (or bfloat16), checked, as float32."""
    if isinstance(x, np.ndarray) and x.dtype == np.dtype(ml_dtypes.bfloat16):
        return _check_rows(x.astype(np.float32), name, dims, np.float32)
    if isinstance(x, np.ndarray) and x.dtype != np.float32:
        raise TypeError(f"{name}: expected float32 holding bf16 values (or bfloat16), got {x.dtype}")
    x32 = _check_rows(x, name, dims, np.float32)
    off = x32 != bf16(x32)
    if off.any():
        t, d = (int(v) for v in np.argwhere(off)[0])
        raise ValueError(
            f"{name}: must hold bf16 values, got {name}[{t}, {d}] = {float(x32[t, d])!r} "
            "(round with .astype(ml_dtypes.bfloat16) first)"
        )
    return x32


# --------------------------------------------------------------------------------------------
# reader


def dequantize_and_gather_k_cache(
    out,
    k_cache,
    seq_lens,
    gather_lens,
    block_table,
    block_size=None,
    offset=0,
    *,
    bytes_per_token=None,
    layout=None,
    mx_scales=False,
) -> None:
    """vLLM's reader, in place, for any V4.1 record: row i < gather_lens[b] of request b (position
    seq_lens[b] - gather_lens[b] + i, on page block_table[b, pos // S], slot pos % S) is decoded
    into out[b, offset + i]; out float32 [R', rows, dims] (dims 512 for KV records, holding bf16
    values; 128 for index keys). gather_lens None = seq_lens. Other rows are left as they were.
    mx_scales: 132-byte pages hold FP8 index keys with UE8M0 scales."""
    geo = _pages(k_cache, block_size, bytes_per_token, writable=False, mx_scales=mx_scales)
    layout = check_layout(layout, geo.record)
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out: expected a numpy.ndarray, got {type(out).__name__}")
    if out.dtype != np.float32:
        raise TypeError(f"out: expected float32, got {out.dtype}")
    dims = geo.record.dims
    if out.ndim != 3 or out.shape[2] != dims:
        raise ValueError(f"out: expected shape [R, rows, {dims}] for {geo.record.name} records, got {out.shape}")
    if not out.flags.writeable:
        raise ValueError("out: is read-only; it is written in place")
    seq, g, bt, off = check_gather_args(seq_lens, gather_lens, block_table, geo.S, geo.num_blocks, out.shape, offset)
    req = np.repeat(np.arange(seq.shape[0]), g)
    i = np.arange(req.shape[0]) - np.repeat(np.cumsum(g) - g, g)
    p = (seq - g)[req] + i
    data, scales = read_slots(k_cache, geo, layout, bt[req, p // geo.S], p % geo.S)
    out[req, off + i] = decode(data, scales, geo.record)
