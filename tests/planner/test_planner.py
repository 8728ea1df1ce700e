"""The planner: vLLM-exact tuples, the worked examples of spec section 4, and what we add."""

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import planner as P
from planner.contract import cdiv

KW = dict(window_size=64, max_model_len=16384, max_num_batched_tokens=4096)
SPEC_SEQ = [256, 320, 448, 640, 1024, 1536, 3072, 4096, 6144, 8192]
SPEC_QRY = [4, 8, 8, 8, 16, 16, 32, 32, 32, 32]


# --- worked examples (spec section 4) ---------------------------------------------------------


def test_spec_example_fixed_plan():
    assert P.get_prefill_chunk_plan(SPEC_SEQ, SPEC_QRY, compress_ratio=4, **KW, policy="fixed") == [
        (0, 4, 4096, 8256),
        (4, 8, 4096, 8256),
        (8, 10, 4096, 8256),
    ]


@pytest.mark.parametrize(
    "ratio, expected", [(4, [(0, 10, 2048, 2143)]), (0, [(0, 10, 0, 95)]), (128, [(0, 10, 64, 159)])]
)
def test_spec_example_adaptive_plan(ratio, expected):
    assert P.get_prefill_chunk_plan(SPEC_SEQ, SPEC_QRY, compress_ratio=ratio, **KW) == expected


def test_spec_example_long_requests():
    plan = P.get_prefill_chunk_plan([16384] * 5 + [100], [3990, 1, 1, 1, 1, 100], compress_ratio=4, **KW)
    assert plan == [(0, 4, 4096, 8149), (4, 6, 4096, 4196)]


def test_spec_example_short_sequences_expand():
    plan = P.get_prefill_chunk_plan(
        [80, 96, 112, 128, 144],
        [4] * 5,
        compress_ratio=4,
        window_size=64,
        max_model_len=1024,
        max_num_batched_tokens=128,
    )
    assert plan == [(0, 5, 36, 103)]


def test_accepts_numpy_and_torch_tensors():
    torch = pytest.importorskip("torch")
    expect = P.get_prefill_chunk_plan(SPEC_SEQ, SPEC_QRY, compress_ratio=4, **KW)
    for conv in (np.array, lambda x: np.array(x, dtype=np.int32), lambda x: torch.tensor(x, dtype=torch.int32)):
        assert P.get_prefill_chunk_plan(conv(SPEC_SEQ), conv(SPEC_QRY), compress_ratio=4, **KW) == expect


# --- vLLM equivalence on random batches --------------------------------------------------------


