"""dsv4_torch prefill: against the chunk-free oracle, chunk invariance, paged == logical."""

import numpy as np
import pytest
import torch

import planner as P
from dsv4_torch import prefill as TP
from tests.cases import boundary_cases, make_case

POLICIES = ("adaptive", "fixed", "per_request")


def run(case, *, policy="adaptive", paged=False, dtype=torch.float32, backend="reference", **cfg):
    step = P.plan_step(case.batch, case.plan_config(policy=policy, **cfg), [case.ratio])
    meta = TP.build_step_metadata(step, index_topk=case.topk)[case.ratio]
    t = lambda a: torch.from_numpy(np.asarray(a)).to(dtype)
    if paged:
        raw = TP.PagedKV(*(torch.from_numpy(x) for x in case.paged("raw", seed=1)))
        raw = TP.PagedKV(raw.pages.to(dtype), raw.block_table)
        comp = None
        if case.ratio > 1:
            pages, table = case.paged("comp", seed=2)
            comp = TP.PagedKV(t(pages), torch.from_numpy(table))
    else:
        raw = [t(x) for x in case.raw]
        comp = [t(x) for x in case.comp] if case.ratio > 1 else None
    out = TP.prefill_attention(
        t(case.q), meta, raw, comp, sm_scale=case.sm_scale, attn_sink=torch.from_numpy(case.sink),
        topk_indices=torch.from_numpy(case.topk_rows) if case.ratio == 4 else None, backend=backend,
    )  # fmt: skip
    return out, meta


@pytest.mark.parametrize("ratio", [0, 4, 128])
@pytest.mark.parametrize("case_no", range(4))
def test_prefill_matches_oracle_and_is_chunk_invariant(ratio, case_no):
    case = boundary_cases(ratio)[case_no]
    want, _, _ = case.oracle()
    outs = {}
    for policy in POLICIES:
        out, meta = run(case, policy=policy)
        assert meta.last_backend == "reference"
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        outs[policy] = out
    # the plan never changes a bit of the result (reference backend, fp32)
    for policy in POLICIES[1:]:
        assert torch.equal(outs[policy], outs["adaptive"]), policy
    # nor does a length-sorted order, a budget that splits requests, or paged caches
    tight = max(s // ratio if ratio > 1 else 0 for s in case.seq_lens) + case.window_size + 4
    for kw in (dict(order="length"), dict(budget_rows=tight), dict(paged=True)):
        out, _ = run(case, **kw)
        assert torch.equal(out, outs["adaptive"]), kw


@pytest.mark.parametrize("topk, width", [(512, 640), (1024, 1152)])
def test_csa_real_index_widths(topk, width):
    case = make_case("csa-wide", [4200, 2100], [3, 2], 4, window_size=128, topk=topk, H=2, D=16, seed=5)
    out, meta = run(case)
    assert meta.index_width == width
    want, _, _ = case.oracle()
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_hca_long_context():
    case = make_case("hca-long", [40000, 300], [4, 300], 128, window_size=128, H=2, D=16, seed=6)
    outs = [run(case, policy=p)[0] for p in POLICIES]
    want, _, _ = case.oracle()
    np.testing.assert_allclose(outs[0].numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_bf16_within_flashmla_tolerance():
    case = boundary_cases(4)[2]
    # FlashMLA's tolerance is against an fp32 reference on the same bf16-rounded inputs
    bf = lambda a: torch.from_numpy(a).bfloat16().float().numpy()
    case.q, case.raw, case.comp = bf(case.q), [bf(x) for x in case.raw], [bf(x) for x in case.comp]
    want, _, _ = case.oracle()
    out, _ = run(case, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    err = np.abs(out.float().numpy() - want)
    assert (err <= 8e-4 + (3 / 128) * np.abs(want)).all(), err.max()


def test_device_indices_equal_numpy_builder():
    for ratio in (0, 4, 128):
        case = boundary_cases(ratio)[2]
        for policy in POLICIES:
            step = P.plan_step(case.batch, case.plan_config(policy=policy, order="length"), [ratio])
            meta = TP.build_step_metadata(step, index_topk=case.topk)[ratio]
            kp = step[ratio]
            for c, cm in zip(kp.chunks, meta.chunks):
                want_idx, want_len = P.build_chunk_indices(kp, c, case.topk_rows if ratio == 4 else None)
                idx, length = TP.build_indices(meta, cm, torch.from_numpy(case.topk_rows))
                np.testing.assert_array_equal(idx.numpy(), want_idx)
                np.testing.assert_array_equal(length.numpy(), want_len)


def test_metadata_built_once_and_workspace_shared():
    case = boundary_cases(128)[0]
    step = P.plan_step(case.batch, case.plan_config(), [0, 4, 128])
    meta = TP.build_step_metadata(step, index_topk=case.topk)
    assert meta[0] is meta[P.LayerKind.SWA]
    ws = meta.workspace(32, torch.float32)
    assert ws.shape[0] == step.max_workspace_rows
    assert meta.workspace(32, torch.float32) is ws  # every layer reuses it


def test_bad_inputs():
    case = boundary_cases(4)[0]
    step = P.plan_step(case.batch, case.plan_config(), [4])
    meta = TP.build_step_metadata(step, index_topk=case.topk)[4]
    q = torch.from_numpy(case.q)
    raw = [torch.from_numpy(x) for x in case.raw]
    comp = [torch.from_numpy(x) for x in case.comp]
    rows = torch.from_numpy(case.topk_rows)
    call = lambda **kw: TP.prefill_attention(**{**dict(q=q, meta=meta, raw_kv=raw, compressed_kv=comp,
                                                     sm_scale=0.1, topk_indices=rows), **kw})  # fmt: skip
    with pytest.raises(ValueError, match="q: 3 tokens"):
        call(q=q[:3])
    with pytest.raises(ValueError, match="topk_indices"):
        call(topk_indices=None)
    with pytest.raises(ValueError, match="compressed_kv"):
        call(compressed_kv=None)
    with pytest.raises(TypeError, match="raw_kv"):
        call(raw_kv=[x.double() for x in raw])
    future = rows.clone()
    future[-1, 0] = 10_000
    with pytest.raises(ValueError, match="topk_indices: row"):
        call(topk_indices=future)
    with pytest.raises(ValueError, match="index_topk"):
        TP.build_step_metadata(step)
    with pytest.raises(ValueError, match="config"):
        TP.build_step_metadata(case.batch)
    with pytest.raises(ValueError, match="block_table"):
        TP.PagedKV(torch.zeros(2, 4, 8), torch.zeros(3, dtype=torch.int32))
