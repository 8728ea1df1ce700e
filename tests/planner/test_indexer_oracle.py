"""planner.indexer_oracle: the float64 indexer, its tie rule, and the comparison helper."""

import numpy as np
import pytest

from planner.indexer_oracle import BF16_REL, compare_topk, fp32_rel, indexer_topk, rank_order


def test_logits_formula_and_visible_entries():
    q = np.array([[[1.0, 0.0], [0.0, 1.0]]])  # one token, two heads
    w = np.array([[2.0, 3.0]])
    keys = np.array([[1.0, 1.0], [-1.0, 2.0], [3.0, -1.0], [9.0, 9.0]])
    # position 11, ratio 4: entries 0..2 visible (3 = (11 + 1) // 4); entry 3 is not
    ids, vals = indexer_topk(q, w, keys, [0], [11], 4, 4)
    # logits: 2*relu(k0) + 3*relu(k1): [5, 6, 6]; tie between 1 and 2 -> lower index first
    assert ids.tolist() == [[1, 2, 0, -1]]
    assert vals[0, :3].tolist() == [6.0, 6.0, 5.0] and vals[0, 3] == -np.inf


def test_tie_rule_and_nan():
    logits = np.array([1.0, np.nan, 3.0, 1.0, -np.inf, 3.0])
    assert rank_order(logits).tolist() == [2, 5, 0, 3, 4, 1]


def test_requests_and_k_larger_than_visible():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((5, 3, 8))
    w = rng.standard_normal((5, 3))
    keys = [rng.standard_normal((4, 8)), rng.standard_normal((9, 8))]
    req, pos = [0, 0, 1, 1, 1], [7, 15, 3, 20, 35]
    ids, vals = indexer_topk(q, w, keys, req, pos, 4, 6)
    for t in range(5):
        vis = (pos[t] + 1) // 4
        k = keys[req[t]][:vis]
        full = (w[t][:, None] * np.maximum(q[t] @ k.T, 0)).sum(0)
        want = sorted(range(vis), key=lambda s: (-full[s], s))[:6]
        assert ids[t].tolist() == want + [-1] * (6 - len(want))
    assert ids[2].tolist() == [0] + [-1] * 5  # position 3 sees (3 + 1) // 4 = 1 entry


def _case(rng, T=6, H=4, D=16, N=40):
    q = rng.standard_normal((T, H, D))
    w = np.abs(rng.standard_normal((T, H)))
    keys = rng.standard_normal((N, D))
    pos = rng.integers(4 * 3, 4 * N, T)
    return q, w, keys, np.zeros(T, np.int64), pos


def test_compare_accepts_exact_and_counts_near_ties():
    rng = np.random.default_rng(1)
    q, w, keys, req, pos = _case(rng)
    ids, _ = indexer_topk(q, w, keys, req, pos, 4, 8)
    c = compare_topk(ids, q, w, keys, req, pos, 4, rel=fp32_rel(16, 4))
    assert (c.tokens, c.near_ties, c.swapped_entries) == (6, 0, 0)
    # duplicate a key: two entries with equal logits at the boundary; swapping them is a near tie
    keys2 = keys.copy()
    ids, vals = indexer_topk(q, w, keys2, req, pos, 4, 8)
    t = 0
    kth = int(ids[t, 7])
    vis = (pos[t] + 1) // 4
    outside = [s for s in range(vis) if s not in ids[t]]
    keys2[outside[0]] = keys2[kth]  # now entry outside[0] ties with the k-th
    ids2, _ = indexer_topk(q, w, keys2, req, pos, 4, 8)
    swapped = ids2.copy()
    row = [s for s in ids2[t] if s != min(kth, outside[0])] + [max(kth, outside[0])]
    swapped[t] = row
    c = compare_topk(swapped, q, w, keys2, req, pos, 4, rel=fp32_rel(16, 4))
    assert c.near_ties == 1 and c.swapped_entries == 1 and c.boundary_ties >= 1


def test_compare_rejects_wrong_rows():
    rng = np.random.default_rng(2)
    q, w, keys, req, pos = _case(rng)
    ids, _ = indexer_topk(q, w, keys, req, pos, 4, 8)
    rel = fp32_rel(16, 4)
    bad = ids.copy()
    vis = (pos[0] + 1) // 4
    bad[0, 7] = next(s for s in np.argsort((w[0][:, None] * np.maximum(q[0] @ keys[:vis].T, 0)).sum(0)))
    with pytest.raises(AssertionError, match="token 0: selected entry"):
        compare_topk(bad, q, w, keys, req, pos, 4, rel=rel)
    bad = ids.copy()
    bad[1, 3] = bad[1, 2]
    with pytest.raises(AssertionError, match="token 1: repeated"):
        compare_topk(bad, q, w, keys, req, pos, 4, rel=rel)
    bad = ids.copy()
    bad[2, [0, 5]] = bad[2, [5, 0]]
    with pytest.raises(AssertionError, match="token 2: entry .* listed after"):
        compare_topk(bad, q, w, keys, req, pos, 4, rel=rel)
    bad = ids.copy()
    bad[3, 0] = vis + 100
    with pytest.raises(AssertionError, match="token 3: expected 8 entries"):
        compare_topk(bad, q, w, keys, req, pos, 4, rel=rel)
    assert BF16_REL > rel


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(q=np.zeros((2, 3))), "q: expected 3 dims"),
        (dict(weights=np.zeros((2, 2))), r"weights: expected shape \(2, 3\)"),
        (dict(keys=[np.zeros((3, 5))]), "keys\\[0\\]: rows of 5 dims"),
        (dict(token_position=[100, 1]), "keys\\[0\\]: 3 rows, token 0 at position 100 sees 25"),
        (dict(token_request=[0, 1]), "token_request: entries must be in"),
        (dict(compress_ratio=0), "compress_ratio: must be >= 1"),
    ],
)
def test_bad_inputs(kw, match):
    args = dict(
        q=np.zeros((2, 3, 4)),
        weights=np.zeros((2, 3)),
        keys=[np.zeros((3, 4))],
        token_request=[0, 0],
        token_position=[3, 4],
        compress_ratio=4,
    )
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        indexer_topk(**args, topk=2)
