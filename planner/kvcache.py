"""vLLM's DeepSeek-V4 KV cache pages (`fp8_ds_mla`), written and read in NumPy: the reference.

One layout serves the sliding-window (raw token) cache and the compressed caches. A page holds
`S` slots (`block_size` in vLLM's argument lists: tokens, or compressed entries); all slots'
token data first, then all slots' scales, then padding up to the page stride:

    bytes [p*576,       p*576 + 448)   slot p: dims [0, 448) as OCP e4m3 (float8_e4m3fn)
    bytes [p*576 + 448, p*576 + 576)   slot p: dims [448, 512) (RoPE) as little-endian bf16
    bytes [S*576 + p*8, +7)            slot p: UE8M0 scale byte g for dims [64g, 64g + 64)
    byte   S*576 + p*8 + 7             zero
    up to page_bytes(S) = round_up(S * 584, 576)

Quantization of one 64-dim group x (the bf16 values, arithmetic in float32):
    amax = max(max|x|, 1e-4);  e = ceil(log2(amax / 448))
    e4m3 = cast_rtne(clamp(x / 2^e, -448, 448));  scale byte = clamp(e + 127, 0, 255)
Dequantization: x = e4m3 * 2^(byte - 127) in float32, rounded to bf16 (exact for bytes this
writer produces), RoPE dims copied.

`e` is computed exactly from the float32 bits of amax / 448 (no log2 approximation: the
quotient's exponent, plus one unless it is an exact power of two). The e4m3 cast is
`ml_dtypes.float8_e4m3fn` (round to nearest even); the clamp makes it saturating.

Facts from vLLM 0.33.0's `vllm/models/deepseek_v4/common/ops/cache_utils.py`
(`quantize_and_insert_k_cache`, `dequantize_and_gather_k_cache`) and
`fused_compress_quant_cache.py`; the functions below take the same arguments in the same order.
"""

from __future__ import annotations

import numbers

import ml_dtypes
import numpy as np

from planner.checks import as_int

HEAD_DIM = 512  # dims per slot
NOPE_DIM = 448  # e4m3 dims
ROPE_DIM = 64  # bf16 dims
GROUP = 64  # dims per scale byte
N_GROUPS = NOPE_DIM // GROUP  # 7 scale bytes (+ 1 zero byte)
SLOT_DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576
SLOT_SCALE_BYTES = 8
SLOT_BYTES = SLOT_DATA_BYTES + SLOT_SCALE_BYTES  # 584
FP8_MAX = 448.0
AMAX_FLOOR = np.float32(1e-4)

# How a cache's pages hold their rows: "auto" = in the model's dtype (q's), "fp8_ds_mla" = vLLM's
# DeepSeek-V4 bytes (this module). vLLM's name for the choice is kv_cache_dtype.
KV_CACHE_DTYPES = ("auto", "fp8_ds_mla")

__all__ = [
    "KV_CACHE_DTYPES",
    "page_bytes",
    "quantize_and_insert_k_cache",
    "dequantize_and_gather_k_cache",
    "scale_exponent",
]


def page_bytes(slots_per_page) -> int:
    """Bytes of one page of `slots_per_page` slots: round_up(S * 584, 576) (S=64: 37440, S=2: 1728)."""
    S = check_block_size(slots_per_page, "slots_per_page")
    return -(-S * SLOT_BYTES // SLOT_DATA_BYTES) * SLOT_DATA_BYTES


def scale_exponent(amax: np.ndarray) -> np.ndarray:
    """e = ceil(log2(max(amax, 1e-4) / 448)) per group, int32, exact (float32 amax in, any shape).

    amax / 448 is a normal float32 (>= 2.2e-7); with bits E (biased exponent) and M
    (mantissa) its ceil(log2) is E - 127 when M == 0 (an exact power of two) and E - 126 otherwise.
    """
    raw = np.maximum(np.asarray(amax, np.float32), AMAX_FLOOR) / np.float32(FP8_MAX)
    bits = raw.view(np.uint32).astype(np.int64)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0)
    return e.astype(np.int32)


