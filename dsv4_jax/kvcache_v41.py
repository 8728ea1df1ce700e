"""DeepSeek-V4.1's cache records on `jax.Array`s: the writers and the gather-dequantize, functional.

The records, layouts and rounding rules: `planner.kvcache_v41` (the NumPy reference, whose
bytes and values these match exactly). The functions of `dsv4_torch.kvcache_v41` with the same
arguments, each returning the new array (the pages, or `out`):

    quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size) -> k_cache
    rope_quant_insert(latent, positions, cos_sin_cache, kv_cache, slot_mapping, compress_ratio) -> kv_cache
    indexer_k_norm_rope_store(k_pre, positions, cos_sin_cache, rms_norm_weight, rms_norm_eps,
                              k_cache, kv_slot_mapping, compress_ratio, use_fp4_cache) -> k_cache
    insert_records(x, k_cache, slot_mapping, block_size) -> k_cache
    dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset) -> out

Pages: uint8 [num_blocks, S, W] (vLLM's view; JAX arrays are contiguous, so the page stride is
S * W) or [num_blocks, page_stride] with `block_size` and `bytes_per_token` (padded pages).
`mx_scales=True`: 132-byte pages hold FP8 index keys whose scale is four UE8M0 bytes (vLLM on
SM100) rather than a float32.
Every array argument takes NumPy or jax arrays. Under `jax.jit`: block_size, bytes_per_token,
layout, offset, compress_ratio, use_fp4_cache and rms_norm_eps are static; traced values are not
checked (an out-of-range slot is dropped, a row whose page is not in k_cache reads NaN).

Backends (keyword `backend=`, the table `dsv4_jax.backends.CACHE`): "xla" (plain jnp / lax, any
platform: every record and op), "cpu" (the gather of mxfp8 pages on CPU: `dsv4_cpu`'s C kernel as
an XLA FFI call), "auto" (cpu for mxfp8 gathers on CPU where it builds, else xla: the same bits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax import backends
from planner import kvcache_v41 as ref
from planner.checks import as_int
from planner.kvcache import check_gather_args, check_request_shapes, check_slot_mapping

_INT_DTYPES = (jnp.dtype(jnp.int32), jnp.dtype(jnp.int64), jnp.dtype(jnp.uint32))
OPS = ("insert_records", "gather_records", "gather_mxfp8")

__all__ = [
    "dequantize_and_gather_k_cache",
    "indexer_k_norm_rope_store",
    "insert_records",
    "page_geometry",
    "quantize_and_insert_k_cache",
    "resolve_backend",
    "rope_quant_insert",
]


def resolve_backend(backend: str = "auto", *arrays, op: str = "gather_records") -> str:
    """The backend a call runs (`op`: "insert_records", "gather_records", or "gather_mxfp8", the
    gather of mxfp8 pages): "auto" = the C gather for mxfp8 pages on CPU where it builds, else xla."""
    if op not in OPS:
        raise ValueError(f"op: expected one of {OPS}, got {op!r}")
    return backends.resolve_cache_backend(backend, *arrays, op=op)


def page_geometry(
    k_cache, block_size=None, bytes_per_token=None, name: str = "k_cache", mx_scales: bool = False
) -> ref.Geometry:
    """The checked geometry (num_blocks, S, record, page_stride) of a page array."""
    dtype = getattr(k_cache, "dtype", None)
    if dtype is None or not hasattr(k_cache, "shape"):
        raise TypeError(f"{name}: expected an array, got {type(k_cache).__name__}")
    if jnp.dtype(dtype) != jnp.dtype(jnp.uint8):
        raise TypeError(f"{name}: expected uint8 pages (V4.1 record bytes), got {jnp.dtype(dtype)}")
    shape = tuple(k_cache.shape)
    strides = tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))  # row-major bytes
    return ref.page_geometry(shape, strides, block_size, bytes_per_token, name, mx_scales)


# --------------------------------------------------------------------------------------------
# writers


def insert_records(
    x,
    k_cache,
    slot_mapping,
    block_size=None,
    *,
    bytes_per_token=None,
    layout=None,
    mx_scales=False,
    backend="auto",
    validate=True,
):
    """float32 rows x [T, dims] quantized into their slots of k_cache (any record); the new pages."""
    geo = page_geometry(k_cache, block_size, bytes_per_token, mx_scales=mx_scales)
    layout = ref.check_layout(layout, geo.record)
    x = _rows(x, "x", geo.record.dims, (jnp.dtype(jnp.float32),))
    slots = _slots(slot_mapping, x, geo, "slot_mapping", validate)
    _finite(x[: slots.shape[0]], "x", validate)
    return _run_insert(backend, x[: slots.shape[0]], k_cache, slots, geo, layout)


def quantize_and_insert_k_cache(
    k, k_cache, slot_mapping, block_size=None, *, bytes_per_token=None, layout=None, backend="auto", validate=True
):
    """vLLM 0.33.0's writer of bf16 rows [T, 512] (no RoPE) into mxfp8 (or, ours, nvfp4) records;
    the new pages."""
    geo = page_geometry(k_cache, block_size, bytes_per_token)
    if not geo.record.main:
        raise ValueError(f"k_cache: holds {geo.record.name} records; this writer takes mxfp8 or nvfp4 pages")
    layout = ref.check_layout(layout, geo.record)
    k = _rows(k, "k", 512, (jnp.dtype(jnp.bfloat16),))
    slots = _slots(slot_mapping, k, geo, "slot_mapping", validate)
    _finite(k[: slots.shape[0]], "k", validate)
    return _run_insert(backend, k[: slots.shape[0]].astype(jnp.float32), k_cache, slots, geo, layout)


def rope(x, cs):
    """GPT-J RoPE on the last 64 dims of float32 rows (cs [N, 64]: 32 cos, 32 sin), as the NumPy
    reference (each product and sum rounded in float32)."""
    even, odd = x[:, -64::2], x[:, -63::2]
    c, s = cs[:, :32], cs[:, 32:]
    pair = jnp.stack([even * c - odd * s, odd * c + even * s], axis=-1).reshape(x.shape[0], 64)
    return jnp.concatenate([x[:, :-64], pair], axis=1)


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
    backend="auto",
    validate=True,
):
    """vLLM 0.33.0's compressed-cache writer (`planner.kvcache_v41.rope_quant_insert`); the new pages."""
    geo = page_geometry(kv_cache, block_size, bytes_per_token, "kv_cache")
    if not geo.record.main:
        raise ValueError(f"kv_cache: holds {geo.record.name} records; rope_quant_insert writes mxfp8 or nvfp4 pages")
    layout = ref.check_layout(layout, geo.record)
    latent = _rows(latent, "latent", 512, (jnp.dtype(jnp.bfloat16),))
    slots = _slots(slot_mapping, latent, geo, "slot_mapping", validate)
    n = slots.shape[0]
    _finite(latent[:n], "latent", validate)
    keep, cs = _rope_rows(positions, cos_sin_cache, compress_ratio, slots, validate)
    rows = rope(latent[:n].astype(jnp.float32), cs)
    return _run_insert(backend, rows, kv_cache, jnp.where(keep, slots, -1), geo, layout)


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
    backend="auto",
    validate=True,
):
    """vLLM 0.33.0's index-key writer (`planner.kvcache_v41.indexer_k_norm_rope_store`); the new pages."""
    geo = page_geometry(k_cache, block_size, None, mx_scales=bool(mx_scales) and not use_fp4_cache)
    if not isinstance(use_fp4_cache, (bool, np.bool_)):
        raise TypeError(f"use_fp4_cache: expected a bool, got {use_fp4_cache!r}")
    want = "index_mxfp4" if use_fp4_cache else ref.MX_INDEX_FP8.name if mx_scales else "index_fp8"
    if geo.record.name != want:
        raise ValueError(
            f"k_cache: holds {geo.record.name} records ({geo.record.bytes} B), but use_fp4_cache={bool(use_fp4_cache)} "
            f"writes {want} ({ref.RECORDS[want].bytes} B)"
        )
    layout = ref.check_layout(layout, geo.record)
    k_pre = _rows(k_pre, "k_pre", 128, (jnp.dtype(jnp.bfloat16),))
    w = _array(rms_norm_weight, "rms_norm_weight")
    if jnp.dtype(w.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)) or tuple(w.shape) != (128,):
        raise ValueError(
            f"rms_norm_weight: expected float32 (or bfloat16) [128], got {jnp.dtype(w.dtype)} {tuple(w.shape)}"
        )
    eps = ref.check_eps(rms_norm_eps)
    slots = _slots(kv_slot_mapping, k_pre, geo, "kv_slot_mapping", validate)
    n = slots.shape[0]
    _finite(k_pre[:n], "k_pre", validate)
    _finite(w[None], "rms_norm_weight", validate)
    keep, cs = _rope_rows(positions, cos_sin_cache, compress_ratio, slots, validate)
    k = rms_norm(k_pre[:n].astype(jnp.float32), w.astype(jnp.float32), eps)
    k = rope(k, cs).astype(jnp.bfloat16).astype(jnp.float32)
    return _run_insert(backend, k, k_cache, jnp.where(keep, slots, -1), geo, layout)


