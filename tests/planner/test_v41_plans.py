"""DeepSeek-V4.1 steps: plans once per (layer spec, band), the replay band's rows and clamped
windows, key sets at ratios 0 / 2 / 1, gather by plan == the float64 oracle, shared caches."""

import numpy as np
import pytest

import planner as P
from planner import oracle
from planner.contract import round_up

RELEASED = P.Schedule.from_name("V4.1")
TINY = P.Schedule.from_name("V4.1-tiny")  # W = 16, index_topk = 8


def limits(W, **kw):
    return P.PlanConfig(window_size=W, max_model_len=4096, max_num_batched_tokens=1024, **kw)


def random_batch(rng, W, n=6, max_seq=120):
    """Requests of every shape: fresh, chunked (a prefix), trimmed (query_len > W) or not, zero-query,
    and window floors (replay_start) anywhere in 0 .. prefix."""
    seq = rng.integers(1, max_seq + 1, n)
    qry = np.where(rng.random(n) < 0.4, seq, rng.integers(0, seq + 1))
    qry[0] = min(int(seq[0]), W + 1 + int(rng.integers(0, 20)))  # at least one trimmed request
    seq[0] = max(int(seq[0]), int(qry[0]))
    prefix = seq - qry
    rs = np.where(rng.random(n) < 0.5, (rng.random(n) * (prefix + 1)).astype(np.int64), 0)
    return P.PrefillBatch(seq, qry, replay_start=rs)


def brute_rows(batch, band, W):
    """Per token of the band, by vLLM's rules one at a time: (step row, position, window positions)."""
    rows, t = [], 0
    for i in range(batch.num_requests):
        s, q, rs = int(batch.seq_lens[i]), int(batch.query_lens[i]), int(batch.window_floor[i])
        kept = q if band == "full" else min(q, W)
        trimmed = kept < q
        for j in range(q):
            p = s - q + j
            if j >= q - kept:  # the band's rows: each request's last `kept`
                # window KV exists from replay_start on; past the cut, a trimmed request holds it
                # for its kept rows only (nothing below them)
                have = lambda x: x >= rs and not (band == "replay" and trimmed and x < s - kept)  # noqa: E731
                rows.append((t, p, [x for x in range(p - W + 1, p + 1) if x >= 0 and have(x)]))
            t += 1
    return rows


@pytest.mark.parametrize("band", P.BANDS)
@pytest.mark.parametrize("seed", range(6))
def test_band_rows_and_windows_against_brute_force(band, seed):
    rng = np.random.default_rng(seed)
    W = int(rng.choice([4, 8, 16]))
    batch = random_batch(rng, W)
    rows = batch.band(band, W)
    want = brute_rows(batch, band, W)
    assert rows.token_index.tolist() == [t for t, _, _ in want]
    assert rows.token_position.tolist() == [p for _, p, _ in want]
    req = batch.token_request[rows.token_index]
    for (t, p, window), i in zip(want, req.tolist()):
        _, got = oracle.key_set(p, kind="SWA", compress_ratio=0, window_size=W, window_start=int(rows.window_starts[i]))
        assert got == window, (band, t, p)
    assert rows.query_lens.sum() == rows.num_tokens and (rows.query_offsets == batch.query_lens - rows.query_lens).all()
    assert batch.band(band, W) is rows  # made once per batch and band


