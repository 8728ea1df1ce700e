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


# ----------------------------------------------------------------------------- the two-level top-k

from planner.indexer_oracle import candidate_blocks, compare_candidates  # noqa: E402


def _brute_logits(q, w, keys, p, r):
    """Token logits over its visible entries, one entry at a time (independent of the oracle)."""
    vis = (p + 1) // r
    return [float(sum(w[h] * max(0.0, float(q[h] @ keys[j])) for h in range(q.shape[0]))) for j in range(vis)]


def _brute_blocks(lg, bs, nb):
    """Level 1 by hand: block maxima of complete and partial blocks, the newest pinned, best others."""
    n = len(lg)
    if n == 0:
        return []
    blocks = [max(lg[i : i + bs]) for i in range(0, n, bs)]
    pin = (n - 1) // bs
    others = sorted((b for b in range(len(blocks)) if b != pin), key=lambda b: (-blocks[b], b))
    return ([pin] + others)[:nb]


@pytest.mark.parametrize("r", [1, 2, 4])
def test_visibility_per_ratio(r):
    """Ratio 1: entry j visible iff j <= p; ratio 2: j < (p + 1) // 2; ratio 4 as V4."""
    rng = np.random.default_rng(r)
    keys = rng.standard_normal((40, 4))
    q, w = rng.standard_normal((3, 2, 4)), np.abs(rng.standard_normal((3, 2)))
    pos = [0, 5, 38]
    ids, _ = indexer_topk(q, w, keys, [0, 0, 0], pos, r, 40)
    for t, p in enumerate(pos):
        want = {1: p + 1, 2: (p + 1) // 2, 4: (p + 1) // 4}[r]
        assert sorted(ids[t][ids[t] >= 0].tolist()) == list(range(want))


@pytest.mark.parametrize("r, bs, nb", [(1, 4, 3), (2, 3, 5), (4, 1, 4), (1, 8, 64), (1, 5, 1)])
def test_candidate_blocks_brute_force(r, bs, nb):
    rng = np.random.default_rng(10 * r + bs)
    H, D = 3, 6
    keys = [rng.standard_normal((90, D)), rng.standard_normal((31, D))]
    keys[0][7] = keys[0][50]  # an exact tie between blocks
    req = [0, 0, 0, 0, 1, 1, 1]
    pos = [0, 1, 60, 89, 3, 17, 30]
    T = len(req)
    q, w = rng.standard_normal((T, H, D)), rng.standard_normal((T, H)) * 0.5 + 0.6
    ids, vals = candidate_blocks(q, w, keys, req, pos, r, bs, nb)
    assert ids.shape == (T, nb) and ids.dtype == np.int32
    for t in range(T):
        lg = _brute_logits(q[t], w[t], keys[req[t]], pos[t], r)
        want = _brute_blocks(lg, bs, nb)
        assert ids[t].tolist() == want + [-1] * (nb - len(want)), t
        if want:
            assert vals[t, 0] == np.inf and vals[t, len(want) :].tolist() == [-np.inf] * (nb - len(want))
            assert np.allclose(vals[t, 1 : len(want)], [max(lg[b * bs : b * bs + bs]) for b in want[1:]])


def test_level2_brute_force_and_every_block_fits():
    rng = np.random.default_rng(3)
    H, D, r, bs, nb, k = 4, 8, 1, 4, 3, 5
    keys = rng.standard_normal((64, D))
    pos = np.array([2, 9, 11, 40, 63])
    T = len(pos)
    q, w = rng.standard_normal((T, H, D)), np.abs(rng.standard_normal((T, H)))
    req = np.zeros(T, np.int64)
    cand, _ = candidate_blocks(q, w, keys, req, pos, r, bs, nb)
    ids, vals = indexer_topk(q, w, keys, req, pos, r, k, candidates=cand, candidate_block_size=bs)
    for t in range(T):
        lg = _brute_logits(q[t], w[t], keys, pos[t], r)
        ok = [j for j in range(len(lg)) if j // bs in set(cand[t][cand[t] >= 0].tolist())]
        want = sorted(ok, key=lambda j: (-lg[j], j))[:k]
        assert ids[t].tolist() == want + [-1] * (k - len(want))
    # a token whose visible entries fit in nb blocks: level 2 equals the plain top-k
    fits = (pos + 1) // r <= nb * bs
    plain, _ = indexer_topk(q, w, keys, req, pos, r, k)
    assert fits.sum() >= 2 and (ids[fits] == plain[fits]).all()
    assert not (ids[~fits] == plain[~fits]).all()  # and restricts where they do not
    # any order of a row's blocks, -1 anywhere: the same selection
    shuffled = np.where(cand >= 0, cand, -1)[:, ::-1].copy()
    again, _ = indexer_topk(q, w, keys, req, pos, r, k, candidates=shuffled, candidate_block_size=bs)
    assert (again == ids).all()
    c = compare_topk(ids, q, w, keys, req, pos, r, rel=fp32_rel(D, H), candidates=cand, candidate_block_size=bs)
    assert c.near_ties == 0
    bad = ids.copy()
    out = next(j for j in range(pos[-1] + 1) if j // bs not in cand[-1])
    bad[-1, 0] = out
    with pytest.raises(AssertionError, match="token 4: expected 5 entries of its"):
        compare_topk(bad, q, w, keys, req, pos, r, rel=fp32_rel(D, H), candidates=cand, candidate_block_size=bs)


def test_level1_drops_nan_and_inf_blocks():
    q = np.ones((1, 1, 1))
    w = np.ones((1, 1))
    keys = np.array([[1.0], [np.nan], [3.0], [2.0], [-np.inf], [5.0], [0.5]])
    # blocks of 2 over 7 visible entries: [1, nan] -> nan, [3, 2], [0 (relu -inf), 5], [0.5] pinned
    ids, vals = candidate_blocks(q, w, keys, [0], [6], 1, 2, 4)
    assert ids.tolist() == [[3, 2, 1, -1]]
    assert vals.tolist() == [[np.inf, 5.0, 3.0, -np.inf]]


def test_compare_candidates_accepts_and_rejects():
    rng = np.random.default_rng(5)
    H, D, r, bs, nb = 4, 8, 2, 4, 4
    keys = rng.standard_normal((50, D))
    pos = np.array([5, 40, 99, 99])
    q, w = rng.standard_normal((4, H, D)), np.abs(rng.standard_normal((4, H)))
    req = np.zeros(4, np.int64)
    ids, _ = candidate_blocks(q, w, keys, req, pos, r, bs, nb)
    rel = fp32_rel(D, H)
    assert compare_candidates(ids, q, w, keys, req, pos, r, bs, rel=rel).near_ties == 0
    bad = ids.copy()
    bad[2, [0, 1]] = bad[2, [1, 0]]
    with pytest.raises(AssertionError, match="token 2: the pinned block 12 must come first"):
        compare_candidates(bad, q, w, keys, req, pos, r, bs, rel=rel)
    bad = ids.copy()
    bad[3, 3] = next(b for b in range(13) if b not in ids[3])
    with pytest.raises(AssertionError, match="token 3: kept block"):
        compare_candidates(bad, q, w, keys, req, pos, r, bs, rel=rel)
    bad = ids.copy()
    bad[1, [1, 2]] = bad[1, [2, 1]]
    with pytest.raises(AssertionError, match="token 1: block .* listed after"):
        compare_candidates(bad, q, w, keys, req, pos, r, bs, rel=rel)
    bad = ids.copy()
    bad[0, 1] = 7
    with pytest.raises(AssertionError, match=r"token 0: expected 1 blocks in \[0, 1\)"):
        compare_candidates(bad, q, w, keys, req, pos, r, bs, rel=rel)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(candidates=None), "candidates: needed with candidate_block_size"),
        (dict(candidate_block_size=0), "candidate_block_size: must be >= 1, got 0"),
        (dict(candidates=[[0], [0]]), r"1 x 4 = 4 positions cannot hold topk = 5"),
        (dict(candidates=[[0, 9], [0, -1]]), r"candidates: token 0, column 1 is block 9, outside \[-1, 2\)"),
        (dict(candidates=[[0, 0], [0, -1]]), "candidates: token 0 lists block 0 more than once"),
        (dict(candidates=[[0, -2], [0, -1]]), "candidates: token 0, column 1 is block -2"),
        (dict(candidates=[[0, 1]]), r"candidates: expected 2 rows \(one per token\)"),
        (dict(candidates=[[0.0, 1.0], [0.0, 1.0]]), "candidates: expected integer block ids"),
    ],
)
def test_level2_bad_inputs(kw, match):
    args = dict(
        q=np.zeros((2, 3, 4)),
        weights=np.zeros((2, 3)),
        keys=[np.zeros((8, 4))],
        token_request=[0, 0],
        token_position=[5, 2],
        compress_ratio=1,
        topk=5,
        candidates=[[0, 1], [0, -1]],
        candidate_block_size=4,
    )
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        indexer_topk(**args)
