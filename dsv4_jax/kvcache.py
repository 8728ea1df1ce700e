"""vLLM's DeepSeek-V4 KV cache pages (`fp8_ds_mla`) on `jax.Array`s: write and gather-dequantize.

The same two functions as vLLM 0.33.0 and `planner.kvcache` (the NumPy reference, whose bytes
and values these match exactly), functional: each returns the new array.

    quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size) -> k_cache
    dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset) -> out

Both work under `jax.jit` (block_size and offset are static Python ints; donate k_cache / out to
update them in place). Backends (keyword `backend=`, names as `dsv4_jax.sparse_attention`'s):
  "xla"               plain jnp / lax (gathers and scatters of whole slots), any platform;
  "pallas_triton"     Pallas kernels lowered through Triton, NVIDIA GPUs;
  "pallas_interpret"  the same kernels under Pallas' interpreter (any platform; for tests);
  "cpu"               the gather only: `planner.ckernel`'s C kernel as an XLA FFI call on CPU
                      (`dsv4_jax/kernels/cpu_kvcache.py`, built once per machine), one pass per row;
  "auto" = pallas_triton on an NVIDIA GPU; on CPU the gather runs "cpu" where it builds (else
  xla: the same bits) and the writer xla; "pallas" = pallas_triton, else pallas_interpret.

Checks: shapes and dtypes always. Values (`validate=True`, the default) when the arrays are
concrete: slots, block-table entries and lengths against the pages and `out`, finiteness of k
(a host read of the small per-request arrays). Traced values cannot be checked; there a slot
outside the pages is dropped like -1 (no write outside the pages), and a gathered row whose
block-table entry or position is not a page of k_cache comes out NaN (no read outside the pages).

Numerics: the e4m3 cast and the scale exponent are integer math (round to nearest even), and
the xla / interpreted gathers build the bf16 bits with integer math too: XLA on CPU flushes
float32 subnormals, which a float multiply by 2^(byte - 127) would hit for scale bytes below
~20 (never written by this writer; vLLM's pages hold bytes 105..247). The Triton kernel
multiplies in float32 (GPUs keep subnormals), the fast path for real pages.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from planner import kvcache as ref
from planner.kvcache import (
    HEAD_DIM,
    N_GROUPS,
    NOPE_DIM,
    SLOT_DATA_BYTES,
    SLOT_SCALE_BYTES,
    page_bytes,
)

__all__ = [
    "BACKENDS",
    "copy_slots",
    "cpu_unavailable_reason",
    "dequantize_and_gather_k_cache",
    "page_bytes",
    "quantize_and_insert_k_cache",
    "resolve_backend",
]

_INT_DTYPES = (jnp.dtype(jnp.int32), jnp.dtype(jnp.int64), jnp.dtype(jnp.uint32))


BACKENDS = ("xla", "pallas_triton", "pallas_interpret", "cpu")  # and "auto", "pallas"
OPS = ("gather", "insert")


def cpu_unavailable_reason() -> str | None:
    """Why the C gather kernel (backend "cpu") cannot run on this machine (None: it can)."""
    from dsv4_jax.kernels import cpu_kvcache

    return cpu_kvcache.unavailable_reason()


def resolve_backend(backend: str = "auto", *arrays, op: str = "gather") -> str:
    """The concrete backend a call (`op`: "gather" or "insert") runs: "xla", "pallas_triton",
    "pallas_interpret" or "cpu".

    Same rule as `dsv4_jax.attention.resolve_backend` (the devices of committed `arrays`, else
    JAX's default device), plus the C kernel for gathers on CPU; a named backend that cannot
    run raises BackendUnavailableError, saying why.
    """
    from dsv4_jax.attention import BackendUnavailableError, _committed_devices
    from dsv4_jax.attention import resolve_backend as resolve

    if op not in OPS:
        raise ValueError(f"op: expected one of {OPS}, got {op!r}")
    devices = _committed_devices(arrays)
    platforms = {d.platform for d in devices} if devices else {jax.default_backend()}
    if backend == "cpu":
        if op != "gather":
            raise BackendUnavailableError(
                "backend 'cpu' has the gather only (dequantize_and_gather_k_cache); "
                "quantize_and_insert_k_cache on CPU runs backend='xla'"
            )
        if platforms != {"cpu"}:
            raise BackendUnavailableError(f"backend 'cpu' cannot run here: the arrays are on {sorted(platforms)}, not the CPU")
        from dsv4_jax.kernels import cpu_kvcache

        if (reason := cpu_kvcache.unavailable_reason()) is not None:
            raise BackendUnavailableError(f"backend 'cpu' cannot run here: {reason}")
        return "cpu"
    if backend == "auto" and platforms == {"cpu"}:  # the attention's choice ("cpu" / "xla") is not the gather's
        from dsv4_jax.kernels import cpu_kvcache

        return "cpu" if op == "gather" and cpu_kvcache.unavailable_reason() is None else "xla"
    return resolve(backend, *arrays)


# --------------------------------------------------------------------------------------------
# elementwise pieces shared by the xla path and the Pallas kernels (integer math)


def _exponent(amax):
    """e = ceil(log2(max(amax, 1e-4) / 448)), int32, exact for bf16 amax (see planner.kvcache)."""
    bits = lax.bitcast_convert_type(jnp.maximum(amax, jnp.float32(ref.AMAX_FLOOR)), jnp.int32)
    return ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).astype(jnp.int32)


def _e4m3_code(q):
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


def _quantize_groups(x):
    """float32 [..., 8, 64] (group 7 = the RoPE dims, ignored) -> (codes int32 [..., 8, 64], e [..., 8])."""
    grp = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 2)
    amax = jnp.max(jnp.where(grp < N_GROUPS, jnp.abs(x), 0.0), axis=-1)
    e = _exponent(amax)
    inv = lax.bitcast_convert_type((127 - e) << 23, jnp.float32)  # 2^-e, e in [-22, 120]
    q = jnp.clip(x * inv[..., None], -ref.FP8_MAX, ref.FP8_MAX)
    return _e4m3_code(q), e


def _scale_bytes(e):
    grp = lax.broadcasted_iota(jnp.int32, e.shape, e.ndim - 1)
    return jnp.where(grp < N_GROUPS, jnp.clip(e + 127, 0, 255), 0)


def _dequant_bits_exact(byte, sb):
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


def _dequant_float(byte, sb):
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


def _bits_to_bf16(bits):
    return lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


# --------------------------------------------------------------------------------------------
# writer


def quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size=64, *, backend="auto", validate=True):
    """Quantize `k` into its slots of `k_cache`; returns the new pages (vLLM's writer).

    Args:
      k: [T, 512] bfloat16 (finite).
      k_cache: uint8 [num_blocks, page_bytes(block_size)].
      slot_mapping: [T'] int32/int64, T' <= T: -1 skips a token; slot s -> page s // S, position
        s % S; each slot at most once, < num_blocks * S.
      block_size: slots per page S (a Python int).
      backend, validate: module doc.
    """
    S = ref._check_block_size(block_size, "block_size")
    num_blocks = _check_pages(k_cache, S)
    _check_dtype(k, "k", (jnp.dtype(jnp.bfloat16),), "bfloat16")
    if k.ndim != 2 or k.shape[1] != HEAD_DIM:
        raise ValueError(f"k: expected shape [T, {HEAD_DIM}], got {tuple(k.shape)}")
    _check_dtype(slot_mapping, "slot_mapping", _INT_DTYPES, "int32 or int64")
    if slot_mapping.ndim != 1:
        raise ValueError(f"slot_mapping: expected a 1-D array, got shape {tuple(slot_mapping.shape)}")
    n = slot_mapping.shape[0]
    if n > k.shape[0]:
        raise ValueError(f"slot_mapping: {n} entries for {k.shape[0]} tokens of k (expected <= {k.shape[0]})")
    name = resolve_backend(backend, k, k_cache, slot_mapping, op="insert")
    if validate and _concrete(k, slot_mapping):
        kk = np.asarray(jnp.asarray(k[:n], jnp.float32))
        bad = ~np.isfinite(kk)
        if bad.any():
            t, d = (int(v) for v in np.argwhere(bad)[0])
            raise ValueError(f"k: must be finite, got k[{t}, {d}] = {float(kk[t, d])}")
        ref._check_slot_mapping(np.asarray(slot_mapping), k.shape[0], num_blocks * S)
    if n == 0:
        return k_cache
    if name == "xla":
        return _insert_xla(k[:n], k_cache, slot_mapping.astype(jnp.int32), S)
    return _insert_pallas(k[:n], k_cache, slot_mapping.astype(jnp.int32), S, interpret=name == "pallas_interpret")


def _encode_tokens(k):
    """bf16 [T, 512] -> (data uint8 [T, 576], scales uint8 [T, 8])."""
    T = k.shape[0]
    codes, e = _quantize_groups(k.astype(jnp.float32).reshape(T, 8, 64))
    bits = lax.bitcast_convert_type(k[:, NOPE_DIM:], jnp.uint16).astype(jnp.int32)
    rope = jnp.stack([bits & 0xFF, bits >> 8], axis=-1).reshape(T, 2 * (HEAD_DIM - NOPE_DIM))
    data = jnp.concatenate([codes[:, :N_GROUPS].reshape(T, NOPE_DIM), rope], axis=1).astype(jnp.uint8)
    return data, _scale_bytes(e).astype(jnp.uint8)


def _scatter_windows(operand, page, col, updates):
    """operand[page[t], col[t] : col[t] + W] = updates[t]; windows out of bounds are dropped."""
    dnums = lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0, 1))
    idx = jnp.stack([page, col], axis=1)
    return lax.scatter(operand, idx, updates, dnums, mode=lax.GatherScatterMode.FILL_OR_DROP)


@functools.partial(jax.jit, static_argnames=("S",))
def _insert_xla(k, k_cache, slots, S):
    nb = k_cache.shape[0]
    data, scales = _encode_tokens(k)
    live = (slots >= 0) & (slots < nb * S)
    page = jnp.where(live, slots // S, nb)  # out of bounds: dropped
    pos = jnp.where(live, slots % S, 0)
    k_cache = _scatter_windows(k_cache, page, pos * SLOT_DATA_BYTES, data)
    return _scatter_windows(k_cache, page, S * SLOT_DATA_BYTES + pos * SLOT_SCALE_BYTES, scales)


def _insert_kernel(slot_ref, k_ref, cache_in_ref, cache_ref, *, S, num_blocks):
    from jax.experimental.pallas import triton as plt

    del cache_in_ref  # aliased with cache_ref
    slot = slot_ref[()]
    live = (slot >= 0) & (slot < num_blocks * S)
    page = jnp.where(live, slot // S, 0)
    pos = jnp.where(live, slot % S, 0)
    kb = k_ref[...]  # [8, 64] bf16
    codes, e = _quantize_groups(kb.astype(jnp.float32))
    grp = lax.broadcasted_iota(jnp.int32, (8, 64), 0)
    lane = lax.broadcasted_iota(jnp.int32, (8, 64), 1)
    base = pos * SLOT_DATA_BYTES
    pages = jnp.full((8, 64), page, jnp.int32)
    plt.store(cache_ref.at[pages, base + grp * 64 + lane], codes.astype(jnp.uint8), mask=(grp < N_GROUPS) & live)
    bits = lax.bitcast_convert_type(kb, jnp.uint16).astype(jnp.int32)  # row 7: the RoPE dims
    rope_cols = base + NOPE_DIM + 2 * lane
    rope_mask = (grp == N_GROUPS) & live
    plt.store(cache_ref.at[pages, rope_cols], (bits & 0xFF).astype(jnp.uint8), mask=rope_mask)
    plt.store(cache_ref.at[pages, rope_cols + 1], (bits >> 8).astype(jnp.uint8), mask=rope_mask)
    g8 = lax.broadcasted_iota(jnp.int32, (8,), 0)
    plt.store(
        cache_ref.at[jnp.full((8,), page, jnp.int32), S * SLOT_DATA_BYTES + pos * SLOT_SCALE_BYTES + g8],
        _scale_bytes(e).astype(jnp.uint8),
        mask=jnp.full((8,), live),
    )


@functools.partial(jax.jit, static_argnames=("S", "interpret"))
def _insert_pallas(k, k_cache, slots, S, interpret):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    T = k.shape[0]
    nb, pb = k_cache.shape
    kernel = functools.partial(_insert_kernel, S=S, num_blocks=nb)
    return pl.pallas_call(
        kernel,
        grid=(T,),
        in_specs=[
            pl.BlockSpec((pl.squeezed,), lambda t: (t,)),
            pl.BlockSpec((pl.squeezed, 8, 64), lambda t: (t, 0, 0)),
            pl.BlockSpec((nb, pb), lambda t: (0, 0)),
        ],
        out_specs=pl.BlockSpec((nb, pb), lambda t: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((nb, pb), jnp.uint8),
        input_output_aliases={2: 0},
        compiler_params=plt.CompilerParams(num_warps=2, num_stages=1),
        interpret=interpret,
        name="dsv4_kvcache_insert",
    )(slots, k.reshape(T, 8, 64), k_cache)


# --------------------------------------------------------------------------------------------
# reader


def dequantize_and_gather_k_cache(
    out, k_cache, seq_lens, gather_lens, block_table, block_size=64, offset=0, *, backend="auto", validate=True
):
    """Gather and dequantize rows of paged requests into a copy of `out`; returns it (vLLM's reader).

    Args:
      out: bf16 [R', rows, 512], R' >= R: row i < gather_lens[b] of request b lands at
        out[b, offset + i]; every other row keeps its value.
      k_cache: uint8 [num_blocks, page_bytes(block_size)].
      seq_lens: [R] int32, >= 0.   gather_lens: [R] int32 in [0, seq_lens[b]], or None (= seq_lens);
        row i is position seq_lens[b] - gather_lens[b] + i.
      block_table: [R'', max_blocks] int32, R'' >= R; entries holding a gathered position must be
        pages of k_cache (the rest are not read).
      block_size: slots per page S; offset: first row written (Python ints, static under jit).
      backend, validate: module doc.
    """
    S = ref._check_block_size(block_size, "block_size")
    num_blocks = _check_pages(k_cache, S)
    _check_dtype(out, "out", (jnp.dtype(jnp.bfloat16),), "bfloat16")
    if out.ndim != 3 or out.shape[2] != HEAD_DIM:
        raise ValueError(f"out: expected shape [R, rows, {HEAD_DIM}], got {tuple(out.shape)}")
    for name, x, ndim in (("seq_lens", seq_lens, 1), ("gather_lens", gather_lens, 1), ("block_table", block_table, 2)):
        if x is None:
            continue
        _check_dtype(x, name, _INT_DTYPES, "int32 (or int64)")
        if x.ndim != ndim:
            raise ValueError(f"{name}: expected a {ndim}-D array, got shape {tuple(x.shape)}")
    R = seq_lens.shape[0]
    ref.check_request_shapes(R, None if gather_lens is None else gather_lens.shape[0], block_table.shape, out.shape)
    try:
        offset = ref._int_scalar(offset, "offset", minimum=0)
    except ValueError:
        if isinstance(offset, jax.core.Tracer):
            raise TypeError("offset: must be a Python int (static under jit), got a traced value") from None
        raise
    if offset > out.shape[1]:
        raise ValueError(f"offset: {offset} is past out's {out.shape[1]} rows")
    name = resolve_backend(backend, out, k_cache, seq_lens, block_table)
    if validate and _concrete(seq_lens, gather_lens, block_table):
        ref.check_gather_args(
            np.asarray(seq_lens), None if gather_lens is None else np.asarray(gather_lens),
            np.asarray(block_table[:R]), S, num_blocks, tuple(out.shape), offset,
        )  # fmt: skip
    if R == 0 or offset == out.shape[1]:
        return out
    seq = seq_lens.astype(jnp.int32)
    glen = seq if gather_lens is None else gather_lens.astype(jnp.int32)
    bt = block_table[:R].astype(jnp.int32)
    if name == "xla":
        return _gather_xla(out, k_cache, seq, glen, bt, S, offset)
    if name == "cpu":
        from dsv4_jax.kernels import cpu_kvcache

        return cpu_kvcache.gather_dequant(out, k_cache, seq, glen, bt, S, offset)
    return _gather_pallas(out, k_cache, seq, glen, bt, S, offset, interpret=name == "pallas_interpret")


def _decode_rows(data, sc, exact=None):
    """uint8 [N, 576] slot data and [N, 8] scale bytes -> bf16 bits, uint16 [N, 512].

    Everything stays in integers up to the caller's final bitcast: XLA on CPU computes bf16
    selects in float32, which would rewrite the NaN payloads of copied RoPE dims. The e4m3
    dims take the float32 decode (fast) when every scale byte is >= 10, where all products are
    normal floats (XLA on CPU flushes subnormals), else the integer one; `exact` forces one.
    """
    N = data.shape[0]

    def unpack(data, sc):  # inside the branches: a cond operand is materialized, so pass bytes
        return data[:, :NOPE_DIM].astype(jnp.int32).reshape(N, N_GROUPS, 64), sc[:, :N_GROUPS].astype(jnp.int32)[..., None]

    def fast(data, sc):
        return lax.bitcast_convert_type(_dequant_float(*unpack(data, sc)), jnp.uint16)

    def slow(data, sc):
        return _dequant_bits_exact(*unpack(data, sc)).astype(jnp.uint16)

    if exact is None:
        nope = lax.cond(jnp.all(sc[:, :N_GROUPS] >= 10), fast, slow, data, sc)
    else:
        nope = (slow if exact else fast)(data, sc)
    pair = data[:, NOPE_DIM:].astype(jnp.uint16).reshape(N, HEAD_DIM - NOPE_DIM, 2)
    return jnp.concatenate([nope.reshape(N, NOPE_DIM), pair[..., 0] | (pair[..., 1] << 8)], axis=1)


_NAN_BITS = 0x7FC0


@functools.partial(jax.jit, static_argnames=("S", "offset", "exact"))
def _gather_xla(out, k_cache, seq, glen, bt, S, offset, exact=None):
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
    rows = jnp.where(good[..., None], _decode_rows(data, sc, exact).reshape(R, n, HEAD_DIM), jnp.uint16(_NAN_BITS))
    bits = lax.bitcast_convert_type(out, jnp.uint16)
    if R == out.shape[0] and offset == 0:  # the whole of out: one select, no update-slice
        return lax.bitcast_convert_type(jnp.where(want[..., None], rows, bits), jnp.bfloat16)
    bits = bits.at[:R, offset:].set(jnp.where(want[..., None], rows, bits[:R, offset:]))
    return lax.bitcast_convert_type(bits, jnp.bfloat16)


def _gather_kernel(seq_ref, glen_ref, bt_ref, cache_ref, out_in_ref, out_ref, *,
                   S, offset, num_blocks, block_r, workers, exact):  # fmt: skip
    from jax.experimental.pallas import triton as plt

    del out_in_ref  # aliased with out_ref
    rows, max_blocks = out_ref.shape[0], bt_ref.shape[0]
    w = pl_program_id(1)
    seq = seq_ref[()]
    g = glen_ref[()]
    n_blocks = (g + block_r - 1) // block_r
    trips = jnp.maximum(n_blocks - w + workers - 1, 0) // workers
    d = lax.broadcasted_iota(jnp.int32, (1, HEAD_DIM), 1)
    is_nope = d < NOPE_DIM
    lo_col = jnp.where(is_nope, d, NOPE_DIM + 2 * (d - NOPE_DIM))  # byte of dim d (RoPE: low byte)
    grp_col = jnp.minimum(d // 64, N_GROUPS - 1)

    def body(j, carry):
        blk = w + j * workers
        i = blk * block_r + lax.broadcasted_iota(jnp.int32, (block_r,), 0)
        want = (i < g) & (offset + i < rows)
        pos = seq - g + i
        col = pos // S
        ok = want & (pos >= 0) & (col < max_blocks)
        page = plt.load(bt_ref.at[jnp.where(ok, col, 0)], mask=ok, other=0)
        good = ok & (page >= 0) & (page < num_blocks)
        page = jnp.where(good, page, 0)[:, None]
        base = (jnp.where(good, pos % S, 0) * SLOT_DATA_BYTES)[:, None]
        sbase = (S * SLOT_DATA_BYTES + jnp.where(good, pos % S, 0) * SLOT_SCALE_BYTES)[:, None]
        m = good[:, None]
        lo = plt.load(cache_ref.at[page, base + lo_col], mask=m, other=0).astype(jnp.int32)
        hi = plt.load(cache_ref.at[page, base + lo_col + 1], mask=m & ~is_nope, other=0).astype(jnp.int32)
        sb = plt.load(cache_ref.at[page, sbase + grp_col], mask=m, other=127).astype(jnp.int32)
        if exact:
            nope = _dequant_bits_exact(lo, sb)
        else:
            nope = lax.bitcast_convert_type(_dequant_float(lo, sb), jnp.uint16).astype(jnp.int32)
        y = jnp.where(is_nope, nope, lo | (hi << 8))  # bf16 bits: NaN payloads of RoPE dims kept
        y = _bits_to_bf16(jnp.where(m, y, _NAN_BITS))  # rows whose page is not in k_cache: NaN
        # Masked lanes still name distinct in-bounds rows (block_r <= rows): the interpreter
        # stores them as read-modify-write, so a shared dummy row would race with a real one.
        orow = ((offset + i) % rows)[:, None]
        plt.store(out_ref.at[orow, jnp.broadcast_to(d, (block_r, HEAD_DIM))], y, mask=want[:, None])
        return carry

    lax.fori_loop(0, trips, body, 0)


def pl_program_id(axis):
    from jax.experimental import pallas as pl

    return pl.program_id(axis)


def default_workers(num_requests: int, interpret: bool) -> int:
    """Programs per request: ~8 per SM over the whole grid on GPUs, one in interpret mode."""
    if interpret or num_requests == 0:
        return 1
    try:
        sms = int(getattr(jax.devices()[0], "core_count", 132) or 132)
    except Exception:  # noqa: BLE001 - any device query failure: a sane default
        sms = 132
    return max(1, min(1024, -(-8 * sms // num_requests)))


@functools.partial(jax.jit, static_argnames=("S", "offset", "interpret", "exact", "block_r", "workers", "num_warps"))
def _gather_pallas(out, k_cache, seq, glen, bt, S, offset, interpret, exact=None, block_r=None, workers=None,
                   num_warps=4):  # fmt: skip
    """The Pallas reader. exact: integer decode (default in interpret mode, where XLA on CPU flushes
    subnormals) or float32 decode (default on GPUs). block_r rows per step, `workers` programs
    per request (static; None = `default_workers`)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    R = seq.shape[0]
    Rp, rows, _ = out.shape
    nb, pb = k_cache.shape
    max_blocks = bt.shape[1]
    br = block_r or (64 if interpret else 16)
    br = min(br, 1 << (rows.bit_length() - 1))  # a power of two <= rows (see the kernel's stores)
    nw = workers or default_workers(R, interpret)
    exact = interpret if exact is None else exact
    kernel = functools.partial(_gather_kernel, S=S, offset=offset, num_blocks=nb, block_r=br, workers=nw, exact=exact)
    return pl.pallas_call(
        kernel,
        grid=(R, nw),
        in_specs=[
            pl.BlockSpec((pl.squeezed,), lambda b, w: (b,)),
            pl.BlockSpec((pl.squeezed,), lambda b, w: (b,)),
            pl.BlockSpec((pl.squeezed, max_blocks), lambda b, w: (b, 0)),
            pl.BlockSpec((nb, pb), lambda b, w: (0, 0)),
            pl.BlockSpec((pl.squeezed, rows, HEAD_DIM), lambda b, w: (b, 0, 0)),
        ],
        out_specs=pl.BlockSpec((pl.squeezed, rows, HEAD_DIM), lambda b, w: (b, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((Rp, rows, HEAD_DIM), jnp.bfloat16),
        input_output_aliases={4: 0},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="dsv4_kvcache_gather",
    )(seq, glen, bt, k_cache, out)


# --------------------------------------------------------------------------------------------
# moving whole slots (bytes, no requantization)


def copy_slots(dst_cache, dst_slots, src_cache, src_slots, block_size):
    """dst_cache with slot dst_slots[i] = slot src_slots[i] of src_cache (576 data + 8 scale
    bytes); returns the new dst pages. Jit-compatible (block_size static).

    Both caches are uint8 [num_blocks, page_bytes(block_size)]; the slot arrays are 1-D integers
    of one length (slot s = page s // S, position s % S). A destination outside dst_cache (e.g. -1)
    is dropped; each destination at most once.
    """
    S = ref._check_block_size(block_size, "block_size")
    _check_pages(src_cache, S)
    _check_pages(dst_cache, S)
    pb = page_bytes(S)
    per_page, per_scale = pb // SLOT_DATA_BYTES, pb // SLOT_SCALE_BYTES
    sp, ss = src_slots // S, src_slots % S
    n_dst = dst_cache.shape[0] * S
    live = (dst_slots >= 0) & (dst_slots < n_dst)
    dp, ds = jnp.where(live, dst_slots // S, dst_cache.shape[0]), dst_slots % S  # out of range: dropped
    data = jnp.take(src_cache.reshape(-1, SLOT_DATA_BYTES), sp * per_page + ss, axis=0, mode="clip")
    sc_off = S * (SLOT_DATA_BYTES // SLOT_SCALE_BYTES)
    scales = jnp.take(src_cache.reshape(-1, SLOT_SCALE_BYTES), sp * per_scale + sc_off + ss, axis=0, mode="clip")
    rows = dst_cache.reshape(-1, SLOT_DATA_BYTES).at[dp * per_page + ds].set(data, mode="drop")
    dst = rows.reshape(dst_cache.shape)
    words = dst.reshape(-1, SLOT_SCALE_BYTES).at[dp * per_scale + sc_off + ds].set(scales, mode="drop")
    return words.reshape(dst_cache.shape)


# --------------------------------------------------------------------------------------------
# checks


def _check_dtype(x, name, dtypes, what):
    dtype = getattr(x, "dtype", None)
    if dtype is None or not hasattr(x, "shape"):
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
    if jnp.dtype(dtype) not in dtypes:
        raise TypeError(f"{name}: expected {what}, got {jnp.dtype(dtype)}")


def _check_pages(k_cache, S: int) -> int:
    dtype = getattr(k_cache, "dtype", None)
    if dtype is None or not hasattr(k_cache, "shape"):
        raise TypeError(f"k_cache: expected an array, got {type(k_cache).__name__}")
    if jnp.dtype(dtype) != jnp.dtype(jnp.uint8):
        raise TypeError(f"k_cache: expected uint8 pages (fp8_ds_mla bytes), got {jnp.dtype(dtype)}")
    want = page_bytes(S)
    if k_cache.ndim != 2:
        raise ValueError(f"k_cache: expected shape [num_blocks, {want}] (page_bytes({S})), got {tuple(k_cache.shape)}")
    if k_cache.shape[1] != want:
        raise ValueError(
            f"k_cache: page stride {k_cache.shape[1]} bytes is not round_up({S} * 584, 576) = {want} for block_size {S}"
        )
    return k_cache.shape[0]


def _concrete(*arrays) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in arrays if x is not None)
