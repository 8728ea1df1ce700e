"""DeepSeek-V4.1's cache records on torch tensors: the writers and the gather-dequantize.

The records (mxfp8 528 B, nvfp4 288 B, index_fp8 132 B, index_mxfp4 68 B), the two page layouts
("interleaved", vLLM 0.33.0's for KV records and FlashMLA's; "split", all data then all scales,
vLLM 0.33.0's for index keys) and the rounding rules: `planner.kvcache_v41`, the NumPy reference,
whose bytes and values these match exactly. Same functions, same argument order as vLLM 0.33.0's:

    quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size)        bf16 rows -> KV records
    rope_quant_insert(latent, positions, cos_sin_cache, kv_cache, slot_mapping, compress_ratio)
    indexer_k_norm_rope_store(k_pre, positions, cos_sin_cache, rms_norm_weight, rms_norm_eps,
                              k_cache, kv_slot_mapping, compress_ratio, use_fp4_cache)
    insert_records(x, k_cache, slot_mapping, block_size)                     float32 rows, any record
    dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset)

Pages: uint8 [num_blocks, S, W] (vLLM's view; the record read off W, the page stride off
stride(0), which may exceed S * W as vLLM pads pages) or [num_blocks, page_stride] with
`block_size` and `bytes_per_token`. `mx_scales=True`: 132-byte pages hold FP8 index keys whose scale
is four UE8M0 bytes (vLLM on SM100) rather than a float32. `layout=None` takes vLLM 0.33.0's layout for the record.

Backends (keyword `backend=`, the table `dsv4_torch.backends.CACHE`): "reference" (vectorized
torch, any device: every record and op), "cpu" (the gather of mxfp8 records, both layouts: the C
kernel of `dsv4_cpu`, one pass per row), "auto" (cpu for mxfp8 gathers on CPU where it builds,
else reference: the same bits). `validate=True` checks every value that could make a kernel
read or write outside the pages (a host read of the small integer arrays: one device sync on a
GPU); shapes, dtypes and devices are always checked.
"""

from __future__ import annotations

import numbers

import torch

from dsv4_torch import backends
from dsv4_torch.kernels.reference import kvcache_v41 as _ref_kernels
from planner import kvcache_v41 as ref
from planner.checks import as_int
from planner.kvcache import check_gather_args, check_request_shapes, check_slot_mapping

_INT_DTYPES = (torch.int32, torch.int64)
OPS = ("insert_records", "gather_records", "gather_mxfp8")

__all__ = [
    "dequantize_and_gather_k_cache",
    "indexer_k_norm_rope_store",
    "insert_records",
    "page_geometry",
    "quantize_and_insert_k_cache",
    "read_slots",
    "resolve_backend",
    "rope_quant_insert",
]


def resolve_backend(backend: str = "auto", k_cache: torch.Tensor | None = None, op: str = "gather_records") -> str:
    """The backend a call runs (`op`: "insert_records", "gather_records" or "gather_mxfp8", the
    gather of mxfp8 pages): "auto" = the C gather for mxfp8 pages on CPU where it builds, else
    reference. A named backend that cannot run raises BackendUnavailableError saying why."""
    if op not in OPS:
        raise ValueError(f"op: expected one of {OPS}, got {op!r}")
    device = k_cache.device if isinstance(k_cache, torch.Tensor) else torch.device("cpu")
    return backends.resolve_cache_backend(backend, device, op)


def read_slots(k_cache, geo: ref.Geometry, layout: str, page: torch.Tensor, slot: torch.Tensor, dtype) -> torch.Tensor:
    """Slots (page[n], slot[n]) of checked pages decoded as the gather does, [n, dims] in `dtype`
    (device ops, no host read: the prefill's row gathers)."""
    data, scales = _ref_kernels.read_bytes(k_cache, geo, layout, page, slot)
    return _ref_kernels.decode(data, scales, geo.record, dtype)


