"""dsv4_jax.indexer (backends "cpu" = the C kernel as an XLA FFI call, and "xla") against the
float64 oracle; dsv4_jax.index_cache's bytes against the NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import index_cache as jic
from dsv4_jax import indexer as ji
from dsv4_jax.backends import INDEXER
from planner import index_cache as ic
from planner import indexer_oracle as orc
from tests.indexer_cases import make_batch

CPU_OK = INDEXER["cpu"].unavailable(()) is None
BACKENDS = ["cpu", "xla"] if CPU_OK else ["xla"]


def _case(seed, seq, qry, H=6, D=64, r=4):
    case = make_batch(np.random.default_rng(seed), seq=seq, qry=qry, H=H, D=D, r=r, dup=4)
    arrays = {k: jnp.asarray(case[k]) for k in ("q", "w", "cache", "bt", "req", "pos")}
    return case, arrays


def _compare(idx, case, r, what, q=None):
    q = case["q"].astype(np.float32) if q is None else q
    H, D = q.shape[1], q.shape[2]
    c = orc.compare_topk(
        np.asarray(idx), q, case["w"], case["deq"], case["req"], case["pos"], r, rel=orc.fp32_rel(D, H)
    )
    print(f"{what}: {c.near_ties} near-tie tokens of {c.tokens}")
    assert c.near_ties <= max(1, c.tokens // 20), c


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("topk", [5, 300])
def test_fp8_pages_against_oracle_and_under_jit(backend, topk):
    case, a = _case(topk, seq=[300, 1500, 40], qry=[40, 30, 5])

    def run(q, w, cache, bt, req, pos):
        res = ji.indexer_topk(q, w, cache, req, pos, compress_ratio=4, topk=topk, block_table=bt, backend=backend)
        return res.indices, res.logits

    idx, val = run(a["q"], a["w"], a["cache"], a["bt"], a["req"], a["pos"])
    _compare(idx, case, 4, f"{backend} fp8 k={topk}")
    jidx, jval = jax.jit(run)(a["q"], a["w"], a["cache"], a["bt"], a["req"], a["pos"])
    assert np.array_equal(np.asarray(jidx), np.asarray(idx))
    ref, refv = orc.indexer_topk(
        case["q"].astype(np.float32), case["w"], case["deq"], case["req"], case["pos"], 4, topk
    )
    live = ref >= 0
    assert np.allclose(np.asarray(val)[live], refv[live], rtol=1e-4, atol=1e-4 * np.abs(refv[live]).max())


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_padding_and_dtypes(backend):
    case, a = _case(5, seq=[500, 90], qry=[33, 9])
    offs = jnp.asarray([0, len(case["deq"][0])])
    flat = np.concatenate(case["deq"])
    valid = np.ones(42, bool)
    valid[[3, 40]] = False
    for keys, q in ((flat.astype(jnp.bfloat16), a["q"]), (flat, a["q"].astype(jnp.float32))):
        res = ji.indexer_topk(
            q, a["w"], jnp.asarray(keys), a["req"], a["pos"], compress_ratio=4, topk=16, offsets=offs,
            valid=jnp.asarray(valid), num_entries=int(max(len(d) for d in case["deq"])), backend=backend,
        )  # fmt: skip
        assert res.backend == backend
        idx = np.asarray(res.indices)
        assert (idx[~valid] == -1).all() and (np.asarray(res.logits)[~valid] == -np.inf).all()
        sub = {k: (v[valid] if k in ("q", "w", "req", "pos") else v) for k, v in case.items()}
        _compare(idx[valid], sub, 4, f"{backend} rows {keys.dtype}")
    q8 = jnp.clip(a["q"].astype(jnp.float32), -448, 448).astype(jnp.float8_e4m3fn)
    res = ji.indexer_topk(q8, a["w"], jnp.asarray(flat), a["req"], a["pos"], compress_ratio=4, topk=8, offsets=offs,
                          backend=backend)  # fmt: skip
    _compare(res.indices, case, 4, f"{backend} e4m3 q", q=np.asarray(q8.astype(jnp.float32)))


@pytest.mark.skipif(not CPU_OK, reason="the C kernels cannot be built here (no compiler)")
def test_auto_is_cpu_and_agrees_with_xla():
    case, a = _case(9, seq=[700, 300], qry=[64, 20])
    args = (a["q"], a["w"], a["cache"], a["req"], a["pos"])
    x = ji.indexer_topk(*args, compress_ratio=4, topk=32, block_table=a["bt"])
    y = ji.indexer_topk(*args, compress_ratio=4, topk=32, block_table=a["bt"], backend="xla")
    assert x.backend == "cpu" and y.backend == "xla"
    assert (np.asarray(x.indices) == np.asarray(y.indices)).all(axis=1).mean() > 0.9


def test_xla_tie_rule():
    keys = jnp.asarray([[1.0], [jnp.nan], [1.0], [-2.0], [0.0]])
    res = ji.indexer_topk(jnp.ones((1, 1, 1)), -jnp.ones((1, 1)), keys, jnp.zeros(1, int), jnp.asarray([4]),
                          compress_ratio=1, topk=5, backend="xla")  # fmt: skip
    assert np.asarray(res.indices).tolist() == [[3, 4, 0, 2, 1]]  # -0.0 ties 0.0, NaN last


def test_index_cache_bytes_equal_numpy():
    rng = np.random.default_rng(0)
    k = (rng.standard_normal((60, 128)) * np.exp(rng.uniform(-15, 15, (60, 1)))).astype(np.float32)
    k[0] = 0.0
    slots = rng.permutation(80)[:60]
    slots[5] = -1
    want = np.zeros((10, 8, 132), np.uint8)
    ic.indexer_k_quant_and_cache(k, want, slots, 128)
    got = jic.indexer_k_quant_and_cache(jnp.asarray(k), jnp.zeros((10, 8, 132), jnp.uint8), jnp.asarray(slots), 128)
    assert np.array_equal(np.asarray(got), want)
    f = jax.jit(lambda k, c, s: jic.indexer_k_quant_and_cache(k, c, s, 128))
    assert np.array_equal(
        np.asarray(f(jnp.asarray(k, jnp.bfloat16), jnp.zeros((10, 8, 132), jnp.uint8), jnp.asarray(slots))), want
    )


@pytest.mark.parametrize(
    "kw, err, match",
    [
        (dict(backend="gpu"), ValueError, "backend: expected one of 'auto', 'xla', 'cpu'"),
        (dict(q=jnp.zeros((4, 2, 16), jnp.float16)), TypeError, "q: expected bfloat16, float32 or float8_e4m3fn"),
        (dict(weights=jnp.zeros((4, 3))), ValueError, r"weights: expected a float \[4, 2\]"),
        (dict(keys=jnp.zeros((5, 8))), ValueError, r"keys: rows must be \[N, D = 16\]"),
        (dict(keys=jnp.zeros((2, 4, 20), jnp.uint8)), ValueError, "block_table: fp8 index pages need"),
        (dict(token_position=jnp.zeros(3, int)), ValueError, "token_position: expected 4 entries"),
        (dict(compress_ratio=0), ValueError, "compress_ratio: expected an integer >= 1"),
        (dict(topk=0), ValueError, "topk: expected an integer >= 1"),
    ],
)
def test_bad_inputs(kw, err, match):
    args = dict(
        q=jnp.zeros((4, 2, 16)), weights=jnp.zeros((4, 2)), keys=jnp.zeros((10, 16)), token_request=jnp.zeros(4, int),
        token_position=jnp.arange(4), compress_ratio=4, topk=2,
    )  # fmt: skip
    args.update(kw)
    with pytest.raises(err, match=match):
        ji.indexer_topk(**args)
    with pytest.raises(ValueError, match="kv_cache_dtype: expected 'ue8m0'"):
        jic.indexer_k_quant_and_cache(jnp.zeros((1, 16)), jnp.zeros((1, 2, 20), jnp.uint8), jnp.zeros(1, int), 16, None)


@pytest.mark.skipif(not CPU_OK, reason="the C kernels cannot be built here (no compiler)")
def test_cpu_refuses_unreadable_keys():
    with pytest.raises(
        Exception, match=r"dsv4_indexer_topk: keys: request 0: 2 rows from row 0 reach outside \[0, 1\)"
    ):
        ji.indexer_topk(jnp.zeros((1, 1, 4)), jnp.ones((1, 1)), jnp.zeros((1, 4)), jnp.zeros(1, int), jnp.asarray([8]),
                        compress_ratio=4, topk=2, backend="cpu").indices.block_until_ready()  # fmt: skip
