"""dsv4_jax prefill: against the chunk-free oracle, chunk invariance, paged == logical, bounded compiles.

Most tests build metadata with `FAST` (small tiles, large minimum buckets) and pad every cache
to one shape, so all boundary cases of a kind share a handful of compiled programs; the tile
ladders and default buckets get tests of their own.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import planner as P
import dsv4_jax.attention
from dsv4_jax import buckets as B
from dsv4_jax.aot import lower_for_cuda
from dsv4_jax import prefill as JP
from tests.cases import boundary_cases, make_case

POLICIES = ("adaptive", "fixed", "per_request")
FAST = dict(token_tile=16, gather_tile=16, min_tokens=64, min_workspace_rows=1024)
CACHE_ROWS = 2048  # logical caches padded to this many rows; paged ones to as many entries
MAX_REQUESTS = 8


def logical(arrays, dtype=np.float32, rows=CACHE_ROWS):
    packed = np.concatenate([np.asarray(a, dtype) for a in arrays])
    packed = np.concatenate([packed, np.zeros((max(rows, packed.shape[0]) - packed.shape[0], packed.shape[1]), dtype)])
    offsets = np.concatenate([[0], np.cumsum([len(a) for a in arrays])[:-1]]).astype(np.int32)
    return JP.LogicalKV(jnp.asarray(packed), jnp.asarray(np.pad(offsets, (0, MAX_REQUESTS - len(offsets)))))


def paged(case, which, dtype=np.float32, seed=1):
    pages, table = case.paged(which, seed=seed)
    n_pages = max(CACHE_ROWS // pages.shape[1], pages.shape[0])
    pages = np.concatenate([pages, np.full((n_pages - pages.shape[0],) + pages.shape[1:], np.nan, np.float32)])
    width = max(table.shape[1], n_pages // 2)
    table = np.pad(table, ((0, MAX_REQUESTS - table.shape[0]), (0, width - table.shape[1])))
    return JP.PagedKV(jnp.asarray(pages.astype(dtype)), jnp.asarray(table))


def caches(case, *, paged_kv=False, dtype=np.float32):
    if paged_kv:
        return paged(case, "raw", dtype, 1), (paged(case, "comp", dtype, 2) if case.ratio > 1 else None)
    return logical(case.raw, dtype), (logical(case.comp, dtype) if case.ratio > 1 else None)


def run(case, *, policy="adaptive", paged_kv=False, dtype=np.float32, backend="xla", meta_kw=FAST, **cfg):
    step = P.plan_step(case.batch, case.plan_config(policy=policy, **cfg), [case.ratio])
    smeta = JP.build_step_metadata(step, index_topk=case.topk, **meta_kw)
    meta = smeta[case.ratio]
    raw, comp = caches(case, paged_kv=paged_kv, dtype=dtype)
    q = jnp.asarray(smeta.pad_tokens(case.q).astype(dtype))
    out = JP.prefill_attention(
        q, meta, raw, comp, sm_scale=case.sm_scale, attn_sink=jnp.asarray(case.sink),
        topk_indices=smeta.pad_tokens(case.topk_rows) if case.ratio == 4 else None, backend=backend,
    )  # fmt: skip
    assert out.shape == (smeta.padded_tokens,) + case.q.shape[1:] and out.dtype == q.dtype
    out = np.asarray(out)
    assert not out[case.batch.num_tokens :].any()  # padding rows stay 0
    return out[: case.batch.num_tokens], meta


def close(out, want, rtol=1e-5):
    np.testing.assert_allclose(out, want, rtol=rtol, atol=rtol * np.abs(want).max())


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_prefill_matches_oracle_and_is_chunk_invariant(ratio):
    for case in boundary_cases(ratio):
        want, _, _ = case.oracle()
        outs = {}
        for policy in POLICIES:
            out, meta = run(case, policy=policy)
            assert meta.last_backend == "xla"
            close(out, want)
            outs[policy] = out
        # the plan never changes a bit of the result (xla backend, fp32)
        for policy in POLICIES[1:]:
            np.testing.assert_array_equal(outs[policy], outs["adaptive"], err_msg=f"{case.name} {policy}")
        # nor does a length-sorted order, a budget that splits requests, or paged caches
        tight = max(s // ratio if ratio > 1 else 0 for s in case.seq_lens) + case.window_size + 4
        for kw in (dict(order="length"), dict(budget_rows=tight), dict(paged_kv=True)):
            out, _ = run(case, **kw)
            np.testing.assert_array_equal(out, outs["adaptive"], err_msg=f"{case.name} {kw}")


def test_tile_ladders_and_default_buckets_are_bitwise_equal():
    """Multi-rung ladders with masked tails, default buckets, another program: the same bits."""
    case = make_case("ladder", [150, 40, 517], [90, 40, 13], 4, window_size=8, topk=6, H=2, D=16, seed=9)
    want, _, _ = case.oracle()
    ref, _ = run(case)  # 16-token and 16-row tiles only
    close(ref, want)
    for policy in ("adaptive", "per_request"):
        out, meta = run(case, policy=policy, meta_kw=dict(token_tile=64, gather_tile=64), paged_kv=True)
        assert meta.shape.token_ladder == (64, 16) and meta.shape.gather_ladder == (64, 16)
        assert meta.shape.padded_tokens == 160 and meta.shape.workspace_rows < 1024
        np.testing.assert_array_equal(out, ref, err_msg=policy)


@pytest.mark.parametrize("topk, width", [(512, 640), (1024, 1152)])
def test_csa_real_index_widths(topk, width):
    case = make_case("csa-wide", [4200, 2100], [3, 2], 4, window_size=128, topk=topk, H=2, D=16, seed=5)
    out, meta = run(case, meta_kw=dict(FAST, min_workspace_rows=128))
    assert meta.index_width == width
    want, _, _ = case.oracle()
    close(out, want)


def test_hca_long_context():
    case = make_case("hca-long", [40000, 300], [4, 300], 128, window_size=128, H=2, D=16, seed=6)
    kw = dict(FAST, min_tokens=16, min_workspace_rows=2048)
    outs = [run(case, policy=p, meta_kw=kw)[0] for p in POLICIES]
    want, _, _ = case.oracle()
    close(outs[0], want)
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


def test_bf16_within_flashmla_tolerance():
    case = boundary_cases(4)[2]
    # FlashMLA's tolerance is against an fp32 reference on the same bf16-rounded inputs
    bf = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    case.q, case.raw, case.comp = bf(case.q), [bf(x) for x in case.raw], [bf(x) for x in case.comp]
    want, _, _ = case.oracle()
    out, _ = run(case, dtype=jnp.bfloat16)
    err = np.abs(out.astype(np.float64) - want)
    assert (err <= 8e-4 + (3 / 128) * np.abs(want)).all(), err.max()


def test_pallas_interpret_small_case():
    case = make_case("pallas", [9, 20], [3, 5], 4, window_size=8, topk=6, H=2, D=16, seed=7)
    want, _, _ = case.oracle()
    out, meta = run(case, backend="pallas", meta_kw=dict(token_tile=16, gather_tile=16))
    assert meta.last_backend == "pallas_interpret"
    close(out, want)


def test_device_indices_equal_numpy_builder():
    for ratio in (0, 4, 128):
        case = boundary_cases(ratio)[2]
        tight = max(s // ratio if ratio > 1 else 0 for s in case.seq_lens) + case.window_size + 4
        for policy, extra in [(p, {}) for p in POLICIES] + [("adaptive", dict(budget_rows=tight))]:
            step = P.plan_step(case.batch, case.plan_config(policy=policy, order="length", **extra), [ratio])
            meta = JP.build_step_metadata(step, index_topk=case.topk, **FAST)[ratio]
            kp = step[ratio]
            assert kp.num_chunks > 1 or policy in ("adaptive", "fixed")
            for c in range(kp.num_chunks):
                want_idx, want_len = P.build_chunk_indices(kp, c, case.topk_rows if ratio == 4 else None, width=meta.index_width)
                idx, length = JP.build_indices(meta, c, case.topk_rows if ratio == 4 else None)
                np.testing.assert_array_equal(np.asarray(idx), want_idx)
                np.testing.assert_array_equal(np.asarray(length), want_len)


@pytest.mark.parametrize("paged_kv", [False, True])
def test_device_gathers_equal_numpy_workspace(paged_kv):
    for ratio in (4, 128):
        case = boundary_cases(ratio)[3]  # with query_len == 0 requests
        step = P.plan_step(case.batch, case.plan_config(policy="fixed"), [ratio])
        meta = JP.build_step_metadata(step, index_topk=case.topk, token_tile=16, gather_tile=64)[ratio]
        raw, comp = caches(case, paged_kv=paged_kv)
        for c in range(step[ratio].num_chunks):
            want = P.gather_workspace(step[ratio], c, case.raw, case.comp, fill=np.nan)
            got = np.asarray(JP.gather_workspace(meta, c, raw, comp))
            written = ~np.isnan(want[:, 0])
            np.testing.assert_array_equal(got[: want.shape[0]][written], want[written])
            assert not got[: want.shape[0]][~written].any() and not got[want.shape[0] :].any()  # nothing else written


def random_batch(rng):
    n = int(rng.integers(1, 4))
    qry = rng.integers(0, 25, n)
    qry[rng.integers(0, n)] = max(1, qry.max())  # at least one request with queries
    seq = qry + rng.integers(0, 60, n)
    return seq.tolist(), qry.tolist()


def test_compile_count_bounded_by_buckets():
    """50 varied batches and plans: one compilation per distinct static key, none per batch."""
    W, H, D = 8, 2, 16
    traces0, cache0 = JP.TRACE_COUNT["prefill"], JP._prefill_jit._cache_size()
    keys, exact = set(), set()
    for _ in range(2):  # the second pass over the same batches compiles nothing new
        rng = np.random.default_rng(0)
        for _ in range(50):
            seq, qry = random_batch(rng)
            case = make_case("r", seq, qry, 0, window_size=W, H=H, D=D, seed=int(rng.integers(1 << 30)))
            cfg = dataclasses.replace(case.plan_config(), max_model_len=100, max_num_batched_tokens=25)
            smeta = JP.build_step_metadata(case.batch, config=cfg, compress_ratios=[0], planner=str(rng.choice(POLICIES)),
                                           token_tile=16, gather_tile=16, min_tokens=32)  # fmt: skip
            meta = smeta[0]
            raw = logical(case.raw, rows=256)  # the cache keeps its shape from step to step
            out = JP.prefill_attention(jnp.asarray(smeta.pad_tokens(case.q)), meta, raw, sm_scale=0.25, attn_sink=jnp.asarray(case.sink))
            keys.add(meta.shape)
            exact.add((case.batch.num_tokens, meta.plan.max_workspace_rows))
        compiles = JP._prefill_jit._cache_size() - cache0
        assert JP.TRACE_COUNT["prefill"] - traces0 == compiles <= len(keys)
    assert compiles == len(keys)  # every key compiled once (none was compiled before this test)
    assert len(keys) <= len(exact) / 4, (len(keys), len(exact))  # buckets, not shapes
    close(np.asarray(out)[: case.batch.num_tokens], case.oracle()[0])  # and the last batch is right


def test_runs_inside_user_jit_and_traces_once_per_bucket():
    W, topk = 8, 6
    cases = [make_case(f"j{i}", seq, qry, 4, window_size=W, topk=topk, H=2, D=16, seed=i)
             for i, (seq, qry) in enumerate([([30, 11], [9, 11]), ([50, 7, 20], [5, 7, 8])])]  # fmt: skip
    traces = []

    @jax.jit
    def layer(q, step_meta, raw, comp, topk_rows, sink):  # the whole step's metadata is a pytree too
        traces.append(1)
        return JP.prefill_attention(q, step_meta[4], raw, comp, sm_scale=0.25, attn_sink=sink, topk_indices=topk_rows)

    build = lambda case: JP.build_step_metadata(  # noqa: E731
        P.plan_step(case.batch, case.plan_config(), [4]), index_topk=topk, token_tile=16, gather_tile=16, min_workspace_rows=256
    )  # fmt: skip
    assert build(cases[0])[4].shape == build(cases[1])[4].shape
    for case in cases:
        smeta = build(case)
        raw, comp = caches(case)
        q, topk_rows, sink = (jnp.asarray(x) for x in (smeta.pad_tokens(case.q), smeta.pad_tokens(case.topk_rows), case.sink))
        got = np.asarray(layer(q, smeta, raw, comp, topk_rows, sink))
        eager = JP.prefill_attention(q, smeta[4], raw, comp, sm_scale=0.25, attn_sink=sink, topk_indices=topk_rows)
        np.testing.assert_array_equal(got, np.asarray(eager))
        close(got[: case.batch.num_tokens], case.oracle()[0])
    assert len(traces) == 1  # both batches fall in the same buckets


def test_server_sizes_leave_only_the_token_bucket_static():
    cfg = P.PlanConfig(window_size=128, max_model_len=65536, max_num_batched_tokens=8192)
    rng = np.random.default_rng(2)
    shapes = set()
    for _ in range(30):
        n = int(rng.integers(1, 20))
        qry = rng.integers(0, 400, n)
        seq = qry + rng.integers(0, 60000, n)
        policy = str(rng.choice(POLICIES))
        smeta = JP.build_step_metadata(P.PrefillBatch(seq, qry), config=cfg, planner=policy, index_topk=512, sizes="server")
        for kind, meta in smeta.kinds.items():
            assert meta.shape.workspace_rows == meta.plan.budget_rows >= meta.plan.max_workspace_rows
            shapes.add(dataclasses.replace(meta.shape, padded_tokens=0, token_ladder=()))
    assert len(shapes) == 3  # one per kind, whatever the batch
    # the same bits as per-step buckets (a wider HCA row, a bigger workspace: no difference)
    for ratio in (4, 128):
        case = boundary_cases(ratio)[2]
        ref, _ = run(case)
        out, meta = run(case, meta_kw=dict(FAST, sizes="server", padded_tokens=case.batch.num_tokens))
        assert meta.padded_tokens == case.batch.num_tokens
        np.testing.assert_array_equal(out, ref)


def test_rows_no_chunk_wrote_are_never_read():
    """A NaN-filled workspace: a read of any row the chunk's gathers did not write would show."""
    for ratio in (0, 4, 128):
        case = boundary_cases(ratio)[3]
        step = P.plan_step(case.batch, case.plan_config(policy="fixed"), [ratio])
        smeta = JP.build_step_metadata(step, index_topk=case.topk, **FAST)
        raw, comp = caches(case, paged_kv=True)
        out = JP._prefill_jit(
            jnp.asarray(smeta.pad_tokens(case.q)), smeta[ratio].table, raw, comp,
            jnp.asarray(smeta.pad_tokens(case.topk_rows)) if ratio == 4 else None, jnp.asarray(case.sink),
            shape=smeta[ratio].shape, sm_scale=case.sm_scale, backend="xla", fill=float("nan"),
        )  # fmt: skip
        close(np.asarray(out)[: case.batch.num_tokens], case.oracle()[0])