def page_geometry(
    k_cache, block_size=None, bytes_per_token=None, name: str = "k_cache", mx_scales: bool = False
) -> ref.Geometry:
    """The checked geometry (num_blocks, S, record, page_stride) of a page tensor."""
    _need_tensor(k_cache, name)
    if k_cache.dtype != torch.uint8:
        raise TypeError(f"{name}: expected uint8 pages (V4.1 record bytes), got {k_cache.dtype}")
    geo = ref.page_geometry(k_cache.shape, k_cache.stride(), block_size, bytes_per_token, name, mx_scales)
    need = k_cache.storage_offset() + ((geo.num_blocks - 1) * geo.page_stride + geo.S * geo.record.bytes)
    if geo.num_blocks and k_cache.untyped_storage().nbytes() < need:
        raise ValueError(f"{name}: the storage holds fewer than {geo.num_blocks} pages of stride {geo.page_stride}")
    return geo


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
) -> None:
    """Quantize float32 rows x [T, dims] into their slots of k_cache, in place (any record).

    slot_mapping: [T'] int64 (or int32), T' <= T; -1 skips a token; slot s -> page s // S,
    position s % S; each slot at most once, < num_blocks * S."""
    geo = page_geometry(k_cache, block_size, bytes_per_token, mx_scales=mx_scales)
    layout = ref.check_layout(layout, geo.record)
    _rows(x, "x", geo.record.dims, (torch.float32,))
    slots = _slots(slot_mapping, x, k_cache, geo, "slot_mapping", validate)
    _finite(x[: slots.shape[0]], "x", validate)
    _run_insert(backend, x.float(), k_cache, slots, geo, layout)


def quantize_and_insert_k_cache(
    k, k_cache, slot_mapping, block_size=None, *, bytes_per_token=None, layout=None, backend="auto", validate=True
) -> None:
    """vLLM 0.33.0's writer of bf16 rows [T, 512] (no RoPE) into mxfp8 (or, ours, nvfp4) records, in place."""
    geo = page_geometry(k_cache, block_size, bytes_per_token)
    if not geo.record.main:
        raise ValueError(f"k_cache: holds {geo.record.name} records; this writer takes mxfp8 or nvfp4 pages")
    layout = ref.check_layout(layout, geo.record)
    _rows(k, "k", 512, (torch.bfloat16,))
    slots = _slots(slot_mapping, k, k_cache, geo, "slot_mapping", validate)
    _finite(k[: slots.shape[0]], "k", validate)
    _run_insert(backend, k[: slots.shape[0]].float(), k_cache, slots, geo, layout)


