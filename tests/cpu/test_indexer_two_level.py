"""DeepSeek-V4.1's two-level top-k in the C indexer (`dsv4_indexer_topk_candidates`) against the
float64 oracle (`planner.indexer_oracle`), on every instruction set this machine runs and both
staging layouts: level 1's candidate blocks (streamed: a running top of block maxima) with the
source's own top-k, level 2 inside given candidates (gathered: only candidate keys are scored), at
ratios 1 / 2 / 4, several requests, contexts below and above the candidates' reach (small block
sizes here; one case at the real 2048 x 8 = 16,384 reach); hostile arguments refused by name."""

import ctypes

import ml_dtypes
import numpy as np
import pytest

from dsv4_cpu import binding as C
from planner import indexer_oracle as orc
from tests import indexer_cases as ik
from tests.indexer_cases import make_batch

pytestmark = pytest.mark.skipif(
    C.unavailable_reason() is not None, reason="the C kernels cannot be built here (no compiler)"
)

ISAS = [name for name, ok in C.isa_supported().items() if ok] if C.unavailable_reason() is None else []


@pytest.fixture(params=[(isa, layout) for isa in ISAS for layout in ("auto", "pairs")], ids=lambda p: f"{p[0]}-{p[1]}")
def isa(request, monkeypatch):
    name, layout = request.param
    if layout == "pairs":
        monkeypatch.setenv("DSV4_PREFILL_INDEXER_LAYOUT", "pairs")
    else:
        monkeypatch.delenv("DSV4_PREFILL_INDEXER_LAYOUT", raising=False)
    return name


def _args(case, r):
    return case["q"].astype(np.float32), case["w"], case["deq"], case["req"], case["pos"], r