def rms_norm(x, w, eps):
    """`planner.kvcache_v41.rms_norm` in jnp (the same float32 ops in the same order)."""
    s = x * x
    while s.shape[1] > 1:
        h = s.shape[1] // 2
        s = s[:, :h] + s[:, h:]
    var = s[:, 0] / jnp.float32(x.shape[1])
    r = jnp.float32(1.0) / jnp.sqrt(var + jnp.float32(eps))  # not lax.rsqrt: XLA's is approximate
    return (x * r[:, None] * w).astype(jnp.bfloat16).astype(jnp.float32)


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
    backend="auto",
    validate=True,
):
    """vLLM's reader for any V4.1 record (`planner.kvcache_v41.dequantize_and_gather_k_cache`):
    out bf16 or float32 [R', rows, dims]; returns the new `out` (donate it under jit to reuse its
    buffer). seq_lens / gather_lens (or None) int32 [R]; block_table int32 [R'', B]."""
    geo = page_geometry(k_cache, block_size, bytes_per_token, mx_scales=mx_scales)
    layout = ref.check_layout(layout, geo.record)
    out = _array(out, "out")
    if jnp.dtype(out.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise TypeError(f"out: expected bfloat16 or float32, got {jnp.dtype(out.dtype)}")
    dims = geo.record.dims
    if out.ndim != 3 or out.shape[2] != dims:
        raise ValueError(f"out: expected shape [R, rows, {dims}] for {geo.record.name} records, got {tuple(out.shape)}")
    seq_lens = _ints(seq_lens, "seq_lens", 1)
    gather_lens = None if gather_lens is None else _ints(gather_lens, "gather_lens", 1)
    block_table = _ints(block_table, "block_table", 2)
    R = seq_lens.shape[0]
    check_request_shapes(R, None if gather_lens is None else gather_lens.shape[0], block_table.shape, out.shape)
    offset = as_int(offset, "offset", minimum=0)
    if offset > out.shape[1]:
        raise ValueError(f"offset: {offset} is past out's {out.shape[1]} rows")
    op = "gather_mxfp8" if geo.record.name == "mxfp8" else "gather_records"
    name = resolve_backend(backend, out, k_cache, op=op)
    if validate and _concrete(seq_lens, gather_lens, block_table):
        check_gather_args(
            np.asarray(seq_lens),
            None if gather_lens is None else np.asarray(gather_lens),
            np.asarray(block_table[:R]),
            geo.S,
            geo.num_blocks,
            tuple(out.shape),
            offset,
        )
    if R == 0 or offset == out.shape[1]:
        return out
    seq = jnp.asarray(seq_lens, jnp.int32)
    glen = seq if gather_lens is None else jnp.asarray(gather_lens, jnp.int32)
    bt = jnp.asarray(block_table[:R], jnp.int32)
    return backends.CACHE[name].op(op)(jnp.asarray(out), jnp.asarray(k_cache), seq, glen, bt, geo, layout, offset)


# --------------------------------------------------------------------------------------------
# checks


def _run_insert(backend, x, k_cache, slots, geo, layout):
    name = resolve_backend(backend, k_cache, op="insert_records")
    return backends.CACHE[name].op("insert_records")(
        jnp.asarray(x, jnp.float32), jnp.asarray(k_cache), jnp.asarray(slots, jnp.int32), geo, layout
    )


def _concrete(*arrays) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in arrays if x is not None)


