"""The `fp8_ds_mla` cache on `jax.Array`s in plain jnp / lax: the codec and the xla backend.

The elementwise codec (integer math: the e4m3 cast, the UE8M0 exponent, the exact bf16 decode)
is shared with the Pallas kernels (`dsv4_jax.kernels.triton.kvcache`); `quantize_insert` and
`gather_dequant` are `dsv4_jax.kvcache`'s "xla" backend (gathers and scatters of whole slots, any
platform). Callers check arguments first (`dsv4_jax.kvcache`); nothing here reads or writes
outside the arrays.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from planner import kvcache as ref
from planner.kvcache import HEAD_DIM, N_GROUPS, NOPE_DIM, SLOT_DATA_BYTES, SLOT_SCALE_BYTES

# --------------------------------------------------------------------------------------------
# elementwise pieces shared by the xla path and the Pallas kernels (integer math)


def exponent(amax):
    """e = ceil(log2(max(amax, 1e-4) / 448)), int32, exact for bf16 amax (see planner.kvcache)."""
    bits = lax.bitcast_convert_type(jnp.maximum(amax, jnp.float32(ref.AMAX_FLOOR)), jnp.int32)
    return ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).astype(jnp.int32)


def e4m3_code(q):
    """float32 in [-448, 448] -> e4m3 bit pattern as int32 (0..255), round to nearest even."""
    bits = lax.bitcast_convert_type(q, jnp.int32)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # |q| < 2^-6: the nearest multiple of 2^-9 (ties to even), from the 24-bit significand.
    sig = (mag & 0x7FFFFF) | 0x800000
    sh = jnp.clip(141 - (mag >> 23), 1, 25)
    sub = (sig + (1 << (sh - 1)) - 1 + ((sig >> sh) & 1)) >> sh
    return jnp.where(mag >= (121 << 23), normal, sub) | sign


def quantize_groups(x):
    """float32 [..., 8, 64] (group 7 = the RoPE dims, ignored) -> (codes int32 [..., 8, 64], e [..., 8])."""
    grp = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 2)
    amax = jnp.max(jnp.where(grp < N_GROUPS, jnp.abs(x), 0.0), axis=-1)
    e = exponent(amax)
    inv = lax.bitcast_convert_type((127 - e) << 23, jnp.float32)  # 2^-e, e in [-22, 120]
    q = jnp.clip(x * inv[..., None], -ref.FP8_MAX, ref.FP8_MAX)
    return e4m3_code(q), e


def scale_bytes(e):
    grp = lax.broadcasted_iota(jnp.int32, e.shape, e.ndim - 1)
    return jnp.where(grp < N_GROUPS, jnp.clip(e + 127, 0, 255), 0)


def dequant_bits_exact(byte, sb):
    """e4m3 byte and scale byte (int32) -> bf16 bits (int32) of e4m3 * 2^(sb - 127), rounded
    to nearest even as float32 math then a bf16 cast would (scale byte 255: 2^128 = inf)."""
    sign = (byte & 0x80) << 8
    c = byte & 0x7F
    # value = (8 + mant) * 2^(E_eff - 10); subnormal codes c < 8 normalized to E_eff <= 0
    cv = jnp.where(c >= 8, c, jnp.where(c >= 4, (c - 4) * 2, jnp.where(c >= 2, (c - 2) * 4 - 8, -16)))
    mant = cv & 7
    field = (cv >> 3) + sb - 7  # the bf16 biased exponent
    normal = (field << 7) | (mant << 4)
    v = 8 + mant
    up = field + 3  # bf16 subnormal: v * 2^(field + 3) units of 2^-133
    exact_sub = v << jnp.clip(up, 0, 7)
    sh = jnp.clip(-up, 1, 30)
    round_sub = (v + (1 << (sh - 1)) - 1 + ((v >> sh) & 1)) >> sh
    bits = jnp.where(field >= 255, 0x7F80, jnp.where(field >= 1, normal, jnp.where(up >= 0, exact_sub, round_sub)))
    bits = jnp.where(c == 0, 0, bits) | sign
    bits = jnp.where(sb == 255, jnp.where(c == 0, 0x7FC0, 0x7F80 | sign), bits)  # x * inf; 0 * inf = NaN
    return jnp.where(c == 0x7F, 0x7FC0, bits)  # NaN codes


def dequant_float(byte, sb):
    """The same value by float32 math (GPU path): e4m3 decoded by bits, times 2^(sb - 127), to bf16."""
    c = byte & 0x7F
    sign = (byte & 0x80) << 24
    normal = lax.bitcast_convert_type(sign | ((c << 20) + (120 << 23)), jnp.float32)
    sub = lax.bitcast_convert_type(
        lax.bitcast_convert_type(c.astype(jnp.float32) * jnp.float32(2.0**-9), jnp.int32) | sign, jnp.float32
    )
    x = jnp.where(c >= 8, normal, sub)
    x = jnp.where(c == 0x7F, jnp.float32(jnp.nan), x)
    scale = lax.bitcast_convert_type(jnp.where(sb == 0, 0x400000, sb << 23), jnp.float32)
    return (x * scale).astype(jnp.bfloat16)


def bits_to_bf16(bits):
    return lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


# --------------------------------------------------------------------------------------------
# writer


def encode_tokens(k):
    """bf16 [T, 512] -> (data uint8 [T, 576], scales uint8 [T, 8])."""
    T = k.shape[0]
    codes, e = quantize_groups(k.astype(jnp.float32).reshape(T, 8, 64))
    bits = lax.bitcast_convert_type(k[:, NOPE_DIM:], jnp.uint16).astype(jnp.int32)
    rope = jnp.stack([bits & 0xFF, bits >> 8], axis=-1).reshape(T, 2 * (HEAD_DIM - NOPE_DIM))
    data = jnp.concatenate([codes[:, :N_GROUPS].reshape(T, NOPE_DIM), rope], axis=1).astype(jnp.uint8)
    return data, scale_bytes(e).astype(jnp.uint8)


def _scatter_windows(operand, page, col, updates):
    """operand[page[t], col[t] : col[t] + W] = updates[t]; windows out of bounds are dropped."""
    dnums = lax.ScatterDimensionNumbers(
        update_window_dims=(1,), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0, 1)
    )
    idx = jnp.stack([page, col], axis=1)
    return lax.scatter(operand, idx, updates, dnums, mode=lax.GatherScatterMode.FILL_OR_DROP)


@functools.partial(jax.jit, static_argnames=("S",))
def quantize_insert(k, k_cache, slots, S):
    nb = k_cache.shape[0]
    data, scales = encode_tokens(k)
    live = (slots >= 0) & (slots < nb * S)
    page = jnp.where(live, slots // S, nb)  # out of bounds: dropped
    pos = jnp.where(live, slots % S, 0)
    k_cache = _scatter_windows(k_cache, page, pos * SLOT_DATA_BYTES, data)
    return _scatter_windows(k_cache, page, S * SLOT_DATA_BYTES + pos * SLOT_SCALE_BYTES, scales)


# --------------------------------------------------------------------------------------------
# reader


def decode_rows(data, sc, exact=None):
    """uint8 [N, 576] slot data and [N, 8] scale bytes -> bf16 bits, uint16 [N, 512].

    Everything stays in integers up to the caller's final bitcast: XLA on CPU computes bf16
    selects in float32, which would rewrite the NaN payloads of copied RoPE dims. The e4m3
    dims take the float32 decode (fast) when every scale byte is >= 10, where all products are
    normal floats (XLA on CPU flushes subnormals), else the integer one; `exact` forces one.
    """
    N = data.shape[0]

    def unpack(data, sc):  # inside the branches: a cond operand is materialized, so pass bytes
        return data[:, :NOPE_DIM].astype(jnp.int32).reshape(N, N_GROUPS, 64), sc[:, :N_GROUPS].astype(jnp.int32)[
            ..., None
        ]

    def fast(data, sc):
        return lax.bitcast_convert_type(dequant_float(*unpack(data, sc)), jnp.uint16)

    def slow(data, sc):
        return dequant_bits_exact(*unpack(data, sc)).astype(jnp.uint16)

    if exact is None:
        nope = lax.cond(jnp.all(sc[:, :N_GROUPS] >= 10), fast, slow, data, sc)
    else:
        nope = (slow if exact else fast)(data, sc)
    pair = data[:, NOPE_DIM:].astype(jnp.uint16).reshape(N, HEAD_DIM - NOPE_DIM, 2)
    return jnp.concatenate([nope.reshape(N, NOPE_DIM), pair[..., 0] | (pair[..., 1] << 8)], axis=1)


NAN_BITS = 0x7FC0


@functools.partial(jax.jit, static_argnames=("S", "offset", "exact"))
def gather_dequant(out, k_cache, seq, glen, bt, S, offset, exact=None):
    R = seq.shape[0]
    n = out.shape[1] - offset  # rows each request may fill
    nb, max_blocks = k_cache.shape[0], bt.shape[1]
    i = jnp.arange(n, dtype=jnp.int32)[None, :]
    want = i < glen[:, None]  # [R, n]
    pos = (seq - glen)[:, None] + i
    col = pos // S
    page = jnp.take_along_axis(bt, jnp.clip(col, 0, max_blocks - 1), axis=1)
    good = (pos >= 0) & (col < max_blocks) & (page >= 0) & (page < nb)
    page = jnp.where(good, page, 0).reshape(-1)
    slot = jnp.where(good, pos % S, 0).reshape(-1)
    # page_bytes is a multiple of 576: slot p of page g is row g * (page_bytes / 576) + p of the
    # pages seen as 576-byte rows, and its scales are 8-byte row g * page_bytes / 8 + S * 72 + p.
    pb = k_cache.shape[1]
    data = jnp.take(k_cache.reshape(-1, SLOT_DATA_BYTES), page * (pb // SLOT_DATA_BYTES) + slot, axis=0, mode="clip")
    sc_row = page * (pb // SLOT_SCALE_BYTES) + S * (SLOT_DATA_BYTES // SLOT_SCALE_BYTES) + slot
    sc = jnp.take(k_cache.reshape(-1, SLOT_SCALE_BYTES), sc_row, axis=0, mode="clip")
    rows = jnp.where(good[..., None], decode_rows(data, sc, exact).reshape(R, n, HEAD_DIM), jnp.uint16(NAN_BITS))
    bits = lax.bitcast_convert_type(out, jnp.uint16)
    if R == out.shape[0] and offset == 0:  # the whole of out: one select, no update-slice
        return lax.bitcast_convert_type(jnp.where(want[..., None], rows, bits), jnp.bfloat16)
    bits = bits.at[:R, offset:].set(jnp.where(want[..., None], rows, bits[:R, offset:]))
    return lax.bitcast_convert_type(bits, jnp.bfloat16)
