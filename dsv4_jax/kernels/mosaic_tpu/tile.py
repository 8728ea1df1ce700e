"""The body of the mosaic_tpu prefill kernel: one query tile (one grid step) of
`dsv4_jax.kernels.mosaic_tpu.prefill` (which builds the pallas_call and documents the design).

`kernel(refs, cfg)`: the tile's q rows, block-table rows and top-k rows by DMA, the fp8 scale rows
of the pages it can read (`_fill_scales`), then the compressed part (CSA: `_topk_phase`, per
token; HCA: dense tiles shared by the tile), the window (`_window_phase`: rows read once per
tile, scored per token) and the outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
from jax import lax

from dsv4_jax.kernels.mosaic_tpu import rows as R
from dsv4_jax.kernels.mosaic_tpu.attention import job_table, job_token, pipeline
from planner import LayerKind

ROW_CHUNK = 256  # query rows per dense product: 2 tokens at H = 128, 4 at H = 64


@dataclass(frozen=True)
class Config:
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


def _locator(cfg_src: R.RowSource, r, prefix: str, b):
    """Scalar entry -> (page, row, scales) of request b for a source (a closure over its SMEM
    refs); scales: fp8, where the slot's scale group sits in the resident copy (`_fill_scales`)."""
    if cfg_src.paged:
        table = r[prefix + "_bt"]
        ps = cfg_src.page_size

        def locate(e):
            lp, row = lax.div(e, ps), lax.rem(e, ps)
            scales = None
            if cfg_src.fp8:
                scales = (r[prefix + "_res"], R.scale_group_row(cfg_src, lp - r["first_page"][prefix], row))
            return table[0, lp], row, scales

        return locate
    off = r["offsets"][0 if prefix == "raw" else 1, b]
    return lambda e: (jnp.int32(0), off + e, None)


def _row_vector(cfg_src: R.RowSource, r, prefix: str, b):
    """(BK, 1) entries -> each row's index inside its page (what `load_rows` selects by)."""
    if cfg_src.paged:
        ps = cfg_src.page_size
        return (lambda e: e & (ps - 1)) if ps & (ps - 1) == 0 else (lambda e: lax.rem(e, ps))
    off = r["offsets"][0 if prefix == "raw" else 1, b]
    return lambda e: off + e


def kernel(r: dict, cfg: Config):
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
    fills = _fill_scales(r, cfg, p0, p_last, each_token)
    each_token(lambda t: q_copy(t).wait(), 0, n)
    if csa:
        each_token(lambda t: _each(topk_copies(t), "wait"), 0, n)
    for wait in fills:
        wait()

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

    def dense_phase(src: R.RowSource, prefix: str, first_block, num_blocks, first_entry, ok_entry, valid_fn):
        """Blocks first_block .. of entries shared by the tile (first_entry: one any of them may
        see); valid_fn(cols (1, BK), tok (RC, 1)) -> (RC, BK): which keys each row of a chunk sees
        (tok: the rows' tile tokens)."""
        bufs, ssems = r[prefix + "_bufs"], r[prefix + "_sems"]
        zeros, locate = r[prefix + "_zeros"], _locator(src, r, prefix, b)
        rows_of = _row_vector(src, r, prefix, b)

        def issue(k, slot):
            base = (first_block + k) * bk

            def one(j, carry):
                e = base + j
                ok = ok_entry(e)
                page, row, scales = locate(jnp.where(ok, e, first_entry))
                R.issue_row(src, r[prefix + "_hbm"], zeros, bufs, ssems, slot, j, ok, page, row, scales)
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
            jnp.int32(0),
            lambda e: e < num,
            lambda cols, tok: (cols < lax.div(p0 + tok + 1, ratio)) & (tok < n),
        )
    elif cfg.kind is LayerKind.CSA:
        _topk_phase(r, cfg, b, p0, n, dtype)
    # 3. the window
    _window_phase(r, cfg, b, p0, n, dtype)
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


