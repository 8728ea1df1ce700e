"""One DeepSeek-V4 prefill layer as a Pallas TPU kernel (backend "mosaic_tpu"), driven by the plan.

Called by `dsv4_jax.prefill.prefill_attention(..., backend="mosaic_tpu")`: no workspace, no chunk
loop, no index rows. The step's metadata (`dsv4_jax.prefill_metadata`, built once per step on the
host) carries the query tiles: up to `query_tile` (16) consecutive new tokens of one request (q
rows, positions, request). They come from the batch alone, so every plan of a step gets the same
tiles; the grid is the tile count (dynamic), the tile table is scalar-prefetched into SMEM.

One grid step = one tile of BT tokens x Hp heads = M = BT * Hp query rows (2048 at V4-Pro's
H = 128): q rows are DMA'd into VMEM, the running softmax state (fp32) covers all M rows, and the
keys come straight from the caches by DMA (`mosaic_tpu_rows`: bf16 / fp32 rows, paged or packed,
or vLLM's fp8_ds_mla pages dequantized in VMEM):

1. compressed part, CSA: each token's own top-k entries (the indexer's ids, first
   min((p+1)//r, topk) columns), gathered by DMA from the compressed cache's pages per key block
   of `block_k` (the MXU width); per token M = Hp rows, N = block_k.
   HCA: every compressed entry the tile can see (w < (p_last + 1) // r), dense: blocks of
   block_k entries from entry 0, shared by all BT tokens: S = (M, D) x (D, block_k) MXU tiles,
   each row masked to its own token's w < (p + 1) // r.
2. window: raw positions max(0, p0 - W + 1) .. p_last in blocks aligned to absolute multiples of
   block_k, shared by the tile (per token W keys; the tile reads W + BT - 1 rows, not BT * W),
   each row masked to p - W < pos <= p.
3. out = acc / (l (1 + exp(sink - lse))) per token, DMA'd to its q row (rows of no planned
   token stay 0: the output buffer starts as zeros).

Same bits for every plan and every split of a prompt over steps: a row's state changes only by
blocks holding one of its keys (a fully masked block leaves it exactly as it was), the blocks a
token sees are aligned to absolute entries / positions and its top-k row, and every MXU product
of a phase has the same static shape; so a token's result depends on its keys alone, not on the
tile it shares. Tests check it bitwise across plans and splits (TPU interpret mode).

VMEM per tile (V4-Pro, H = 128, bf16, BT = 16, 128-wide blocks): q 2 MB, fp32 state 6.3 MB, the
output staging 2 MB, scores and probabilities (2048 x 128 fp32) 1 MB each, row buffers 0.5 MB per
source (fp8: 1.2 MB data + 4.7 MB scale rows, which sit one per 32-row tile): about 15-25 MB,
under the 48 MB limit of v5p / 7x and the 96 MB of v5e / v6e. `tests/jax/test_mosaic_tpu_compile.py`
compiles it with libtpu and reads Mosaic's own figure.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from dsv4_jax.kernels import mosaic_tpu_rows as R
from dsv4_jax.kernels.mosaic_tpu import job_table, job_token, pipeline
from dsv4_jax.prefill_metadata import SCALARS, TILE_POSITION, TILE_Q_ROW, KindShape
from planner import LayerKind
from planner.contract import value_dim

ROW_CHUNK = 256  # query rows per dense product: 2 tokens at H = 128, 4 at H = 64


@dataclass(frozen=True)
class _Config:
    kind: LayerKind
    window: int
    ratio: int
    bt: int  # tokens per tile
    hp: int  # padded heads
    d: int
    d_v: int
    bk: int
    row_chunk: int  # query rows per dense product (whole tokens)
    topk: int  # CSA: columns of the top-k rows used (the indexer's topk)
    sm_scale: float
    raw: R.RowSource
    comp: R.RowSource | None
    names: tuple  # kernel argument names, in order


def _source(src, dtype):
    """(RowSource, HBM array (P, rows, W), block table (B, max_pages) or None, offsets (B,) or None)."""
    if hasattr(src, "block_table"):
        if src.fp8:
            pages = R.fp8_page_rows(src.pages)
            return R.fp8_source(pages.shape[1], src.page_size), pages, src.block_table, None
        return R.rows_source(src.pages.shape, src.pages.dtype, paged=True), src.pages, src.block_table, None
    rows = src.rows
    S, D = rows.shape
    g = R.packing(rows.dtype)
    Sp = -(-max(S, 1) // g) * g
    if Sp != S:  # a bf16 row moves with its pair partner: the last row needs one
        rows = jnp.pad(rows, ((0, Sp - S), (0, 0)))
    return R.rows_source((1, Sp, D), rows.dtype, paged=False), rows.reshape(1, Sp, D), None, src.offsets


def _locator(cfg_src: R.RowSource, r, prefix: str, b):
    """Scalar entry -> (page, row) of request b for a source (a closure over its SMEM refs)."""
    if cfg_src.paged:
        table = r[prefix + "_bt"]
        ps = cfg_src.page_size
        return lambda e: (table[0, lax.div(e, ps)], lax.rem(e, ps))
    off = r["offsets"][0 if prefix == "raw" else 1, b]
    return lambda e: (jnp.int32(0), off + e)


def _row_vector(cfg_src: R.RowSource, r, prefix: str, b):
    """(BK, 1) entries -> each row's index inside its page (what `load_rows` selects by)."""
    if cfg_src.paged:
        ps = cfg_src.page_size
        return (lambda e: e & (ps - 1)) if ps & (ps - 1) == 0 else (lambda e: lax.rem(e, ps))
    off = r["offsets"][0 if prefix == "raw" else 1, b]
    return lambda e: off + e


