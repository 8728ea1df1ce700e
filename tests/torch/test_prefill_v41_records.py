"""dsv4_torch prefill straight from DeepSeek-V4.1's 528-byte mxfp8 pages (PagedKV(kv_cache_dtype=
"fp8_ds_mla") with pages (num_pages, S, 528), both layouts): the reference path and the fused C
prefill ("cpu") give the same bits as float pages of the very values the pages hold, and the
oracle's values; nvfp4 pages and misplaced layouts are refused by name."""

import numpy as np
import pytest
import torch

import planner as P
from dsv4_torch import prefill as TP
from tests import v41_record_cases as C
from tests.cases import make_case

LAYOUTS = ("interleaved", "split")


def v41_case(ratio, layout, seed):
    case = make_case("v41-records", [37, 300, 9], [37, 11, 0], ratio, D=512, window_size=8, H=2, seed=seed)
    raw_pages, raw_table, case.raw = C.mxfp8_paged(case.raw, 16, seed + 1, layout)
    comp = None
    if case.kind.has_compressed:
        comp_pages, comp_table, case.comp = C.mxfp8_paged(case.comp, 4, seed + 2, layout)
        comp = TP.PagedKV(
            torch.from_numpy(comp_pages), torch.from_numpy(comp_table), kv_cache_dtype="fp8_ds_mla", layout=layout
        )
    raw = TP.PagedKV(
        torch.from_numpy(raw_pages), torch.from_numpy(raw_table), kv_cache_dtype="fp8_ds_mla", layout=layout
    )
    case.q = C.bf16(case.q)
    return case, raw, comp


def run(case, raw, comp, backend, dtype=torch.float32):
    step = P.plan_step(case.batch, case.plan_config(), [case.layer])
    meta = TP.build_step_metadata(step, index_topk=case.topk)[case.kind]
    return TP.prefill_attention(
        torch.from_numpy(case.q).to(dtype),
        meta,
        raw,
        comp,
        sm_scale=case.sm_scale,
        attn_sink=torch.from_numpy(case.sink),
        backend=backend,
        topk_indices=torch.from_numpy(case.topk_rows) if case.kind is P.LayerKind.CSA else None,
    )


@pytest.mark.parametrize("ratio", [0, 4, 128])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mxfp8_pages_equal_float_pages_of_their_values(ratio, layout):
    case, raw, comp = v41_case(ratio, layout, seed=ratio + (layout == "split"))
    want, _, _ = case.oracle()
    floats = (list(map(torch.from_numpy, case.raw)), list(map(torch.from_numpy, case.comp)) if comp else None)
    for backend in ("reference", "cpu"):
        for dtype in (torch.float32, torch.bfloat16):
            out = run(case, raw, comp, backend, dtype)
            same = run(
                case,
                [x.to(dtype) for x in floats[0]],
                [x.to(dtype) for x in floats[1]] if comp else None,
                backend,
                dtype,
            )
            assert torch.equal(out, same), (backend, dtype)
            if dtype == torch.float32:
                np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_device_op_gather_equals_the_c_gather(monkeypatch):
    """The workspace's row gather by device ops (what runs where the C gather does not: GPUs, no
    compiler) gives the C gather's bits."""
    from dsv4_torch import kvcache_v41

    case, raw, comp = v41_case(4, "interleaved", seed=9)
    want = run(case, raw, comp, "reference")
    monkeypatch.setattr(kvcache_v41, "resolve_backend", lambda *a, **k: "reference")
    assert torch.equal(run(case, raw, comp, "reference"), want)


def test_two_d_padded_pages():
    """vLLM pads V4.1 pages beside NVFP4 ones: (num_pages, page_stride) with block_size and the
    layout named read the same as the 3-D pages."""
    case, raw, comp = v41_case(4, "split", seed=11)

    def padded(src):
        p = src.pages.reshape(src.pages.shape[0], -1)
        p = torch.cat([p, torch.full((p.shape[0], 96), 0xFF, dtype=torch.uint8)], dim=1)
        return TP.PagedKV(p, src.block_table, kv_cache_dtype="fp8_ds_mla", block_size=src.page_size, layout="split")

    for backend in ("cpu", "reference"):
        assert torch.equal(run(case, padded(raw), padded(comp), backend), run(case, raw, comp, backend)), backend


def test_refused_pages():
    table = torch.zeros((1, 1), dtype=torch.int32)
    with pytest.raises(ValueError, match="pages: a layer call reads fp8_ds_mla .* or mxfp8 .* records, got nvfp4"):
        TP.PagedKV(torch.zeros((2, 4, 288), dtype=torch.uint8), table, kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(ValueError, match="layout: only DeepSeek-V4.1's mxfp8 pages"):
        TP.PagedKV(torch.zeros((2, 4, 584), dtype=torch.uint8), table, kv_cache_dtype="fp8_ds_mla", layout="split")
    with pytest.raises(ValueError, match="layout: expected one of"):
        TP.PagedKV(torch.zeros((2, 4, 528), dtype=torch.uint8), table, kv_cache_dtype="fp8_ds_mla", layout="rows")
    with pytest.raises(ValueError, match="block_size: required for 2-D mxfp8 pages"):
        TP.PagedKV(torch.zeros((2, 2112), dtype=torch.uint8), table, kv_cache_dtype="fp8_ds_mla", layout="split")
    with pytest.raises(ValueError, match="block_size: 8, but pages holds 4 slots"):
        TP.PagedKV(torch.zeros((2, 4, 528), dtype=torch.uint8), table, kv_cache_dtype="fp8_ds_mla", block_size=8)