def decode(plan, chunk, idx, lengths):
    """Each row's keys as ("c", entry) / ("w", position), through the workspace labels."""
    c = plan.chunks[chunk]
    n_comp = [int(s) // plan.compress_ratio if plan.has_compressed else 0 for s in plan.batch.seq_lens]
    comp = [np.stack([np.ones(n), np.arange(n)], 1) for n in n_comp]  # (1, entry) labels
    raw = [np.stack([np.zeros(int(s)), np.arange(int(s))], 1) for s in plan.batch.seq_lens]  # (0, position)
    ws = P.gather_workspace(plan, c, raw, comp if plan.has_compressed else None, fill=np.nan)
    out = []
    for row, n in zip(idx, lengths):
        assert (row[n:] == -1).all()
        keys = [("x", -1) if k == -1 else ("cw"[int(ws[k, 0]) ^ 1], int(ws[k, 1])) for k in row[:n]]
        out.append(keys)
    return out


@pytest.mark.parametrize("ratio", [0, 2, 1])
@pytest.mark.parametrize("band", P.BANDS)
def test_index_rows_at_ratios_0_2_1_against_brute_force(ratio, band):
    """vLLM's row: [min((p+1)//r, topk) compressed slots] + [window], width round_up(topk + W, 128)."""
    rng = np.random.default_rng(ratio * 7 + len(band))
    W, topk = 8, 6
    batch = random_batch(rng, W, n=7, max_seq=90)
    layer = P.LayerSpec("SWA", 0) if ratio == 0 else P.LayerSpec("CSA", ratio)
    topk_rows = np.full((batch.num_tokens, topk), -1, dtype=np.int32)
    for t, p in enumerate(batch.token_position.tolist()):
        visible = [w for w in range(p + 1) if ratio and ratio * w + ratio - 1 <= p]  # entry w complete by p
        topk_rows[t, : min(len(visible), topk)] = rng.permutation(visible)[:topk]
    want = {t: (p, window) for t, p, window in brute_rows(batch, band, W)}
    budget = 120 if ratio == 1 else 70  # small enough to split some requests (a ratio-1 token needs p + W rows)
    plan = P.plan_kind(batch, limits(W, budget_rows=budget), layer, band=band)
    seen = 0
    for c in range(plan.num_chunks):
        idx, lengths = P.build_chunk_indices(plan, c, topk_rows if ratio else None)
        assert idx.shape[1] == (round_up(topk + W, 128) if ratio else round_up(W, 128))
        for t, keys in zip(plan.chunks[c].token_index.tolist(), decode(plan, c, idx, lengths)):
            p, window = want[t]
            n_comp = min((p + 1) // ratio, topk) if ratio else 0
            assert keys == [("c", int(e)) for e in topk_rows[t, :n_comp]] + [("w", x) for x in window], (t, p)
            comp, win = oracle.key_set(p, kind=layer.kind, compress_ratio=ratio, window_size=W, topk_row=topk_rows[t],
                                       window_start=window[0])  # fmt: skip
            assert keys == [("c", e) for e in comp] + [("w", x) for x in win]
            seen += 1
    assert seen == len(want) and sorted(plan.token_index.tolist()) == sorted(want)


def test_key_set_visibility():
    # ratio 2: entry j (tokens 2j, 2j+1) visible iff j < (p+1)//2; ratio 1: j <= p (the query's own token)
    assert oracle.key_set(4, kind="HCA", compress_ratio=2, window_size=2) == ([0, 1], [3, 4])
    assert oracle.key_set(5, kind="HCA", compress_ratio=2, window_size=2)[0] == [0, 1, 2]
    assert oracle.key_set(3, kind="HCA", compress_ratio=1, window_size=2) == ([0, 1, 2, 3], [2, 3])
    assert oracle.key_set(3, kind="CSA", compress_ratio=1, window_size=4, topk_row=[3, 1], window_start=2) == (
        [3, 1],
        [2, 3],
    )
    with pytest.raises(ValueError, match=r"topk_rows: position 3 points at entries outside 0..3: \[3, 4\]"):
        oracle.key_set(3, kind="CSA", compress_ratio=1, window_size=4, topk_row=[3, 4])
    with pytest.raises(ValueError, match="points at entries"):
        oracle.key_set(3, kind="CSA", compress_ratio=2, window_size=4, topk_row=[-1, 0])
    assert oracle.key_set(3, kind="CSA", compress_ratio=2, window_size=4, topk_row=[-1, 0], allow_invalid=True)[0] == [
        -1,
        0,
    ]


def test_invalid_picks_stay_invalid_and_count():
    """V4.1's combine kernel: a -1 among the used top-k stays -1 and counts in topk_length."""
    batch = P.PrefillBatch([10], [3])
    plan = P.plan_kind(batch, limits(4), ("CSA", 2))
    rows = np.array([[0, -1, 2], [-1, 3, 1], [4, -1, -1]], dtype=np.int32)
    with pytest.raises(ValueError, match="topk_rows: row 0 .* outside"):
        P.build_chunk_indices(plan, 0, rows)
    idx, lengths = P.build_chunk_indices(plan, 0, rows, allow_invalid=True)
    # p = 7, 8, 9: 4, 4, 5 visible entries -> 3 used each (topk 3); windows of 4
    assert lengths.tolist() == [7, 7, 7]
    N = plan.chunks[0].N
    assert idx[0, :3].tolist() == [0, -1, 2] and idx[1, :3].tolist() == [-1, 3, 1]
    assert idx[0, 3:7].tolist() == [
        N,
        N + 1,
        N + 2,
        N + 3,
    ]  # positions 4..7, gather_start 4 and (idx[:, 7:] == -1).all()
    with pytest.raises(ValueError, match="topk_rows"):  # other negatives are refused all the same
        P.build_chunk_indices(plan, 0, rows - 1, allow_invalid=True)


def step(schedule, batch, replay=None, **kw):
    return P.plan_step(batch, P.PlanConfig(window_size=schedule.sliding_window, max_model_len=1 << 16,
                                           max_num_batched_tokens=8192, replay=replay, **kw), schedule)  # fmt: skip


def test_released_step_plans_shared_and_counted():
    batch = P.PrefillBatch([300, 5000, 129, 40], [300, 1000, 129, 1], replay_start=[0, 0, 0, 39])
    on, off = step(RELEASED, batch), step(RELEASED, batch, replay=False)
    assert on.replay and not off.replay
    key = lambda spec, band="full": P.PlanKey(P.LayerSpec(*spec), band)  # noqa: E731
    assert on.sharing == {
        key(("SWA", 0)): (0, 1),
        key(("CSA", 2)): tuple(range(2, 20)),
        key(("CSA", 1), "cut"): (20,),
        key(("CSA", 1), "replay"): tuple(range(21, 40)),
    }
    assert off.sharing == {
        key(("SWA", 0)): (0, 1),
        key(("CSA", 2)): tuple(range(2, 20)),
        key(("CSA", 1)): tuple(range(20, 40)),
    }
    assert (on.num_plans, off.num_plans) == (4, 3)
    for st in (on, off):
        for k, layers in st.sharing.items():
            assert all(st.for_layer(i) is st.plans[k] is st[k] for i in layers) and st.plans[k].key == k
        assert st.layer_keys == tuple(RELEASED.plan_key(i, st.replay) for i in range(40))
        assert st["SWA"] is st.plans[key(("SWA", 0))] and set(st.kinds) == {P.LayerKind.SWA}
        with pytest.raises(KeyError, match=r"CSA: this step has \d CSA plans"):
            st["CSA"]
        with pytest.raises(KeyError, match="no plan for HCA"):
            st["HCA"]
    assert {b: r.num_tokens for b, r in on.bands.items()} == {"full": 1430, "cut": 385, "replay": 385}
    assert set(off.bands) == {"full"}
    # the cut computes its kept rows with the full band's windows; past the cut they are clamped
    cut, rep = on.plans[key(("CSA", 1), "cut")], on.plans[key(("CSA", 1), "replay")]
    assert cut.seg_query_len.tolist() == rep.seg_query_len.tolist() == [128, 128, 128, 1]
    assert cut.seg_gather_len.tolist() == [255, 255, 129, 1] and rep.seg_gather_len.tolist() == [128, 128, 128, 1]
    assert cut.seg_query_offset.tolist() == [172, 872, 1, 0]
    # nothing trimmed (no request has more than W new rows): vLLM makes no replay batch
    short = step(RELEASED, P.PrefillBatch([300, 50], [128, 50]))
    assert (
        not short.replay
        and short.num_plans == 3
        and step(RELEASED, P.PrefillBatch([300], [128]), replay=True).num_plans == 3
    )


@pytest.mark.parametrize("seed", range(8))
def test_plans_equal_vllm_chunks_and_the_band_batch(seed):
    rng = np.random.default_rng(100 + seed)
    batch = random_batch(rng, 16, n=int(rng.integers(1, 12)), max_seq=400)
    st = step(TINY, batch)
    for k, plan in st.plans.items():
        assert plan.as_tuples() == P.plan_kind(batch, st.config, k.layer, band=k.band).as_tuples()
        rows = batch.band(k.band, 16)
        # a band's plan is the plan of its kept rows as a batch of their own with the band's floors
        as_batch = P.PrefillBatch(batch.seq_lens, rows.query_lens, replay_start=rows.window_starts)
        assert plan.as_tuples() == P.plan_kind(as_batch, st.config, k.layer).as_tuples()
        assert plan.seg_gather_len.tolist() == rows.gather_lens[rows.query_lens > 0].tolist()
        assert sorted(plan.token_index.tolist()) == rows.token_index.tolist()
    # vLLM's V4.1 plans, get_prefill_chunk_plan(ratio, has_compressed=ratio != 0), on the batch
    # without window floors (vLLM plans with the unclamped bound; zero-query requests aside)
    fresh = P.PrefillBatch(batch.seq_lens, batch.query_lens)
    active = np.flatnonzero(fresh.active)
    compared = 0
    for k, plan in step(TINY, fresh, replay=False).plans.items():
        vllm = P.get_prefill_chunk_plan(
            fresh.seq_lens[active],
            fresh.query_lens[active],
            compress_ratio=k.compress_ratio,
            has_compressed=k.compress_ratio != 0,
            window_size=16,
            max_model_len=1 << 16,
            max_num_batched_tokens=8192,
        )
        pos = {int(b): a for a, b in enumerate(active)}  # batch index -> index among the active
        assert [(pos[s], pos[e - 1] + 1, N, M) for s, e, N, M in plan.as_tuples()] == vllm
        compared += 1
    assert compared == 3


def run_layer_by_plan(st, layer_id, q, raw, caches, topk, sink, scale):
    """Gather each chunk of the layer's plan (NaN-filled workspace) and run the FlashMLA oracle."""
    role = TINY[layer_id]
    plan = st.for_layer(layer_id)
    out = {}
    for c in plan.chunks:
        comp = caches[role.kv_source_layer_id] if role.has_compressed else None
        ws = P.gather_workspace(plan, c, raw, comp, fill=np.nan)
        rows = topk[role.index_source_layer_id] if role.has_compressed else None
        idx, tl = P.build_chunk_indices(plan, c, rows)
        o, _, l = oracle.sparse_attention(q[c.token_index], ws, idx, scale, sink, tl)
        out.update({int(t): (o[j], l[j]) for j, t in enumerate(c.token_index)})
    return out


@pytest.mark.parametrize("replay", [None, False])
@pytest.mark.parametrize(
    "cfg", [dict(), dict(policy="per_request"), dict(order="length"), dict(budget_rows=160)],
    ids=["adaptive", "per_request", "length", "budget-split"],
)  # fmt: skip
def test_gather_by_plan_equals_layer_oracle(replay, cfg):
    """Every layer of the tiny schedule: its KV source's cache (distinct per source), its index
    source's top-k, its band's rows and windows; the plan's workspace path and the chunk-free oracle."""
    rng = np.random.default_rng(7)
    D, H, W = 16, 2, TINY.sliding_window
    batch = random_batch(rng, W, n=5, max_seq=150)
    seq = batch.seq_lens.tolist()
    st = step(TINY, batch, replay=replay, **cfg)
    assert st.replay is (replay is None)
    caches = {src: [rng.standard_normal((s // TINY[src].compress_ratio, D)) for s in seq] for src in (1, 3)}
    topk = {}
    for src in (1, 3, 5):
        r = TINY[src].compress_ratio
        rows = np.full((batch.num_tokens, TINY.index_topk), -1, dtype=np.int32)
        for t, p in enumerate(batch.token_position.tolist()):
            k = min((p + 1) // r, TINY.index_topk)
            rows[t, :k] = rng.permutation((p + 1) // r)[:k]
        topk[src] = rows
    if "budget_rows" in cfg:
        assert any(p.split_requests.size for p in st.plans.values()), "the budget should split a request"
    scale = D**-0.5
    for layer_id in range(len(TINY)):
        q = rng.standard_normal((batch.num_tokens, H, D))
        raw = [rng.standard_normal((s, D)) for s in seq]
        sink = rng.standard_normal(H)
        token_index, want, _, want_lse = oracle.layer_attention(
            TINY, layer_id, q, raw, caches, batch.seq_lens, batch.query_lens, sm_scale=scale, attn_sink=sink,
            topk_rows=topk, replay=replay, replay_start=batch.replay_start,
        )  # fmt: skip
        assert token_index.tolist() == st.bands[st.layer_keys[layer_id].band].token_index.tolist()
        got = run_layer_by_plan(st, layer_id, q, raw, caches, topk, sink, scale)
        assert sorted(got) == token_index.tolist()
        np.testing.assert_allclose(np.stack([got[t][0] for t in token_index.tolist()]), want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(np.stack([got[t][1] for t in token_index.tolist()]), want_lse, rtol=1e-12)
        # the layer read its KV source's cache and its index source's top-k (the tiny schedule's wiring)
        src, isrc = {1: (1, 1), 2: (1, 1), 3: (3, 3), 4: (3, 3), 5: (3, 5), 6: (3, 5)}.get(layer_id, (None, None))
        rows = batch.band(st.layer_keys[layer_id].band, W)
        direct = oracle.prefill_attention(
            q[token_index], raw, None if src is None else caches[src], batch.seq_lens, rows.query_lens,
            kind="SWA" if src is None else "CSA", compress_ratio=TINY[layer_id].compress_ratio, window_size=W,
            sm_scale=scale, attn_sink=sink, topk_rows=None if src is None else topk[isrc][token_index],
            window_starts=rows.window_starts,
        )[0]  # fmt: skip
        np.testing.assert_array_equal(direct, want)


def test_layer_oracle_bad_inputs():
    batch = P.PrefillBatch([20], [20])
    q, raw = np.zeros((20, 2, 4)), [np.zeros((20, 4))]
    kw = dict(sm_scale=0.5, topk_rows={1: np.zeros((20, 8), dtype=np.int32)})
    with pytest.raises(ValueError, match="compressed_kv: layer 2 reads layer 1's"):
        oracle.layer_attention(TINY, 2, q, raw, {3: []}, batch.seq_lens, batch.query_lens, **kw)
    with pytest.raises(ValueError, match="topk_rows: layer 5 reads layer 5's"):
        oracle.layer_attention(TINY, 5, q, raw, {3: [np.zeros((20, 4))]}, batch.seq_lens, batch.query_lens, **kw)
    with pytest.raises(ValueError, match="window_starts: expected"):
        oracle.prefill_attention(q, raw, None, [20], [20], kind="SWA", compress_ratio=0, window_size=4, sm_scale=1.0,
                                 window_starts=[0, 0])  # fmt: skip


def test_replay_start_and_bad_inputs():
    # vLLM's rewind of a prefix hit: the last W tokens recomputed; hits of at most W dropped
    assert [P.replay_start_of_hit(h, 128) for h in (0, 5, 128, 129, 300)] == [0, 0, 0, 1, 172]
    assert P.replay_start_of_hit(301, 128, block_size=64) == 128
    assert P.replay_start_of_hit(np.array([64, 1000]), 16, block_size=16).tolist() == [48, 976]
    with pytest.raises(ValueError, match="hit_tokens: must be >= 0"):
        P.replay_start_of_hit(-1, 4)
    for rs, match in (([5, 0], r"replay_start\[0\] = 5 is outside 0 .. seq_lens\[0\] - query_lens\[0\] = 4"),
                      ([0, -1], r"replay_start\[1\] = -1"), ([0], "replay_start: 1 entries for 2 requests"),
                      ([0.5, 0], "replay_start: expected integers")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            P.PrefillBatch([10, 3], [6, 3], replay_start=rs)
    batch = P.PrefillBatch([100], [100])
    with pytest.raises(ValueError, match="replay: expected True, False or None"):
        limits(16, replay="on")
    with pytest.raises(ValueError, match="replay: True needs a planner.Schedule"):
        P.plan_step(batch, limits(16, replay=True))
    with pytest.raises(
        ValueError, match="window_size: PlanConfig.window_size = 8 differs from the schedule's sliding_window = 16"
    ):
        P.plan_step(batch, limits(8), TINY)
    last = P.Schedule((0, 2, 1), (1, 2), (1, 2), sliding_window=16)
    with pytest.raises(ValueError, match=r"replay: True, but .*layer 2\) is the last layer"):
        P.plan_step(batch, limits(16, replay=True), last)
    assert not P.plan_step(batch, limits(16), last).replay
    with pytest.raises(ValueError, match="band: expected one of"):
        P.plan_kind(batch, limits(16), ("SWA", 0), band="kept")
    with pytest.raises(ValueError, match="layer_id: this step was planned from a list"):
        P.plan_step(batch, limits(16)).for_layer(0)


def test_ratio_1_workspace_reaches_max_model_len():
    """Ratio 1 gathers every earlier token's compressed entry: N = seq_len, up to max_model_len."""
    mml, W, topk = 1 << 20, 128, 512
    batch = P.PrefillBatch([mml, 700], [3, 700])
    cfg = P.PlanConfig(window_size=W, max_model_len=mml, max_num_batched_tokens=1024)
    plan = P.plan_kind(batch, cfg, ("CSA", 1))
    c = plan.chunks[0]
    assert plan.num_chunks == 1 and c.N == mml and c.M == mml + 700  # the short one's 700 new rows
    rows = np.full((batch.num_tokens, topk), -1, dtype=np.int32)
    for t, p in enumerate(batch.token_position.tolist()):
        k = min(p + 1, topk)
        rows[t, :k] = p - np.arange(k)  # the newest visible entries, the query's own (j = p) first
    idx, lengths = P.build_chunk_indices(plan, c, rows)
    assert idx.shape == (703, round_up(topk + W, 128)) and idx.dtype == np.int32
    assert int(idx.max()) < c.workspace_rows
    # the long request (slot 0), its first new token p = mml - 3: entries p, p-1, ..., then its window
    p = mml - 3
    assert idx[0, 0] == p and idx[0, topk - 1] == p - topk + 1 and lengths[0] == topk + W
    assert idx[0, topk] == c.N + 0 and idx[0, topk + W - 1] == c.N + W - 1  # gathered from p - 127
    # the short one (slot 1, base M), position 699: entries 699.., its window from N + 699 - 127
    assert idx[702, 0] == c.M + 699 and idx[702, topk] == c.M + c.N + 699 - (W - 1) and lengths[702] == topk + W
    assert lengths[3] == 1 + 1 and idx[3, :2].tolist() == [c.M + 0, c.M + c.N]  # position 0: entry 0, itself
