"""DeepSeek-V4.1's two-level top-k through both frameworks' `indexer_topk` (torch "cpu" /
"reference", JAX "cpu" / "xla") against the float64 oracle (`planner.indexer_oracle`): level 1's
candidate blocks and the source's own top-k, level 2 inside given candidates, at ratios 1 / 2 / 4,
several requests, contexts below and above the candidates' reach; one signature on both sides
taking NumPy or the framework's arrays; torch == JAX; hostile inputs refused by name, alike."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dsv4_cpu import binding as C
from dsv4_jax import indexer as ji
from dsv4_torch import indexer as ti
from planner import indexer_oracle as orc
from tests.indexer_cases import make_batch

TORCH = [b for b in ("cpu", "reference") if ti.available_backends()[b] is None]
JAX = ["xla"] + (["cpu"] if ji.backends.INDEXER["cpu"].unavailable(()) is None else [])
RUNS = [("torch", b) for b in TORCH] + [("jax", b) for b in JAX]
BS, NB, TOPK = 4, 6, 8  # the candidates reach 24 entries: most tokens below see more


def _case(seed, r, H=6, D=32):
    # entries per request: 300 (far above the reach), 21 (below), 90; some tokens see < TOPK
    seq = [300 * r, 21 * r, 90 * r]
    case = make_batch(np.random.default_rng(seed), seq=seq, qry=[12, 21 * r, 9], H=H, D=D, r=r, page=16, dup=3)
    case["q32"] = case["q"].astype(np.float32)
    return case


def _run(fw, backend, case, r, **kw):
    """indexer_topk of framework `fw` on the case's fp8 pages; results as NumPy."""
    if fw == "torch":
        q = torch.from_numpy(case["q32"]).bfloat16()
        args = (q, torch.from_numpy(case["w"]), torch.from_numpy(case["cache"]))
        mod, bt = ti, torch.from_numpy(case["bt"])
    else:
        args = (jnp.asarray(case["q"]), jnp.asarray(case["w"]), jnp.asarray(case["cache"]))
        mod, bt = ji, jnp.asarray(case["bt"])
    res = mod.indexer_topk(*args, case["req"], case["pos"], r, TOPK, block_table=bt, backend=backend, **kw)
    assert res.backend == backend
    cand = None if res.candidates is None else np.asarray(res.candidates)
    return np.asarray(res.indices), np.asarray(res.logits), cand


def _oracle_args(case, r):
    return case["q32"], case["w"], case["deq"], case["req"], case["pos"], r