def test_zero_token_batch_and_unpadded_q():
    case = make_case("none", [40, 9], [0, 0], 128, window_size=8, H=2, D=16)
    step = P.plan_step(case.batch, case.plan_config(), [128])
    meta = JP.build_step_metadata(step)[128]
    assert step[128].num_chunks == 0
    out = JP.prefill_attention(jnp.zeros((0, 2, 16)), meta, *caches(case), sm_scale=0.25)
    assert out.shape == (0, 2, 16)
    # q with exactly T rows (no padding) works too
    case = boundary_cases(0)[1]
    step = P.plan_step(case.batch, case.plan_config(), [0])
    meta = JP.build_step_metadata(step, **FAST)[0]
    raw = [jnp.asarray(x) for x in case.raw]
    out = JP.prefill_attention(jnp.asarray(case.q), meta, raw, sm_scale=case.sm_scale, attn_sink=jnp.asarray(case.sink))
    close(np.asarray(out), case.oracle()[0])


def test_buckets_and_ladders():
    values = sorted({B.bucket(n) for n in range(1, 5000)})
    assert values[:12] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16]
    assert all(B.bucket(v) == v for v in values)
    assert max(B.bucket(n) / n for n in range(1, 5000)) <= 1.25
    assert B.bucket(3, minimum=16) == 16 and B.bucket(100, minimum=16) == 112
    assert B.tile_ladder(256) == (256, 64, 16) and B.tile_ladder(4096, limit=200) == (64, 16)
    for n in range(0, 700):
        counts = B.ladder_counts(n, (256, 64, 16))
        assert counts[1] <= 3 and counts[2] <= 4
        assert n <= B.tiled_items(n, (256, 64, 16)) < n + 16
    with pytest.raises(ValueError, match="power of two"):
        B.tile_ladder(48)