def rope(x: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """GPT-J RoPE on the last 64 dims of float32 rows (cs [N, 64]: 32 cos, 32 sin), as the NumPy
    reference: even * c - odd * s, odd * c + even * s, each op rounded in float32."""
    y = x.clone()
    even, odd = x[:, -64::2], x[:, -63::2]
    c, s = cs[:, :32], cs[:, 32:]
    y[:, -64::2] = even * c - odd * s
    y[:, -63::2] = odd * c + even * s
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
    backend="auto",
    validate=True,
) -> None:
    """vLLM 0.33.0's compressed-cache writer (`planner.kvcache_v41.rope_quant_insert`), in place:
    latent bf16 [T, 512], positions int [>= T'], cos_sin_cache float32 / bf16 [max_pos, 64]."""
    geo = page_geometry(kv_cache, block_size, bytes_per_token, "kv_cache")
    if not geo.record.main:
        raise ValueError(f"kv_cache: holds {geo.record.name} records; rope_quant_insert writes mxfp8 or nvfp4 pages")
    layout = ref.check_layout(layout, geo.record)
    _rows(latent, "latent", 512, (torch.bfloat16,))
    slots = _slots(slot_mapping, latent, kv_cache, geo, "slot_mapping", validate)
    n = slots.shape[0]
    _finite(latent[:n], "latent", validate)
    keep, cs = _rope_rows(positions, cos_sin_cache, compress_ratio, slots, kv_cache, validate)
    rows = rope(latent[:n].float(), cs)
    _run_insert(backend, rows, kv_cache, torch.where(keep, slots, -1), geo, layout)


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
) -> None:
    """vLLM 0.33.0's index-key writer (`planner.kvcache_v41.indexer_k_norm_rope_store`), in place:
    k_pre bf16 [T, 128], rms_norm_weight float32 / bf16 [128]."""
    geo = page_geometry(k_cache, block_size, None, mx_scales=bool(mx_scales) and not use_fp4_cache)
    if not isinstance(use_fp4_cache, bool):
        raise TypeError(f"use_fp4_cache: expected a bool, got {use_fp4_cache!r}")
    want = "index_mxfp4" if use_fp4_cache else ref.MX_INDEX_FP8.name if mx_scales else "index_fp8"
    if geo.record.name != want:
        raise ValueError(
            f"k_cache: holds {geo.record.name} records ({geo.record.bytes} B), but use_fp4_cache={use_fp4_cache} "
            f"writes {want} ({ref.RECORDS[want].bytes} B)"
        )
    layout = ref.check_layout(layout, geo.record)
    _rows(k_pre, "k_pre", 128, (torch.bfloat16,))
    _need_tensor(rms_norm_weight, "rms_norm_weight")
    if rms_norm_weight.dtype not in (torch.float32, torch.bfloat16) or tuple(rms_norm_weight.shape) != (128,):
        raise ValueError(
            f"rms_norm_weight: expected float32 (or bfloat16) [128], got {rms_norm_weight.dtype} "
            f"{tuple(rms_norm_weight.shape)}"
        )
    eps = float(ref.check_eps(rms_norm_eps))
    slots = _slots(kv_slot_mapping, k_pre, k_cache, geo, "kv_slot_mapping", validate)
    n = slots.shape[0]
    _finite(k_pre[:n], "k_pre", validate)
    _finite(rms_norm_weight[None], "rms_norm_weight", validate)
    keep, cs = _rope_rows(positions, cos_sin_cache, compress_ratio, slots, k_cache, validate)
    k = rms_norm(k_pre[:n].float(), rms_norm_weight.float(), eps)
    k = rope(k, cs).to(torch.bfloat16).float()
    _run_insert(backend, k, k_cache, torch.where(keep, slots, -1), geo, layout)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """`planner.kvcache_v41.rms_norm` in torch (the same float32 ops in the same order), as float32."""
    s = x * x
    while s.shape[1] > 1:
        h = s.shape[1] // 2
        s = s[:, :h] + s[:, h:]
    var = s[:, 0] / float(x.shape[1])
    r = 1.0 / torch.sqrt(var + torch.tensor(eps, dtype=torch.float32, device=x.device))
    return (x * r[:, None] * w).to(torch.bfloat16).float()


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
) -> None:
    """vLLM's reader for any V4.1 record, in place (`planner.kvcache_v41.dequantize_and_gather_k_cache`):
    out bf16 or float32 [R', rows, dims] (dims 512, or 128 for index keys), unit stride in the
    last dim; seq_lens / gather_lens (or None) int32/int64 [R]; block_table int32/int64 [R'', B]."""
    geo = page_geometry(k_cache, block_size, bytes_per_token, mx_scales=mx_scales)
    layout = ref.check_layout(layout, geo.record)
    _need_tensor(out, "out")
    if out.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out: expected bfloat16 or float32, got {out.dtype}")
    dims = geo.record.dims
    if out.ndim != 3 or out.shape[2] != dims:
        raise ValueError(f"out: expected shape [R, rows, {dims}] for {geo.record.name} records, got {tuple(out.shape)}")
    if out.stride(2) != 1:
        raise ValueError(f"out: expected unit stride in the last dim, got strides {out.stride()}")
    for name, x, ndim in (("seq_lens", seq_lens, 1), ("gather_lens", gather_lens, 1), ("block_table", block_table, 2)):
        if x is None and name == "gather_lens":
            continue
        _need_tensor(x, name)
        if x.dtype not in _INT_DTYPES:
            raise TypeError(f"{name}: expected int32 (or int64), got {x.dtype}")
        if x.ndim != ndim:
            raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(x.shape)}")
        if x.device != k_cache.device:
            raise ValueError(f"{name}: on {x.device}, but k_cache is on {k_cache.device}")
    if out.device != k_cache.device:
        raise ValueError(f"out: on {out.device}, but k_cache is on {k_cache.device}")
    R = seq_lens.shape[0]
    check_request_shapes(R, None if gather_lens is None else gather_lens.shape[0], block_table.shape, out.shape)
    if isinstance(offset, bool) or not isinstance(offset, numbers.Integral) or offset < 0:
        raise ValueError(f"offset: expected an integer >= 0, got {offset!r}")
    offset = int(offset)
    op = "gather_mxfp8" if geo.record.name == "mxfp8" else "gather_records"
    name = resolve_backend(backend, k_cache, op)
    if validate:
        check_gather_args(
            seq_lens.cpu().numpy(),
            None if gather_lens is None else gather_lens.cpu().numpy(),
            block_table[:R].cpu().numpy(),
            geo.S,
            geo.num_blocks,
            tuple(out.shape),
            offset,
        )
    if R == 0:
        return
    glen = None if gather_lens is None else gather_lens.contiguous()
    bt = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    backends.CACHE[name].op(op)(out, k_cache, seq_lens.contiguous(), glen, bt, geo, layout, offset)