# --------------------------------------------------------------------------------------------
# writer


def quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size) -> None:
    """Quantize `k` and write each token into its slot of `k_cache`, in place (vLLM's writer).

    Args:
      k: [T, 512] float32 holding bf16 values (or an ml_dtypes.bfloat16 array); finite.
      k_cache: uint8 [num_blocks, page_bytes(block_size)], C-contiguous, writable.
      slot_mapping: [T'] integers, T' <= T (vLLM: only the first T' tokens are written, the rest
        are padding): slot -1 skips the token; slot s goes to page s // block_size, position
        s % block_size. Slots must be < num_blocks * block_size and appear at most once.
      block_size: slots per page S (>= 1).
    Bytes of a page that no written slot owns (other slots, the tail padding) stay as they were.
    """
    S = check_block_size(block_size, "block_size")
    num_blocks = _check_cache(k_cache, S, writable=True)
    k32 = _check_k(k)
    slots = check_slot_mapping(slot_mapping, k32.shape[0], num_blocks * S)
    live = np.flatnonzero(slots >= 0)
    if live.size == 0:
        return
    data, scales = encode_slots(k32[live])
    s = slots[live]
    page, pos = s // S, s % S
    k_cache[page[:, None], (pos * SLOT_DATA_BYTES)[:, None] + np.arange(SLOT_DATA_BYTES)] = data
    base = S * SLOT_DATA_BYTES + pos * SLOT_SCALE_BYTES
    k_cache[page[:, None], base[:, None] + np.arange(SLOT_SCALE_BYTES)] = scales


