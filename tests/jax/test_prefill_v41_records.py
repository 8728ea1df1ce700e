"""dsv4_jax prefill straight from DeepSeek-V4.1's 528-byte mxfp8 pages (PagedKV(kv_cache_dtype=
"fp8_ds_mla") with pages (num_pages, S, 528), both layouts): the xla path and the fused C prefill
("cpu") give the same bits as float rows of the very values the pages hold, the oracle's values,
and torch's bits; nvfp4 pages and misplaced layouts are refused by name. One CSA case (compiles
are what cost here)."""

import jax.numpy as jnp
import numpy as np
import pytest

import planner as P
from dsv4_jax import prefill as JP
from tests import v41_record_cases as C
from tests.cases import make_case

TILES = dict(token_tile=16, gather_tile=64)


@pytest.mark.parametrize("layout", ["interleaved", "split"])
def test_mxfp8_pages_equal_float_rows(layout):
    seed = 5 + (layout == "split")
    case = make_case("v41-records", [37, 300, 9], [37, 11, 3], 4, D=512, window_size=8, H=2, seed=seed)
    raw_pages, raw_table, case.raw = C.mxfp8_paged(case.raw, 16, seed + 1, layout)
    comp_pages, comp_table, case.comp = C.mxfp8_paged(case.comp, 4, seed + 2, layout)
    case.q = C.bf16(case.q)
    raw = JP.PagedKV(jnp.asarray(raw_pages), jnp.asarray(raw_table), kv_cache_dtype="fp8_ds_mla", layout=layout)
    comp = JP.PagedKV(jnp.asarray(comp_pages), jnp.asarray(comp_table), kv_cache_dtype="fp8_ds_mla", layout=layout)
    step = P.plan_step(case.batch, case.plan_config(), [case.layer])
    m = JP.build_step_metadata(step, index_topk=case.topk, **TILES)
    meta = m[case.kind]
    q = jnp.asarray(m.pad_tokens(case.q))
    T = case.q.shape[0]
    want, _, _ = case.oracle()
    floats = ([jnp.asarray(x) for x in case.raw], [jnp.asarray(x) for x in case.comp])
    outs = {}
    pad = np.full((raw_pages.shape[0], 96), 0xFF, np.uint8)  # 2-D pages with a padded stride, layout named
    raw2 = JP.PagedKV(
        jnp.asarray(np.concatenate([raw_pages.reshape(raw_pages.shape[0], -1), pad], 1)),
        jnp.asarray(raw_table),
        kv_cache_dtype="fp8_ds_mla",
        block_size=16,
        layout=layout,
    )
    for backend in ("xla", "cpu"):
        kw = dict(
            sm_scale=case.sm_scale, attn_sink=case.sink, topk_indices=m.pad_tokens(case.topk_rows), backend=backend
        )
        out = np.asarray(JP.prefill_attention(q, meta, raw, comp, **kw))[:T]
        assert meta.last_backend == backend
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        same = np.asarray(JP.prefill_attention(q, meta, *floats, **kw))[:T]
        assert np.array_equal(out, same), backend
        assert np.array_equal(np.asarray(JP.prefill_attention(q, meta, raw2, comp, **kw))[:T], out), backend
        outs[backend] = out
    try:
        import torch

        from dsv4_torch import prefill as TP
    except ImportError:  # pragma: no cover - torch is in the dev install
        return
    t_meta = TP.build_step_metadata(step, index_topk=case.topk)[case.kind]
    t_out = TP.prefill_attention(
        torch.from_numpy(case.q),
        t_meta,
        TP.PagedKV(
            torch.from_numpy(raw_pages), torch.from_numpy(raw_table), kv_cache_dtype="fp8_ds_mla", layout=layout
        ),
        TP.PagedKV(
            torch.from_numpy(comp_pages), torch.from_numpy(comp_table), kv_cache_dtype="fp8_ds_mla", layout=layout
        ),
        sm_scale=case.sm_scale,
        attn_sink=torch.from_numpy(case.sink),
        backend="cpu",
        topk_indices=torch.from_numpy(case.topk_rows),
    )
    assert np.array_equal(t_out.numpy(), outs["cpu"])


def test_refused_pages():
    table = jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(ValueError, match="pages: a layer call reads fp8_ds_mla .* or mxfp8 .* records, got nvfp4"):
        JP.PagedKV(jnp.zeros((2, 4, 288), jnp.uint8), table, kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(ValueError, match="layout: only DeepSeek-V4.1's mxfp8 pages"):
        JP.PagedKV(jnp.zeros((2, 4, 2336), jnp.uint8), table, kv_cache_dtype="fp8_ds_mla", layout="split")
    with pytest.raises(ValueError, match="layout: expected one of"):
        JP.PagedKV(jnp.zeros((2, 4, 528), jnp.uint8), table, kv_cache_dtype="fp8_ds_mla", layout="rows")