def _array(x, name: str):
    if isinstance(x, (jax.Array, np.ndarray)):
        return x
    raise TypeError(f"{name}: expected a jax.Array or numpy.ndarray, got {type(x).__name__}")


def _rows(x, name: str, dims: int, dtypes):
    x = _array(x, name)
    if jnp.dtype(x.dtype) not in dtypes:
        raise TypeError(f"{name}: expected {' or '.join(d.name for d in dtypes)}, got {jnp.dtype(x.dtype)}")
    if x.ndim != 2 or x.shape[1] != dims:
        raise ValueError(f"{name}: expected shape [T, {dims}], got {tuple(x.shape)}")
    return x


def _ints(x, name: str, ndim: int):
    x = _array(x, name)
    if jnp.dtype(x.dtype) not in _INT_DTYPES:
        raise TypeError(f"{name}: expected int32 (or int64), got {jnp.dtype(x.dtype)}")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array, got shape {tuple(x.shape)}")
    return x


def _finite(x, name: str, validate: bool) -> None:
    if not validate or not _concrete(x):
        return
    v = np.asarray(jnp.asarray(x, jnp.float32))
    bad = ~np.isfinite(v)
    if bad.any():
        t, d = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name}: must be finite, got {name}[{t}, {d}] = {float(v[t, d])}")


