"""vLLM's DeepSeek-V4 KV cache pages (`fp8_ds_mla`) on `jax.Array`s: write and gather-dequantize.

The same two functions as vLLM 0.33.0 and `planner.kvcache` (the NumPy reference, whose bytes
and values these match exactly), functional: each returns the new array.

    quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size) -> k_cache
    dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset) -> out

Both work under `jax.jit` (block_size and offset are static Python ints; donate k_cache / out to
update them in place). Backends (keyword `backend=`; the table is `dsv4_jax.backends.CACHE`):
  "xla"     plain jnp / lax (gathers and scatters of whole slots), any platform
            (`dsv4_jax/kernels/xla/kvcache.py`, with the codec the kernels share);
  "triton"  Pallas kernels lowered through Triton, NVIDIA GPUs (`dsv4_jax/kernels/triton/kvcache.py`);
            `interpret=True` runs them under Pallas' interpreter (any platform; for tests);
  "cpu"     the gather only: `dsv4_cpu`'s C kernel as an XLA FFI call on CPU
            (`dsv4_jax/kernels/cpu/kvcache.py`, built once per machine), one pass per row;
  "auto" = triton on an NVIDIA GPU; on CPU the gather runs "cpu" where it builds (else xla: the
  same bits) and the writer xla.

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

DeepSeek-V4.1's records (mxfp8 528 B, nvfp4 288 B, index keys; both page layouts): `dsv4_jax.kvcache_v41`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax import backends
from planner import kvcache as ref
from planner.checks import as_int
from planner.kvcache import HEAD_DIM, SLOT_DATA_BYTES, SLOT_SCALE_BYTES, page_bytes

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


BACKENDS = backends.CACHE_BACKENDS
OPS = ("gather", "insert")


def cpu_unavailable_reason() -> str | None:
    """Why the C gather kernel (backend "cpu") cannot run on this machine (None: it can)."""
    from dsv4_jax.kernels.cpu import library

    return library.unavailable_reason()


def resolve_backend(backend: str = "auto", *arrays, op: str = "gather", interpret=False) -> str:
    """The cache backend (a key of `dsv4_jax.backends.CACHE`) a call (`op`: "gather" or "insert")
    on `arrays` runs.

    Where it runs: the devices of the committed `arrays`, else JAX's default device
    (`dsv4_jax.devices`). "auto": triton on NVIDIA GPUs; elsewhere the C kernel for gathers
    on CPU where it builds, else xla. `interpret=True` runs the triton kernels in Pallas'
    interpreter (any platform). A named backend that cannot run raises BackendUnavailableError
    saying why.
    """
    return backends.resolve_cache_backend(backend, *arrays, op=op, interpret=interpret)


# --------------------------------------------------------------------------------------------
# writer


def quantize_and_insert_k_cache(
    k, k_cache, slot_mapping, block_size=64, *, backend="auto", interpret=False, validate=True
):
    """Quantize `k` into its slots of `k_cache`; returns the new pages (vLLM's writer).

    Args:
      k: [T, 512] bfloat16 (finite).
      k_cache: uint8 [num_blocks, page_bytes(block_size)].
      slot_mapping: [T'] int32/int64, T' <= T: -1 skips a token; slot s -> page s // S, position
        s % S; each slot at most once, < num_blocks * S.
      block_size: slots per page S (a Python int).
      backend, interpret, validate: module doc.
    """
    S = ref.check_block_size(block_size, "block_size")
    num_blocks = check_pages(k_cache, S)
    _check_dtype(k, "k", (jnp.dtype(jnp.bfloat16),), "bfloat16")
    if k.ndim != 2 or k.shape[1] != HEAD_DIM:
        raise ValueError(f"k: expected shape [T, {HEAD_DIM}], got {tuple(k.shape)}")
    _check_dtype(slot_mapping, "slot_mapping", _INT_DTYPES, "int32 or int64")
    if slot_mapping.ndim != 1:
        raise ValueError(f"slot_mapping: expected a 1-D array, got shape {tuple(slot_mapping.shape)}")
    n = slot_mapping.shape[0]
    if n > k.shape[0]:
        raise ValueError(f"slot_mapping: {n} entries for {k.shape[0]} tokens of k (expected <= {k.shape[0]})")
    name = resolve_backend(backend, k, k_cache, slot_mapping, op="insert", interpret=interpret)
    if validate and _concrete(k, slot_mapping):
        kk = np.asarray(jnp.asarray(k[:n], jnp.float32))
        bad = ~np.isfinite(kk)
        if bad.any():
            t, d = (int(v) for v in np.argwhere(bad)[0])
            raise ValueError(f"k: must be finite, got k[{t}, {d}] = {float(kk[t, d])}")
        ref.check_slot_mapping(np.asarray(slot_mapping), k.shape[0], num_blocks * S)
    if n == 0:
        return k_cache
    b = backends.CACHE[name]
    kw = {"interpret": bool(interpret)} if b.interpret else {}
    return b.op("insert")(k[:n], k_cache, slot_mapping.astype(jnp.int32), S, **kw)


# --------------------------------------------------------------------------------------------
# reader


def dequantize_and_gather_k_cache(
    out,
    k_cache,
    seq_lens,
    gather_lens,
    block_table,
    block_size=64,
    offset=0,
    *,
    backend="auto",
    interpret=False,
    validate=True,
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
      backend, interpret, validate: module doc.
    """
    S = ref.check_block_size(block_size, "block_size")
    num_blocks = check_pages(k_cache, S)
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
        offset = as_int(offset, "offset", minimum=0)
    except ValueError:
        if isinstance(offset, jax.core.Tracer):
            raise TypeError("offset: must be a Python int (static under jit), got a traced value") from None
        raise
    if offset > out.shape[1]:
        raise ValueError(f"offset: {offset} is past out's {out.shape[1]} rows")
    name = resolve_backend(backend, out, k_cache, seq_lens, block_table, interpret=interpret)
    if validate and _concrete(seq_lens, gather_lens, block_table):
        ref.check_gather_args(
            np.asarray(seq_lens),
            None if gather_lens is None else np.asarray(gather_lens),
            np.asarray(block_table[:R]),
            S,
            num_blocks,
            tuple(out.shape),
            offset,
        )
    if R == 0 or offset == out.shape[1]:
        return out
    seq = seq_lens.astype(jnp.int32)
    glen = seq if gather_lens is None else gather_lens.astype(jnp.int32)
    bt = block_table[:R].astype(jnp.int32)
    b = backends.CACHE[name]
    kw = {"interpret": bool(interpret)} if b.interpret else {}
    return b.op("gather")(out, k_cache, seq, glen, bt, S, offset, **kw)


# --------------------------------------------------------------------------------------------
# moving whole slots (bytes, no requantization)


def copy_slots(dst_cache, dst_slots, src_cache, src_slots, block_size):
    """dst_cache with slot dst_slots[i] = slot src_slots[i] of src_cache (576 data + 8 scale
    bytes); returns the new dst pages. Jit-compatible (block_size static).

    Both caches are uint8 [num_blocks, page_bytes(block_size)]; the slot arrays are 1-D integers
    of one length (slot s = page s // S, position s % S). A destination outside dst_cache (e.g. -1)
    is dropped; each destination at most once.
    """
    S = ref.check_block_size(block_size, "block_size")
    check_pages(src_cache, S)
    check_pages(dst_cache, S)
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


def check_pages(k_cache, S: int, name: str = "k_cache") -> int:
    """num_blocks of a valid page array ([num_blocks, page_bytes(S)] uint8: JAX arrays are
    contiguous, so vLLM's strided 3-D view has no JAX form); errors name the argument `name`."""
    dtype = getattr(k_cache, "dtype", None)
    if dtype is None or not hasattr(k_cache, "shape"):
        raise TypeError(f"{name}: expected an array, got {type(k_cache).__name__}")
    if jnp.dtype(dtype) != jnp.dtype(jnp.uint8):
        raise TypeError(f"{name}: expected uint8 pages (fp8_ds_mla bytes), got {jnp.dtype(dtype)}")
    shape = tuple(k_cache.shape)
    strides = (shape[1], 1) if len(shape) == 2 else (1,) * len(shape)  # row-major bytes
    return ref.check_page_layout(shape, strides, S, name, view_3d=False)


def _concrete(*arrays) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in arrays if x is not None)
