"""dsv4_torch prefill on vLLM's fp8_ds_mla pages: oracle on the dequantized rows, exact workspace,
fp8 pages == bf16 pages of the same values, the Triton gather path, bad inputs, no host sync."""

import numpy as np
import pytest
import torch

import planner as P
from dsv4_torch import kvcache as TK
from dsv4_torch import prefill as TP
from planner import kvcache as KV
from tests.fp8_cases import RAW_SLOTS, fp8_case, fp8_cases

POLICIES = ("adaptive", "fixed", "per_request")


def _fp8(p, view=False):
    pages = torch.from_numpy(p.pages)
    if view:  # vLLM's nominal (num_blocks, S, 584) view of the same bytes
        pages = pages.as_strided((pages.shape[0], p.block_size, KV.SLOT_BYTES), (pages.shape[1], KV.SLOT_BYTES, 1))
        return TP.PagedKV(pages, torch.from_numpy(p.block_table), kv_cache_dtype="fp8_ds_mla")
    return TP.PagedKV(pages, torch.from_numpy(p.block_table), kv_cache_dtype="fp8_ds_mla", block_size=p.block_size)


def _bf16_paged(rows, S, dtype):
    """The same (dequantized) values in q-dtype pages of S rows (a PagedKV of the "auto" format)."""
    counts = [-(-len(x) // S) for x in rows]
    pages = torch.full((sum(counts) + 1, S, KV.HEAD_DIM), float("nan"), dtype=dtype)
    table = torch.zeros((len(rows), max(max(counts), 1)), dtype=torch.int32)
    k = 1
    for i, x in enumerate(rows):
        for j in range(counts[i]):
            part = torch.from_numpy(x[j * S : (j + 1) * S]).to(dtype)
            pages[k, : part.shape[0]] = part
            table[i, j] = k
            k += 1
    return TP.PagedKV(pages, table)


def run(case, raw, comp, *, dtype=torch.float32, policy="adaptive", **cfg):
    step = P.plan_step(case.batch, case.plan_config(policy=policy, **cfg), [case.layer])
    meta = TP.build_step_metadata(step, index_topk=case.topk)[case.kind]
    out = TP.prefill_attention(
        torch.from_numpy(case.q).to(dtype),
        meta,
        raw,
        comp,
        sm_scale=case.sm_scale,
        attn_sink=torch.from_numpy(case.sink),
        backend="reference",
        topk_indices=torch.from_numpy(case.topk_rows) if case.kind is P.LayerKind.CSA else None,
    )
    return out, meta


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_fp8_pages_match_oracle_and_bf16_pages(ratio):
    for case, raw, comp in fp8_cases(ratio):
        want, _, _ = case.oracle()  # float64, on the rows the pages hold (dequantized)
        rk, ck = _fp8(raw), _fp8(comp) if comp else None
        out, _ = run(case, rk, ck)
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        # fp8 pages and float pages of the very same values: the same bits (float32 q; bf16 q below)
        for dtype in (torch.float32, torch.bfloat16) if case.name == "fp8-long-prefix" else (torch.float32,):
            fp8_out = out if dtype == torch.float32 else run(case, rk, ck, dtype=dtype)[0]
            same = run(
                case,
                _bf16_paged(case.raw, RAW_SLOTS, dtype),
                _bf16_paged(case.comp, comp.block_size, dtype) if comp else None,
                dtype=dtype,
            )[0]
            assert torch.equal(fp8_out, same), (case.name, dtype)
        if case.name != "fp8-long-prefix":
            continue
        # any plan, vLLM's 3-D page view: the same bits
        tight = max(s // ratio if ratio else 0 for s in case.seq_lens) + case.window_size + 4
        for kw in (dict(policy="per_request"), dict(budget_rows=tight, order="length")):
            assert torch.equal(run(case, rk, ck, **kw)[0], out), kw
        assert torch.equal(run(case, _fp8(raw, view=True), _fp8(comp, view=True) if comp else None)[0], out)


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_fp8_workspace_is_exactly_the_dequantized_rows(ratio):
    case, raw, comp = fp8_cases(ratio)[1]
    step = P.plan_step(
        case.batch,
        case.plan_config(budget_rows=(max(case.seq_lens) // ratio if ratio else 0) + case.window_size + 13),
        [case.layer],
    )
    meta = TP.build_step_metadata(step, index_topk=case.topk)[case.kind]
    kp = step[case.kind]
    assert kp.num_chunks > 1
    for c in range(kp.num_chunks):
        want = P.layout.gather_workspace(kp, c, case.raw, case.comp if comp else None, fill=np.nan)
        written = ~np.isnan(want[:, 0])
        for dtype in (torch.bfloat16, torch.float32):
            ws = TP.gather_workspace(meta, c, _fp8(raw), _fp8(comp) if comp else None, dtype=dtype)
            assert ws.dtype == dtype
            got = ws.float().numpy()
            np.testing.assert_array_equal(got[written], want[written])  # exact
            assert not got[~written].any()  # rows the chunk does not write stay 0


def test_triton_gather_path_equals_reference(monkeypatch):
    """The GPU path (one Triton dequant-gather per region, here under the interpreter) writes the
    same bits as the device-op path."""
    from dsv4_torch.kernels.triton import kvcache as triton_kvcache

    if not triton_kvcache.INTERPRETED and not torch.cuda.is_available():
        pytest.skip("the triton backend needs a CUDA GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it on CPU)")
    case, raw, comp = fp8_case("fp8-triton", [70, 33, 5], [6, 33, 5], 4, seed=7, window_size=8, H=2)
    want = {dt: run(case, _fp8(raw), _fp8(comp), dtype=dt)[0] for dt in (torch.float32, torch.bfloat16)}
    monkeypatch.setattr(TK, "resolve_backend", lambda backend="auto", k_cache=None, op="gather": "triton")
    for dt, w in want.items():
        out, meta = run(case, _fp8(raw), _fp8(comp), dtype=dt)
        assert torch.equal(out, w), dt


def test_cpu_gather_path_equals_device_op_path(monkeypatch):
    """On CPU tensors the prefill gathers fp8 pages with the C kernel (auto, where it builds):
    the same bits as the index-op path it replaces, in every chunk, fp32 and bf16 workspaces."""
    if TK.cpu_unavailable_reason() is not None:
        pytest.skip(f"the cpu backend's C kernel cannot be built here: {TK.cpu_unavailable_reason()}")
    case, raw, comp = fp8_case("fp8-cpu", [70, 33, 5], [6, 33, 5], 4, seed=8, window_size=8, H=2)
    from dsv4_torch.kernels.cpu import kvcache as cpu_kvcache

    rows = TP.Rows(_fp8(raw), "raw_kv", torch.zeros(1, 1, 512), run_meta(case), "raw")
    assert rows.gather is cpu_kvcache.gather_dequant
    got = {dt: run(case, _fp8(raw), _fp8(comp), dtype=dt, budget_rows=40)[0] for dt in (torch.float32, torch.bfloat16)}
    monkeypatch.setattr(TK, "resolve_backend", lambda backend="auto", k_cache=None, op="gather": "reference")
    for dt, g in got.items():
        assert torch.equal(run(case, _fp8(raw), _fp8(comp), dtype=dt, budget_rows=40)[0], g), dt


def run_meta(case):
    step = P.plan_step(case.batch, case.plan_config(), [case.layer])
    return TP.build_step_metadata(step, index_topk=case.topk)[case.kind]


@pytest.mark.parametrize("layout", ["paged", "packed"])
def test_triton_gather_path_for_float_caches(layout, monkeypatch):
    """The GPU gather of caches in q's dtype (`triton_gather`, here under the interpreter) == the
    device-op path, bit for bit, for paged and packed caches (a window-only packed cache too)."""
    from dsv4_torch.kernels.triton import kvcache as triton_kvcache
    from tests.cases import boundary_cases

    if not triton_kvcache.INTERPRETED and not torch.cuda.is_available():
        pytest.skip("the triton backend needs a CUDA GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it on CPU)")
    case = boundary_cases(4)[2]
    if layout == "paged":
        raw = TP.PagedKV(*(torch.from_numpy(x) for x in case.paged("raw", seed=1)))
        comp = TP.PagedKV(*(torch.from_numpy(x) for x in case.paged("comp", seed=2)))
    else:
        raw = TP.LogicalKV.from_list([torch.from_numpy(x) for x in case.raw])
        comp = TP.LogicalKV.from_list([torch.from_numpy(x) for x in case.comp])
    want = run(case, raw, comp, budget_rows=300)[0]
    monkeypatch.setattr("dsv4_torch.prefill_kv.use_gather_kernel", lambda t: True)
    assert torch.equal(run(case, raw, comp, budget_rows=300)[0], want)


def test_fp8_layer_call_makes_no_host_sync(monkeypatch):
    from dsv4_torch.kernels.reference import attention as ref_kernel
    from tests.no_host_sync import forbid_host_sync

    case, raw, comp = fp8_cases(4)[1]
    # the device-op path (what non-CUDA devices run); the C kernel is a CPU-only path that reads
    # its per-request arrays on the host by design, and CUDA runs the Triton kernel
    monkeypatch.setattr(TK, "resolve_backend", lambda backend="auto", k_cache=None, op="gather": "reference")
    rk, ck = _fp8(raw), _fp8(comp)
    want, meta = run(case, rk, ck)
    monkeypatch.setattr("dsv4_torch.prefill_kv.check_source_values", lambda *a: None)  # CPU-only host reads
    monkeypatch.setattr(TP, "_check_topk_values", lambda *a: None)
    monkeypatch.setattr(ref_kernel, "SKIP_EMPTY_BLOCKS_ON_CPU", False)
    meta._index_rows = None  # the first layer call's index rows are guarded too
    with forbid_host_sync():
        got = TP.prefill_attention(
            torch.from_numpy(case.q),
            meta,
            rk,
            ck,
            sm_scale=case.sm_scale,
            attn_sink=torch.from_numpy(case.sink),
            backend="reference",
            topk_indices=torch.from_numpy(case.topk_rows),
        )
    assert torch.equal(got, want)


def test_fp8_bad_inputs():
    case, raw, comp = fp8_cases(4)[1]
    step = P.plan_step(case.batch, case.plan_config(), [case.layer])
    meta = TP.build_step_metadata(step, index_topk=case.topk)[case.kind]
    q = torch.from_numpy(case.q)
    pages, table = torch.from_numpy(raw.pages), torch.from_numpy(raw.block_table)
    S = raw.block_size

    def call(raw_kv, compressed_kv=_fp8(comp), q=q):
        return TP.prefill_attention(
            q,
            meta,
            raw_kv,
            compressed_kv,
            sm_scale=case.sm_scale,
            topk_indices=torch.from_numpy(case.topk_rows),
            backend="reference",
        )

    fp8 = dict(kv_cache_dtype="fp8_ds_mla", block_size=S)
    with pytest.raises(TypeError, match=r"pages: fp8_ds_mla pages are uint8 bytes, got torch.float32"):
        TP.PagedKV(pages.float(), table, **fp8)
    with pytest.raises(TypeError, match=r"pages: uint8 pages hold fp8_ds_mla bytes: pass kv_cache_dtype='fp8_ds_mla'"):
        TP.PagedKV(pages.view(pages.shape[0], 1, -1), table)
    with pytest.raises(ValueError, match=r"block_size: required for 2-D fp8_ds_mla pages"):
        TP.PagedKV(pages, table, kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(
        ValueError, match=rf"pages: page stride {KV.page_bytes(S) - 576} bytes is not round_up\({S} \* 584, 576\)"
    ):
        TP.PagedKV(pages[:, :-576].contiguous(), table, **fp8)
    with pytest.raises(ValueError, match=r"pages: page stride .* is not round_up\(8 \* 584, 576\)"):
        TP.PagedKV(pages, table, kv_cache_dtype="fp8_ds_mla", block_size=8)  # block_size disagrees with the stride
    with pytest.raises(ValueError, match=r"block_size: 8 differs from the pages' 16 slots"):
        TP.PagedKV(_fp8(raw, view=True).pages, table, kv_cache_dtype="fp8_ds_mla", block_size=8)
    with pytest.raises(ValueError, match=r"kv_cache_dtype: expected one of \('auto', 'fp8_ds_mla'\), got 'fp8'"):
        TP.PagedKV(pages, table, kv_cache_dtype="fp8", block_size=S)
    # out-of-range block table entries and too narrow tables, on the host, naming the argument
    bad = table.clone()
    bad[1, 31] = pages.shape[0]  # position 497 (the first the window reads) is on page 31
    with pytest.raises(
        ValueError,
        match=rf"raw_kv.block_table: request 1 page 31 is {pages.shape[0]}, outside 0 .. {pages.shape[0] - 1}",
    ):
        call(TP.PagedKV(pages, bad, **fp8))
    # the values are checked once per (table, version): an in-place change after a good call with
    # the same metadata is seen; an inference tensor (no version counter) is checked every call
    good = table.clone()
    call(TP.PagedKV(pages, good, **fp8))
    good[1, 31] = pages.shape[0]
    with pytest.raises(ValueError, match=r"raw_kv.block_table: request 1 page 31 is"):
        call(TP.PagedKV(pages, good, **fp8))
    with torch.inference_mode():
        frozen = table.clone()
        assert frozen.is_inference()
        call(TP.PagedKV(pages, frozen, **fp8))
        frozen[1, 31] = pages.shape[0]
        with pytest.raises(ValueError, match=r"raw_kv.block_table: request 1 page 31 is"):
            call(TP.PagedKV(pages, frozen, **fp8))
    with pytest.raises(ValueError, match=r"raw_kv.block_table: 1 pages of 16 entries hold 16, but request 1 needs 517"):
        call(TP.PagedKV(pages, table[:, :1].contiguous(), **fp8))
    with pytest.raises(ValueError, match=r"raw_kv.block_table: 2 rows, but the step's batch has 3 requests"):
        call(TP.PagedKV(pages, table[:2], **fp8))
    # q must be 512-dim, bf16 or float32; uint8 rows as q-dtype rows are refused with a hint
    with pytest.raises(
        TypeError,
        match=r"raw_kv: fp8_ds_mla pages dequantize to bf16 values: q must be bfloat16 or float32, got torch.float16",
    ):
        call(_fp8(raw), q=q.half())
    packed = TP.LogicalKV(pages.view(-1)[: 10 * KV.HEAD_DIM].view(10, KV.HEAD_DIM), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(
        TypeError, match=r"raw_kv: dtype torch.uint8 differs from q's torch.float32 \(fp8_ds_mla bytes come as PagedKV"
    ):
        call(packed)
    small, raw_s, comp_s = fp8_case("small-d", [9], [9], 0, window_size=8, H=2)
    small_meta = TP.build_step_metadata(P.plan_step(small.batch, small.plan_config(), [small.layer]))[small.kind]
    with pytest.raises(ValueError, match=r"raw_kv: fp8_ds_mla pages hold 512-dim rows, but q's D is 64"):
        TP.prefill_attention(torch.zeros(9, 2, 64), small_meta, _fp8(raw_s), sm_scale=1.0, backend="reference")
