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

import dsv4_jax.attention
import planner as P
from dsv4_jax import prefill as JP
from planner import sizes as B
from tests.cases import PrefillCase, boundary_cases, make_case
from tools.aot import lower_for_cuda

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
        return paged(case, "raw", dtype, 1), (paged(case, "comp", dtype, 2) if case.kind.has_compressed else None)
    return logical(case.raw, dtype), (logical(case.comp, dtype) if case.kind.has_compressed else None)


def run(
    case, *, policy="adaptive", paged_kv=False, dtype=np.float32, backend="xla", interpret=False, meta_kw=FAST, **cfg
):
    step = P.plan_step(case.batch, case.plan_config(policy=policy, **cfg), [case.layer])
    smeta = JP.build_step_metadata(step, index_topk=case.topk, **meta_kw)
    meta = smeta[case.kind]
    raw, comp = caches(case, paged_kv=paged_kv, dtype=dtype)
    q = jnp.asarray(smeta.pad_tokens(case.q).astype(dtype))
    out = JP.prefill_attention(
        q,
        meta,
        raw,
        comp,
        sm_scale=case.sm_scale,
        attn_sink=jnp.asarray(case.sink),
        topk_indices=smeta.pad_tokens(case.topk_rows) if case.kind is P.LayerKind.CSA else None,
        backend=backend,
        interpret=interpret,
    )
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
        tight = max(s // ratio if case.kind.has_compressed else 0 for s in case.seq_lens) + case.window_size + 4
        for kw in (dict(order="length"), dict(budget_rows=tight), dict(paged_kv=True)):
            out, _ = run(case, **kw)
            np.testing.assert_array_equal(out, outs["adaptive"], err_msg=f"{case.name} {kw}")


@pytest.mark.parametrize("kind, ratio", [("CSA", 8), ("HCA", 32)])
def test_other_ratios_match_oracle_and_are_chunk_invariant(kind, ratio):
    """A kind and a ratio vary apart: a small test model's CSA 8 / HCA 32 (ratio 1: tests/torch/test_prefill.py)."""
    for case in boundary_cases(ratio, kind=kind)[1:2]:  # queries at r - 1, r, W - 1, W (one case: compiles)
        assert case.layer == P.LayerSpec(kind, ratio)
        want, _, _ = case.oracle()
        outs = [run(case, policy=p)[0] for p in POLICIES] + [run(case, paged_kv=True)[0]]
        close(outs[0], want)
        for o in outs[1:]:
            np.testing.assert_array_equal(o, outs[0], err_msg=case.name)


def test_tile_ladders_and_default_buckets_are_bitwise_equal():
    """Multi-rung ladders with masked tails, default buckets, another program: the same bits."""
    case = make_case("ladder", [150, 40, 517], [90, 40, 13], 4, window_size=8, topk=6, H=2, D=16, seed=9)
    want, _, _ = case.oracle()
    ref, _ = run(case)  # 16-token and 16-row tiles only
    close(ref, want)
    for policy in ("adaptive", "per_request"):
        out, meta = run(case, policy=policy, meta_kw=dict(token_tile=64, gather_tile=64), paged_kv=True)
        assert meta.shape.token_ladder == (64, 16) and meta.shape.gather_ladder == (64, 16)
        assert meta.shape.padded_tokens == 160  # the default buckets: 1.25x tokens, power-of-two rows
        assert meta.shape.workspace_rows == B.pow2_bucket(meta.plan.max_workspace_rows, JP.MIN_WORKSPACE_ROWS) < 2048
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


def test_triton_interpreted_small_case():
    case = make_case("triton", [9, 20], [3, 5], 4, window_size=8, topk=6, H=2, D=16, seed=7)
    want, _, _ = case.oracle()
    out, meta = run(case, backend="triton", interpret=True, meta_kw=dict(token_tile=16, gather_tile=16))
    assert meta.last_backend == "triton"
    close(out, want)


def test_device_indices_equal_numpy_builder():
    for ratio in (0, 4, 128):
        case = boundary_cases(ratio)[2]
        tight = max(s // ratio if case.kind.has_compressed else 0 for s in case.seq_lens) + case.window_size + 4
        rows = case.topk_rows if case.kind is P.LayerKind.CSA else None
        for policy, extra in [(p, {}) for p in POLICIES] + [("adaptive", dict(budget_rows=tight))]:
            step = P.plan_step(case.batch, case.plan_config(policy=policy, order="length", **extra), [case.layer])
            meta = JP.build_step_metadata(step, index_topk=case.topk, **FAST)[case.kind]
            kp = step[case.kind]
            assert kp.num_chunks > 1 or policy in ("adaptive", "fixed")
            for c in range(kp.num_chunks):
                want_idx, want_len = P.build_chunk_indices(kp, c, rows, width=meta.index_width)
                idx, length = JP.build_indices(meta, c, rows)
                np.testing.assert_array_equal(np.asarray(idx), want_idx)
                np.testing.assert_array_equal(np.asarray(length), want_len)


@pytest.mark.parametrize("paged_kv", [False, True])
def test_device_gathers_equal_numpy_workspace(paged_kv):
    for ratio in (4, 128):
        case = boundary_cases(ratio)[3]  # with query_len == 0 requests
        step = P.plan_step(case.batch, case.plan_config(policy="fixed"), [case.layer])
        meta = JP.build_step_metadata(step, index_topk=case.topk, token_tile=16, gather_tile=64)[case.kind]
        raw, comp = caches(case, paged_kv=paged_kv)
        for c in range(step[case.kind].num_chunks):
            want = P.gather_workspace(step[case.kind], c, case.raw, case.comp, fill=np.nan)
            got = np.asarray(JP.gather_workspace(meta, c, raw, comp))
            written = ~np.isnan(want[:, 0])
            np.testing.assert_array_equal(got[: want.shape[0]][written], want[written])
            assert not got[: want.shape[0]][~written].any() and not got[want.shape[0] :].any()  # nothing else written


def random_topk_rows(rng, positions, topk):
    """Valid CSA top-k rows: distinct visible entries (first min((p+1)//4, topk)), -1 after."""
    rows = np.full((len(positions), topk), -1, np.int32)
    for t, p in enumerate(positions.tolist()):
        k = min((p + 1) // 4, topk)
        rows[t, :k] = rng.choice((p + 1) // 4, size=k, replace=False)
    return rows


def test_compile_count_bounded_by_buckets():
    """50 random batches, each through an SWA, a CSA (top-k) and an HCA layer call, contexts of
    6k..48k tokens: the token, workspace-row and HCA-width buckets all vary. Compilations (jit
    cache misses) stay <= the buckets touched, computed here from the planner's own numbers with
    the public bucket functions (never from the metadata the jit keys on), and the buckets
    touched are far fewer than the exact shapes. Padding waste of each size stays under 2x."""
    W, H, D, topk, max_requests = 8, 2, 16, 8, 2
    min_tokens, min_rows, max_len = 32, 512, 48_018
    rng = np.random.default_rng(0)
    # One cache bank per kind, request i at rows i * max_len // r: its shape never changes, so
    # only the buckets can make a new program.
    banks = {r: rng.standard_normal((max_requests * (max_len // max(r, 1)), D)).astype(np.float32) for r in (0, 4, 128)}
    kv = {
        r: JP.LogicalKV(jnp.asarray(b), np.arange(max_requests, dtype=np.int32) * (max_len // max(r, 1)))
        for r, b in banks.items()
    }
    sink = rng.standard_normal(H).astype(np.float32)
    touched, exact, waste = set(), set(), {}

    def count(name, real, padded):
        w = waste.setdefault(name, [0, 0])
        w[0], w[1] = w[0] + real, w[1] + padded

    traces0, cache0 = JP.TRACE_COUNT["prefill"], JP._prefill_jit._cache_size()
    for i in range(50):
        n = int(rng.integers(1, max_requests + 1))
        qry = rng.integers(12, 19, n)
        seq = qry + np.exp(rng.uniform(np.log(6000), np.log(48_000), n)).astype(int)
        batch = P.PrefillBatch(seq, qry)
        cfg = P.PlanConfig(
            window_size=W, max_model_len=max_len, max_num_batched_tokens=18, policy=str(rng.choice(POLICIES))
        )
        step = P.plan_step(batch, cfg, P.V4_LAYERS)
        smeta = JP.build_step_metadata(
            step, index_topk=topk, token_tile=16, gather_tile=64, min_tokens=min_tokens, min_workspace_rows=min_rows
        )
        T = batch.num_tokens
        q = rng.standard_normal((T, H, D)).astype(np.float32)
        rows = random_topk_rows(rng, batch.token_position, topk)
        token_bucket = B.bucket(T, min_tokens)
        count("tokens", T, token_bucket)
        for kind, kp in step.kinds.items():  # the static sizes, from the planner's numbers
            width = P.index_width(kp, topk if kind is P.LayerKind.CSA else None)
            width_bucket = B.pow2_bucket(width // 128) * 128 if kind is P.LayerKind.HCA else width
            rows_bucket = B.pow2_bucket(kp.max_workspace_rows, min_rows)
            touched.add((kind, token_bucket, rows_bucket, width_bucket))
            exact.add((kind, T, kp.max_workspace_rows, width))
            count("workspace rows", kp.max_workspace_rows, rows_bucket)
            if kind is P.LayerKind.HCA:
                count("HCA index width", width, width_bucket)
            r = kp.compress_ratio  # 0 for SWA
            out = JP.prefill_attention(
                jnp.asarray(smeta.pad_tokens(q)),
                smeta[kind],
                kv[0],
                kv[r] if r else None,
                sm_scale=D**-0.5,
                attn_sink=jnp.asarray(sink),
                topk_indices=jnp.asarray(smeta.pad_tokens(rows)) if kind is P.LayerKind.CSA else None,
                backend="xla",
            )
            if i % 10 == 9:  # and the results are right
                per = max_len // max(r, 1)
                case = PrefillCase(
                    "r",
                    seq.tolist(),
                    qry.tolist(),
                    r,
                    W,
                    topk,
                    q,
                    [banks[0][j * max_len : j * max_len + s] for j, s in enumerate(seq)],
                    [banks[r][j * per : j * per + s // r] for j, s in enumerate(seq)] if r else [],
                    rows,
                    sink,
                    kind=kind,
                )
                close(np.asarray(out)[:T], case.oracle()[0])
    compiles = JP._prefill_jit._cache_size() - cache0
    assert JP.TRACE_COUNT["prefill"] - traces0 == compiles <= len(touched)
    assert len(touched) <= len(exact) / 4, (len(touched), len(exact))  # buckets, not shapes
    # every bucketed size took several buckets (SWA's workspace follows its few tokens)
    assert len({t[1] for t in touched}) > 1
    assert all(len({t[2] for t in touched if t[0] is kind}) > 1 for kind in (P.LayerKind.CSA, P.LayerKind.HCA))
    assert len({t[3] for t in touched if t[0] is P.LayerKind.HCA}) > 1
    ratios = {name: padded / real for name, (real, padded) in waste.items()}
    print(
        f"\n{compiles} compilations, {len(touched)} buckets touched, {len(exact)} exact shapes; padding waste "
        + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
    )
    assert all(v < 2 for v in ratios.values()), ratios


def test_runs_inside_user_jit_and_traces_once_per_bucket():
    W, topk = 8, 6
    cases = [
        make_case(f"j{i}", seq, qry, 4, window_size=W, topk=topk, H=2, D=16, seed=i)
        for i, (seq, qry) in enumerate([([30, 11], [9, 11]), ([50, 7, 20], [5, 7, 8])])
    ]
    traces = []

    @jax.jit
    def layer(q, step_meta, raw, comp, topk_rows, sink):  # the whole step's metadata is a pytree too
        traces.append(1)
        return JP.prefill_attention(
            q, step_meta["CSA"], raw, comp, sm_scale=0.25, attn_sink=sink, topk_indices=topk_rows
        )

    build = lambda case: JP.build_step_metadata(  # noqa: E731
        P.plan_step(case.batch, case.plan_config(), [case.layer]),
        index_topk=topk,
        token_tile=16,
        gather_tile=16,
        min_workspace_rows=256,
    )
    assert build(cases[0])["CSA"].shape == build(cases[1])["CSA"].shape
    for case in cases:
        smeta = build(case)
        raw, comp = caches(case)
        q, topk_rows, sink = (
            jnp.asarray(x) for x in (smeta.pad_tokens(case.q), smeta.pad_tokens(case.topk_rows), case.sink)
        )
        got = np.asarray(layer(q, smeta, raw, comp, topk_rows, sink))
        eager = JP.prefill_attention(q, smeta["CSA"], raw, comp, sm_scale=0.25, attn_sink=sink, topk_indices=topk_rows)
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
        smeta = JP.build_step_metadata(
            P.PrefillBatch(seq, qry), config=cfg, policy=policy, index_topk=512, sizes="server"
        )
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
        step = P.plan_step(case.batch, case.plan_config(policy="fixed"), [case.layer])
        smeta = JP.build_step_metadata(step, index_topk=case.topk, **FAST)
        raw, comp = caches(case, paged_kv=True)
        out = JP._prefill_jit(
            jnp.asarray(smeta.pad_tokens(case.q)),
            smeta[case.kind].table,
            raw,
            comp,
            jnp.asarray(smeta.pad_tokens(case.topk_rows)) if case.kind is P.LayerKind.CSA else None,
            jnp.asarray(case.sink),
            shape=smeta[case.kind].shape,
            sm_scale=case.sm_scale,
            backend="xla",
            fill=float("nan"),
        )
        close(np.asarray(out)[: case.batch.num_tokens], case.oracle()[0])


def test_zero_token_batch_and_unpadded_q():
    case = make_case("none", [40, 9], [0, 0], 128, window_size=8, H=2, D=16)
    step = P.plan_step(case.batch, case.plan_config(), [case.layer])
    meta = JP.build_step_metadata(step)[case.kind]
    assert step[P.LayerKind.HCA].num_chunks == 0
    out = JP.prefill_attention(jnp.zeros((0, 2, 16)), meta, *caches(case), sm_scale=0.25)
    assert out.shape == (0, 2, 16)
    # q with exactly T rows (no padding) works too
    case = boundary_cases(0)[1]
    step = P.plan_step(case.batch, case.plan_config(), [case.layer])
    meta = JP.build_step_metadata(step, **FAST)[case.kind]
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
    assert [B.pow2_bucket(n) for n in (0, 1, 2, 3, 4, 5, 1000, 1024, 1025)] == [1, 1, 2, 4, 4, 8, 1024, 1024, 2048]
    assert B.pow2_bucket(3, minimum=128) == 128 and B.pow2_bucket(129, minimum=128) == 256
    assert max(B.pow2_bucket(n) / n for n in range(2, 5000)) < 2


def test_padding_waste_over_random_stream_is_under_2x():
    """Default sizes (powers of two for workspace rows and HCA width) vs "fine" (1.25x buckets):
    both waste under 2x; the default takes far fewer (workspace rows, width) sizes, the part of
    the compile key it decides (a program per token bucket x those)."""
    cfg = P.PlanConfig(window_size=128, max_model_len=65536, max_num_batched_tokens=8192)
    totals, keys = {}, {}
    for sizes in ("bucket", "fine"):
        rng = np.random.default_rng(1)
        totals[sizes], keys[sizes] = {}, set()
        for _ in range(60):
            n = int(rng.integers(1, 24))
            qry = np.exp(rng.uniform(0, np.log(2048), n)).astype(int)
            qry[rng.random(n) < 0.1] = 0
            qry = (qry * min(1.0, 8192 / max(1, qry.sum()))).astype(int)
            seq = qry + np.exp(rng.uniform(0, np.log(60000), n)).astype(int)
            policy = str(rng.choice(POLICIES))
            smeta = JP.build_step_metadata(
                P.PrefillBatch(seq, qry), config=cfg, policy=policy, index_topk=512, sizes=sizes
            )
            for kind, meta in smeta.kinds.items():
                keys[sizes].add((kind, meta.shape.workspace_rows, meta.shape.index_width))
                for k, v in meta.padding().items():
                    totals[sizes][k] = totals[sizes].get(k, 0) + v
                s = meta.shape
                if sizes == "bucket":  # powers of two, each under 2x its step's need (above the minimum)
                    assert s.workspace_rows == B.pow2_bucket(meta.plan.max_workspace_rows, JP.MIN_WORKSPACE_ROWS)
                    assert s.index_width == (
                        B.pow2_bucket(P.index_width(meta.plan) // 128) * 128
                        if kind is P.LayerKind.HCA
                        else P.index_width(meta.plan, 512 if kind is P.LayerKind.CSA else None)
                    )
        t = totals[sizes]
        assert t["padded_tokens"] / t["tokens"] < 1.25
        assert t["attended_tokens"] / t["tokens"] < 2
        assert t["gathered_rows"] / t["rows"] < 2
        assert t["workspace_rows"] / t["max_chunk_rows"] < (2 if sizes == "bucket" else 1.25)
        assert t["index_width"] / t["needed_width"] < (2 if sizes == "bucket" else 1.25)
    assert len(keys["bucket"]) < 0.5 * len(keys["fine"]), {k: len(v) for k, v in keys.items()}


def test_bad_inputs():
    case = boundary_cases(4)[0]
    step = P.plan_step(case.batch, case.plan_config(), [case.layer])
    meta = JP.build_step_metadata(step, index_topk=case.topk, **FAST)[case.kind]
    q = jnp.asarray(case.q)
    raw = [jnp.asarray(x) for x in case.raw]
    comp = [jnp.asarray(x) for x in case.comp]
    rows = case.topk_rows
    call = lambda **kw: JP.prefill_attention(
        **{
            **dict(
                q=q,
                meta=meta,
                raw_kv=raw,
                compressed_kv=comp,  # noqa: E731
                sm_scale=0.1,
                topk_indices=rows,
            ),
            **kw,
        }
    )
    with pytest.raises(ValueError, match="q: 3 tokens"):
        call(q=q[:3])
    with pytest.raises(TypeError, match="q: expected a jax.Array"):
        call(q=case.q.tolist())
    with pytest.raises(TypeError, match="meta"):
        call(meta=step[case.kind])
    with pytest.raises(ValueError, match="topk_indices"):
        call(topk_indices=None)
    for dtype in (np.float32, np.int64, np.uint32, np.int16):  # never a silent cast
        with pytest.raises(TypeError, match=f"topk_indices: expected int32, got {np.dtype(dtype).name}"):
            call(topk_indices=rows.astype(dtype))
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
    with pytest.raises(
        ValueError, match="raw_kv: block_table covers 8 entries per request .2 pages of 4., but request 4 needs 21"
    ):
        call(raw_kv=short)
    future = rows.copy()
    future[-1, 0] = 10_000
    with pytest.raises(ValueError, match="topk_indices: row"):
        call(topk_indices=future)
    with pytest.raises(ValueError, match="index_topk"):
        JP.build_step_metadata(step)
    with pytest.raises(ValueError, match="config"):
        JP.build_step_metadata(case.batch)
    with pytest.raises(ValueError, match="policy"):
        JP.build_step_metadata(step, policy="fixed", index_topk=6)
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


def test_bad_caches_raise_naming_the_argument():
    """Caches that do not hold what the step reads: a ValueError on the host, never a silently
    wrong output (JAX gathers clamp out-of-range rows) or a bare IndexError."""
    case = boundary_cases(4)[0]  # seq_lens [3, 7, 8, 9, 21], D = 32; compressed lens [0, 1, 2, 2, 5]
    step = P.plan_step(case.batch, case.plan_config(), [case.layer])
    meta = JP.build_step_metadata(step, index_topk=case.topk, **FAST)[case.kind]
    q, rows, D = jnp.asarray(case.q), jnp.asarray(case.topk_rows), case.q.shape[2]
    raw, comp = list(case.raw), list(case.comp)
    call = lambda raw_kv=raw, compressed_kv=comp: JP.prefill_attention(  # noqa: E731
        q, meta, raw_kv, compressed_kv, sm_scale=case.sm_scale, attn_sink=jnp.asarray(case.sink), topk_indices=rows
    )
    want = case.oracle()[0]
    extra = np.zeros((1, D), np.float32)
    # request 0 one row short, the last one row long: the total is right, the split is not
    shifted = [raw[0][:-1], *raw[1:-1], np.concatenate([raw[-1], extra])]
    with pytest.raises(ValueError, match=r"raw_kv\[0\]: 2 rows, but request 0 needs 3"):
        call(raw_kv=shifted)
    with pytest.raises(ValueError, match="raw_kv: request 0 has 2 rows, but needs 3"):
        call(raw_kv=JP.LogicalKV.from_list(shifted))
    comp_shifted = [comp[0], comp[1][:-1], *comp[2:-1], np.concatenate([comp[-1], extra])]
    with pytest.raises(ValueError, match=r"compressed_kv\[1\]: 0 rows, but request 1 needs 1"):
        call(compressed_kv=comp_shifted)
    with pytest.raises(ValueError, match="compressed_kv: request 1 has 0 rows, but needs 1"):
        call(compressed_kv=JP.LogicalKV.from_list(comp_shifted))
    # packed rows with host offsets: a request past the end of rows
    packed = np.concatenate(raw)  # 48 rows
    offsets = np.array([0, 3, 10, 18, 28], np.int32)  # the last should start at 27
    with pytest.raises(ValueError, match="raw_kv: request 4 at offset 28 needs rows up to 49, but rows has 48"):
        call(raw_kv=JP.LogicalKV(jnp.asarray(packed), offsets))
    with pytest.raises(ValueError, match="raw_kv: 3 offsets, but the batch has 5 requests"):
        call(raw_kv=JP.LogicalKV(jnp.asarray(packed), offsets[:3]))
    # wrong last dim: per-request, packed, paged
    with pytest.raises(ValueError, match=rf"raw_kv\[2\]: last dim {D + 1} differs from q's head dim {D}"):
        call(raw_kv=[*raw[:2], np.zeros((8, D + 1), np.float32), *raw[3:]])
    with pytest.raises(ValueError, match=r"arrays\[1\]: last dim 16 differs from arrays\[0\]'s 32"):
        JP.LogicalKV.from_list([raw[0], np.zeros((7, 16), np.float32)])
    pages, table = case.paged("raw")
    with pytest.raises(ValueError, match=f"raw_kv: last dim 16 differs from q's head dim {D}"):
        call(raw_kv=JP.PagedKV(jnp.asarray(pages[..., :16]), table))
    # block tables: too few rows, too narrow (in test_bad_inputs), a page id out of the pages
    with pytest.raises(ValueError, match="raw_kv: 3 block_table rows, but the batch has 5 requests"):
        call(raw_kv=JP.PagedKV(jnp.asarray(pages), table[:3]))
    for bad in (pages.shape[0], -1):
        wrong = table.copy()
        wrong[2, 0] = bad
        with pytest.raises(
            ValueError, match=rf"raw_kv: block_table\[2\] lists page {bad}, outside 0..{pages.shape[0] - 1}"
        ):
            call(raw_kv=JP.PagedKV(jnp.asarray(pages), wrong))
    # the right caches in every form pass the checks and give the oracle's answer
    cpages, ctable = case.paged("comp")
    for r, c in (
        (raw, comp),
        (JP.LogicalKV.from_list(raw), JP.LogicalKV.from_list(comp)),
        (JP.LogicalKV(jnp.asarray(packed), offsets - (offsets == 28)), JP.LogicalKV.from_list(comp)),
        (JP.PagedKV(jnp.asarray(pages), table), JP.PagedKV(jnp.asarray(cpages), ctable)),
    ):
        close(np.asarray(call(r, c)), want)


def test_last_backend_outside_and_inside_a_user_jit():
    """Outside jax.jit the caller's metadata records the backend; inside a user's jit the call
    sees a copy JAX rebuilt, so `resolve_backend` is the way to know (it is what the call asks)."""
    case = boundary_cases(0)[0]
    step = P.plan_step(case.batch, case.plan_config(), [case.layer])
    raw, sink = logical(case.raw), jnp.asarray(case.sink)
    meta = JP.build_step_metadata(step, **FAST)[case.kind]
    q = jnp.asarray(JP.build_step_metadata(step, **FAST).pad_tokens(case.q))
    eager = JP.prefill_attention(q, meta, raw, sm_scale=0.25, attn_sink=sink)
    on_cpu = "cpu" if dsv4_jax.available_backends()["cpu"] is None else "xla"  # the C kernel where it builds
    assert meta.last_backend == dsv4_jax.resolve_backend("auto") == on_cpu
    seen = []

    @jax.jit
    def layer(q, meta):
        out = JP.prefill_attention(q, meta, raw, sm_scale=0.25, attn_sink=sink)
        seen.append(meta.last_backend)  # the traced copy's
        return out

    fresh = JP.build_step_metadata(step, **FAST)[case.kind]
    np.testing.assert_array_equal(np.asarray(layer(q, fresh)), np.asarray(eager))
    assert seen == [on_cpu] and fresh.last_backend is None


def test_prefill_lowers_for_cuda_with_the_triton_kernel(fake_gpu):
    """The whole layer call (loops, gathers, one Triton kernel per token tile size) lowers for
    CUDA with V4-Flash's CSA configuration, on a machine without a GPU."""
    H, D, topk, W = 64, 512, 512, 128
    batch = P.PrefillBatch([5000, 300], [300, 300])
    cfg = P.PlanConfig(window_size=W, max_model_len=8192, max_num_batched_tokens=512)
    meta = JP.build_step_metadata(batch, config=cfg, layers={"CSA": 4}, index_topk=topk)["CSA"]
    assert meta.shape.token_ladder == (256, 64, 16)

    def layer(q, meta, raw_pages, comp_pages, block_table, comp_table, topk_rows, sink):
        raw, comp = JP.PagedKV(raw_pages, block_table), JP.PagedKV(comp_pages, comp_table)
        return JP.prefill_attention(
            q, meta, raw, comp, sm_scale=D**-0.5, attn_sink=sink, topk_indices=topk_rows, backend="triton"
        )

    T = meta.padded_tokens
    args = (
        jax.ShapeDtypeStruct((T, H, D), jnp.bfloat16),
        meta,
        jax.ShapeDtypeStruct((1024, 64, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((1024, 16, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((8, 128), jnp.int32),
        jax.ShapeDtypeStruct((8, 128), jnp.int32),
        jax.ShapeDtypeStruct((T, topk), jnp.int32),
        jax.ShapeDtypeStruct((H,), jnp.float32),
    )
    text = lower_for_cuda(layer, *args).as_text()
    calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    token_grids = [max(int(g) for g in re.findall(r"grid_[xyz] = (\d+)", call)) for call in calls]
    assert sorted(token_grids) == [16, 64, 256], token_grids  # one kernel per token tile size
