"""dsv4_torch prefill: against the chunk-free oracle, chunk invariance, paged == logical."""

import numpy as np
import pytest
import torch

import planner as P
from dsv4_torch import prefill as TP
from tests.cases import boundary_cases, make_case

POLICIES = ("adaptive", "fixed", "per_request")


def run(case, *, policy="adaptive", paged=False, dtype=torch.float32, backend="reference", **cfg):
    step = P.plan_step(case.batch, case.plan_config(policy=policy, **cfg), [case.layer])
    meta = TP.build_step_metadata(step, index_topk=case.topk)[case.kind]
    t = lambda a: torch.from_numpy(np.asarray(a)).to(dtype)
    if paged is True:
        raw = TP.PagedKV(*(torch.from_numpy(x) for x in case.paged("raw", seed=1)))
        raw = TP.PagedKV(raw.pages.to(dtype), raw.block_table)
        comp = None
        if case.kind.has_compressed:
            pages, table = case.paged("comp", seed=2)
            comp = TP.PagedKV(t(pages), torch.from_numpy(table))
    else:
        raw = [t(x) for x in case.raw]
        comp = [t(x) for x in case.comp] if case.kind.has_compressed else None
        if paged == "packed":  # one tensor + offsets; a window-only raw cache needs negative offsets
            raw = TP.LogicalKV.from_list(raw)
            comp = TP.LogicalKV.from_list(comp) if comp else None
    out = TP.prefill_attention(
        t(case.q),
        meta,
        raw,
        comp,
        sm_scale=case.sm_scale,
        attn_sink=torch.from_numpy(case.sink),
        topk_indices=torch.from_numpy(case.topk_rows) if case.kind is P.LayerKind.CSA else None,
        backend=backend,
    )
    return out, meta