def window_rows(cfg_window: int, bt: int) -> tuple[int, int]:
    """(Wp, L): the window product's width (W rounded up to 16 rows) and the tile's window buffer
    rows (Wp + BT: positions p0 - Wp + 1 .. p0 + BT - 1)."""
    wp = -(-cfg_window // 16) * 16
    return wp, wp + bt


def _window_phase(r, cfg: Config, b, p0, n, dtype):
    """The window: the rows of positions p0 - Wp + 1 .. p_last are gathered once per tile into a
    VMEM buffer (blocks of `block_k` rows, double-buffered); then each token t takes its own Wp
    rows, positions p - Wp + 1 .. p, by a sublane roll of the buffer, and scores them alone
    (M = Hp rows, N = Wp columns, masked to p - W < pos <= p). The block a token sees depends on
    its position only (same bits for every tile it may fall in) and its N is the window, not
    two MXU-wide blocks of a shared dense tile."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    Hp, bk, W, src = cfg.hp, cfg.bk, cfg.window, cfg.raw
    Wp, L = window_rows(W, cfg.bt)
    bufs, ssems, zeros = r["raw_bufs"], r["raw_sems"], r["raw_zeros"]
    locate, rows_of = _locator(src, r, "raw", b), _row_vector(src, r, "raw", b)
    win = r["win"]
    p_last = p0 + n - 1
    lo = jnp.maximum(p0 - W + 1, 0)
    base = p0 - Wp + 1  # buffer row 0

    def issue(k, slot):
        def one(j, carry):
            e = base + k * bk + j
            ok = (e >= lo) & (e <= p_last)
            page, row, scales = locate(jnp.where(ok, e, lo))
            R.issue_row(src, r["raw_hbm"], zeros, bufs, ssems, slot, j, ok, page, row, scales)
            return carry

        lax.fori_loop(0, bk, one, 0)

    def store(k, slot):
        entries = jnp.maximum(base + k * bk + lax.broadcasted_iota(jnp.int32, (bk, 1), 0), 0)
        keys = R.load_rows(src, bufs, slot, rows_of(entries), dtype, r.get("raw_decode"))
        win[pl.ds(pl.multiple_of(k * bk, bk), bk), :] = keys

    pipeline(jnp.int32(win.shape[0] // bk), issue, lambda slot: R.wait_rows(src, bufs, ssems, slot), store)

    col = lax.broadcasted_iota(jnp.int32, (1, Wp), 1)

    def token(t, carry):
        keys = pltpu.roll(win[0:L, :], lax.rem(L - t, L), 0)[:Wp]  # row j: position p - Wp + 1 + j
        valid = (col >= Wp - W) & (col >= Wp - 1 - (p0 + t))  # p - W < pos and pos >= 0
        rows = pl.ds(pl.multiple_of(t * Hp, Hp), Hp)
        R.softmax_update(r["acc"], r["m"], r["l"], rows, r["q2"][rows, :], keys, valid, cfg.sm_scale, cfg.d_v)
        return carry

    lax.fori_loop(0, n, token, 0)


def _fill_scales(r, cfg: Config, p0, p_last, each):
    """Start copying, for each fp8 source, the scale rows of the pages the tile can read into VMEM
    (raw: the window's pages; compressed: every page up to the last token's visible entries) and
    its zero group; set r["first_page"][prefix]; return the waits."""
    from jax.experimental.pallas import tpu as pltpu

    r["first_page"], waits = {}, []
    for k, (prefix, src) in enumerate((("raw", cfg.raw), ("comp", cfg.comp))):
        if src is None or not src.fp8:
            continue
        sem = r["sems"].at[4 + k]
        if prefix == "raw":
            lo, hi = jnp.maximum(p0 - cfg.window + 1, 0), p_last + 1  # entries [lo, hi)
        else:
            lo, hi = jnp.int32(0), lax.div(p_last + 1, cfg.ratio)
        first = lax.div(lo, src.page_size)
        count = jnp.where(hi > lo, lax.div(hi - 1, src.page_size) - first + 1, 0)
        r["first_page"][prefix] = first
        table, hbm, res = r[prefix + "_bt"], r[prefix + "_hbm"], r[prefix + "_res"]

        def copy(j, src=src, table=table, hbm=hbm, res=res, first=first, sem=sem):
            return R.copy_scale_rows(src, hbm, res, sem, table[0, first + j], j)

        zero = pltpu.make_async_copy(r[prefix + "_zero0"], r[prefix + "_zero_v"], sem)
        zero.start()
        each(lambda j, copy=copy: copy(j).start(), 0, count)

        def wait(copy=copy, count=count, zero=zero):
            zero.wait()
            each(lambda j: copy(j).wait(), 0, count)

        waits.append(wait)
    return waits


def _each(copies, method: str) -> None:
    for c in copies:
        getattr(c, method)()


def _topk_phase(r, cfg: Config, b, p0, n, dtype):
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
            page, row, scales = locate(jnp.where(ok, e, 0))
            R.issue_row(src, r["comp_hbm"], zeros, bufs, ssems, slot, i, ok, page, row, scales)
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
