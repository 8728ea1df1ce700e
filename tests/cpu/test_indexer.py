"""The C Lightning Indexer (dsv4_cpu/csrc/indexer.cc) against the float64 oracle, on every
instruction set this machine runs and both staging layouts, with every key source.

Each comparison counts the tokens whose selected set differs from the oracle's by near ties
(`planner.indexer_oracle.compare_topk`); the counts are printed (`pytest -s`) and bounded.
"""

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
LAYOUTS = ["auto", "pairs"]


@pytest.fixture(params=[(isa, layout) for isa in ISAS for layout in LAYOUTS], ids=lambda p: f"{p[0]}-{p[1]}")
def isa(request, monkeypatch):
    name, layout = request.param
    if layout == "pairs":
        monkeypatch.setenv("DSV4_PREFILL_INDEXER_LAYOUT", "pairs")
    else:
        monkeypatch.delenv("DSV4_PREFILL_INDEXER_LAYOUT", raising=False)
    return name


def check(idx, case, r, H, D, rel=None, what=""):
    q64 = case["q"].astype(np.float32)
    c = orc.compare_topk(idx, q64, case["w"], case["deq"], case["req"], case["pos"], r, rel=rel or orc.fp32_rel(D, H))
    print(f"{what}: {c.near_ties} near-tie tokens of {c.tokens} ({c.swapped_entries} entries swapped)")
    assert c.near_ties <= max(1, c.tokens // 20), c
    return c


@pytest.mark.parametrize("topk", [1, 7, 64])
def test_fp8_pages_small(isa, topk):
    rng = np.random.default_rng(topk)
    H, D, r = 5, 40, 4  # heads not a multiple of any register tile; D not a multiple of the vectors
    case = make_batch(rng, seq=[97, 400, 3, 260], qry=[30, 64, 3, 1], H=H, D=D, r=r, dup=3)
    idx, val = ik.indexer_topk(
        case["q"],
        case["w"],
        ik.IndexKeys.fp8_pages(case["cache"], case["bt"]),
        case["req"],
        case["pos"],
        r,
        topk,
        isa=isa,
        threads=2,
    )
    check(idx, case, r, H, D, what=f"{isa} fp8 k={topk}")
    ref, refv = orc.indexer_topk(
        case["q"].astype(np.float32), case["w"], case["deq"], case["req"], case["pos"], r, topk
    )
    live = ref >= 0
    assert np.allclose(val[live], refv[live], rtol=1e-5, atol=1e-5 * np.abs(refv[live]).max())
    assert (val[~live] == -np.inf).all() and (idx[~live] == -1).all()


@pytest.mark.parametrize("topk", [512, 1024, 2048])
def test_large_k_streaming(isa, topk):
    """Contexts several times k: the running top-k compacts many times."""
    rng = np.random.default_rng(topk + 1)
    H, D, r = 8, 128, 4
    seq = [4 * (3 * topk + 100), 4 * topk - 8]  # one request well beyond k, one with fewer entries than k
    case = make_batch(rng, seq=seq, qry=[6, 3], H=H, D=D, r=r, page=64, dup=20)
    src = ik.IndexKeys.fp8_pages(case["cache"], case["bt"])
    idx, _ = ik.indexer_topk(case["q"], case["w"], src, case["req"], case["pos"], r, topk, isa=isa, threads=2)
    check(idx, case, r, H, D, what=f"{isa} fp8 k={topk}")
    assert (idx[6:, : (seq[1] - 3) // 4] >= 0).all()  # fewer entries than k: every one, then -1
    one, _ = ik.indexer_topk(case["q"], case["w"], src, case["req"], case["pos"], r, topk, isa=isa, threads=1)
    assert (one == idx).all(), "results depend on the thread count"


def test_rows_sources_and_dtypes(isa):
    rng = np.random.default_rng(5)
    H, D, r = 6, 64, 2
    case = make_batch(rng, seq=[300, 90], qry=[40, 9], H=H, D=D, r=r, dup=4)
    offs = np.array([0, len(case["deq"][0])])
    flat = np.concatenate(case["deq"])  # the dequantized fp8 keys: exact in bf16 and float32
    fp8 = ik.IndexKeys.fp8_pages(case["cache"], case["bt"])
    args = (case["req"], case["pos"], r, 16)
    base, _ = ik.indexer_topk(case["q"], case["w"], fp8, *args, isa=isa)
    for keys in (flat.astype(ml_dtypes.bfloat16), flat):
        got, _ = ik.indexer_topk(case["q"], case["w"], ik.IndexKeys.rows(keys, offs), *args, isa=isa)
        check(got, case, r, H, D, what=f"{isa} rows {keys.dtype}")
    q32 = case["q"].astype(np.float32)
    got, _ = ik.indexer_topk(q32, case["w"], fp8, *args, isa=isa)
    check(got, case, r, H, D, what=f"{isa} float32 q")
    # e4m3 queries (vLLM's fp8 q, its scale folded into the weights)
    q8 = np.clip(q32, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    case8 = dict(case, q=q8)
    got, _ = ik.indexer_topk(q8, case["w"], fp8, *args, isa=isa)
    check(got, case8, r, H, D, what=f"{isa} e4m3 q")


@pytest.mark.parametrize("D", [40, 7])
def test_e4m3_queries_every_byte(isa, D):
    """Every e4m3 byte as a query value, exactly (the vector widening at staging; D 40: whole
    vectors and a tail; D 7: an odd depth; and the same values as bf16 q): token t has byte t at dim t % D and sees two keys,
    +1 and -1 at that dim, so its two logits are relu(v) and relu(-v) of the byte's value v."""
    T = 256
    q = np.zeros((T, 1, D), np.uint8)
    q[np.arange(T), 0, np.arange(T) % D] = np.arange(T)
    q = q.view(ml_dtypes.float8_e4m3fn)
    keys = np.zeros((2 * T, D), np.float32)
    keys[2 * np.arange(T), np.arange(T) % D] = 1
    keys[2 * np.arange(T) + 1, np.arange(T) % D] = -1
    v = np.arange(T, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    for qx, k in [
        (q, keys.astype(ml_dtypes.bfloat16)),
        (q, keys),
        (q.astype(ml_dtypes.bfloat16), keys.astype(ml_dtypes.bfloat16)),
    ]:
        idx, val = ik.indexer_topk(
            qx,
            np.ones((T, 1), np.float32),
            ik.IndexKeys.rows(k, 2 * np.arange(T)),
            np.arange(T),
            np.ones(T, int),
            1,
            2,
            isa=isa,
        )
        nan = np.isnan(v)
        assert nan.sum() == 2 and np.isnan(val[nan]).all()
        got = np.sort(val[~nan], axis=1)
        want = np.sort(np.stack([np.maximum(v, 0), np.maximum(-v, 0)], 1)[~nan], axis=1)
        np.testing.assert_array_equal(got, want, err_msg=f"{isa} q {qx.dtype} keys {k.dtype}")


def test_tie_rule_exact_duplicates(isa):
    """Identical keys give bitwise-equal logits: the lower entry index ranks first, always."""
    rng = np.random.default_rng(9)
    H, D, r, k = 4, 32, 1, 5
    base = rng.standard_normal((8, D)).astype(np.float32)
    keys = np.tile(base, (30, 1)).astype(ml_dtypes.bfloat16)  # entry e = base[e % 8]
    q = rng.standard_normal((3, H, D)).astype(ml_dtypes.bfloat16)
    w = np.ones((3, H), np.float32)
    pos = np.array([239, 100, 17])
    idx, val = ik.indexer_topk(q, w, ik.IndexKeys.rows(keys), np.zeros(3, int), pos, r, k, isa=isa)
    for t in range(3):
        ref, _ = orc.indexer_topk(
            q[t : t + 1].astype(np.float32), w[t : t + 1], keys.astype(np.float32), [0], pos[t : t + 1], r, k
        )
        assert idx[t].tolist() == ref[0].tolist()
        best = int(np.argmax(val[t]))
        assert idx[t, 0] == idx[t, best] < 8  # the first of the equal top entries


def test_nan_keys_rank_last(isa):
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((20, 16)).astype(np.float32)
    keys[[2, 5]] = np.nan
    q = rng.standard_normal((1, 2, 16)).astype(np.float32)
    w = np.ones((1, 2), np.float32)
    idx, val = ik.indexer_topk(q, w, ik.IndexKeys.rows(keys), [0], [19], 1, 20, isa=isa)
    assert idx[0, -2:].tolist() == [2, 5] and np.isnan(val[0, -2:]).all()
    ref, _ = orc.indexer_topk(q, w, keys, [0], [19], 1, 20)
    assert idx.tolist() == ref.tolist()


def test_tokens_in_any_order_and_rows():
    """Requests interleaved, repeated positions: results per token do not depend on the order."""
    rng = np.random.default_rng(11)
    H, D, r = 4, 32, 4
    case = make_batch(rng, seq=[500, 300], qry=[20, 20], H=H, D=D, r=r)
    perm = rng.permutation(40)
    fp8 = ik.IndexKeys.fp8_pages(case["cache"], case["bt"])
    a, _ = ik.indexer_topk(case["q"], case["w"], fp8, case["req"], case["pos"], r, 9)
    b, _ = ik.indexer_topk(case["q"][perm], case["w"][perm], fp8, case["req"][perm], case["pos"][perm], r, 9)
    assert (a[perm] == b).all()


def test_bad_inputs():
    rng = np.random.default_rng(0)
    case = make_batch(rng, seq=[100], qry=[4], H=2, D=16, r=4)
    fp8 = ik.IndexKeys.fp8_pages(case["cache"], case["bt"])
    args = (case["q"], case["w"], fp8, case["req"], case["pos"], 4, 3)
    bt = case["bt"].copy()
    bt[0, 0] = 10_000
    with pytest.raises(ValueError, match="keys: request 0, entry 0: block-table entry 0 is page 10000, outside"):
        ik.indexer_topk(case["q"], case["w"], ik.IndexKeys.fp8_pages(case["cache"], bt), case["req"], case["pos"], 4, 3)
    with pytest.raises(ValueError, match="token_request: token 0 names request 3"):
        ik.indexer_topk(case["q"], case["w"], fp8, case["req"] + 3, case["pos"], 4, 3)
    with pytest.raises(ValueError, match="keys: tokens see 25 entries, the rows hold 10"):
        ik.indexer_topk(
            case["q"], case["w"], ik.IndexKeys.rows(np.zeros((10, 16), np.float32)), case["req"], case["pos"], 4, 3
        )
    with pytest.raises(ValueError, match="topk: must be >= 1"):
        ik.indexer_topk(*args[:-1], 0)
    with pytest.raises(ValueError, match="isa: expected one of"):
        ik.indexer_topk(*args, isa="sse9")
    unsupported = [n for n, ok in C.isa_supported().items() if not ok]
    if unsupported:
        with pytest.raises(RuntimeError, match=f"isa: {unsupported[0]} cannot run on this machine"):
            ik.indexer_topk(*args, isa=unsupported[0])


def test_isa_cap_and_choice(monkeypatch):
    assert ik.indexer_isa(ml_dtypes.bfloat16, "fp8") == C.best_isa()
    monkeypatch.setenv("DSV4_PREFILL_CPU_ISA", "generic")
    assert ik.indexer_isa(np.float32, "bf16") == "generic"
    monkeypatch.setenv("DSV4_PREFILL_CPU_ISA", "bogus")
    with pytest.raises(RuntimeError, match="DSV4_PREFILL_CPU_ISA: unknown instruction set 'bogus'"):
        ik.indexer_isa(np.float32, "bf16")


def test_decode_shapes_split_the_key_range(isa):
    """Fewer tiles than two per thread (one token per request, long contexts): the key range is cut
    into pieces whose best k are merged; the same rows as one piece (one thread) and the oracle's."""
    rng = np.random.default_rng(21)
    H, D, r, k = 16, 128, 4, 64  # enough work for 2 threads (4 MFLOP a thread); 3 tiles < 2 x 2: split
    case = make_batch(rng, seq=[4 * 3000, 4 * 1500 + 3, 4 * 70], qry=[1, 1, 1], H=H, D=D, r=r, page=64, dup=10)
    src = ik.IndexKeys.fp8_pages(case["cache"], case["bt"])
    args = (case["q"], case["w"], src, case["req"], case["pos"], r, k)
    split, _ = ik.indexer_topk(*args, isa=isa, threads=2)
    whole, _ = ik.indexer_topk(*args, isa=isa, threads=1)
    assert (split == whole).all()
    check(split, case, r, H, D, what=f"{isa} decode split")


def test_hostile_inputs_raise_never_read_out_of_bounds():
    """Seeded hostile tables, offsets, positions and rows (`make test-sanitize` runs this under
    AddressSanitizer): every call returns rows or raises ValueError naming the argument."""
    rng = np.random.default_rng(99)
    case = make_batch(rng, seq=[700, 300], qry=[5, 5], H=2, D=16, r=4, page=16)
    raised = ran = 0
    for _ in range(200):
        bt = case["bt"].copy()
        req, pos = case["req"].copy(), case["pos"].copy()
        what = rng.integers(4)
        if what == 0:
            bt[rng.integers(bt.shape[0]), rng.integers(bt.shape[1])] = rng.choice([-5, 10**6, bt.max() + 1])
        elif what == 1:
            pos[rng.integers(pos.shape[0])] = rng.choice([-1, 2**31 - 1, 10**6])
        elif what == 2:
            req[rng.integers(req.shape[0])] = rng.choice([-1, 2, 10**6])
        try:
            ik.indexer_topk(case["q"], case["w"], ik.IndexKeys.fp8_pages(case["cache"], bt), req, pos, 4, 8, threads=2)
            ran += 1
        except ValueError:
            raised += 1
    rows = np.zeros((40, 16), np.float32)
    for offs in ([-1], [39], [10**9], [2**62], [2**63 - 1]):
        try:
            ik.indexer_topk(case["q"][:1], case["w"][:1], ik.IndexKeys.rows(rows, offs), [0], [20], 1, 4)
            ran += 1
        except ValueError:
            raised += 1
    assert raised > 50 and ran > 20
