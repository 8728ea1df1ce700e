"""dsv4_torch.indexer (backends "cpu" and "reference") against the float64 oracle; dsv4_torch.index_cache's bytes."""

import numpy as np
import pytest
import torch

from dsv4_torch import index_cache as tic
from dsv4_torch import indexer as ti
from planner import index_cache as ic
from planner import indexer_oracle as orc
from planner.contract import BackendUnavailableError
from tests.indexer_cases import make_batch

CPU_OK = ti.available_backends()["cpu"] is None
BACKENDS = ["cpu", "reference"] if CPU_OK else ["reference"]


def _case(seed, seq, qry, H=6, D=64, r=4, dup=4):
    case = make_batch(np.random.default_rng(seed), seq=seq, qry=qry, H=H, D=D, r=r, dup=dup)
    q = torch.from_numpy(case["q"].astype(np.float32)).bfloat16()
    return case, q, torch.from_numpy(case["w"]), torch.from_numpy(case["cache"]), torch.from_numpy(case["bt"])


def _compare(res, case, q, r, what):
    H, D = q.shape[1], q.shape[2]
    c = orc.compare_topk(
        res.indices.numpy(),
        q.float().numpy(),
        case["w"],
        case["deq"],
        case["req"],
        case["pos"],
        r,
        rel=orc.fp32_rel(D, H),
    )
    print(f"{what}: {c.near_ties} near-tie tokens of {c.tokens}")
    assert c.near_ties <= max(1, c.tokens // 20), c
    return c


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("topk", [5, 64, 512])
def test_fp8_pages_against_oracle(backend, topk):
    case, q, w, cache, bt = _case(topk, seq=[300, 2500, 40], qry=[40, 30, 5])
    res = ti.indexer_topk(q, w, cache, case["req"], case["pos"], 4, topk, block_table=bt, backend=backend)
    assert res.backend == backend and res.indices.dtype == torch.int32 and res.indices.shape == (75, topk)
    _compare(res, case, q, 4, f"{backend} fp8 k={topk}")
    ref, refv = orc.indexer_topk(q.float().numpy(), case["w"], case["deq"], case["req"], case["pos"], 4, topk)
    live = ref >= 0
    assert np.allclose(res.logits.numpy()[live], refv[live], rtol=1e-4, atol=1e-4 * np.abs(refv[live]).max())
    assert (res.logits.numpy()[~live] == -np.inf).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_and_dtypes(backend):
    case, q, w, _, _ = _case(3, seq=[500, 90], qry=[33, 9])
    offs = torch.tensor([0, len(case["deq"][0])])
    flat = torch.from_numpy(np.concatenate(case["deq"]))
    for keys, qq in ((flat.bfloat16(), q), (flat, q.float()), (flat.bfloat16(), q.float())):
        res = ti.indexer_topk(qq, w, keys, case["req"], case["pos"], 4, 16, offsets=offs, backend=backend)
        _compare(res, case, q, 4, f"{backend} rows {keys.dtype} q {qq.dtype}")
    q8 = q.float().clamp(-448, 448).to(torch.float8_e4m3fn)
    res = ti.indexer_topk(q8, w, flat.bfloat16(), case["req"], case["pos"], 4, 16, offsets=offs, backend=backend)
    c = orc.compare_topk(
        res.indices.numpy(), q8.float().numpy(), case["w"], case["deq"], case["req"], case["pos"], 4,
        rel=orc.fp32_rel(64, 6),
    )  # fmt: skip
    print(f"{backend} e4m3 q: {c.near_ties} near-tie tokens of {c.tokens}")


@pytest.mark.skipif(not CPU_OK, reason="the C kernels cannot be built here (no compiler)")
def test_auto_reports_cpu_and_matches_reference():
    case, q, w, cache, bt = _case(7, seq=[700, 300], qry=[64, 20])
    a = ti.indexer_topk(q, w, cache, case["req"], case["pos"], 4, 32, block_table=bt)
    b = ti.indexer_topk(q, w, cache, case["req"], case["pos"], 4, 32, block_table=bt, backend="reference")
    assert a.backend == "cpu" and b.backend == "reference"
    same = (a.indices == b.indices).all(dim=1)
    assert same.float().mean() > 0.9  # the rest: near ties (both within float32 rounding of the oracle)
    _compare(a, case, q, 4, "auto")
    _compare(b, case, q, 4, "reference")


def test_reference_tie_rule_nan_and_zero():
    keys = torch.tensor([[1.0], [float("nan")], [1.0], [-2.0], [0.0]])
    q = torch.ones((1, 1, 1))
    w = torch.ones((1, 1))
    res = ti.indexer_topk(q, w, keys, [0], [4], 1, 5, backend="reference")
    # logits [1, nan, 1, 0 (relu), 0]: ties by index, NaN last
    assert res.indices.tolist() == [[0, 2, 3, 4, 1]]
    w = -torch.ones((1, 1))  # logits [-1, nan, -1, -0.0, -0.0]: -0.0 ranks as 0.0
    res = ti.indexer_topk(q, w, keys, [0], [4], 1, 5, backend="reference")
    assert res.indices.tolist() == [[3, 4, 0, 2, 1]]
    if CPU_OK:
        assert ti.indexer_topk(q, w, keys, [0], [4], 1, 5, backend="cpu").indices.tolist() == [[3, 4, 0, 2, 1]]


def test_index_cache_bytes_equal_numpy():
    rng = np.random.default_rng(0)
    for _ in range(2):
        k = (rng.standard_normal((60, 128)) * np.exp(rng.uniform(-15, 15, (60, 1)))).astype(np.float32)
        k[0] = 0.0  # amax below the 1e-4 floor
        slots = rng.permutation(80)[:60]
        slots[5] = -1
        want = np.zeros((10, 8, 132), np.uint8)
        ic.indexer_k_quant_and_cache(k, want, slots, 128)
        got = torch.zeros((10, 2, 8, 132), dtype=torch.uint8)[:, 1]  # a strided per-layer view
        tic.indexer_k_quant_and_cache(torch.from_numpy(k), got, torch.from_numpy(slots), 128)
        assert np.array_equal(got.numpy(), want)
        tic.indexer_k_quant_and_cache(torch.from_numpy(k).bfloat16(), got, torch.from_numpy(slots), 128)
        assert np.array_equal(got.numpy(), want)


@pytest.mark.parametrize(
    "kw, err, match",
    [
        (dict(backend="gpu"), ValueError, "backend: expected one of 'auto', 'cpu', 'reference'"),
        (dict(q=torch.zeros((4, 2, 16), dtype=torch.float16)), TypeError, "q: expected a"),
        (dict(weights=torch.zeros((4, 3))), ValueError, r"weights: expected a float \[4, 2\]"),
        (dict(keys=torch.zeros((5, 8))), ValueError, r"keys: rows must be \[N, D = 16\]"),
        (dict(keys=torch.zeros((5, 16), dtype=torch.int32)), TypeError, "keys: expected uint8"),
        (dict(keys=torch.zeros((2, 4, 20), dtype=torch.uint8)), ValueError, "block_table: fp8 index pages need"),
        (dict(token_position=[1, 2, 3]), ValueError, "token_position: expected 4 entries"),
        (dict(token_position=[-1, 2, 3, 4]), ValueError, "token_position: positions must be in"),
        (dict(compress_ratio=0), ValueError, "compress_ratio: expected an integer >= 1"),
        (dict(topk=0), ValueError, "topk: expected an integer >= 1"),
    ],
)
def test_bad_inputs(kw, err, match):
    args = dict(
        q=torch.zeros((4, 2, 16)), weights=torch.zeros((4, 2)), keys=torch.zeros((10, 16)), token_request=[0] * 4,
        token_position=[3, 4, 5, 6], compress_ratio=4, topk=2,
    )  # fmt: skip
    args.update(kw)
    with pytest.raises(err, match=match):
        ti.indexer_topk(**args)


@pytest.mark.skipif(not CPU_OK, reason="the C kernels cannot be built here (no compiler)")
def test_cpu_refuses_unreadable_keys():
    with pytest.raises(ValueError, match="keys: tokens see 2 entries, the rows hold 1"):
        ti.indexer_topk(torch.zeros((1, 1, 4)), torch.ones((1, 1)), torch.zeros((1, 4)), [0], [8], 4, 2, backend="cpu")
    with pytest.raises(ValueError, match="keys: request 0 needs rows 0 .. 1, the rows hold 1"):
        ti.indexer_topk(
            torch.zeros((1, 1, 4)), torch.ones((1, 1)), torch.zeros((1, 4)), [0], [8], 4, 2, backend="reference"
        )
    if torch.cuda.is_available():  # pragma: no cover - GPU machines
        with pytest.raises(BackendUnavailableError):
            ti.indexer_topk(torch.zeros((1, 1, 4), device="cuda"), torch.ones((1, 1), device="cuda"),
                            torch.zeros((4, 4), device="cuda"), [0], [8], 4, 2, backend="cpu")  # fmt: skip
