"""One DeepSeek-V4 prefill layer as a Pallas TPU kernel (backend "mosaic_tpu"), driven by the plan.

Called by `dsv4_jax.prefill.prefill_attention(..., backend="mosaic_tpu")`: no workspace, no chunk
loop, no index rows. The step's metadata (`dsv4_jax.prefill_metadata`, built once per step on the
host) carries the query tiles: up to `query_tile` (16) consecutive new tokens of one request (q
rows, positions, request). They come from the batch alone, so every plan of a step gets the same
tiles; the grid is the tile count (dynamic), the tile table is scalar-prefetched into SMEM. This
module builds the call; `mosaic_tpu_tile` is the body of one grid step.

What one grid step does, why the output is the same bits for every plan, and its VMEM per tile:
`docs/kernel-design.md`, "Mosaic TPU prefill".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4_jax.kernels.mosaic_tpu import rows as R
from dsv4_jax.kernels.mosaic_tpu import tile as T
from dsv4_jax.kernels.mosaic_tpu.tile import ROW_CHUNK, window_rows
from dsv4_jax.prefill_metadata import SCALARS, TILE_POSITION, TILE_Q_ROW, KindShape
from planner import LayerKind
from planner.contract import value_dim


def _source(src, dtype):
    """(RowSource, HBM array (P, rows, W), block table (B, max_pages) or None, offsets (B,) or None)."""
    if hasattr(src, "block_table"):
        if getattr(src, "mxfp8", False):
            raise ValueError(
                "pages: the Pallas TPU prefill reads fp8_ds_mla (584 B) pages, not DeepSeek-V4.1's mxfp8 (528 B) "
                "records: run backend 'xla' or 'cpu', or dequantize with dsv4_jax.kvcache_v41"
            )
        if src.fp8:
            pages = R.fp8_slot_rows(src.pages)
            return R.fp8_source(pages.shape[1], src.page_size), pages, src.block_table, None
        return R.rows_source(src.pages.shape, src.pages.dtype, paged=True), src.pages, src.block_table, None
    rows = src.rows
    S, D = rows.shape
    g = R.packing(rows.dtype)
    Sp = -(-max(S, 1) // g) * g
    if Sp != S:  # a bf16 row moves with its pair partner: the last row needs one
        rows = jnp.pad(rows, ((0, Sp - S), (0, 0)))
    return R.rows_source((1, Sp, D), rows.dtype, paged=False), rows.reshape(1, Sp, D), None, src.offsets


def resident_pages(src: R.RowSource, table_width: int, prefix: str, window: int, bt: int) -> int:
    """Pages whose fp8 scale rows a tile keeps in VMEM: raw, the window's (W + BT - 1 entries
    span at most (W + BT - 2) // S + 2 pages); compressed, every page of a request."""
    if prefix == "raw":
        return min(table_width, (window + bt - 2) // src.page_size + 2)
    return table_width


def vmem_bytes(bt: int, hp: int, d: int, dtype, bk: int, sources, topk: int, window: int) -> int:
    """Our estimate of the kernel's VMEM (tile-padded scratch and the largest temporaries);
    sources: (RowSource, resident pages) per cache."""
    item = jnp.dtype(dtype).itemsize
    M, d_v = bt * hp, value_dim(d)
    lanes = lambda w: -(-w // 128) * 128  # noqa: E731
    size = M * lanes(d) * item + M * (lanes(d_v) + 256) * 4 + M * lanes(d_v) * item  # q, state, out staging
    size += 3 * M * lanes(bk) * 4  # scores, probabilities, mask
    _, win_rows = window_rows(window, bt)
    size += 3 * (-(-win_rows // bk) * bk) * lanes(d) * item  # the window buffer, a rolled copy, its slice
    for src, pages in sources:
        size += R.source_vmem_bytes(src, bk, pages)
        if R.needs_decode(src):  # the keys buffer and the decode's (CHUNK, 576) int32 temporaries
            size += bk * lanes(src.out_dim) * item + bk * 128 * 4 + 8 * R.CHUNK * lanes(576) * 4
    if topk:
        size += -(-bt // 8) * 8 * lanes(topk) * 4
    return size


def layer(
    q,
    meta,
    raw_kv,
    compressed_kv=None,
    *,
    sm_scale: float,
    attn_sink=None,
    topk_indices=None,
    out=None,
    interpret=None,
    shapes=None,
):
    """The fused prefill layer call of `dsv4_jax.prefill` for backend "mosaic_tpu" (the arguments
    every fused layer takes, as `dsv4_jax.kernels.cpu.prefill.layer`): meta the kind's `KindMetadata`
    (traced); interpret None (compile) or a `pltpu.InterpretParams`; shapes the `BlockShapes`.
    `out` is not written into (XLA may reuse a donated buffer). Its query tiles attend the windows
    max(0, p - W + 1) .. p: a plan with window floors (`KindShape.window_floors`: replay_start,
    DeepSeek-V4.1's replay band) is refused (NotImplementedError), never run with wider windows."""
    del out
    if meta.shape.window_floors:
        raise NotImplementedError(
            "backend 'mosaic_tpu': this plan's windows start above max(0, p - W + 1) for some request "
            "(replay_start or a DeepSeek-V4.1 replay band), which its query tiles do not model; use 'xla', 'cpu' "
            "or 'triton'"
        )
    return layer_from_table(
        q,
        meta.table,
        raw_kv,
        compressed_kv,
        topk_indices,
        attn_sink,
        shape=meta.shape,
        sm_scale=sm_scale,
        interpret=interpret,
        shapes=shapes,
    )


def layer_from_table(
    q, table, raw, comp, topk_rows, attn_sink, *, shape: KindShape, sm_scale: float, interpret, shapes=None
):
    """`layer` from the kind's metadata table and static shape (what `tools.tpu_aot` compiles):
    the layer's output (T_q, H, d_v) in q's dtype; rows of no planned token are 0.

    q (T_q, H, D); table: the kind's metadata table (traced); raw / comp: `PagedKV` or
    `LogicalKV` (comp None for SWA); topk_rows (T', topk) int32 for CSA; attn_sink (H,) f32 or None.
    interpret: None (compile) or a `pltpu.InterpretParams`. shapes: the `BlockShapes` (default:
    `block_shapes(target_chip())` compiled, the interpret ones otherwise).
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    T_q, H, D = q.shape
    dtype, d_v = q.dtype, value_dim(D)
    if shapes is None:
        shapes = R.block_shapes(None if interpret is not None else R.target_chip())
    bk, BT = shapes.block_k, shape.query_tile
    Hp = -(-H // R.sublanes(dtype)) * R.sublanes(dtype)
    if Hp != H:
        q = jnp.pad(q, ((0, 0), (0, Hp - H), (0, 0)))
    sink = jnp.full((H,), -jnp.inf, jnp.float32) if attn_sink is None else attn_sink.astype(jnp.float32)
    sink = jnp.pad(sink, (0, Hp - H), constant_values=-jnp.inf).reshape(1, Hp)
    raw_src, raw_hbm, raw_table, raw_off = _source(raw, dtype)
    comp_src = comp_hbm = comp_table = comp_off = None
    if comp is not None:
        comp_src, comp_hbm, comp_table, comp_off = _source(comp, dtype)
    offsets = jnp.zeros((2, 1), jnp.int32)
    if raw_off is not None or comp_off is not None:
        B = max(x.shape[0] for x in (raw_off, comp_off) if x is not None)
        pad = lambda x: jnp.zeros((B,), jnp.int32) if x is None else jnp.pad(x.astype(jnp.int32), (0, B - x.shape[0]))  # noqa: E731
        offsets = jnp.stack([pad(raw_off), pad(comp_off)])
    tiles = table[TILE_Q_ROW : TILE_POSITION + 1]
    num_tiles = table[SCALARS, 3]
    resident = {}
    for prefix, src, tbl in (("raw", raw_src, raw_table), ("comp", comp_src, comp_table)):
        if src is not None and src.fp8:
            resident[prefix] = resident_pages(src, tbl.shape[1], prefix, shape.window_size, BT)
    topk_width = 0 if shape.kind is not LayerKind.CSA else -(-topk_rows.shape[1] // bk) * bk
    sources = [(s, resident.get(p, 0)) for p, s in (("raw", raw_src), ("comp", comp_src)) if s is not None]
    need = vmem_bytes(BT, Hp, D, dtype, bk, sources, topk_width, shape.window_size)
    if need > shapes.vmem_capacity * 3 // 4:  # the chip's default limit (a smaller one may be asked for: probes)
        raise ValueError(
            f"block_table: backend 'mosaic_tpu' needs about {need / 2**20:.1f} MiB of VMEM per query tile here "
            f"(fp8 scale rows of {resident} pages per request), over the {shapes.vmem_capacity * 3 / 4 / 2**20:.0f} MiB "
            f"limit on {shapes.chip}"
        )

    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    names, args, specs = ["tiles", "offsets"], [tiles, offsets], []
    scratch = []

    def add(name, array, spec=any_spec):
        names.append(name)
        args.append(array)
        specs.append(spec)

    add("sink", sink, pl.BlockSpec((1, Hp), lambda i, *_: (0, 0)))
    add("q", q)
    topk = 0
    for prefix, src, hbm, tbl in (("raw", raw_src, raw_hbm, raw_table), ("comp", comp_src, comp_hbm, comp_table)):
        if src is None:
            continue
        add(prefix + "_hbm", hbm)
        (zero,) = src.zero_arrays()
        add(prefix + "_zero0", zero)
        if tbl is not None:
            add(prefix + "_table", tbl.astype(jnp.int32))
    if shape.kind is LayerKind.CSA:
        topk = topk_rows.shape[1]
        width = -(-topk // bk) * bk
        if width != topk:
            topk_rows = jnp.pad(topk_rows, ((0, 0), (0, width - topk)), constant_values=-1)
        add("topk", topk_rows.astype(jnp.int32))
    add("out_init", jnp.zeros((T_q, Hp, d_v), dtype))
    n_in = len(names)
    names.append("out")

    def scratch_add(name, s):
        names.append(name)
        scratch.append(s)

    scratch_add("q2", pltpu.VMEM((BT * Hp, D), dtype))
    _, win_rows = window_rows(shape.window_size, BT)
    scratch_add("win", pltpu.VMEM((-(-win_rows // bk) * bk, D), dtype))
    for name, s in zip(("acc", "m", "l"), R.state_scratch(BT * Hp, d_v)):
        scratch_add(name, s)
    for prefix, src, tbl in (("raw", raw_src, raw_table), ("comp", comp_src, comp_table)):
        if src is None:
            continue
        bufs, ssems = R.source_scratch(src, bk)
        for k, buf in enumerate(bufs):
            scratch_add(f"{prefix}_buf{k}", buf)
        scratch_add(prefix + "_sems", ssems)
        for k, buf in enumerate(R.decode_scratch(src, bk, dtype)):
            scratch_add(f"{prefix}_decode{k}", buf)
        if tbl is not None:
            scratch_add(prefix + "_bt", pltpu.SMEM((1, tbl.shape[1]), jnp.int32))
        if src.fp8:
            scratch_add(prefix + "_res", R.fp8_resident_scratch(src, resident[prefix]))
            scratch_add(prefix + "_zero_v", R.zero_scratch(src))
    if topk:
        scratch_add("topk_s", pltpu.SMEM((BT, width), jnp.int32))
        scratch_add("topk_v", pltpu.VMEM((BT, width), jnp.int32))
    scratch_add("job", pltpu.SMEM((BT + 1,), jnp.int32))
    scratch_add("out_v", pltpu.VMEM((BT, Hp, d_v), dtype))
    scratch_add("sems", pltpu.SemaphoreType.DMA((6,)))

    row_chunk = Hp * max(1, min(BT, ROW_CHUNK // Hp))
    if BT % (row_chunk // Hp):
        raise ValueError(f"query_tile: {BT} tokens do not split into chunks of {row_chunk // Hp} (use a power of two)")
    cfg = T.Config(
        shape.kind,
        shape.window_size,
        shape.compress_ratio,
        BT,
        Hp,
        D,
        d_v,
        bk,
        row_chunk,
        topk,
        sm_scale,
        raw_src,
        comp_src,
        tuple(names),
    )

    def body(*refs):
        r = dict(zip(cfg.names, refs))
        for prefix in ("raw", "comp"):  # group the per-source refs the helpers take
            if prefix + "_buf0" in r:
                bufs = [r[prefix + "_buf0"]] + ([r[prefix + "_buf1"]] if prefix + "_buf1" in r else [])
                zeros = [r[prefix + ("_zero_v" if prefix + "_zero_v" in r else "_zero0")]]
                r[prefix + "_bufs"], r[prefix + "_zeros"] = bufs, zeros
                if prefix + "_decode0" in r:
                    r[prefix + "_decode"] = (r[prefix + "_decode0"], r[prefix + "_decode1"])
        T.kernel(r, cfg)

    out = pl.pallas_call(
        body,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(num_tiles,),
            in_specs=specs,
            out_specs=any_spec,
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct((T_q, Hp, d_v), dtype),
        input_output_aliases={n_in - 1: 0},
        # tiles are independent (megacore splits them); TPU interpret mode wants a static grid for
        # "parallel" dims (it shuffles them), and the tile count is dynamic: "arbitrary" there
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary" if interpret else "parallel",), vmem_limit_bytes=shapes.vmem_limit
        ),
        interpret=interpret,
        name=f"dsv4_prefill_{shape.kind.name.lower()}_tpu",
    )(*args)
    return out[:, :H] if Hp != H else out