def encode_slots(k32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Checked float32 [N, 512] bf16 values -> (data uint8 [N, 576], scales uint8 [N, 8])."""
    N = k32.shape[0]
    x = k32[:, :NOPE_DIM].reshape(N, N_GROUPS, GROUP)
    e = scale_exponent(np.abs(x).max(axis=-1))  # [N, 7]
    inv = np.ldexp(np.float32(1.0), -e).astype(np.float32)  # 2^-e, e in [-22, 120]: a normal float32
    with np.errstate(under="ignore"):  # tiny x against a huge amax: products below 2^-126 (-> e4m3 0)
        q = np.clip(x * inv[..., None], -FP8_MAX, FP8_MAX).astype(np.float32)
    data = np.empty((N, SLOT_DATA_BYTES), np.uint8)
    data[:, :NOPE_DIM] = q.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).reshape(N, NOPE_DIM)
    rope = k32[:, NOPE_DIM:].astype(ml_dtypes.bfloat16).view(np.uint16).astype("<u2")
    data[:, NOPE_DIM:] = rope.view(np.uint8).reshape(N, 2 * ROPE_DIM)
    scales = np.zeros((N, SLOT_SCALE_BYTES), np.uint8)
    scales[:, :N_GROUPS] = np.clip(e + 127, 0, 255).astype(np.uint8)
    return data, scales


# --------------------------------------------------------------------------------------------
# reader


def dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset) -> None:
    """Gather and dequantize rows of paged requests into `out`, in place (vLLM's reader).

    Args:
      out: float32 [R', rows, 512], R' >= R, writable; row i < gather_lens[b] of request b
        goes to out[b, offset + i]. Other rows are left as they were.
      k_cache: uint8 [num_blocks, page_bytes(block_size)].
      seq_lens: [R] integers >= 0: slots (tokens or compressed entries) request b holds.
      gather_lens: [R] integers in [0, seq_lens[b]], or None (= seq_lens): row i is position
        seq_lens[b] - gather_lens[b] + i of request b.
      block_table: [R'', max_blocks] integers, R'' >= R: position p of request b lives on page
        block_table[b, p // block_size], slot p % block_size. Only entries that hold a gathered
        position are read (and must lie in [0, num_blocks)); the rest may be anything.
      block_size: slots per page S.
      offset: first row of out written, >= 0, offset + gather_lens[b] <= rows.
    """
    S = check_block_size(block_size, "block_size")
    num_blocks = _check_cache(k_cache, S, writable=False)
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out: expected a numpy.ndarray, got {type(out).__name__}")
    if out.dtype != np.float32:
        raise TypeError(f"out: expected float32 (holding bf16 values), got {out.dtype}")
    if out.ndim != 3 or out.shape[2] != HEAD_DIM:
        raise ValueError(f"out: expected shape [R, rows, {HEAD_DIM}], got {out.shape}")
    if not out.flags.writeable:
        raise ValueError("out: is read-only; it is written in place")
    req, pos = gather_positions(seq_lens, gather_lens, block_table, S, num_blocks, out.shape, offset)
    row = pos[2]
    rows = decode_slots(k_cache, S, pos[0], pos[1])
    out[req, row] = rows


def gather_positions(seq_lens, gather_lens, block_table, S, num_blocks, out_shape, offset):
    """Check the request arrays; return (request [N], (page [N], slot [N], out row [N])) per row.

    Rows are ordered by request, then by position.
    """
    seq, g, bt, off = check_gather_args(seq_lens, gather_lens, block_table, S, num_blocks, out_shape, offset)
    R = seq.shape[0]
    start = seq - g
    n = int(g.sum())
    req = np.repeat(np.arange(R), g)
    i = np.arange(n) - np.repeat(np.cumsum(g) - g, g)
    p = start[req] + i
    page = bt[req, p // S]
    return req, (page, p % S, off + i)


def check_request_shapes(R: int, gather_lens_len: int | None, block_table_shape, out_shape) -> None:
    """The per-request arrays' shapes agree with each other and with out (no values read): R
    requests in seq_lens, as many gather_lens (None: not given), >= R block-table rows and
    >= R requests in out. Raises ValueError naming the argument."""
    if gather_lens_len is not None and gather_lens_len != R:
        raise ValueError(f"gather_lens: expected {R} entries (one per request, as seq_lens), got {gather_lens_len}")
    if block_table_shape[0] < R:
        raise ValueError(f"block_table: expected >= {R} rows (one per request), got shape {tuple(block_table_shape)}")
    if out_shape[0] < R:
        raise ValueError(f"out: expected >= {R} requests in dim 0, got shape {tuple(out_shape)}")


def check_gather_args(seq_lens, gather_lens, block_table, S, num_blocks, out_shape, offset):
    """Check a gather's per-request arrays against the pages and `out`'s shape, O(R * max_blocks).

    Returns (seq_lens, gather_lens, block_table) as int64 arrays and offset as an int; raises
    ValueError naming the first bad argument and entry.
    """
    seq = _int_vector(seq_lens, "seq_lens")
    R = seq.shape[0]
    if np.any(seq < 0):
        b = int(np.flatnonzero(seq < 0)[0])
        raise ValueError(f"seq_lens: must be >= 0, got seq_lens[{b}] = {int(seq[b])}")
    g = seq if gather_lens is None else _int_vector(gather_lens, "gather_lens")
    bt = _int_matrix(block_table, "block_table")
    check_request_shapes(R, None if gather_lens is None else g.shape[0], bt.shape, out_shape)
    if gather_lens is not None:
        bad = np.flatnonzero((g < 0) | (g > seq))
        if bad.size:
            b = int(bad[0])
            raise ValueError(
                f"gather_lens: must lie in [0, seq_lens[b]], got gather_lens[{b}] = {int(g[b])} "
                f"with seq_lens[{b}] = {int(seq[b])}"
            )
    off = as_int(offset, "offset", minimum=0)
    if R and int(g.max(initial=0)) + off > out_shape[1]:
        b = int(np.argmax(g))
        raise ValueError(
            f"out: {out_shape[1]} rows per request are too few for offset {off} + gather_lens[{b}] = {int(g[b])}"
        )
    # Pages each request reads: [first, last] of block_table[b]
    start = seq - g
    has = g > 0
    first = np.where(has, start // S, 0)
    last = np.where(has, (seq - 1) // S, -1)
    short = np.flatnonzero(last >= bt.shape[1])
    if short.size:
        b = int(short[0])
        raise ValueError(
            f"block_table: seq_lens[{b}] = {int(seq[b])} needs {int(last[b]) + 1} pages of {S} slots, "
            f"but block_table has {bt.shape[1]} columns"
        )
    if R and bt.shape[1]:
        cols = np.arange(bt.shape[1])
        used = (cols[None, :] >= first[:, None]) & (cols[None, :] <= last[:, None])
        entries = bt[:R]
        bad = used & ((entries < 0) | (entries >= num_blocks))
        if bad.any():
            b, c = (int(v) for v in np.argwhere(bad)[0])
            raise ValueError(
                f"block_table: entry [{b}, {c}] = {int(entries[b, c])} is not a page of k_cache "
                f"(num_blocks = {num_blocks})"
            )
    return seq, g, bt, off


def decode_slots(k_cache: np.ndarray, S: int, page: np.ndarray, slot: np.ndarray) -> np.ndarray:
    """Slots (page[n], slot[n]) of k_cache -> float32 [N, 512] holding their bf16 values."""
    num_blocks = k_cache.shape[0]
    data = k_cache[:, : S * SLOT_DATA_BYTES].reshape(num_blocks, S, SLOT_DATA_BYTES)[page, slot]
    sc = k_cache[:, S * SLOT_DATA_BYTES : S * SLOT_BYTES].reshape(num_blocks, S, SLOT_SCALE_BYTES)[page, slot]
    N = data.shape[0]
    fp8 = np.ascontiguousarray(data[:, :NOPE_DIM]).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # byte 255: 2^128 = inf in float32 (0 * inf = NaN)
        scale = np.ldexp(np.float32(1.0), sc[:, :N_GROUPS].astype(np.int32) - 127).astype(np.float32)
        prod = fp8.reshape(N, N_GROUPS, GROUP) * scale[..., None]
    rows = np.empty((N, HEAD_DIM), np.float32)
    rows[:, :NOPE_DIM] = prod.reshape(N, NOPE_DIM).astype(ml_dtypes.bfloat16).astype(np.float32)
    rope = np.ascontiguousarray(data[:, NOPE_DIM:]).view("<u2").astype(np.uint16).view(ml_dtypes.bfloat16)
    rows[:, NOPE_DIM:] = rope.astype(np.float32)
    return rows


# --------------------------------------------------------------------------------------------
# checks


def check_block_size(block_size, name: str) -> int:
    if isinstance(block_size, (bool, np.bool_)) or not isinstance(block_size, numbers.Integral):
        raise ValueError(f"{name}: expected a positive integer (slots per page), got {block_size!r}")
    S = int(block_size)
    if S < 1:
        raise ValueError(f"{name}: expected a positive integer (slots per page), got {S}")
    return S


def check_page_layout(
    shape, strides, S: int, name: str = "k_cache", *, view_3d: bool = True, padded: bool = False
) -> int:
    """num_blocks of fp8_ds_mla pages with this shape and these byte strides (the one page-layout
    check of the NumPy reference, torch and JAX): [num_blocks, page_bytes(S)] with unit byte
    stride, or (view_3d) vLLM's nominal view [num_blocks, S, 584] whose page stride is
    page_bytes(S). `padded` (readers that take the page stride, the C kernels): the 3-D view's
    page stride may be larger, as vLLM's CPU engine allocates it (one page size for every layer
    kind of the model: 95616 bytes per 64-slot SWA page on its DeepSeek-V4 cache, 37440 of them
    used). Raises ValueError naming `name`."""
    want = page_bytes(S)
    shape, strides = tuple(int(x) for x in shape), tuple(int(x) for x in strides)
    many = shape[0] > 1 if shape else False
    if len(shape) == 2:
        stride = strides[0] if many else shape[1]
        if shape[1] != want or stride != want or strides[1] != 1:
            raise ValueError(
                f"{name}: page stride {shape[1] if shape[1] != want else stride} bytes is not round_up({S} * 584, 576) "
                f"= {want} for block_size {S} (got shape {shape}, strides {strides})"
            )
    elif len(shape) == 3 and view_3d:
        if shape[1:] != (S, SLOT_BYTES) or strides[1:] != (SLOT_BYTES, 1):
            raise ValueError(
                f"{name}: a 3-D page view must be [num_blocks, {S}, {SLOT_BYTES}] with strides ({want}, "
                f"{SLOT_BYTES}, 1), got shape {shape}, strides {strides}"
            )
        if many and (strides[0] < want if padded else strides[0] != want):
            rule = "below" if padded else "not"
            raise ValueError(
                f"{name}: page stride {strides[0]} bytes is {rule} round_up({S} * 584, 576) = {want} for block_size {S}"
            )
    else:
        views = f" (or [num_blocks, {S}, {SLOT_BYTES}])" if view_3d else f" (page_bytes({S}))"
        raise ValueError(f"{name}: expected shape [num_blocks, {want}]{views}, got {shape}")
    return shape[0]


def _check_cache(k_cache, S: int, *, writable: bool) -> int:
    """num_blocks of a valid page array."""
    if not isinstance(k_cache, np.ndarray):
        raise TypeError(f"k_cache: expected a numpy.ndarray, got {type(k_cache).__name__}")
    if k_cache.dtype != np.uint8:
        raise TypeError(f"k_cache: expected uint8 pages (fp8_ds_mla bytes), got {k_cache.dtype}")
    check_page_layout(k_cache.shape, k_cache.strides, S, view_3d=False)
    if writable and not k_cache.flags.writeable:
        raise ValueError("k_cache: is read-only; it is written in place")
    return k_cache.shape[0]


def _check_k(k) -> np.ndarray:
    if not isinstance(k, np.ndarray):
        raise TypeError(f"k: expected a numpy.ndarray, got {type(k).__name__}")
    if k.dtype not in (np.float32, np.dtype(ml_dtypes.bfloat16)):
        raise TypeError(f"k: expected float32 holding bf16 values (or bfloat16), got {k.dtype}")
    if k.ndim != 2 or k.shape[1] != HEAD_DIM:
        raise ValueError(f"k: expected shape [T, {HEAD_DIM}], got {k.shape}")
    k32 = np.ascontiguousarray(k, dtype=np.float32)
    finite = np.isfinite(k32)
    if not finite.all():
        t, d = (int(v) for v in np.argwhere(~finite)[0])
        raise ValueError(f"k: must be finite, got k[{t}, {d}] = {float(k32[t, d])}")
    if k.dtype == np.float32:
        off = k32 != k32.astype(ml_dtypes.bfloat16).astype(np.float32)
        if off.any():
            t, d = (int(v) for v in np.argwhere(off)[0])
            raise ValueError(
                f"k: must hold bf16 values, got k[{t}, {d}] = {float(k32[t, d])!r} "
                "(round with .astype(ml_dtypes.bfloat16) first)"
            )
    return k32


def check_slot_mapping(slot_mapping, T: int, num_slots: int) -> np.ndarray:
    s = _int_vector(slot_mapping, "slot_mapping")
    if s.shape[0] > T:
        raise ValueError(f"slot_mapping: {s.shape[0]} entries for {T} tokens of k (expected <= {T})")
    bad = np.flatnonzero((s < -1) | (s >= num_slots))
    if bad.size:
        t = int(bad[0])
        raise ValueError(
            f"slot_mapping: slot_mapping[{t}] = {int(s[t])} is neither -1 nor a slot of k_cache "
            f"(num_blocks * block_size = {num_slots})"
        )
    live = np.sort(s[s >= 0])
    dup = np.flatnonzero(live[1:] == live[:-1])
    if dup.size:
        raise ValueError(f"slot_mapping: slot {int(live[dup[0]])} appears more than once")
    return s


def _int_vector(x, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integers, got dtype {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array, got shape {a.shape}")
    return a.astype(np.int64)


def _int_matrix(x, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integers, got dtype {a.dtype}")
    if a.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D array [requests, max_blocks], got shape {a.shape}")
    return a.astype(np.int64)
