"""DeepSeek-V4.1 layers through dsv4_torch's public prefill: `build_step_metadata` of a V4.1 step
(metadata once per PlanKey, `for_layer`), every layer of the tiny schedule (ratios 0 / 2 / 1, the
cut and replay bands, shared caches, -1 picks, prefix hits) equal to the float64 oracle
(`planner.oracle.layer_attention`) on the reference and fused "cpu" backends, per-request and
paged caches, 528-byte mxfp8 pages; bad input refused by name."""

import numpy as np
import pytest
import torch

import planner as P
from dsv4_torch import prefill as TP
from tests import v41_record_cases as R
from tests.cases import make_case
from tests.v41_prefill_cases import TINY, paged, v41_case, v41_cases

CASES = {c.name: c for c in v41_cases()}
BACKENDS = ("reference", "cpu")
t = torch.from_numpy


def run_layer(case, meta, st, i, backend, layout="list", caches=None, dtype=torch.float32):
    q, raw, comp, topk = case.layer_inputs(i, st)
    if caches is not None:  # given sources (e.g. mxfp8 pages)
        raw_src, comp_src = caches(i)
    elif layout == "paged":
        raw_src = TP.PagedKV(*map(t, paged(raw, 8, seed=i)))
        r = TINY[i].compress_ratio
        comp_src = None if comp is None else TP.PagedKV(*map(t, paged(comp, 8 // r, seed=10 + i)))
    else:
        raw_src = [t(x).to(dtype) for x in raw]
        comp_src = None if comp is None else [t(x).to(dtype) for x in comp]
    m = meta.for_layer(i)
    out = TP.prefill_attention(
        t(q).to(dtype),
        m,
        raw_src,
        comp_src,
        sm_scale=case.sm_scale,
        attn_sink=t(case.sink[i]),
        topk_indices=None if topk is None else t(topk),
        backend=backend,
    )
    assert m.last_backend == backend
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_every_layer_equals_the_oracle(name):
    case = CASES[name]
    st = case.step()
    meta = TP.build_step_metadata(st, index_topk=case.index_topk)
    assert isinstance(meta, TP.PlanStepMetadata) and set(meta.plans) == set(st.plans)
    for i in range(len(TINY)):
        key = st.layer_keys[i]
        assert meta.for_layer(i) is meta[key] and meta[key].plan.key == key
        token_index, want, _ = case.oracle(i)
        assert token_index.tolist() == case.rows(i, st).tolist()
        scale = np.abs(want).max()
        outs = {}
        for backend in BACKENDS:
            for layout in ("list", "paged") if backend == "reference" or name.startswith("prefix-hit") else ("list",):
                out = run_layer(case, meta, st, i, backend, layout).numpy()
                assert out.shape == want.shape, (i, key)
                np.testing.assert_allclose(out, want, rtol=1e-5, atol=2e-6 * scale, err_msg=f"{name} {i} {backend}")
                outs.setdefault(backend, []).append(out)
        for backend, got in outs.items():  # the cache layout changes no bit
            assert all(np.array_equal(got[0], g) for g in got[1:]), (name, i, backend)


def test_metadata_shared_per_plan_and_plans_change_no_bit():
    """One metadata per PlanKey (4 with replay: SWA, ratio 2, the cut, the replay band; 3 without),
    every layer of a key on the same object; the reference backend gives the same bits under
    every plan (adaptive, per request, length order, a budget that splits requests)."""
    case = CASES["prefix-hit-replay"]
    for replay, n in ((None, 4), (False, 3)):
        st = case.step(replay=replay)
        meta = TP.build_step_metadata(st, index_topk=case.index_topk)
        assert len(meta.plans) == st.num_plans == n
        assert meta.sharing == st.sharing and sum(map(len, meta.sharing.values())) == len(TINY)
        assert set(meta.kinds) == {P.LayerKind.SWA} and meta["SWA"] is meta.for_layer(0)
    base = {}
    for cfg in (dict(), dict(policy="per_request"), dict(order="length"), dict(budget_rows=130)):
        st = case.step(**cfg)
        meta = TP.build_step_metadata(st, index_topk=case.index_topk)
        for i in range(len(TINY)):
            out = run_layer(case, meta, st, i, "reference")
            if i in base:
                assert torch.equal(out, base[i]), (cfg, i)
            base[i] = out


@pytest.mark.parametrize("layout", ["interleaved", "split"])
def test_mxfp8_pages(layout):
    """Window and shared compressed caches in 528-byte mxfp8 pages (D = 512): equal to the oracle
    on the values the pages hold, and to float caches of those values bit for bit."""
    case = v41_case("mxfp8", [50, 21, 70], [34, 21, 9], replay_start=[0, 0, 40], D=512, seed=5)
    st = case.step()
    assert st.replay
    pages, held = {}, {"raw": {}, "comp": {}}
    for i in range(len(TINY)):
        p, table, held["raw"][i] = R.mxfp8_paged(case.raw[i], 16, 100 + i, layout)
        pages[("raw", i)] = TP.PagedKV(t(p), t(table), kv_cache_dtype="fp8_ds_mla", layout=layout)
    for src in TINY.kv_source_layer_ids:
        p, table, held["comp"][src] = R.mxfp8_paged(case.caches[src], 16 // TINY[src].compress_ratio, 7 + src, layout)
        pages[("comp", src)] = TP.PagedKV(t(p), t(table), kv_cache_dtype="fp8_ds_mla", layout=layout)
    case.raw = held["raw"]
    meta = TP.build_step_metadata(st, index_topk=case.index_topk)

    def sources(i):
        role = TINY[i]
        return pages[("raw", i)], pages[("comp", role.kv_source_layer_id)] if role.has_compressed else None

    for i in range(len(TINY)):
        _, want, _ = case.oracle(i, caches=held["comp"])
        for backend in BACKENDS:
            out = run_layer(case, meta, st, i, backend, caches=sources)
            np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
            role = TINY[i]
            floats = (
                [t(x) for x in held["raw"][i]],
                [t(x) for x in held["comp"][role.kv_source_layer_id]] if role.has_compressed else None,
            )
            assert torch.equal(out, run_layer(case, meta, st, i, backend, caches=lambda _: floats)), (i, backend)


def test_v4_steps_keep_their_kinds_and_take_window_floors():
    """A V4 step's metadata is indexed by kind as before; a batch with replay_start (prefix hits)
    gets windows from its floors on every backend (the oracle's `window_starts`)."""
    case = make_case("floors", [60, 41, 30], [20, 41, 9], 4, window_size=8, topk=6, H=2, D=16, seed=3)
    batch = P.PrefillBatch(case.seq_lens, case.query_lens, replay_start=[35, 0, 19])
    meta = TP.build_step_metadata(batch, config=case.plan_config(), layers=[case.layer], index_topk=case.topk)
    assert type(meta) is TP.StepMetadata and meta["CSA"].plan.key == P.PlanKey(case.layer)
    with pytest.raises(ValueError, match="layer_id: this step was planned from a list"):
        meta.step_plan.for_layer(0)
    want = P.oracle.prefill_attention(
        case.q, case.raw, case.comp, case.seq_lens, case.query_lens, kind="CSA", compress_ratio=4, window_size=8,
        sm_scale=case.sm_scale, attn_sink=case.sink, topk_rows=case.topk_rows, window_starts=[35, 0, 19],
    )[0]  # fmt: skip
    for backend in BACKENDS:
        out = TP.prefill_attention(
            t(case.q), meta["CSA"], [t(x) for x in case.raw], [t(x) for x in case.comp], sm_scale=case.sm_scale,
            attn_sink=t(case.sink), topk_indices=t(case.topk_rows), backend=backend,
        )  # fmt: skip
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_bad_input():
    case = CASES["prefix-replay"]
    st = case.step()
    assert st.replay
    meta = TP.build_step_metadata(st, index_topk=case.index_topk)
    q, raw, comp, topk = case.layer_inputs(4, st)  # a replay-band layer (ratio 1)
    kw = dict(sm_scale=case.sm_scale, backend="reference")
    raw_t, comp_t = [t(x) for x in raw], [t(x) for x in comp]
    m = meta.for_layer(4)
    # the step's every row for a replay-band layer (or the cut's rows for a full-band layer)
    with pytest.raises(ValueError, match=r"q: 52 rows, but this layer's plan CSA1/replay computes 37 rows"):
        TP.prefill_attention(t(case.q[4]), m, raw_t, comp_t, topk_indices=t(case.topk[3]), **kw)
    with pytest.raises(ValueError, match=r"q: 37 rows, but this layer's plan CSA2/full computes 52 rows"):
        TP.prefill_attention(t(q), meta.for_layer(2), raw_t, [t(x) for x in case.caches[1]], topk_indices=t(topk), **kw)
    # a PlanKey the step does not have; a kind with several plans
    with pytest.raises(KeyError, match=r"no metadata for CSA4/full in this step \(built: \['SWA/full', 'CSA2/full'"):
        meta[P.PlanKey(("CSA", 4))]
    with pytest.raises(KeyError, match="CSA: this step has 3 CSA plans"):
        meta["CSA"]
    with pytest.raises(ValueError, match="layer_id: expected 0..6, got 7"):
        meta.for_layer(7)
    # a compressed cache shorter than the plan reads (ratio 1: seq_len entries per request)
    short = [x[:-1] for x in comp_t]
    with pytest.raises(ValueError, match=r"compressed_kv\[0\]: 89 rows, but request 0 needs 90"):
        TP.prefill_attention(t(q), m, raw_t, short, topk_indices=t(topk), **kw)
    pages, table = paged(comp, 8, seed=1)
    with pytest.raises(ValueError, match="compressed_kv.block_table: 11 pages of 8 entries hold 88, but request 3"):
        TP.prefill_attention(t(q), m, raw_t, TP.PagedKV(t(pages), t(table[:, :11])), topk_indices=t(topk), **kw)
    # top-k rows: V4.1's -1 picks are no key, other negatives and invisible entries are refused
    assert (topk == -1).any()
    bad = topk.copy()
    bad[3, 0] = -2
    with pytest.raises(ValueError, match=r"topk_indices: row 3 \(position 77\) points at entries outside 0..77"):
        TP.prefill_attention(t(q), m, raw_t, comp_t, topk_indices=t(bad), **kw)
    bad[3, 0] = 78
    with pytest.raises(ValueError, match=r"topk_indices: row 3 \(position 77\) points at entries outside 0..77"):
        TP.prefill_attention(t(q), m, raw_t, comp_t, topk_indices=t(bad), **kw)
    with pytest.raises(ValueError, match=r"topk_indices: expected \(37, 8\)"):
        TP.prefill_attention(t(q), m, raw_t, comp_t, topk_indices=t(case.topk[3]), **kw)
    with pytest.raises(ValueError, match=r"index_topk: required when CSA layers are planned \(this step plans CSA2"):
        TP.build_step_metadata(st)
    # V4's rows keep refusing -1 among the used entries
    v4 = make_case("v4", [30], [30], 4, window_size=8, topk=6, H=2, D=16, seed=1)
    v4.topk_rows[20, 0] = -1
    m4 = TP.build_step_metadata(P.plan_step(v4.batch, v4.plan_config(), [v4.layer]), index_topk=6)["CSA"]
    with pytest.raises(ValueError, match=r"topk_indices: row 20 \(position 20\) points at entries outside 0..4"):
        TP.prefill_attention(
            t(v4.q), m4, [t(x) for x in v4.raw], [t(x) for x in v4.comp], sm_scale=1.0, topk_indices=t(v4.topk_rows)
        )
