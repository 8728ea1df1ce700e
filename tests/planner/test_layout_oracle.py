"""Index building and gathers: gather by plan + sparse_attention == chunk-free prefill_attention."""

import numpy as np
import pytest

import planner as P
from planner import oracle
from planner.contract import round_up


def random_step(rng, seq, qry, layer, D=16, H=4, topk=6):
    """Per-request raw and compressed latents, queries, and a random valid CSA top-k row per token."""
    batch = P.PrefillBatch(seq, qry)
    r = layer.compress_ratio
    raw = [rng.standard_normal((s, D)) for s in seq]
    comp = [rng.standard_normal((s // r if layer.has_compressed else 0, D)) for s in seq]
    q = rng.standard_normal((batch.num_tokens, H, D))
    topk_rows = np.full((batch.num_tokens, topk), -1, dtype=np.int32)
    if layer.kind is P.LayerKind.CSA:
        for t, p in enumerate(batch.token_position):
            visible = (int(p) + 1) // r
            k = min(visible, topk)
            topk_rows[t, :k] = rng.permutation(visible)[:k]  # request-local, any order
    return batch, raw, comp, q, topk_rows


def run_by_plan(plan, raw, comp, q, topk_rows, sink, scale, fill=np.nan):
    """Gather each chunk into a NaN-filled workspace and call the oracle kernel on it."""
    out = np.full((q.shape[0], q.shape[1], q.shape[2]), np.nan)
    lse = np.full(q.shape[:2], np.nan)
    for c in plan.chunks:
        ws = P.gather_workspace(plan, c, raw, comp, fill=fill)
        idx, tl = P.build_chunk_indices(plan, c, topk_rows if plan.kind is P.LayerKind.CSA else None)
        assert idx.dtype == np.int32 and tl.dtype == np.int32
        assert idx.shape[1] % 128 == 0
        o, _, l = oracle.sparse_attention(q[c.token_index], ws, idx, scale, sink, tl)
        out[c.token_index] = o
        lse[c.token_index] = l
    return out, lse


CASES = [
    # (seq_lens, query_lens): fresh prefill, seq < W, chunked prefill with long prefixes, zero-query
    ([5, 17, 33], [5, 17, 33]),
    ([40, 129, 64, 3], [3, 2, 64, 1]),
    ([300, 7, 0 + 9, 150, 260], [0, 7, 9, 0, 31]),
    ([127, 128, 129, 131, 132], [1, 128, 2, 4, 5]),
]
# V4.0's layers, then other ratios (a small test model's CSA 8 / HCA 32; V4.1's full-length ratio 1)
LAYERS = [P.LayerSpec(k, r) for k, r in (("SWA", 0), ("CSA", 4), ("HCA", 128), ("CSA", 8), ("HCA", 32), ("CSA", 1))]
LAYER_IDS = [f"{x.kind.name}{x.compress_ratio}" for x in LAYERS]


@pytest.mark.parametrize("layer", LAYERS, ids=LAYER_IDS)
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize(
    "cfg",
    [
        dict(policy="adaptive"),
        dict(policy="fixed"),
        dict(policy="per_request"),
        dict(policy="adaptive", order="length"),
        dict(policy="adaptive", budget_rows=90),
    ],
    ids=["adaptive", "fixed", "per_request", "length-order", "budget-split"],
)
def test_plan_gather_equals_chunk_free_reference(layer, case, cfg):
    rng = np.random.default_rng(case * 10 + layer.compress_ratio)
    seq, qry = CASES[case]
    W = 8
    batch, raw, comp, q, topk_rows = random_step(rng, seq, qry, layer)
    sink = rng.standard_normal(q.shape[1])
    scale = q.shape[2] ** -0.5
    if layer.compress_ratio == 1 and "budget_rows" in cfg:  # full-length entries: a token needs seq_len + W rows
        cfg = dict(cfg, budget_rows=280)  # position 259 of case 2 needs 268; its whole request 298: split
    plan = P.plan_kind(batch, P.PlanConfig(window_size=W, max_model_len=512, max_num_batched_tokens=128, **cfg), layer)
    assert plan.layer == layer
    got, got_lse = run_by_plan(plan, raw, comp, q, topk_rows, sink, scale)
    want, _, want_lse = oracle.prefill_attention(
        q,
        raw,
        comp,
        seq,
        qry,
        kind=layer.kind,
        compress_ratio=layer.compress_ratio,
        window_size=W,
        sm_scale=scale,
        attn_sink=sink,
        topk_rows=topk_rows if layer.kind is P.LayerKind.CSA else None,
    )
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-12)


def test_indices_follow_spec_layout():
    """Spot-check the spec's formulas on a 2-request HCA chunk."""
    batch = P.PrefillBatch([300, 10], [2, 10])
    plan = P.plan_kind(batch, P.PlanConfig(window_size=4, max_model_len=512, max_num_batched_tokens=16), ("HCA", 128))
    c = plan.chunks[0]
    assert (c.N, c.M) == (2, 2 + 10)  # N = 300 // 128; gather_len = max(2 + 3, 10)
    idx, tl = P.build_chunk_indices(plan, c)
    # token 0: position 298, sees entries 0,1 then window 295..298 = rows N + (q - 296) ... gather start 295
    assert c.gather_starts.tolist() == [295, 0]
    assert idx[0, :6].tolist() == [0, 1, 2, 3, 4, 5]
    assert tl.tolist()[:2] == [6, 6]
    # request 1 (base M=12): position 0 sees only itself -> row 12 + N + 0
    assert idx[2, :2].tolist() == [14, -1] and tl[2] == 1
    assert idx.shape == (12, round_up(300 // 128 + 4, 128))
    assert (idx[np.arange(idx.shape[1])[None, :] >= tl[:, None]] == -1).all()


def test_csa_topk_rows_validated():
    batch = P.PrefillBatch([16], [4])
    plan = P.plan_kind(batch, P.PlanConfig(window_size=4, max_model_len=64, max_num_batched_tokens=16), ("CSA", 4))
    rows = np.tile(np.arange(8, dtype=np.int32)[::-1], (4, 1))  # position 12 sees entries 0..2 only
    with pytest.raises(ValueError, match="topk_rows: row 0 \\(position 12\\)"):
        P.build_chunk_indices(plan, 0, rows)
    with pytest.raises(ValueError, match="topk_rows: required"):
        P.build_chunk_indices(plan, 0)
    ok = np.tile(np.array([2, 0, 1, 3, -1, -1, -1, -1], dtype=np.int32), (4, 1))
    idx, tl = P.build_chunk_indices(plan, 0, ok)
    assert idx[0, :3].tolist() == [2, 0, 1] and tl[0] == 3 + 4 and tl[3] == 4 + 4
    with pytest.raises(ValueError, match="width"):
        P.build_chunk_indices(plan, 0, ok, width=4)


def test_oracle_contract_edges():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((3, 2, 8))
    kv = rng.standard_normal((5, 1, 8))
    idx = np.array([[0, 1, 7, -3], [-1, -1, -1, -1], [2, 2, 4, 0]], dtype=np.int32)[:, None, :]
    out, mx, lse = oracle.sparse_attention(q, kv, idx, 0.5, attn_sink=np.array([-np.inf, 30.0]), topk_length=[4, 4, 3])
    assert (out[1] == 0).all() and np.isinf(lse[1]).all() and (lse[1] > 0).all() and (mx[1] == -np.inf).all()
    # row 0 uses keys 0, 1; row 2 uses 2, 2, 4 (duplicates count, column 3 is past topk_length)
    keys = kv[[2, 2, 4], 0]
    s = 0.5 * q[2] @ keys.T
    np.testing.assert_allclose(lse[2], np.log(np.exp(s).sum(1)))
    w = np.exp(s) / np.exp(s).sum(1, keepdims=True)
    np.testing.assert_allclose(out[2, 0], w[0] @ keys)  # no sink on head 0
    np.testing.assert_allclose(out[2, 1], (w[1] @ keys) / (1 + np.exp(30.0 - lse[2, 1])))
    with pytest.raises(ValueError, match="kv"):
        oracle.sparse_attention(q, rng.standard_normal((5, 2, 8)), idx, 1.0)
    with pytest.raises(TypeError, match="indices"):
        oracle.sparse_attention(q, kv, idx.astype(np.float32), 1.0)
    with pytest.raises(ValueError, match="attn_sink"):
        oracle.sparse_attention(q, kv, idx, 1.0, attn_sink=np.zeros(3))
    with pytest.raises(ValueError, match="topk_length"):
        oracle.sparse_attention(q, kv, idx, 1.0, topk_length=[1, 2])


@pytest.mark.parametrize("layer", LAYERS[:5], ids=LAYER_IDS[:5])
def test_logical_key_rows_identical_across_plans(layer):
    """Whatever the plan, a token's index row names the same keys in the same columns (width too)."""
    rng = np.random.default_rng(7)
    seq, qry = [300, 7, 9, 150, 260, 40], [0, 7, 9, 3, 31, 40]
    batch, raw, comp, q, topk_rows = random_step(rng, seq, qry, layer)
    logical = {}
    for cfg in (
        dict(policy="adaptive"),
        dict(policy="fixed"),
        dict(policy="per_request"),
        dict(policy="adaptive", order="length"),
        dict(policy="adaptive", budget_rows=90),
    ):
        plan = P.plan_kind(
            batch, P.PlanConfig(window_size=8, max_model_len=512, max_num_batched_tokens=128, **cfg), layer
        )
        rows = np.full((batch.num_tokens, P.index_width(plan, 6)), -9, dtype=np.int64)
        for c in plan.chunks:
            idx, tl = P.build_chunk_indices(plan, c, topk_rows if layer.kind is P.LayerKind.CSA else None)
            b = idx // c.M
            j = idx - b * c.M
            raw_pos = c.gather_starts[np.clip(b, 0, None)] + (j - c.N)
            # compressed entry w -> w; raw token at position q -> 100000 + q; padding -> -1
            name = np.where(idx < 0, -1, np.where(j < c.N, j, 100000 + raw_pos))
            rows[c.token_index] = name
        logical[str(cfg)] = rows
    first = next(iter(logical.values()))
    assert (first != -9).all()
    for rows in logical.values():
        np.testing.assert_array_equal(rows, first)