def _bounded(c):
    assert c.near_ties <= max(1, c.tokens // 20), c


@pytest.mark.parametrize("r, bs, nb, topk", [(1, 4, 6, 8), (2, 3, 5, 7), (4, 1, 9, 9), (1, 8, 1, 8), (1, 5, 40, 16)])
def test_both_levels_against_oracle(isa, r, bs, nb, topk):
    rng = np.random.default_rng(100 * r + bs)
    H, D = 5, 40  # heads and dims off every register tile
    # entries per request: far above the reach, below it, a few; ratio 1 / 2: every query row
    case = make_batch(rng, seq=[r * 330, r * 21, r * 90, 3], qry=[14, 21 * r, 9, 3], H=H, D=D, r=r, dup=3)
    src = ik.IndexKeys.fp8_pages(case["cache"], case["bt"])
    args = _args(case, r)
    rel = orc.fp32_rel(D, H)
    idx, val, blocks = ik.indexer_topk(
        case["q"], case["w"], src, case["req"], case["pos"], r, topk, isa=isa, threads=2,
        candidate_block_size=bs, candidate_topk_blocks=nb,
    )  # fmt: skip
    _bounded(orc.compare_topk(idx, *args, rel=rel))  # the source's own top-k: not restricted
    _bounded(orc.compare_candidates(blocks, *args, bs, rel=rel))
    plain, _ = ik.indexer_topk(case["q"], case["w"], src, case["req"], case["pos"], r, topk, isa=isa, threads=2)
    assert (plain == idx).all()
    # level 2 inside the oracle's candidates, and inside this kernel's own
    cand, _ = orc.candidate_blocks(*args, bs, nb)
    for rows in (cand, blocks):
        idx2, val2 = ik.indexer_topk(
            case["q"], case["w"], src, case["req"], case["pos"], r, topk, isa=isa, threads=2,
            candidate_block_size=bs, candidates=rows,
        )  # fmt: skip
        _bounded(orc.compare_topk(idx2, *args, rel=rel, candidates=rows, candidate_block_size=bs))
    ref, refv = orc.indexer_topk(*args, topk, candidates=blocks, candidate_block_size=bs)
    live = ref >= 0
    assert ((idx2 >= 0) == live).all() and (val2[~live] == -np.inf).all()
    assert np.allclose(val2[live], refv[live], rtol=1e-5, atol=1e-5 * np.abs(refv[live]).max())
    vis = (case["pos"] + 1) // r
    fits = vis <= bs * nb  # every block a candidate: level 2 is the plain top-k
    assert (idx2[fits] == plain[fits]).all()
    assert (~fits).any()


@pytest.mark.parametrize("topk", [64, 512])
def test_streaming_blocks_and_threads(isa, topk):
    """Many more blocks than kept (the running top of blocks compacts many times), threads 1 / 2
    equal, bf16 and float32 rows with offsets as the key source of both levels."""
    rng = np.random.default_rng(topk)
    H, D, r, bs, nb = 4, 64, 1, 8, topk // 4
    case = make_batch(rng, seq=[3000, 700], qry=[5, 4], H=H, D=D, r=r, page=64, dup=30)
    args = _args(case, r)
    rel = orc.fp32_rel(D, H)
    fp8 = ik.IndexKeys.fp8_pages(case["cache"], case["bt"])
    kw = dict(candidate_block_size=bs, candidate_topk_blocks=nb)
    idx, _, blocks = ik.indexer_topk(case["q"], case["w"], fp8, case["req"], case["pos"], r, topk, isa=isa, **kw)
    _bounded(orc.compare_candidates(blocks, *args, bs, rel=rel))
    for threads in (2, 3):
        again = ik.indexer_topk(case["q"], case["w"], fp8, case["req"], case["pos"], r, topk, isa=isa, threads=threads,
                                **kw)  # fmt: skip
        assert (again[0] == idx).all() and (again[2] == blocks).all(), "results depend on the thread count"
    kw2 = dict(candidate_block_size=bs, candidates=blocks)
    one, _ = ik.indexer_topk(case["q"], case["w"], fp8, case["req"], case["pos"], r, topk, isa=isa, **kw2)
    two, _ = ik.indexer_topk(case["q"], case["w"], fp8, case["req"], case["pos"], r, topk, isa=isa, threads=2, **kw2)
    assert (one == two).all()
    _bounded(orc.compare_topk(one, *args, rel=rel, candidates=blocks, candidate_block_size=bs))
    offs = np.cumsum([0] + [len(d) for d in case["deq"][:-1]])
    flat = np.concatenate(case["deq"])
    for dt in (np.float32, ml_dtypes.bfloat16):
        rows = ik.IndexKeys.rows(flat.astype(dt), offs)
        got, _ = ik.indexer_topk(case["q"], case["w"], rows, case["req"], case["pos"], r, topk, isa=isa, **kw2)
        q = case["q"].astype(np.float32)
        keys = [d.astype(dt).astype(np.float32) for d in case["deq"]]
        _bounded(
            orc.compare_topk(
                got,
                q,
                case["w"],
                keys,
                case["req"],
                case["pos"],
                r,
                rel=rel,
                candidates=blocks,
                candidate_block_size=bs,
            )  # fmt: skip
        )


def test_real_reach_above_16k():
    """The released sizes (2048 blocks of 8, top-512) on contexts below and above 16,384 entries at
    ratio 1: below, every block is kept and level 2 is the plain top-k; above, it is restricted."""
    rng = np.random.default_rng(9)
    H, D, r, bs, nb, topk = 2, 16, 1, 8, 2048, 512
    case = make_batch(rng, seq=[20000, 9000], qry=[2, 1], H=H, D=D, r=r, page=64, q_dtype=np.float32)
    src = ik.IndexKeys.fp8_pages(case["cache"], case["bt"])
    args = _args(case, r)
    rel = orc.fp32_rel(D, H)
    idx, _, blocks = ik.indexer_topk(case["q"], case["w"], src, case["req"], case["pos"], r, topk, threads=2,
                                     candidate_block_size=bs, candidate_topk_blocks=nb)  # fmt: skip
    _bounded(orc.compare_candidates(blocks, *args, bs, rel=rel))
    assert (blocks[:2] >= 0).all()  # 2500 blocks seen: 2048 kept
    assert sorted(blocks[2][blocks[2] >= 0].tolist()) == list(range(-(-9000 // bs)))  # 1125: all kept
    idx2, _ = ik.indexer_topk(case["q"], case["w"], src, case["req"], case["pos"], r, topk, threads=2,
                              candidate_block_size=bs, candidates=blocks)  # fmt: skip
    _bounded(orc.compare_topk(idx2, *args, rel=rel, candidates=blocks, candidate_block_size=bs))
    assert (idx2[2] == idx[2]).all()


def _raw_call(cand, T=3, topk=4, pos=(7, 9, 2)):
    """dsv4_indexer_topk_candidates on a tiny float32 case with a hand-made dsv4_index_candidates."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((T, 2, 8)).astype(np.float32)
    w = np.ones((T, 2), np.float32)
    keys = ik.IndexKeys.rows(rng.standard_normal((12, 8)).astype(np.float32))
    tk, keep = ik.tokens_struct(np.arange(T), np.zeros(T, np.int64), np.array(pos), 1)
    idx = np.empty((T, topk), np.int32)
    val = np.empty((T, topk), np.float32)
    lib = C.library()
    rc = lib.dsv4_indexer_topk_candidates(
        q.ctypes.data, 16, 8, C.F32, T, 2, 8, w.ctypes.data, 2, ctypes.byref(tk), ctypes.byref(keys.source), topk,
        idx.ctypes.data, topk, val.ctypes.data, topk, None, -1, cand,
    )  # fmt: skip
    return rc, idx


def test_bad_candidates_refused_by_name():
    blocks = np.array([[0, 1], [0, 2], [0, -1]], np.int32)

    kept = []  # the arrays the structs point at, alive until the calls

    def cand(mode=C.CANDIDATES_RESTRICT, bs=4, nb=2, arr=blocks, s0=2):
        kept.append(arr)
        return ctypes.byref(C.IndexCandidates(mode, bs, nb, None if arr is None else arr.ctypes.data, s0))

    rc, idx = _raw_call(cand())
    assert rc == 0 and (idx[2, :3] >= 0).all() and idx[2, 3] == -1  # token 2 sees 3 entries
    cases = [
        (cand(mode=3), r"cand: mode must be 1 \(select\) or 2 \(restrict\), got 3"),
        (cand(bs=0), r"cand: block_size and topk_blocks must be in \[1, 2\^31\), got 0 and 2"),
        (cand(bs=1), "cand: topk_blocks x block_size = 2 x 1 = 2 positions cannot hold topk = 4 entries"),
        (cand(arr=None), "cand: blocks NULL"),
        (cand(s0=1), "its row stride 1 < topk_blocks 2"),
        (
            cand(arr=np.array([[0, 1], [0, 3], [0, -1]], np.int32)),
            r"candidates: token 1, column 1 is block 3, outside \[-1, 3\)",
        ),
        (cand(arr=np.array([[0, 1], [0, 2], [-2, -1]], np.int32)), r"candidates: token 2, column 0 is block -2"),
        (cand(arr=np.array([[0, 1], [2, 2], [0, 0]], np.int32)), "candidates: token 1 lists block 2 more than once"),
    ]
    for c, match in cases:
        rc, _ = _raw_call(c)
        with pytest.raises(ValueError, match=match):
            C.check(rc)
    # level 1 writes every column of its rows (the rest -1), and nothing else
    out = np.full((3, 5), -9, np.int32)
    rc, _ = _raw_call(cand(mode=C.CANDIDATES_SELECT, bs=2, nb=3, arr=out, s0=5))
    assert rc == 0 and (out[:, 3:] == -9).all() and (out[:, :3] >= -1).all() and out[2].tolist()[:3] == [1, 0, -1]


def test_exact_ties_and_nan_blocks(isa):
    """Every key equal: every block ties, so level 1 keeps the pinned block then the lowest blocks,
    and level 2 the lowest entries (the tie rule, exactly); a NaN logit's block is dropped."""
    T, H, D, r, bs, nb, k = 3, 3, 8, 1, 4, 5, 6
    keys = np.ones((60, D), np.float32)
    keys[9] = np.nan  # entry 9: block 2 scores NaN
    q = np.ones((T, H, D), np.float32)
    w = np.ones((T, H), np.float32)
    pos = np.array([59, 30, 6])
    src = ik.IndexKeys.rows(keys)
    req = np.zeros(T, np.int64)
    idx, _, blocks = ik.indexer_topk(q, w, src, req, pos, r, k, isa=isa, candidate_block_size=bs,
                                     candidate_topk_blocks=nb)  # fmt: skip
    assert blocks.tolist() == [[14, 0, 1, 3, 4], [7, 0, 1, 3, 4], [1, 0, -1, -1, -1]]
    want, _ = orc.candidate_blocks(q, w, keys, req, pos, r, bs, nb)
    assert (blocks == want).all()
    two, _ = ik.indexer_topk(q, w, src, req, pos, r, k, isa=isa, candidate_block_size=bs, candidates=blocks)
    ref, _ = orc.indexer_topk(q, w, keys, req, pos, r, k, candidates=blocks, candidate_block_size=bs)
    assert (two == ref).all() and two[0].tolist() == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("bs", [8, 5, 96])
def test_level1_split_tiles_equal_one_piece(isa, bs):
    """Few tiles (a decode step: one token per request) split their key range across threads, on
    whole candidate blocks (bs 5 and 96 do not divide the 64-key blocks): the rows equal one
    thread's, and the oracle's."""
    rng = np.random.default_rng(bs)
    H, D, r, nb, topk = 8, 64, 1, 7, 16  # (enough work for two threads: 8 MFLOP)
    case = make_batch(rng, seq=[5000, 3001], qry=[1, 1], H=H, D=D, r=r, page=64, dup=10)
    src = ik.IndexKeys.fp8_pages(case["cache"], case["bt"])
    kw = dict(candidate_block_size=bs, candidate_topk_blocks=nb)
    one = ik.indexer_topk(case["q"], case["w"], src, case["req"], case["pos"], r, topk, isa=isa, threads=1, **kw)
    for threads in (2, 4):
        got = ik.indexer_topk(case["q"], case["w"], src, case["req"], case["pos"], r, topk, isa=isa, threads=threads,
                              **kw)  # fmt: skip
        assert (got[0] == one[0]).all() and (got[2] == one[2]).all(), threads
    orc.compare_candidates(one[2], *_args(case, r), bs, rel=orc.fp32_rel(D, H))