@pytest.mark.parametrize("r", [1, 2, 4])
@pytest.mark.parametrize("fw, backend", RUNS)
def test_level1_against_oracle(fw, backend, r):
    case = _case(r, r)
    idx, _, cand = _run(fw, backend, case, r, candidate_block_size=BS, candidate_topk_blocks=NB)
    args = _oracle_args(case, r)
    rel = orc.fp32_rel(32, 6)
    c = orc.compare_topk(idx, *args, rel=rel)  # the source's own top-k: the ordinary one
    assert c.near_ties <= max(1, c.tokens // 20), c
    assert cand.shape == (len(case["pos"]), NB) and cand.dtype == np.int32
    cc = orc.compare_candidates(cand, *args, BS, rel=rel)
    assert cc.near_ties <= max(1, cc.tokens // 20), cc
    vis = (case["pos"] + 1) // r
    full = -(-vis // BS) <= NB  # every block fits: all kept, the pinned one first
    assert full.any() and (~full).any()
    for t in np.flatnonzero(full):
        nb = -(-vis[t] // BS)
        assert sorted(cand[t, :nb].tolist()) == list(range(nb)) and (cand[t, nb:] == -1).all()


@pytest.mark.parametrize("r", [1, 2])
@pytest.mark.parametrize("fw, backend", RUNS)
def test_level2_against_oracle(fw, backend, r):
    case = _case(10 + r, r)
    args = _oracle_args(case, r)
    cand, _ = orc.candidate_blocks(*args, BS, NB)
    idx, val, none = _run(fw, backend, case, r, candidates=cand, candidate_block_size=BS)
    assert none is None
    c = orc.compare_topk(idx, *args, rel=orc.fp32_rel(32, 6), candidates=cand, candidate_block_size=BS)
    assert c.near_ties <= max(1, c.tokens // 20), c
    ref, refv = orc.indexer_topk(*args, TOPK, candidates=cand, candidate_block_size=BS)
    live = ref >= 0
    assert ((idx >= 0) == live).all()
    assert np.allclose(val[live], refv[live], rtol=1e-4, atol=1e-4 * np.abs(refv[live]).max())
    # where every visible entry is a candidate, level 2 is the plain top-k
    plain, _, _ = _run(fw, backend, case, r)
    vis = (case["pos"] + 1) // r
    fits = vis <= BS * NB
    assert fits.any() and (idx[fits] == plain[fits]).all()
    # the level-1 rows of this very backend feed its level 2 (the model's use)
    _, _, own = _run(fw, backend, case, r, candidate_block_size=BS, candidate_topk_blocks=NB)
    idx2, _, _ = _run(fw, backend, case, r, candidates=own, candidate_block_size=BS, candidate_topk_blocks=NB)
    orc.compare_topk(idx2, *args, rel=orc.fp32_rel(32, 6), candidates=own, candidate_block_size=BS)


def test_torch_equals_jax():
    r = 1
    case = _case(7, r)
    args = _oracle_args(case, r)
    cand, _ = orc.candidate_blocks(*args, BS, NB)
    kw1 = dict(candidate_block_size=BS, candidate_topk_blocks=NB)
    kw2 = dict(candidates=cand, candidate_block_size=BS)
    for kw in (kw1, kw2):
        got = {(fw, b): _run(fw, b, case, r, **kw) for fw, b in RUNS}
        base = got[RUNS[0]]
        for key, (idx, val, blocks) in got.items():
            same = (idx == base[0]).all(axis=1).mean()
            assert same >= 0.9, (key, same)  # (the rest: near ties, checked against the oracle above)
            live = base[0] >= 0
            assert np.allclose(val[live], base[1][live], rtol=1e-4, atol=1e-4 * np.abs(base[1][live]).max())
            if blocks is not None:
                assert (blocks[:, 0] == base[2][:, 0]).all()  # the pinned blocks: exact
                assert (blocks == base[2]).all(axis=1).mean() >= 0.9


def test_one_signature_and_numpy_arrays():
    st, sj = inspect.signature(ti.indexer_topk), inspect.signature(ji.indexer_topk)
    assert [(p.name, p.kind, p.default) for p in st.parameters.values()] == [
        (p.name, p.kind, p.default) for p in sj.parameters.values()
    ]
    # issue 34: NumPy offsets through JAX's xla backend with several requests crashed
    # (TracerArrayConversionError); every array argument as NumPy, both frameworks, both positional forms
    rng = np.random.default_rng(3)
    case = make_batch(rng, seq=[40, 90], qry=[5, 7], H=4, D=16, r=1, q_dtype=np.float32)
    flat = np.concatenate(case["deq"]).astype(np.float32)
    offs = np.array([0, len(case["deq"][0])])
    want, _ = orc.indexer_topk(case["q"], case["w"], case["deq"], case["req"], case["pos"], 1, 6)
    for mod, backends in ((ti, TORCH), (ji, JAX)):
        for b in backends:
            res = mod.indexer_topk(case["q"], case["w"], flat, case["req"], case["pos"], 1, 6, offsets=offs, backend=b)
            assert (np.asarray(res.indices) == want).all(), (mod.__name__, b)
            res = mod.indexer_topk(
                case["q"], case["w"], flat, case["req"], case["pos"], compress_ratio=1, topk=6, offsets=offs,
                valid=np.arange(12) != 3, backend=b,
            )  # fmt: skip
            got = np.asarray(res.indices)
            assert (got[3] == -1).all() and (np.delete(got, 3, 0) == np.delete(want, 3, 0)).all()


@pytest.mark.parametrize("backend", JAX)
def test_jax_under_jit_takes_traced_candidates(backend):
    r = 1
    case = _case(5, r)
    args = _oracle_args(case, r)
    cand, _ = orc.candidate_blocks(*args, BS, NB)

    @jax.jit
    def both(q, w, cache, bt, req, pos, cand):
        one = ji.indexer_topk(q, w, cache, req, pos, r, TOPK, block_table=bt, candidate_block_size=BS,
                              candidate_topk_blocks=NB, num_entries=300, backend=backend)  # fmt: skip
        two = ji.indexer_topk(q, w, cache, req, pos, r, TOPK, block_table=bt, candidates=cand,
                              candidate_block_size=BS, num_entries=300, backend=backend)  # fmt: skip
        return one.candidates, two.indices

    arrays = [jnp.asarray(case[k]) for k in ("q", "w", "cache", "bt", "req", "pos")]
    blocks, idx = both(*arrays, jnp.asarray(cand))
    rel = orc.fp32_rel(32, 6)
    orc.compare_candidates(np.asarray(blocks), *args, BS, rel=rel)
    orc.compare_topk(np.asarray(idx), *args, rel=rel, candidates=cand, candidate_block_size=BS)
    if backend == "cpu":  # traced candidates: the C kernel still refuses a bad one by name
        bad = cand.copy()
        bad[3, 1] = 9999
        with pytest.raises(Exception, match=r"candidates: token 3, column 1 is block 9999"):
            jax.block_until_ready(both(*arrays, jnp.asarray(bad)))


HOSTILE = [
    (dict(candidate_block_size=4, candidate_topk_blocks=1), "4 positions cannot hold topk = 8"),
    (dict(candidate_block_size=2, candidates=np.zeros((3, 3), np.int32)), "6 positions cannot hold topk = 8"),
    (dict(candidate_topk_blocks=4), "candidate_block_size: needed with candidate_topk_blocks"),
    (dict(candidate_block_size=4), "candidate_topk_blocks: needed with candidate_block_size"),
    (dict(candidate_block_size=0, candidate_topk_blocks=4), "candidate_block_size: must be >= 1, got 0"),
    (dict(candidate_block_size=4, candidate_topk_blocks=True), "candidate_topk_blocks: expected an integer"),
    (dict(candidate_block_size=4, candidates=np.zeros((2, 4), np.int32)), r"candidates: expected 3 rows"),
    (dict(candidate_block_size=4, candidates=np.zeros((3, 4))), "candidates: expected integer block ids"),
    (dict(candidate_block_size=4, candidates=np.zeros(3, np.int32)), r"candidates: expected \[tokens, blocks\]"),
    (
        dict(candidate_block_size=4, candidate_topk_blocks=5, candidates=np.zeros((3, 4), np.int32)),
        "candidate_topk_blocks: 5 differs from candidates' 4 columns",
    ),
    (
        dict(candidate_block_size=4, candidates=np.array([[0, 1, -1, -1], [0, 5, -1, -1], [0, -1, -1, -1]])),
        r"candidates: token 1, column 1 is block 5, outside \[-1, 3\)",
    ),
    (
        dict(candidate_block_size=4, candidates=np.array([[0, 1, -1, -1], [2, 1, 2, -1], [0, -1, -1, -1]])),
        "candidates: token 1 lists block 2 more than once",
    ),
    (
        dict(candidate_block_size=4, candidates=np.array([[0, 1, -1, -1], [0, -1, -1, -1], [0, -3, -1, -1]])),
        r"candidates: token 2, column 1 is block -3",
    ),
    (dict(num_entries=5), "num_entries: 5, but token 1 sees 10 entries"),
    (dict(valid=np.ones(2, bool)), "valid: expected"),
]


@pytest.mark.parametrize("kw, match", HOSTILE, ids=[m[:40] for _, m in HOSTILE])
@pytest.mark.parametrize("fw, backend", RUNS)
def test_hostile_inputs_named_alike(fw, backend, kw, match):
    rng = np.random.default_rng(0)
    q, w = rng.standard_normal((3, 2, 16)).astype(np.float32), np.ones((3, 2), np.float32)
    keys = rng.standard_normal((12, 16)).astype(np.float32)
    mod = ti if fw == "torch" else ji
    with pytest.raises(ValueError, match=match):
        mod.indexer_topk(q, w, keys, [0, 0, 0], [7, 9, 2], 1, 8, backend=backend, **kw)


@pytest.mark.parametrize("fw, backend", RUNS)
def test_exact_ties_and_nan_blocks(fw, backend):
    """Equal scores: the lower block (entry) first, exactly, on every backend; a NaN block dropped."""
    keys = np.ones((60, 8), np.float32)
    keys[9] = np.nan
    q, w = np.ones((3, 3, 8), np.float32), np.ones((3, 3), np.float32)
    mod = ti if fw == "torch" else ji
    args = (q, w, keys, [0, 0, 0], [59, 30, 6], 1, 6)
    res = mod.indexer_topk(*args, candidate_block_size=4, candidate_topk_blocks=5, backend=backend)
    blocks = np.asarray(res.candidates)
    assert blocks.tolist() == [[14, 0, 1, 3, 4], [7, 0, 1, 3, 4], [1, 0, -1, -1, -1]]
    two = mod.indexer_topk(*args, candidate_block_size=4, candidates=blocks, backend=backend)
    assert np.asarray(two.indices)[0].tolist() == [0, 1, 2, 3, 4, 5]


CPU_ISAS = [n for n, ok in C.isa_supported().items() if ok] if "cpu" in TORCH else []


@pytest.mark.parametrize("isa", CPU_ISAS)
def test_cpu_backends_on_every_isa_by_environment(isa, monkeypatch):
    """DSV4_PREFILL_CPU_ISA caps the C kernel under both frameworks' APIs: both levels on each
    instruction set this machine runs, against the oracle."""
    monkeypatch.setenv("DSV4_PREFILL_CPU_ISA", isa)
    r = 1
    case = _case(20, r)
    args = _oracle_args(case, r)
    rel = orc.fp32_rel(32, 6)
    cand, _ = orc.candidate_blocks(*args, BS, NB)
    for fw in ("torch", "jax"):
        idx, _, blocks = _run(fw, "cpu", case, r, candidate_block_size=BS, candidate_topk_blocks=NB)
        orc.compare_candidates(blocks, *args, BS, rel=rel)
        idx2, _, _ = _run(fw, "cpu", case, r, candidates=cand, candidate_block_size=BS)
        orc.compare_topk(idx2, *args, rel=rel, candidates=cand, candidate_block_size=BS)


@pytest.mark.parametrize("fw, backend", RUNS)
def test_padding_rows_are_not_read_and_errors_name_the_callers_token(fw, backend):
    rng = np.random.default_rng(1)
    q, w = rng.standard_normal((3, 2, 16)).astype(np.float32), np.ones((3, 2), np.float32)
    keys = rng.standard_normal((12, 16)).astype(np.float32)
    mod = ti if fw == "torch" else ji
    valid = np.array([False, True, True])
    cand = np.array([[77, 77, 77, 77], [0, 1, 2, -1], [0, 9, -1, -1]])  # row 0: padding, never read
    with pytest.raises(ValueError, match=r"candidates: token 2, column 1 is block 9"):
        mod.indexer_topk(q, w, keys, [0, 0, 0], [7, 9, 2], 1, 8, valid=valid, candidates=cand, candidate_block_size=4,
                         backend=backend)  # fmt: skip
    cand[2, 1] = -1
    res = mod.indexer_topk(q, w, keys, [0, 0, 0], [7, 9, 2], 1, 8, valid=valid, candidates=cand,
                           candidate_block_size=4, backend=backend)  # fmt: skip
    got = np.asarray(res.indices)
    one = got[1][got[1] >= 0]
    assert (got[0] == -1).all() and one.size == 8 and set(one.tolist()) <= set(range(10))
    assert sorted(got[2][got[2] >= 0].tolist()) == [0, 1, 2]