@pytest.mark.parametrize("ratio", [0, 4, 128])
@pytest.mark.parametrize("case_no", range(4))
def test_prefill_matches_oracle_and_is_chunk_invariant(ratio, case_no):
    case = boundary_cases(ratio)[case_no]
    want, _, _ = case.oracle()
    outs = {}
    for policy in POLICIES:
        out, meta = run(case, policy=policy)
        assert meta.last_backend == "reference"
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        outs[policy] = out
    # the plan never changes a bit of the result (reference backend, fp32)
    for policy in POLICIES[1:]:
        assert torch.equal(outs[policy], outs["adaptive"]), policy
    # nor does a length-sorted order, a budget that splits requests, paged or packed caches
    tight = max(s // ratio if case.kind.has_compressed else 0 for s in case.seq_lens) + case.window_size + 4
    for kw in (dict(order="length"), dict(budget_rows=tight), dict(paged=True), dict(paged="packed")):
        out, _ = run(case, **kw)
        assert torch.equal(out, outs["adaptive"]), kw


@pytest.mark.parametrize("kind, ratio", [("CSA", 8), ("HCA", 32), ("HCA", 1)])
@pytest.mark.parametrize("case_no", [1, 2])
def test_other_ratios_match_oracle_and_are_chunk_invariant(kind, ratio, case_no):
    """A kind and a ratio vary apart: a small test model's CSA 8 / HCA 32, V4.1's full-length ratio 1."""
    case = boundary_cases(ratio, kind=kind)[case_no]
    assert case.layer == P.LayerSpec(kind, ratio)
    want, _, _ = case.oracle()
    outs = [run(case, policy=p)[0] for p in POLICIES] + [run(case, paged=True)[0]]
    np.testing.assert_allclose(outs[0].numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert all(torch.equal(o, outs[0]) for o in outs)


@pytest.mark.parametrize("topk, width", [(512, 640), (1024, 1152)])
def test_csa_real_index_widths(topk, width):
    case = make_case("csa-wide", [4200, 2100], [3, 2], 4, window_size=128, topk=topk, H=2, D=16, seed=5)
    out, meta = run(case)
    assert meta.index_width == width
    want, _, _ = case.oracle()
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_hca_long_context():
    case = make_case("hca-long", [40000, 300], [4, 300], 128, window_size=128, H=2, D=16, seed=6)
    outs = [run(case, policy=p)[0] for p in POLICIES]
    want, _, _ = case.oracle()
    np.testing.assert_allclose(outs[0].numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_bf16_within_flashmla_tolerance():
    case = boundary_cases(4)[2]
    # FlashMLA's tolerance is against an fp32 reference on the same bf16-rounded inputs
    bf = lambda a: torch.from_numpy(a).bfloat16().float().numpy()
    case.q, case.raw, case.comp = bf(case.q), [bf(x) for x in case.raw], [bf(x) for x in case.comp]
    want, _, _ = case.oracle()
    out, _ = run(case, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    err = np.abs(out.float().numpy() - want)
    assert (err <= 8e-4 + (3 / 128) * np.abs(want)).all(), err.max()


def test_device_indices_equal_numpy_builder():
    for ratio in (0, 4, 128):
        case = boundary_cases(ratio)[2]
        for policy in POLICIES:
            step = P.plan_step(case.batch, case.plan_config(policy=policy, order="length"), [case.layer])
            meta = TP.build_step_metadata(step, index_topk=case.topk)[case.kind]
            kp = step[case.kind]
            for c, cm in zip(kp.chunks, meta.chunks):
                want_idx, want_len = P.build_chunk_indices(
                    kp, c, case.topk_rows if case.kind is P.LayerKind.CSA else None
                )
                idx, length = TP.build_indices(meta, cm, torch.from_numpy(case.topk_rows))
                np.testing.assert_array_equal(idx.numpy(), want_idx)
                np.testing.assert_array_equal(length.numpy(), want_len)


def test_metadata_built_once_and_workspace_shared():
    case = boundary_cases(128)[0]
    step = P.plan_step(case.batch, case.plan_config(), P.V4_LAYERS)
    meta = TP.build_step_metadata(step, index_topk=case.topk)
    assert meta["SWA"] is meta[P.LayerKind.SWA]
    ws = meta.workspace(32, torch.float32)
    assert ws.shape[0] == step.max_workspace_rows
    assert meta.workspace(32, torch.float32) is ws  # every layer reuses it


def test_logical_kv_keeps_only_recent_rows():
    """A LogicalKV may hold just each request's window rows, with negative offsets."""
    case = boundary_cases(0)[2]  # long prefixes
    want, _ = run(case)
    gath = case.batch.gather_lens(case.window_size)
    keep = [x[int(s) - int(g) :] for x, s, g in zip(case.raw, case.seq_lens, gath)]
    starts = np.concatenate([[0], np.cumsum([len(k) for k in keep])[:-1]])
    offsets = torch.tensor(starts - (np.array(case.seq_lens) - gath))
    step = P.plan_step(case.batch, case.plan_config(), [case.layer])
    meta = TP.build_step_metadata(step)[case.kind]
    got = TP.prefill_attention(
        torch.from_numpy(case.q),
        meta,
        TP.LogicalKV(torch.from_numpy(np.concatenate(keep)), offsets),
        sm_scale=case.sm_scale,
        attn_sink=torch.from_numpy(case.sink),
        backend="reference",
    )
    assert torch.equal(got, want)


def test_bad_inputs():
    case = boundary_cases(4)[0]
    step = P.plan_step(case.batch, case.plan_config(), [case.layer])
    meta = TP.build_step_metadata(step, index_topk=case.topk)[case.kind]
    q = torch.from_numpy(case.q)
    raw = [torch.from_numpy(x) for x in case.raw]
    comp = [torch.from_numpy(x) for x in case.comp]
    rows = torch.from_numpy(case.topk_rows)
    call = lambda **kw: TP.prefill_attention(
        **{**dict(q=q, meta=meta, raw_kv=raw, compressed_kv=comp, sm_scale=0.1, topk_indices=rows), **kw}
    )
    with pytest.raises(ValueError, match="q: 3 tokens"):
        call(q=q[:3])
    with pytest.raises(ValueError, match="topk_indices"):
        call(topk_indices=None)
    with pytest.raises(ValueError, match="compressed_kv"):
        call(compressed_kv=None)
    with pytest.raises(TypeError, match="raw_kv"):
        call(raw_kv=[x.double() for x in raw])
    future = rows.clone()
    future[-1, 0] = 10_000
    with pytest.raises(ValueError, match="topk_indices: row"):
        call(topk_indices=future)
    with pytest.raises(ValueError, match="index_topk"):
        TP.build_step_metadata(step)
    with pytest.raises(ValueError, match="config"):
        TP.build_step_metadata(case.batch)
    with pytest.raises(ValueError, match="block_table"):
        TP.PagedKV(torch.zeros(2, 4, 8), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="offsets"):
        TP.LogicalKV(torch.zeros(4, 8), torch.zeros(2))
    with pytest.raises(TypeError, match="raw_kv"):
        call(raw_kv=[])


# --- bad caches: every one a ValueError naming the argument, never a wrong answer ---------------


def _layer(ratio, case_no=2):
    """(call(**overrides), case, meta): a CSA/HCA/SWA layer call with good inputs by default."""
    case = boundary_cases(ratio)[case_no]
    step = P.plan_step(case.batch, case.plan_config(), [case.layer])
    meta = TP.build_step_metadata(step, index_topk=case.topk)[case.kind]
    kw = dict(
        q=torch.from_numpy(case.q),
        meta=meta,
        raw_kv=[torch.from_numpy(x) for x in case.raw],
        compressed_kv=[torch.from_numpy(x) for x in case.comp] if case.kind.has_compressed else None,
        sm_scale=case.sm_scale,
        attn_sink=torch.from_numpy(case.sink),
        topk_indices=torch.from_numpy(case.topk_rows) if case.kind is P.LayerKind.CSA else None,
        backend="reference",
    )
    return (lambda **o: TP.prefill_attention(**{**kw, **o})), case, meta


def _paged(case, which):
    pages, table = case.paged(which, seed=3)
    return TP.PagedKV(torch.from_numpy(pages), torch.from_numpy(table))


def test_bad_cache_last_dim():
    call, case, _ = _layer(4)
    raw = _paged(case, "raw")
    with pytest.raises(ValueError, match=r"raw_kv: last dim 31, q's D is 32"):
        call(raw_kv=TP.PagedKV(raw.pages[..., :31].contiguous(), raw.block_table))
    with pytest.raises(ValueError, match=r"compressed_kv\[1\]: last dim 31"):
        call(compressed_kv=[torch.from_numpy(x[:, : 31 if i == 1 else None]) for i, x in enumerate(case.comp)])
    packed = TP.LogicalKV.from_list([torch.from_numpy(x[:, :31]) for x in case.comp])
    with pytest.raises(ValueError, match=r"compressed_kv: last dim 31"):
        call(compressed_kv=packed)


def test_bad_cache_block_table_too_few_rows():
    call, case, _ = _layer(128)
    raw = _paged(case, "raw")
    with pytest.raises(ValueError, match=r"raw_kv.block_table: 2 rows, but the step's batch has 3 requests"):
        call(raw_kv=TP.PagedKV(raw.pages, raw.block_table[:2]))
    comp = _paged(case, "comp")
    with pytest.raises(ValueError, match=r"compressed_kv.block_table: 1 rows"):
        call(compressed_kv=TP.PagedKV(comp.pages, comp.block_table[:1]))
    # extra rows (an engine's padded table) are fine
    want = call(raw_kv=raw)
    wide = TP.PagedKV(raw.pages, torch.cat([raw.block_table, raw.block_table[:1]]))
    assert torch.equal(call(raw_kv=wide), want)


def test_bad_cache_block_table_too_narrow():
    call, case, _ = _layer(4)  # seq_lens [300, 517, 260], raw pages of 16, compressed pages of 4
    raw, comp = _paged(case, "raw"), _paged(case, "comp")
    with pytest.raises(
        ValueError, match=r"raw_kv.block_table: 32 pages of 16 entries hold 512, but request 1 needs 517"
    ):
        call(raw_kv=TP.PagedKV(raw.pages, raw.block_table[:, :32]))
    with pytest.raises(
        ValueError, match=r"compressed_kv.block_table: 32 pages of 4 entries hold 128, but request 1 needs 129"
    ):
        call(compressed_kv=TP.PagedKV(comp.pages, comp.block_table[:, :32]))


def test_bad_cache_page_ids_checked_on_cpu():
    call, case, _ = _layer(0)
    raw = _paged(case, "raw")
    table = raw.block_table.clone()
    table[2, 16] = raw.pages.shape[0]  # request 2 (seq_len 260) reads pages 0 .. 16
    with pytest.raises(ValueError, match=r"raw_kv.block_table: request 2 page 16 is \d+, outside 0 \.\. \d+"):
        call(raw_kv=TP.PagedKV(raw.pages, table))
    table = raw.block_table.clone()
    table[2, :] = -1  # pages request 2 never reads (before its window) may be anything
    table[2, 15:17] = raw.block_table[2, 15:17]
    assert torch.equal(call(raw_kv=TP.PagedKV(raw.pages, table)), call(raw_kv=raw))


def test_bad_cache_per_request_lengths():
    """The audit's probe: request 0 one row short, the last one row long, same total."""
    call, case, _ = _layer(0)
    raw = [torch.from_numpy(x) for x in case.raw]
    shifted = [raw[0][:-1], raw[1], torch.cat([raw[2], raw[2][:1]])]
    with pytest.raises(ValueError, match=r"raw_kv\[0\]: 299 rows, but request 0 needs 300"):
        call(raw_kv=shifted)
    with pytest.raises(ValueError, match=r"raw_kv: 2 per-request tensors, but the step's batch has 3 requests"):
        call(raw_kv=raw[:2])
    call4, case4, _ = _layer(4)
    comp = [torch.from_numpy(x) for x in case4.comp]
    with pytest.raises(ValueError, match=r"compressed_kv\[2\]: 64 rows, but request 2 needs 65"):
        call4(compressed_kv=comp[:2] + [comp[2][:-1]])
    # longer than needed (a cache holding more) is fine
    assert torch.equal(call(raw_kv=raw[:2] + [torch.cat([raw[2], raw[2][:5]])]), call())


def test_bad_cache_packed_offsets():
    call, case, _ = _layer(0)
    packed = TP.LogicalKV.from_list([torch.from_numpy(x) for x in case.raw])
    with pytest.raises(ValueError, match=r"raw_kv.offsets: 2 rows, but the step's batch has 3 requests"):
        call(raw_kv=TP.LogicalKV(packed.rows, packed.offsets[:2]))
    off = packed.offsets.clone()
    off[0] += 1  # request 0 would read into request 1's rows: fine for the bounds, so shift the last
    off[2] += 1  # request 2 (260 rows) now ends one row past the end
    with pytest.raises(ValueError, match=r"raw_kv.offsets: request 2 at offset 818 reads rows .* outside 0 \.\. 1076"):
        call(raw_kv=TP.LogicalKV(packed.rows, off))
    off = packed.offsets.clone()
    off[0] = -300  # request 0 reads positions 286 .. 299 only (7 queries + 7 window rows): -14 .. -1
    with pytest.raises(ValueError, match=r"raw_kv.offsets: request 0 at offset -300 reads rows -14 \.\. -1"):
        call(raw_kv=TP.LogicalKV(packed.rows, off))


def test_bad_topk_indices():
    call, case, meta = _layer(4)
    rows = torch.from_numpy(case.topk_rows)
    want = call()
    assert torch.equal(call(topk_indices=rows.long()), want)  # int64 is accepted ...
    with pytest.raises(TypeError, match=r"topk_indices: expected int32 or int64, got torch.float32"):
        call(topk_indices=rows.float())  # ... and the message says so
    with pytest.raises(ValueError, match=r"topk_indices: on meta, q on cpu"):
        call(topk_indices=torch.empty(rows.shape, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match=rf"topk_indices: expected \({rows.shape[0]}, {case.topk}\)"):
        call(topk_indices=rows[:, :-1])
    with pytest.raises(TypeError, match=r"block_table: expected int32 or int64, got torch.float32"):
        TP.PagedKV(torch.zeros(2, 4, 8), torch.zeros(3, 2))


# --- per-step work stays in the metadata -------------------------------------------------------


@pytest.mark.parametrize("ratio", [0, 4, 128])
@pytest.mark.parametrize("layout", ["paged", "packed"])
def test_layer_call_makes_no_host_sync(ratio, layout, monkeypatch):
    from tests.no_host_sync import forbid_host_sync

    call, case, meta = _layer(ratio)
    want = call()
    if layout == "paged":
        raw, comp = _paged(case, "raw"), _paged(case, "comp") if case.kind.has_compressed else None
    else:
        raw = TP.LogicalKV.from_list([torch.from_numpy(x) for x in case.raw])
        comp = TP.LogicalKV.from_list([torch.from_numpy(x) for x in case.comp]) if case.kind.has_compressed else None
    # The value checks read page ids / offsets / top-k rows on the host and run for CPU tensors only
    # (free there; on a GPU they are skipped), so they are the one thing taken out here.
    monkeypatch.setattr("dsv4_torch.prefill_kv.check_source_values", lambda *a: None)
    monkeypatch.setattr(TP, "_check_topk_values", lambda *a: None)
    # The whole layer call is guarded, the reference kernel included, as it runs on a GPU.
    from dsv4_torch.kernels.reference import attention as ref_kernel

    monkeypatch.setattr(ref_kernel, "SKIP_EMPTY_BLOCKS_ON_CPU", False)
    for _ in range(2):  # the first call builds the row maps, the second reuses them
        with forbid_host_sync():
            got = call(raw_kv=raw, compressed_kv=comp)
        assert torch.equal(got, want)
    assert meta.last_backend == "reference"


def test_forbid_host_sync_catches_old_style_gather():
    """The guard would have caught a gather sized from device data (the test above can fail)."""
    from tests.no_host_sync import HostSyncError, forbid_host_sync

    lengths = torch.tensor([2, 0, 3])
    with pytest.raises(HostSyncError, match="repeat_interleave"), forbid_host_sync():
        torch.repeat_interleave(torch.arange(3), lengths)


def test_index_rows_built_once_per_step_gathers_follow_the_block_table(monkeypatch):
    from dsv4_torch import prefill_metadata as TPM

    call, case, meta = _layer(4)
    assert meta._index_rows is None  # build_step_metadata forms nothing on the device ...
    want = call()
    rows = meta.chunk_indices  # ... the first layer call does, once for the kind
    monkeypatch.setattr(TPM, "chunk_index_rows", lambda *a: pytest.fail("index rows rebuilt in a layer call"))
    raw, comp = _paged(case, "raw"), _paged(case, "comp")
    assert torch.equal(call(raw_kv=raw, compressed_kv=comp), want)
    assert meta.chunk_indices is rows
    # gathers read the block table of each call: pages moved, or a table edited in place
    perm = torch.randperm(raw.pages.shape[0], generator=torch.Generator().manual_seed(0))
    moved = TP.PagedKV(raw.pages[perm], torch.argsort(perm).to(torch.int32)[raw.block_table.long()])
    assert torch.equal(call(raw_kv=moved, compressed_kv=comp), want)
    table = raw.block_table.clone()
    pages = raw.pages.clone()
    assert torch.equal(call(raw_kv=TP.PagedKV(pages, table), compressed_kv=comp), want)
    table.copy_(moved.block_table)  # in place: same tensor, new contents
    pages.copy_(moved.pages)
    assert torch.equal(call(raw_kv=TP.PagedKV(pages, table), compressed_kv=comp), want)


def test_device_gather_maps_equal_numpy_rows():
    """`gather_map` (device, from per-segment arrays) == planner.layout.chunk_gather_rows, any block."""
    from planner.layout import chunk_gather_rows

    for ratio in (0, 4, 128):
        case = boundary_cases(ratio)[3]
        for kw in (dict(), dict(order="length"), dict(budget_rows=200 // max(ratio, 1) + case.window_size + 4)):
            step = P.plan_step(case.batch, case.plan_config(**kw), [case.layer])
            meta = TP.build_step_metadata(step, index_topk=case.topk)[case.kind]
            kp = step[case.kind]
            for c, cm in enumerate(meta.chunks):
                for region, want in zip(("compressed", "raw"), chunk_gather_rows(kp, c)):
                    n = cm.compressed_rows if region == "compressed" else cm.raw_rows
                    assert n == want[0].shape[0]
                    g = TP.gather_map(meta, cm, region)
                    for got, w in zip((g.dst, g.request, g.entry), want):
                        np.testing.assert_array_equal(got.numpy(), w)
                    if n > 2:  # a block of rows in the middle
                        g = TP.gather_map(meta, cm, region, 1, n - 2)
                        np.testing.assert_array_equal(g.dst.numpy(), want[0][1:-1])
