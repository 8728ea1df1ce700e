"""DeepSeek-V4.1 layers through dsv4_jax's public prefill (the twin of
tests/torch/test_prefill_v41.py): `build_step_metadata` of a V4.1 step (metadata once per PlanKey,
`for_layer`, a pytree), every layer of the tiny schedule (ratios 0 / 2 / 1, the cut and replay
bands, shared caches, -1 picks, prefix hits) equal to the float64 oracle on "xla" and the fused
"cpu", equal to torch ("cpu": bit for bit, the same C kernel); 528-byte mxfp8 pages; bad input
refused by name. Shapes are bucketed so that the cases share compiled programs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import planner as P
from dsv4_jax import prefill as JP
from dsv4_torch import prefill as TP
from tests import v41_record_cases as R
from tests.v41_prefill_cases import TINY, paged, v41_case, v41_cases

CASES = {c.name: c for c in v41_cases()}
BACKENDS = ("xla", "cpu")
META = dict(token_tile=16, gather_tile=64, min_tokens=64, min_workspace_rows=1024)


def sources(case, st, i, layout):
    _, raw, comp, _ = case.layer_inputs(i, st)
    if layout == "paged":
        r = TINY[i].compress_ratio
        raw_src = JP.PagedKV(*map(jnp.asarray, paged(raw, 8, seed=i)))
        comp_src = None if comp is None else JP.PagedKV(*map(jnp.asarray, paged(comp, 8 // r, seed=10 + i)))
        return raw_src, comp_src
    return [jnp.asarray(x) for x in raw], None if comp is None else [jnp.asarray(x) for x in comp]


def run_layer(case, meta, st, i, backend, srcs, pad=True):
    q, _, _, topk = case.layer_inputs(i, st)
    m = meta.for_layer(i)
    T = q.shape[0]
    if pad:
        q = meta.pad_tokens(q)
        topk = None if topk is None else meta.pad_tokens(topk)
    out = JP.prefill_attention(
        jnp.asarray(q),
        m,
        *srcs,
        sm_scale=case.sm_scale,
        attn_sink=jnp.asarray(case.sink[i]),
        topk_indices=None if topk is None else jnp.asarray(topk),
        backend=backend,
    )
    assert m.last_backend == backend
    out = np.asarray(out)
    assert not out[T:].any()  # padding rows are 0
    return out[:T]


def torch_layer(case, st, tmeta, i, backend):
    q, raw, comp, topk = case.layer_inputs(i, st)
    t = torch.from_numpy
    return TP.prefill_attention(
        t(q),
        tmeta.for_layer(i),
        [t(x) for x in raw],
        None if comp is None else [t(x) for x in comp],
        sm_scale=case.sm_scale,
        attn_sink=t(case.sink[i]),
        topk_indices=None if topk is None else t(topk),
        backend=backend,
    ).numpy()


@pytest.mark.parametrize("name", list(CASES))
def test_every_layer_equals_the_oracle_and_torch(name):
    case = CASES[name]
    st = case.step()
    meta = JP.build_step_metadata(st, index_topk=case.index_topk, **META)
    tmeta = TP.build_step_metadata(st, index_topk=case.index_topk)
    assert set(meta.plans) == set(st.plans)
    for i in range(len(TINY)):
        key = st.layer_keys[i]
        assert meta.for_layer(i) is meta[key] and meta[key].plan.key == key
        _, want, _ = case.oracle(i)
        scale = np.abs(want).max()
        layouts = ("list", "paged") if name == "prefix-hit-replay" else ("list",)
        for backend in BACKENDS:
            got = [run_layer(case, meta, st, i, backend, sources(case, st, i, lay)) for lay in layouts]
            np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=2e-6 * scale, err_msg=f"{name} {i} {backend}")
            assert all(np.array_equal(got[0], g) for g in got[1:]), (name, i, backend)
            ref = torch_layer(case, st, tmeta, i, "cpu" if backend == "cpu" else "reference")
            if backend == "cpu":  # the same C kernel on the same bits
                assert np.array_equal(got[0], ref), (name, i)
            else:
                np.testing.assert_allclose(got[0], ref, rtol=1e-5, atol=1e-6 * scale)


def test_metadata_is_a_pytree_and_runs_under_jit():
    case = CASES["fresh-replay"]
    st = case.step()
    meta = JP.build_step_metadata(st, index_topk=case.index_topk, **META)
    leaves, tree = jax.tree_util.tree_flatten(meta)
    assert len(leaves) == st.num_plans == 4
    back = jax.tree_util.tree_unflatten(tree, leaves)
    assert set(back.plans) == set(meta.plans) and back["SWA"] is back.plans[P.PlanKey(("SWA", 0))]
    i = 5  # a replay-band reindex layer
    q, raw, comp, topk = case.layer_inputs(i, st)
    key = st.layer_keys[i]

    @jax.jit
    def f(m, q, raw, comp, topk):
        return JP.prefill_attention(q, m[key], raw, comp, sm_scale=case.sm_scale, topk_indices=topk, backend="xla")

    out = f(
        meta,
        jnp.asarray(meta.pad_tokens(q)),
        JP.LogicalKV.from_list([jnp.asarray(x) for x in raw]),
        JP.LogicalKV.from_list([jnp.asarray(x) for x in comp]),
        jnp.asarray(meta.pad_tokens(topk)),
    )
    want = JP.prefill_attention(
        jnp.asarray(q),
        meta.for_layer(i),
        [jnp.asarray(x) for x in raw],
        [jnp.asarray(x) for x in comp],
        sm_scale=case.sm_scale,
        topk_indices=jnp.asarray(topk),
        backend="xla",
    )
    np.testing.assert_array_equal(np.asarray(out)[: q.shape[0]], np.asarray(want))


@pytest.mark.parametrize("layout", ["interleaved", "split"])
def test_mxfp8_pages(layout):
    case = v41_case("mxfp8", [50, 21, 70], [34, 21, 9], replay_start=[0, 0, 40], D=512, seed=5)
    st = case.step()
    held, pages = {"raw": {}, "comp": {}}, {}
    for i in range(len(TINY)):
        p, table, held["raw"][i] = R.mxfp8_paged(case.raw[i], 16, 100 + i, layout)
        pages[("raw", i)] = JP.PagedKV(jnp.asarray(p), jnp.asarray(table), kv_cache_dtype="fp8_ds_mla", layout=layout)
    for src in TINY.kv_source_layer_ids:
        p, table, held["comp"][src] = R.mxfp8_paged(case.caches[src], 16 // TINY[src].compress_ratio, 7 + src, layout)
        pages[("comp", src)] = JP.PagedKV(
            jnp.asarray(p), jnp.asarray(table), kv_cache_dtype="fp8_ds_mla", layout=layout
        )
    case.raw = held["raw"]
    meta = JP.build_step_metadata(st, index_topk=case.index_topk, **META)
    for i in (0, 2, 3, 5):  # ratio 0, ratio 2 (reuse), the cut, a replay-band reindex layer
        role = TINY[i]
        _, want, _ = case.oracle(i, caches=held["comp"])
        src = (pages[("raw", i)], pages[("comp", role.kv_source_layer_id)] if role.has_compressed else None)
        floats = (
            [jnp.asarray(x) for x in held["raw"][i]],
            [jnp.asarray(x) for x in held["comp"][role.kv_source_layer_id]] if role.has_compressed else None,
        )
        for backend in BACKENDS:
            out = run_layer(case, meta, st, i, backend, src)
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
            assert np.array_equal(out, run_layer(case, meta, st, i, backend, floats)), (i, backend)


def test_bad_input():
    case = CASES["prefix-replay"]
    st = case.step()
    meta = JP.build_step_metadata(st, index_topk=case.index_topk, **META)
    q, raw, comp, topk = case.layer_inputs(4, st)
    raw_j, comp_j = [jnp.asarray(x) for x in raw], [jnp.asarray(x) for x in comp]
    m = meta.for_layer(4)
    kw = dict(sm_scale=case.sm_scale, backend="xla")
    with pytest.raises(ValueError, match=r"q: 52 rows, but this layer's plan CSA1/replay computes 37 rows"):
        JP.prefill_attention(jnp.asarray(case.q[4]), m, raw_j, comp_j, topk_indices=jnp.asarray(case.topk[3]), **kw)
    with pytest.raises(KeyError, match=r"no metadata for CSA4/full in this step \(built: \['SWA/full', 'CSA2/full'"):
        meta[P.PlanKey(("CSA", 4))]
    with pytest.raises(KeyError, match="CSA: this step has 3 CSA plans"):
        meta["CSA"]
    with pytest.raises(ValueError, match="layer_id: expected 0..6, got 7"):
        meta.for_layer(7)
    with pytest.raises(ValueError, match=r"compressed_kv\[0\]: 89 rows, but request 0 needs 90"):
        JP.prefill_attention(jnp.asarray(q), m, raw_j, [x[:-1] for x in comp_j], topk_indices=jnp.asarray(topk), **kw)
    bad = topk.copy()
    bad[3, 0] = -2
    with pytest.raises(ValueError, match=r"topk_indices: row 3 \(position 77\) points at entries outside 0..77"):
        JP.prefill_attention(jnp.asarray(q), m, raw_j, comp_j, topk_indices=bad, **kw)
    JP.prefill_attention(jnp.asarray(q), m, raw_j, comp_j, topk_indices=topk, **kw)  # -1 picks: no key
    with pytest.raises(ValueError, match=r"index_topk: required when CSA layers are planned \(this step plans CSA2"):
        JP.build_step_metadata(st)
    with pytest.raises(ValueError, match="layer_id: this metadata's step was not planned from a planner.Schedule"):
        JP.build_step_metadata(P.plan_step(case.batch, P.PlanConfig(16, 4096, 4096)), index_topk=8).for_layer(0)