def test_padding_waste_over_random_stream_is_under_2x():
    rng = np.random.default_rng(1)
    cfg = P.PlanConfig(window_size=128, max_model_len=65536, max_num_batched_tokens=8192)
    totals = {}
    for _ in range(60):
        n = int(rng.integers(1, 24))
        qry = np.exp(rng.uniform(0, np.log(2048), n)).astype(int)
        qry[rng.random(n) < 0.1] = 0
        qry = (qry * min(1.0, 8192 / max(1, qry.sum()))).astype(int)
        seq = qry + np.exp(rng.uniform(0, np.log(60000), n)).astype(int)
        policy = str(rng.choice(POLICIES))
        smeta = JP.build_step_metadata(P.PrefillBatch(seq, qry), config=cfg, planner=policy, index_topk=512)
        for kind, meta in smeta.kinds.items():
            for k, v in meta.padding().items():
                totals[k] = totals.get(k, 0) + v
    assert totals["padded_tokens"] / totals["tokens"] < 1.25
    assert totals["attended_tokens"] / totals["tokens"] < 2
    assert totals["gathered_rows"] / totals["rows"] < 2
    assert totals["workspace_rows"] / totals["max_chunk_rows"] < 1.25


def test_bad_inputs():
    case = boundary_cases(4)[0]
    step = P.plan_step(case.batch, case.plan_config(), [4])
    meta = JP.build_step_metadata(step, index_topk=case.topk, **FAST)[4]
    q = jnp.asarray(case.q)
    raw = [jnp.asarray(x) for x in case.raw]
    comp = [jnp.asarray(x) for x in case.comp]
    rows = case.topk_rows
    call = lambda **kw: JP.prefill_attention(**{**dict(q=q, meta=meta, raw_kv=raw, compressed_kv=comp,  # noqa: E731
                                                     sm_scale=0.1, topk_indices=rows), **kw})  # fmt: skip
    with pytest.raises(ValueError, match="q: 3 tokens"):
        call(q=q[:3])
    with pytest.raises(TypeError, match="q: expected a jax.Array"):
        call(q=case.q.tolist())
    with pytest.raises(TypeError, match="meta"):
        call(meta=step[4])
    with pytest.raises(ValueError, match="topk_indices"):
        call(topk_indices=None)
    with pytest.raises(TypeError, match="topk_indices: expected int32"):
        call(topk_indices=rows.astype(np.float32))
    with pytest.raises(ValueError, match="compressed_kv: required"):
        call(compressed_kv=None)
    with pytest.raises(TypeError, match="raw_kv: dtype"):
        call(raw_kv=[x.astype(jnp.bfloat16) for x in raw])
    with pytest.raises(ValueError, match=r"raw_kv\[4\]: 20 rows"):
        call(raw_kv=raw[:4] + [raw[4][:20]])
    with pytest.raises(ValueError, match="raw_kv: 4 per-request"):
        call(raw_kv=raw[:4])
    with pytest.raises(TypeError, match="compressed_kv: expected a PagedKV"):
        call(compressed_kv="cache")
    with pytest.raises(TypeError, match="sm_scale"):
        call(sm_scale="0.1")
    with pytest.raises(ValueError, match="attn_sink"):
        call(attn_sink=jnp.zeros(3))
    with pytest.raises(ValueError, match="backend"):
        call(backend="cuda")
    short = JP.PagedKV(jnp.zeros((4, 4, 32)), jnp.zeros((5, 2), jnp.int32))
    with pytest.raises(ValueError, match="raw_kv: block_table covers 8 entries"):
        call(raw_kv=short)
    future = rows.copy()
    future[-1, 0] = 10_000
    with pytest.raises(ValueError, match="topk_indices: row"):
        call(topk_indices=future)
    with pytest.raises(ValueError, match="index_topk"):
        JP.build_step_metadata(step)
    with pytest.raises(ValueError, match="config"):
        JP.build_step_metadata(case.batch)
    with pytest.raises(ValueError, match="planner"):
        JP.build_step_metadata(step, planner="fixed", index_topk=6)
    with pytest.raises(ValueError, match="sizes"):
        JP.build_step_metadata(step, index_topk=6, sizes="exact")
    with pytest.raises(ValueError, match="padded_tokens"):
        JP.build_step_metadata(step, index_topk=6, padded_tokens=10)
    with pytest.raises(ValueError, match="token_tile"):
        JP.build_step_metadata(step, index_topk=6, token_tile=100)
    with pytest.raises(ValueError, match="chunk"):
        JP.build_indices(meta, 7, rows)
    with pytest.raises(ValueError, match="block_table"):
        JP.PagedKV(jnp.zeros((2, 4, 8)), jnp.zeros(3, jnp.int32))
    with pytest.raises(TypeError, match="block_table: expected int32"):
        JP.PagedKV(jnp.zeros((2, 4, 8)), np.zeros((3, 2), np.int64))
    # inside a trace the host plan is gone: building indices needs it
    with pytest.raises(ValueError, match="meta: build_indices needs the host plan"):
        jax.jit(lambda m: JP.build_indices(m, 0, rows)[0])(meta)