def _kernel(r: dict, cfg: _Config):
    """One tile (grid step); r: the kernel's refs by name (`layer` builds it)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    BT, Hp, bk = cfg.bt, cfg.hp, cfg.bk
    tiles, q2, sems = r["tiles"], r["q2"], r["sems"]
    i = pl.program_id(0)
    q_row0, n, b, p0 = tiles[0, i], tiles[1, i], tiles[2, i], tiles[3, i]
    p_last = p0 + n - 1
    dtype = q2.dtype

    # 1. the tile's q rows, block-table rows and top-k rows (loops over the n live tokens)
    def q_copy(t):
        rows = pl.ds(pl.multiple_of(t * Hp, Hp), Hp)
        return pltpu.make_async_copy(r["q"].at[q_row0 + t], q2.at[rows], sems.at[0])

    def topk_copies(t):
        src = r["topk"].at[pl.ds(q_row0 + t, 1)]
        return (
            pltpu.make_async_copy(src, r["topk_s"].at[pl.ds(t, 1)], sems.at[2]),
            pltpu.make_async_copy(src, r["topk_v"].at[pl.ds(t, 1)], sems.at[2]),
        )

    def each_token(fn, lo, hi):
        lax.fori_loop(lo, hi, lambda t, c: (fn(t), c)[1], 0)

    csa = cfg.kind is LayerKind.CSA
    copies = []
    for prefix in ("raw", "comp"):
        if prefix + "_bt" in r:
            copies.append(pltpu.make_async_copy(r[prefix + "_table"].at[pl.ds(b, 1)], r[prefix + "_bt"], sems.at[1]))
    _each(copies, "start")
    each_token(lambda t: q_copy(t).start(), 0, n)
    if csa:
        each_token(lambda t: _each(topk_copies(t), "start"), 0, n)

    def zero_q(t):  # rows of no token: finite, so they cannot disturb anything
        q2[pl.ds(pl.multiple_of(t * Hp, Hp), Hp), :] = jnp.zeros((Hp, cfg.d), dtype)

    each_token(zero_q, n, BT)
    _each(copies, "wait")
    each_token(lambda t: q_copy(t).wait(), 0, n)
    if csa:
        each_token(lambda t: _each(topk_copies(t), "wait"), 0, n)

    acc, m_ref, l_ref = r["acc"], r["m"], r["l"]
    R.init_state(acc, m_ref, l_ref)
    # Dense products go over the M rows in chunks of RC rows (whole tokens): one chunk's code,
    # looped, instead of M-row vector code (Mosaic compiles it several times faster).
    RC = cfg.row_chunk
    per_chunk = RC // Hp  # tokens per chunk
    iota_rc = lax.broadcasted_iota(jnp.int32, (RC, 1), 0)
    local_tok = jnp.zeros((RC, 1), jnp.int32)
    for u in range(1, per_chunk):
        local_tok = local_tok + (iota_rc >= u * Hp).astype(jnp.int32)

    def dense_phase(src: R.RowSource, prefix: str, first_block, num_blocks, ok_entry, valid_fn):
        """Blocks first_block .. of entries shared by the tile; valid_fn(cols (1, BK), tok (RC, 1))
        -> (RC, BK): which keys each row of a chunk sees (tok: the rows' tile tokens)."""
        bufs, ssems = r[prefix + "_bufs"], r[prefix + "_sems"]
        zeros, locate = r[prefix + "_zeros"], _locator(src, r, prefix, b)
        rows_of = _row_vector(src, r, prefix, b)

        def issue(k, slot):
            base = (first_block + k) * bk

            def one(j, carry):
                e = base + j
                ok = ok_entry(e)
                page, row = locate(jnp.where(ok, e, 0))
                R.issue_row(src, r[prefix + "_hbm"], zeros, bufs, ssems, slot, j, ok, page, row)
                return carry

            lax.fori_loop(0, bk, one, 0)

        def compute(k, slot):
            base = (first_block + k) * bk
            entries = base + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
            keys = R.load_rows(src, bufs, slot, rows_of(entries), dtype, r.get(prefix + "_decode"))
            cols = base + lax.broadcasted_iota(jnp.int32, (1, bk), 1)

            def chunk(c, carry):
                rows = pl.ds(pl.multiple_of(c * RC, RC), RC)
                valid = valid_fn(cols, c * per_chunk + local_tok)
                R.softmax_update(acc, m_ref, l_ref, rows, q2[rows, :], keys, valid, cfg.sm_scale, cfg.d_v)
                return carry

            lax.fori_loop(0, lax.div(n + per_chunk - 1, per_chunk), chunk, 0)  # chunks holding a token

        pipeline(num_blocks, issue, lambda slot: R.wait_rows(src, bufs, ssems, slot), compute)

    # 2. the compressed part
    if cfg.kind is LayerKind.HCA:
        ratio = cfg.ratio
        num = lax.div(p_last + 1, ratio)  # entries the last token sees
        dense_phase(
            cfg.comp,
            "comp",
            jnp.int32(0),
            lax.div(num + bk - 1, bk),
            lambda e: e < num,
            lambda cols, tok: (cols < lax.div(p0 + tok + 1, ratio)) & (tok < n),
        )
    elif cfg.kind is LayerKind.CSA:
        _topk_phase(r, cfg, b, p0, n, dtype)
    # 3. the window
    W = cfg.window
    lo = jnp.maximum(p0 - W + 1, 0)
    first = lax.div(lo, bk)
    dense_phase(
        cfg.raw,
        "raw",
        first,
        lax.div(p_last, bk) - first + 1,
        lambda e: (e >= lo) & (e <= p_last),
        lambda cols, tok: (cols <= p0 + tok) & (cols > p0 + tok - W) & (tok < n),
    )
    # 4. outputs
    sink = R.col(r["sink"][...])
    out_v = r["out_v"]

    def out_copy(t):
        return pltpu.make_async_copy(out_v.at[t], r["out"].at[q_row0 + t], sems.at[3])

    def finish(t):
        rows = pl.ds(pl.multiple_of(t * Hp, Hp), Hp)
        o, _, _ = R.finalize(acc[rows, :], m_ref[rows, :1], l_ref[rows, :1], sink, True)
        out_v[t] = o.astype(out_v.dtype)
        out_copy(t).start()

    each_token(finish, 0, n)
    each_token(lambda t: out_copy(t).wait(), 0, n)


def _each(copies, method: str) -> None:
    for c in copies:
        getattr(c, method)()


def _topk_phase(r, cfg: _Config, b, p0, n, dtype):
    """CSA: each token's own top-k entries, per key block (M = Hp rows per product)."""
    from jax.experimental import pallas as pl

    BT, Hp, bk, src = cfg.bt, cfg.hp, cfg.bk, cfg.comp
    bufs, ssems, zeros = r["comp_bufs"], r["comp_sems"], r["comp_zeros"]
    locate, rows_of = _locator(src, r, "comp", b), _row_vector(src, r, "comp", b)
    topk_s, topk_v, job = r["topk_s"], r["topk_v"], r["job"]

    def limits(t):
        visible = lax.div(p0 + t + 1, cfg.ratio)
        return visible, jnp.where(t < n, jnp.minimum(visible, cfg.topk), 0)

    total = job_table(job, [limits(t)[1] for t in range(BT)], bk)

    def issue(k, slot):
        t, j = job_token(job, k, BT)
        visible, count = limits(t)

        def one(i, carry):
            c = j * bk + i
            e = topk_s[t, c]
            ok = (c < count) & (e >= 0) & (e < visible)
            page, row = locate(jnp.where(ok, e, 0))
            R.issue_row(src, r["comp_hbm"], zeros, bufs, ssems, slot, i, ok, page, row)
            return carry

        lax.fori_loop(0, bk, one, 0)

    def compute(k, slot):
        t, j = job_token(job, k, BT)
        visible, count = limits(t)
        entries = R.row_at(topk_v, t, pl.ds(pl.multiple_of(j * bk, bk), bk))
        cols = j * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        valid = (cols < count) & (entries >= 0) & (entries < visible)
        keys = R.load_rows(src, bufs, slot, rows_of(R.col(entries)), dtype, r.get("comp_decode"))
        rows = pl.ds(pl.multiple_of(t * Hp, Hp), Hp)
        R.softmax_update(r["acc"], r["m"], r["l"], rows, r["q2"][rows, :], keys, valid, cfg.sm_scale, cfg.d_v)

    pipeline(total, issue, lambda slot: R.wait_rows(src, bufs, ssems, slot), compute)


def vmem_bytes(cfg_bt: int, hp: int, d: int, dtype, bk: int, raw: R.RowSource, comp, topk: int) -> int:
    """Our estimate of the kernel's VMEM (tile-padded scratch and the largest temporaries)."""
    item = jnp.dtype(dtype).itemsize
    M, d_v = cfg_bt * hp, value_dim(d)
    lanes = lambda w: -(-w // 128) * 128  # noqa: E731
    size = M * lanes(d) * item + M * (lanes(d_v) + 256) * 4 + M * lanes(d_v) * item  # q, state, out staging
    size += 3 * M * lanes(bk) * 4  # scores, probabilities, mask
    size += R.source_vmem_bytes(raw, bk) + (R.source_vmem_bytes(comp, bk) if comp is not None else 0)
    if topk:
        size += -(-cfg_bt // 8) * 8 * lanes(topk) * 4
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
    every fused layer takes, as `dsv4_jax.prefill_cpu.layer`): meta the kind's `KindMetadata`
    (traced); interpret None (compile) or a `pltpu.InterpretParams`; shapes the `BlockShapes`.
    `out` is not written into (XLA may reuse a donated buffer)."""
    del out
    return _layer(
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


def _layer(q, table, raw, comp, topk_rows, attn_sink, *, shape: KindShape, sm_scale: float, interpret, shapes=None):
    """The layer's output (T_q, H, d_v) in q's dtype; rows of no planned token are 0.

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
        for z, name in zip(src.zero_arrays(), ("_zero0", "_zero1")):
            add(prefix + name, z)
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
    if topk:
        scratch_add("topk_s", pltpu.SMEM((BT, width), jnp.int32))
        scratch_add("topk_v", pltpu.VMEM((BT, width), jnp.int32))
    scratch_add("job", pltpu.SMEM((BT + 1,), jnp.int32))
    scratch_add("out_v", pltpu.VMEM((BT, Hp, d_v), dtype))
    scratch_add("sems", pltpu.SemaphoreType.DMA((4,)))

    row_chunk = Hp * max(1, min(BT, ROW_CHUNK // Hp))
    if BT % (row_chunk // Hp):
        raise ValueError(f"query_tile: {BT} tokens do not split into chunks of {row_chunk // Hp} (use a power of two)")
    cfg = _Config(
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
                zeros = [r[prefix + "_zero0"]] + ([r[prefix + "_zero1"]] if prefix + "_zero1" in r else [])
                r[prefix + "_bufs"], r[prefix + "_zeros"] = bufs, zeros
                if prefix + "_decode0" in r:
                    r[prefix + "_decode"] = (r[prefix + "_decode0"], r[prefix + "_decode1"])
        _kernel(r, cfg)

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