# --------------------------------------------------------------------------------------------
# checks


def _run_insert(backend, x, k_cache, slots, geo, layout) -> None:
    name = resolve_backend(backend, k_cache, "insert_records")
    backends.CACHE[name].op("insert_records")(x, k_cache, slots.long(), geo, layout)


def _need_tensor(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")


def _rows(x, name: str, dims: int, dtypes) -> None:
    _need_tensor(x, name)
    if x.dtype not in dtypes:
        raise TypeError(f"{name}: expected {' or '.join(str(d) for d in dtypes)}, got {x.dtype}")
    if x.ndim != 2 or x.shape[1] != dims:
        raise ValueError(f"{name}: expected shape [T, {dims}], got {tuple(x.shape)}")


def _finite(x: torch.Tensor, name: str, validate: bool) -> None:
    if not validate:
        return
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        t, d = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"{name}: must be finite, got {name}[{t}, {d}] = {float(x[t, d])}")


def _slots(slot_mapping, x, k_cache, geo, name: str, validate: bool) -> torch.Tensor:
    _need_tensor(slot_mapping, name)
    if slot_mapping.dtype not in _INT_DTYPES:
        raise TypeError(f"{name}: expected int64 (or int32), got {slot_mapping.dtype}")
    if slot_mapping.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.shape[0] > x.shape[0]:
        raise ValueError(f"{name}: {slot_mapping.shape[0]} entries for {x.shape[0]} rows (expected <= {x.shape[0]})")
    for n, t in ((name, slot_mapping), ("rows", x)):
        if t.device != k_cache.device:
            raise ValueError(f"{n}: on {t.device}, but the pages are on {k_cache.device}")
    if validate:
        try:
            check_slot_mapping(slot_mapping.cpu().numpy(), x.shape[0], geo.num_blocks * geo.S)
        except ValueError as e:
            raise ValueError(str(e).replace("slot_mapping", name, 1)) from None
    return slot_mapping.long()


def _rope_rows(positions, cos_sin_cache, compress_ratio, slots, k_cache, validate: bool):
    """(written [n] bool, cos/sin rows float32 [n, 64]) of the tokens with slots `slots`."""
    ratio = as_int(compress_ratio, "compress_ratio")
    if ratio not in (1, 2):
        raise ValueError(f"compress_ratio: V4.1's compressed caches have ratio 1 or 2, got {ratio}")
    _need_tensor(positions, "positions")
    if positions.dtype not in _INT_DTYPES or positions.ndim != 1:
        raise TypeError(
            f"positions: expected a 1-D int64 (or int32) tensor, got {positions.dtype} {tuple(positions.shape)}"
        )
    n = slots.shape[0]
    if positions.shape[0] < n:
        raise ValueError(f"positions: {positions.shape[0]} entries for {n} slots (expected >= {n})")
    _need_tensor(cos_sin_cache, "cos_sin_cache")
    if cos_sin_cache.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"cos_sin_cache: expected float32 (or bfloat16), got {cos_sin_cache.dtype}")
    if cos_sin_cache.ndim != 2 or cos_sin_cache.shape[1] != 64:
        raise ValueError(
            f"cos_sin_cache: expected shape [max_position, 64] (32 cos, 32 sin), got {tuple(cos_sin_cache.shape)}"
        )
    for name, t in (("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        if t.device != k_cache.device:
            raise ValueError(f"{name}: on {t.device}, but the pages are on {k_cache.device}")
    pos = positions[:n].long()
    keep = (slots >= 0) & ((pos + 1) % ratio == 0)
    row = torch.div(pos, ratio, rounding_mode="floor") * ratio
    if validate:
        bad = (keep & ((pos < 0) | (row >= cos_sin_cache.shape[0]))).nonzero()
        if bad.numel():
            t = int(bad[0, 0])
            raise ValueError(
                f"positions: positions[{t}] = {int(pos[t])} has no row of cos_sin_cache "
                f"({cos_sin_cache.shape[0]} positions)"
            )
    row = torch.where(keep, row, 0).clamp(0, max(cos_sin_cache.shape[0] - 1, 0))
    cs = cos_sin_cache.float()[row] if cos_sin_cache.shape[0] else cos_sin_cache.float().new_zeros((n, 64))
    if validate and not bool(torch.isfinite(cs[keep]).all()):
        raise ValueError("cos_sin_cache: the rows of the written positions must be finite")
    return keep, cs