def _slots(slot_mapping, x, geo, name: str, validate: bool):
    s = _ints(slot_mapping, name, 1)
    if s.shape[0] > x.shape[0]:
        raise ValueError(f"{name}: {s.shape[0]} entries for {x.shape[0]} rows (expected <= {x.shape[0]})")
    if validate and _concrete(s):
        try:
            check_slot_mapping(np.asarray(s), x.shape[0], geo.num_blocks * geo.S)
        except ValueError as e:
            raise ValueError(str(e).replace("slot_mapping", name, 1)) from None
    return jnp.asarray(s, jnp.int32)


def _rope_rows(positions, cos_sin_cache, compress_ratio, slots, validate: bool):
    """(written [n] bool, cos/sin rows float32 [n, 64]) of the tokens with slots `slots`."""
    ratio = as_int(compress_ratio, "compress_ratio")
    if ratio not in (1, 2):
        raise ValueError(f"compress_ratio: V4.1's compressed caches have ratio 1 or 2, got {ratio}")
    positions = _ints(positions, "positions", 1)
    n = slots.shape[0]
    if positions.shape[0] < n:
        raise ValueError(f"positions: {positions.shape[0]} entries for {n} slots (expected >= {n})")
    cs = _array(cos_sin_cache, "cos_sin_cache")
    if jnp.dtype(cs.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise TypeError(f"cos_sin_cache: expected float32 (or bfloat16), got {jnp.dtype(cs.dtype)}")
    if cs.ndim != 2 or cs.shape[1] != 64:
        raise ValueError(f"cos_sin_cache: expected shape [max_position, 64] (32 cos, 32 sin), got {tuple(cs.shape)}")
    pos = jnp.asarray(positions[:n], jnp.int32)
    keep = (slots >= 0) & ((pos + 1) % ratio == 0)
    row = (pos // ratio) * ratio
    if validate and _concrete(pos, slots):
        k, p = np.asarray(keep), np.asarray(pos)
        bad = np.flatnonzero(k & ((p < 0) | ((p // ratio) * ratio >= cs.shape[0])))
        if bad.size:
            t = int(bad[0])
            raise ValueError(
                f"positions: positions[{t}] = {int(p[t])} has no row of cos_sin_cache ({cs.shape[0]} positions)"
            )
    if cs.shape[0] == 0:  # nothing to rotate (validate refuses a written position)
        return keep, jnp.zeros((n, 64), jnp.float32)
    rows = jnp.take(jnp.asarray(cs, jnp.float32), jnp.where(keep, row, 0), axis=0, mode="clip")
    if validate and _concrete(rows, keep) and not np.isfinite(np.asarray(rows)[np.asarray(keep)]).all():
        raise ValueError("cos_sin_cache: the rows of the written positions must be finite")
    return keep, rows