def vllm_adaptive(seq, qry, r, W, mml, mnbt, pcs, has_compressed=None):
    """vLLM's loop, transcribed from the spec's formula with scalar arithmetic (independent of ours).

    has_compressed: vLLM 0.33's flag; None means r > 1 (at r = 1 and True: full-length entries)."""
    hc = r > 1 if has_compressed is None else has_compressed
    area = pcs * ((cdiv(mml, r) if hc else 0) + W + mnbt)
    comp = [s // r if hc else 0 for s in seq]
    gath = [q + min(max(s - q, 0), W - 1) for s, q in zip(seq, qry)]
    plan, s0 = [], 0
    while s0 < len(seq):
        mc, mg, e = comp[s0], gath[s0], s0 + 1
        while e < len(seq):
            c, g = max(mc, comp[e]), max(mg, gath[e])
            if (e - s0 + 1) * (c + g) > area:
                break
            mc, mg, e = c, g, e + 1
        plan.append((s0, e, mc, mc + mg))
        s0 = e
    return plan


@st.composite
def batches(draw, min_query=1, max_requests=12):
    mml = draw(st.sampled_from([256, 1024, 4096]))
    mnbt = draw(st.sampled_from([16, 64, 512]))
    n = draw(st.integers(1, max_requests))
    seq, qry = [], []
    for _ in range(n):
        s = draw(st.integers(min_query, mml))
        q = draw(st.integers(min(min_query, s), min(s, mnbt)))
        seq.append(s)
        qry.append(q)
    return seq, qry, mml, mnbt


@settings(max_examples=150, deadline=None)
@given(
    batches(),
    st.sampled_from([0, 1, 4, 8, 32, 128]),
    st.sampled_from([None, None, True, False]),
    st.sampled_from([1, 8, 64, 128]),
    st.integers(1, 6),
)
def test_adaptive_matches_vllm(b, r, hc, W, pcs):
    seq, qry, mml, mnbt = b
    hc = None if hc and r == 0 else hc  # has_compressed=True needs a ratio >= 1
    kw = dict(
        compress_ratio=r,
        window_size=W,
        max_model_len=mml,
        max_num_batched_tokens=mnbt,
        prefill_chunk_size=pcs,
        has_compressed=hc,
    )
    assert P.get_prefill_chunk_plan(seq, qry, **kw) == vllm_adaptive(seq, qry, r, W, mml, mnbt, pcs, hc)
    N = cdiv(mml, r) if (r > 1 if hc is None else hc) else 0
    assert P.get_prefill_chunk_plan(seq, qry, **kw, policy="fixed") == [
        (s, min(s + pcs, len(seq)), N, N + W + mnbt) for s in range(0, len(seq), pcs)
    ]


def min_partition(widths_c, widths_g, area):
    """Fewest in-order chunks under the area rule, by dynamic programming (brute force)."""
    n = len(widths_c)
    best = [0] + [10**9] * n
    for e in range(1, n + 1):
        for s in range(e):
            cnt = e - s
            if cnt == 1 or cnt * (max(widths_c[s:e]) + max(widths_g[s:e])) <= area:
                best[e] = min(best[e], best[s] + 1)
    return best[n]


# V4.0's layers and other ratios (small test models' CSA 8 / HCA 32, V4.1's full-length ratio 1)
LAYERS = P.V4_LAYERS + tuple(
    P.LayerSpec(k, r) for k, r in ((P.LayerKind.CSA, 8), (P.LayerKind.HCA, 32), (P.LayerKind.HCA, 1))
)


@settings(max_examples=100, deadline=None)
@given(batches(min_query=0), st.sampled_from(LAYERS), st.sampled_from([4, 64]), st.sampled_from([None, 0.3, 0.7]))
def test_plan_properties(b, layer, W, budget_frac):
    """Coverage exactly once, budget respected, minimal chunk count, determinism."""
    seq, qry, mml, mnbt = b
    cfg0 = P.PlanConfig(window_size=W, max_model_len=mml, max_num_batched_tokens=mnbt)
    budget = None if budget_frac is None else max(1, int(cfg0.vllm_budget_rows(layer) * budget_frac))
    cfg = P.PlanConfig(window_size=W, max_model_len=mml, max_num_batched_tokens=mnbt, budget_rows=budget)
    batch = P.PrefillBatch(seq, qry)
    try:
        plan = P.plan_kind(batch, cfg, layer)
    except ValueError as e:  # a budget below one token's rows is refused, never silently exceeded
        assert "budget_rows" in str(e)
        return
    # every token of every request with queries is covered exactly once
    assert sorted(plan.token_index.tolist()) == list(range(batch.num_tokens))
    np.testing.assert_array_equal(plan.token_position, batch.token_position[plan.token_index])
    # no chunk exceeds the budget (a chunk always fits: the vLLM bound holds every request alone)
    assert (plan.chunk_workspace_rows <= plan.budget_rows).all()
    # zero-query requests are never planned
    assert set(plan.skipped.tolist()) == {i for i, q in enumerate(qry) if q == 0}
    assert not set(plan.seg_request.tolist()) & set(plan.skipped.tolist())
    # each segment's rows fit its chunk
    c = np.repeat(np.arange(plan.num_chunks), plan.chunk_num_requests)
    assert (plan.seg_compressed_len <= plan.chunk_N[c]).all()
    assert (plan.seg_gather_len <= plan.chunk_M[c] - plan.chunk_N[c]).all()
    # minimal chunk count for an in-order partition of the segments
    assert plan.num_chunks == min_partition(
        plan.seg_compressed_len.tolist(), plan.seg_gather_len.tolist(), plan.budget_rows
    )
    # deterministic
    again = P.plan_kind(P.PrefillBatch(list(seq), list(qry)), cfg, layer)
    for name in ("seg_request", "chunk_starts", "chunk_N", "chunk_M", "token_index", "token_request"):
        np.testing.assert_array_equal(getattr(plan, name), getattr(again, name))


# --- kinds and ratios vary apart (vLLM 0.33's has_compressed) ----------------------------------


def test_has_compressed_at_ratio_1_is_a_full_length_compressed_cache():
    seq, qry = [100, 300, 200], [4, 8, 8]  # one chunk: N = the longest request, every row compressed
    plan = P.get_prefill_chunk_plan(seq, qry, compress_ratio=1, has_compressed=True, **KW)
    assert plan == [(0, 3, 300, 300 + 8 + 63)]
    # the default at ratio 1 (None: r > 1) has no compressed rows, the SWA plan
    assert P.get_prefill_chunk_plan(seq, qry, compress_ratio=1, **KW) == [(0, 3, 0, 71)]
    assert P.get_prefill_chunk_plan(seq, qry, compress_ratio=1, has_compressed=True, **KW, policy="fixed") == [
        (0, 3, 16384, 16384 + 64 + 4096)
    ]
    # the same through plan_kind with a (kind, 1) layer: N of every chunk is its longest request
    for kind in (P.LayerKind.CSA, P.LayerKind.HCA):
        kp = P.plan_kind(P.PrefillBatch(SPEC_SEQ, SPEC_QRY), P.PlanConfig(**KW), (kind, 1))
        assert kp.has_compressed and kp.compress_ratio == 1
        np.testing.assert_array_equal(kp.seg_compressed_len, SPEC_SEQ)
        ends = kp.chunk_starts[1:]
        assert kp.chunk_N.tolist() == [max(SPEC_SEQ[s:e]) for s, e in zip(kp.chunk_starts[:-1], ends)]
        assert kp.as_tuples() == vllm_adaptive(SPEC_SEQ, SPEC_QRY, 1, 64, 16384, 4096, 4, has_compressed=True)


def test_has_compressed_false_gives_the_swa_plan():
    for policy in ("adaptive", "fixed"):
        plan = functools.partial(P.get_prefill_chunk_plan, policy=policy)
        for r in (4, 128):
            swa = plan(SPEC_SEQ, SPEC_QRY, compress_ratio=0, **KW)
            assert plan(SPEC_SEQ, SPEC_QRY, compress_ratio=r, has_compressed=False, **KW) == swa
    assert P.get_prefill_chunk_plan(SPEC_SEQ, SPEC_QRY, compress_ratio=4, has_compressed=False, **KW) == [
        (0, 10, 0, 95)
    ]
    # and None at ratio 4 is V4.0's compressed layer
    assert P.get_prefill_chunk_plan(SPEC_SEQ, SPEC_QRY, compress_ratio=4, has_compressed=None, **KW) == [
        (0, 10, 2048, 2143)
    ]


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from([1, 8, 64]), st.integers(1, 6))
def test_plans_at_csa_8_and_hca_32_match_the_transcription(b, W, pcs):
    """A small test model's ratios (CSA 8, HCA 32), every policy, against scalar transcriptions."""
    seq, qry, mml, mnbt = b
    limits = dict(window_size=W, max_model_len=mml, max_num_batched_tokens=mnbt, prefill_chunk_size=pcs)
    layers = {P.LayerKind.SWA: 0, P.LayerKind.CSA: 8, P.LayerKind.HCA: 32}
    steps = {
        pol: P.plan_step(P.PrefillBatch(seq, qry), P.PlanConfig(policy=pol, **limits), layers)
        for pol in ("adaptive", "fixed", "per_request")
    }
    gath = [q + min(s - q, W - 1) for s, q in zip(seq, qry)]
    for kind, r in layers.items():
        assert steps["adaptive"][kind].layer == P.LayerSpec(kind, r)
        assert steps["adaptive"][kind].as_tuples() == vllm_adaptive(seq, qry, r, W, mml, mnbt, pcs)
        N = cdiv(mml, r) if r else 0
        assert steps["fixed"][kind].as_tuples() == [
            (s, min(s + pcs, len(seq)), N, N + W + mnbt) for s in range(0, len(seq), pcs)
        ]
        comp = [s // r if r else 0 for s in seq]
        assert steps["per_request"][kind].as_tuples() == [
            (i, i + 1, c, c + g) for i, (c, g) in enumerate(zip(comp, gath))
        ]


# --- beyond vLLM -------------------------------------------------------------------------------


def test_zero_query_requests_never_form_or_widen_a_chunk():
    seq = [100, 5000, 100, 100, 6000]
    qry = [10, 0, 10, 0, 0]
    tuples = P.get_prefill_chunk_plan(seq, qry, compress_ratio=4, **KW)
    # request 1 (5000 tokens, no queries) would set N = 1250 if it widened the chunk
    assert tuples == [(0, 3, 25, 25 + 73)]
    plan = P.plan_kind(P.PrefillBatch(seq, qry), P.PlanConfig(**KW), (P.LayerKind.CSA, 4))
    assert plan.skipped.tolist() == [1, 3, 4]
    assert plan.seg_request.tolist() == [0, 2]
    # the chunk's workspace holds the two requests with queries only
    assert plan.chunks[0].row_bases.tolist() == [0, 98]
    # a batch of only zero-query requests has no chunk at all
    assert P.get_prefill_chunk_plan([10, 20], [0, 0], compress_ratio=4, **KW) == []
    assert P.get_prefill_chunk_plan([10, 20], [0, 0], compress_ratio=4, **KW, policy="fixed") == []


def _runs(qry):
    """Maximal runs [a, b) of requests with queries."""
    runs, a = [], None
    for i, q in enumerate(list(qry) + [0]):
        if q > 0 and a is None:
            a = i
        elif q == 0 and a is not None:
            runs.append((a, i))
            a = None
    return runs


@settings(max_examples=100, deadline=None)
@given(
    batches(min_query=0),
    st.sampled_from(LAYERS),
    st.sampled_from([1, 8, 64]),
    st.integers(1, 6),
    st.sampled_from(["adaptive", "fixed", "per_request"]),
)
def test_contiguous_plans_never_reach_across_a_skipped_request(b, layer, W, pcs, policy):
    """What vLLM's chunk loop needs: every request of a chunk's batch range has queries; each run
    between skipped requests is planned as that run alone; without skipped requests nothing changes."""
    seq, qry, mml, mnbt = b
    limits = dict(window_size=W, max_model_len=mml, max_num_batched_tokens=mnbt, prefill_chunk_size=pcs, policy=policy)
    plan = P.plan_kind(P.PrefillBatch(seq, qry), P.PlanConfig(contiguous=True, **limits), layer)
    got = plan.as_tuples()
    assert all(q > 0 for s, e, _, _ in got for q in qry[s:e])
    assert [i for s, e, _, _ in got for i in range(s, e)] == [i for i, q in enumerate(qry) if q > 0]
    want = []
    for a, e in _runs(qry):
        sub = P.plan_kind(P.PrefillBatch(seq[a:e], qry[a:e]), P.PlanConfig(**limits), layer).as_tuples()
        want += [(s + a, t + a, n, m) for s, t, n, m in sub]
    assert got == want
    if all(q > 0 for q in qry):
        assert got == P.plan_kind(P.PrefillBatch(seq, qry), P.PlanConfig(**limits), layer).as_tuples()
    # its per-segment and per-token layout agrees with the chunks
    assert plan.chunk_starts.tolist()[-1] == plan.seg_request.shape[0] == len([q for q in qry if q > 0])
    assert sorted(plan.token_index.tolist()) == list(range(sum(qry)))


def test_contiguous_example_and_bad_config():
    seq, qry = [100, 5000, 100, 100, 6000], [10, 0, 10, 0, 0]
    plan = P.plan_kind(P.PrefillBatch(seq, qry), P.PlanConfig(contiguous=True, **KW), (P.LayerKind.CSA, 4))
    assert plan.as_tuples() == [(0, 1, 25, 25 + 73), (2, 3, 25, 25 + 73)]
    with pytest.raises(ValueError, match="contiguous"):
        P.PlanConfig(contiguous=True, order="length", **KW)
    with pytest.raises(ValueError, match="contiguous"):
        P.PlanConfig(contiguous="yes", **KW)


def test_plan_arrays_are_int32_read_only_and_made_once():
    batch = P.PrefillBatch([300, 40, 9, 700], [20, 40, 0, 7])
    plan = P.plan_kind(batch, P.PlanConfig(**KW), (P.LayerKind.HCA, 128))
    names = [
        "order",
        "skipped",
        "split_requests",
        "seg_request",
        "seg_seq_len",
        "seg_query_len",
        "seg_query_offset",
        "seg_compressed_len",
        "seg_gather_len",
        "seg_gather_start",
        "seg_row_base",
        "chunk_starts",
        "chunk_N",
        "chunk_M",
        "chunk_token_starts",
        "token_index",
        "token_request",
        "token_position",
    ]
    for name in names:
        a = getattr(plan, name)
        assert a.dtype == np.int32 and not a.flags.writeable, name
        assert getattr(plan, name) is a, name  # derived once, then the same array
    assert plan.seg_compressed_len.tolist() == [2, 0, 5]
    assert plan.seg_query_offset.tolist() == [0, 0, 0]
    for name in ("query_start_loc", "token_request", "token_position", "token_arange"):
        a = getattr(batch, name)
        assert not a.flags.writeable and getattr(batch, name) is a, name
    assert batch.token_position.tolist() == list(range(280, 300)) + list(range(40)) + list(range(693, 700))


def test_budget_rows_honoured_and_long_request_split():
    cfg = P.PlanConfig(window_size=8, max_model_len=4096, max_num_batched_tokens=2048, budget_rows=600)
    batch = P.PrefillBatch([40, 2000, 30], [40, 1000, 30])
    plan = P.plan_kind(batch, cfg, (P.LayerKind.CSA, 4))
    assert plan.split_requests.tolist() == [1]
    assert (plan.chunk_workspace_rows <= 600).all()
    pieces = [(o, q) for r, o, q in zip(plan.seg_request, plan.seg_query_offset, plan.seg_query_len) if r == 1]
    # pieces tile request 1's 1000 queries in order
    starts = [o for o, _ in pieces]
    assert starts == sorted(starts) and starts[0] == 0
    assert sum(q for _, q in pieces) == 1000
    assert all(o2 == o1 + q1 for (o1, q1), (o2, _) in zip(pieces, pieces[1:]))
    # each piece sees the whole KV before its last query: compressed_len = (prefix + end) // 4
    seg = plan.seg_request == 1
    ends = plan.seg_query_offset[seg] + plan.seg_query_len[seg]
    np.testing.assert_array_equal(plan.seg_compressed_len[seg], (1000 + ends) // 4)
    np.testing.assert_array_equal(plan.seg_gather_len[seg], plan.seg_query_len[seg] + 7)
    # a budget below what one token needs is refused
    with pytest.raises(ValueError, match="budget_rows"):
        P.plan_kind(
            batch,
            P.PlanConfig(window_size=8, max_model_len=4096, max_num_batched_tokens=2048, budget_rows=400 // 4),
            (P.LayerKind.CSA, 4),
        )
    with pytest.raises(ValueError, match="budget_rows"):
        P.PlanConfig(window_size=8, max_model_len=4096, max_num_batched_tokens=2048, policy="fixed", budget_rows=10)


def test_length_order_reduces_padding():
    rng = np.random.default_rng(0)
    long = rng.integers(3000, 4000, 8)
    short = rng.integers(50, 200, 8)
    seq = np.ravel(np.column_stack([long, short]))  # alternating long and short requests
    qry = np.minimum(seq, 64)
    batch = P.PrefillBatch(seq, qry)
    csa = P.LayerSpec(P.LayerKind.CSA, 4)
    by_batch = P.plan_kind(batch, P.PlanConfig(window_size=128, max_model_len=4096, max_num_batched_tokens=256), csa)
    by_len = P.plan_kind(
        batch, P.PlanConfig(window_size=128, max_model_len=4096, max_num_batched_tokens=256, order="length"), csa
    )
    pad = lambda p: p.total_workspace_rows - p.padding_free_rows
    assert pad(by_len) < pad(by_batch) / 2
    assert sorted(by_len.order.tolist()) == list(range(16))
    assert set(by_len.order[:8].tolist()) == set(range(0, 16, 2))  # the long ones first
    assert sorted(by_len.token_index.tolist()) == list(range(batch.num_tokens))
    with pytest.raises(ValueError, match="as_tuples"):
        by_len.as_tuples()


def test_step_plan_shared_per_kind():
    flash = P.ModelShape.from_name("V4-Flash").layers  # one LayerSpec per layer, the MTP layer last
    assert len(flash) == 44 and flash[-1] == P.LayerSpec(P.LayerKind.SWA, 0)
    step = P.plan_step(P.PrefillBatch(SPEC_SEQ, SPEC_QRY), P.PlanConfig(**KW), flash)
    assert set(step.kinds) == {P.LayerKind.SWA, P.LayerKind.CSA, P.LayerKind.HCA}
    assert step["CSA"] is step[P.LayerKind.CSA] is step["compressed_sparse_attention"]
    assert step["swa"] is step[P.LayerKind.SWA]
    assert step[P.LayerKind.CSA].as_tuples() == [(0, 10, 2048, 2143)]
    assert step[P.LayerKind.CSA].layer == P.LayerSpec(P.LayerKind.CSA, 4) and step["HCA"].compress_ratio == 128
    assert step.max_workspace_rows == 10 * 2143
    # the same step from a {kind: ratio} mapping and from (kind, ratio) pairs
    for layers in ({"SWA": 0, "CSA": 4, "HCA": 128}, [("CSA", 4), (P.LayerKind.HCA, 128), ("sliding_attention", 0)]):
        again = P.plan_step(P.PrefillBatch(SPEC_SEQ, SPEC_QRY), P.PlanConfig(**KW), layers)
        assert {k: p.as_tuples() for k, p in again.kinds.items()} == {k: p.as_tuples() for k, p in step.kinds.items()}
    with pytest.raises(KeyError, match="no plan for CSA"):
        P.plan_step(P.PrefillBatch([8], [8]), P.PlanConfig(**KW), [(P.LayerKind.SWA, 0)])["CSA"]


def test_per_token_metadata():
    batch = P.PrefillBatch([10, 7, 20], [3, 7, 5])
    plan = P.plan_kind(
        batch,
        P.PlanConfig(window_size=4, max_model_len=64, max_num_batched_tokens=16, policy="per_request"),
        P.LayerSpec(P.LayerKind.CSA, 4),
    )
    assert plan.num_chunks == 3
    assert plan.token_position.tolist() == [7, 8, 9, 0, 1, 2, 3, 4, 5, 6, 15, 16, 17, 18, 19]
    assert plan.token_request.tolist() == [0] * 15
    c = plan.chunks[2]
    assert (c.N, c.M) == (5, 5 + 5 + 3)
    assert c.gather_starts.tolist() == [20 - 8]


# --- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "seq, qry, kw, match",
    [
        ([10, -1], [1, 0], {}, "seq_lens"),
        ([10, 5], [1, -2], {}, "query_lens"),
        ([10, 5], [1, 6], {}, r"query_lens\[1\] = 6 exceeds seq_lens\[1\] = 5"),
        ([20000], [1], {}, "max_model_len"),
        ([8000], [5000], {}, "max_num_batched_tokens"),
        ([10, 5], [1], {}, "lengths differ"),
        ([10.5], [1], {}, "seq_lens: expected integers"),
        ([[10]], [[1]], {}, "seq_lens: expected a 1-D"),
        (["a"], [1], {}, "seq_lens"),
        ([10], [1], {"window_size": 0}, "window_size"),
        ([10], [1], {"compress_ratio": -4}, "compress_ratio"),
        (
            [10],
            [1],
            {"compress_ratio": 0, "has_compressed": True},
            "compress_ratio: has_compressed=True needs a ratio >= 1",
        ),
        ([10], [1], {"has_compressed": "yes"}, "has_compressed"),
        ([10], [1], {"prefill_chunk_size": 0}, "prefill_chunk_size"),
    ],
)
def test_bad_input_names_the_argument(seq, qry, kw, match):
    args = dict(KW, compress_ratio=4)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        P.get_prefill_chunk_plan(seq, qry, **args)


def test_bad_kind_and_config():
    for r in (0, -1, 4.0, "4", True, None):
        with pytest.raises(ValueError, match="compress_ratio"):
            P.LayerSpec(P.LayerKind.CSA, r)
    for kind in (4, "c4a", "dense", None, P.LayerSpec(P.LayerKind.CSA, 4)):
        with pytest.raises(ValueError, match="kind"):
            P.LayerKind.of(kind)
    with pytest.raises(ValueError, match="policy"):
        P.PlanConfig(window_size=4, max_model_len=64, max_num_batched_tokens=16, policy="greedy")
    with pytest.raises(ValueError, match="order"):
        P.PlanConfig(window_size=4, max_model_len=64, max_num_batched_tokens=16, order="random")
    # a ratio alone does not say the kind: bare ints are refused, pointing at LayerSpec
    batch, cfg = P.PrefillBatch([64], [8]), P.PlanConfig(window_size=4, max_model_len=64, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="LayerSpec"):
        P.plan_kind(batch, cfg, 16)
    for layers in ([4, 0, 128], [(P.LayerKind.SWA, 0), 4], (4,)):
        with pytest.raises(ValueError, match=r"layers: .*bare ratio 4\b.*LayerSpec"):
            P.plan_step(batch, cfg, layers)
    # one ratio per kind: two would need two plans under one name
    with pytest.raises(ValueError, match=r"layers: CSA layers with two ratios \(4 and 8\)"):
        P.plan_step(batch, cfg, [("CSA", 4), ("HCA", 128), ("CSA", 8)])
    # a step built from a batch is planned with the caller's layers, and the same rules
    with pytest.raises(ValueError, match="LayerSpec"):
        P.as_step_plan(batch, cfg, [0, 4])