def test_prefill_lowers_for_cuda_with_the_triton_kernel(monkeypatch):
    """The whole layer call (loops, gathers, one Triton kernel per token tile size) lowers for
    CUDA with V4-Flash's CSA configuration, on a machine without a GPU."""
    monkeypatch.setattr(dsv4_jax.attention, "_pallas_triton_unavailable", lambda: None)
    H, D, topk, W = 64, 512, 512, 128
    batch = P.PrefillBatch([5000, 300], [300, 300])
    cfg = P.PlanConfig(window_size=W, max_model_len=8192, max_num_batched_tokens=512)
    meta = JP.build_step_metadata(batch, config=cfg, compress_ratios=[4], index_topk=topk)[4]
    assert meta.shape.token_ladder == (256, 64, 16)

    def layer(q, meta, raw_pages, comp_pages, block_table, comp_table, topk_rows, sink):
        raw, comp = JP.PagedKV(raw_pages, block_table), JP.PagedKV(comp_pages, comp_table)
        return JP.prefill_attention(q, meta, raw, comp, sm_scale=D**-0.5, attn_sink=sink, topk_indices=topk_rows,
                                    backend="pallas_triton")  # fmt: skip

    T = meta.padded_tokens
    args = (jax.ShapeDtypeStruct((T, H, D), jnp.bfloat16), meta,
            jax.ShapeDtypeStruct((1024, 64, D), jnp.bfloat16), jax.ShapeDtypeStruct((1024, 16, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((8, 128), jnp.int32), jax.ShapeDtypeStruct((8, 128), jnp.int32),
            jax.ShapeDtypeStruct((T, topk), jnp.int32), jax.ShapeDtypeStruct((H,), jnp.float32))  # fmt: skip
    text = lower_for_cuda(layer, *args).as_text()
    calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    token_grids = [max(int(g) for g in re.findall(r"grid_[xyz] = (\d+)", call)) for call in calls]
    assert sorted(token_grids) == [16, 64, 256], token_grids  # one kernel per token tile size
