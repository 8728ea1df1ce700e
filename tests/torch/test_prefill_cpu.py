"""dsv4_torch prefill on backend "cpu": one fused C kernel call per layer straight from the caches.

Against the chunk-free float64 oracle (fp32 within 1e-5 of its scale; bf16 within FlashMLA's
tolerance on the same bf16-rounded inputs), for SWA / CSA / HCA, every cache form the prefill
takes (per-request tensors, LogicalKV, paged rows in bf16 / fp32 with int32 / int64 block tables,
fp8_ds_mla pages 2-D and vLLM's 3-D view); bitwise the same under every plan (the fused call never
sees the plan), cache form and thread count; close to backend="reference"; and the wiring:
"auto" runs it on CPU, the backend is resolved once per layer call, no workspace, the per-token
arrays are built once per step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import planner as P
from dsv4_cpu import binding as ckernel
from dsv4_torch import BackendUnavailableError
from dsv4_torch import prefill as TP
from dsv4_torch.kernels.cpu import attention as CA
from dsv4_torch.kernels.cpu import prefill as prefill_cpu
from planner import kvcache as KV
from tests.cases import boundary_cases, make_case
from tests.fp8_cases import RAW_SLOTS, bf16_values, fp8_case, fp8_cases
from tests.parity import tolerances as TOL

_REASON = ckernel.unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"the C kernel cannot be built here: {_REASON}")

POLICIES = ("adaptive", "fixed", "per_request")


def caches(case, form, dtype):
    """(raw_kv, compressed_kv) of a case in one of the prefill's cache forms."""
    t = lambda a: torch.from_numpy(np.asarray(a)).to(dtype)  # noqa: E731
    has_comp = case.kind.has_compressed
    if form in ("list", "logical"):
        raw = [t(x) for x in case.raw]
        comp = [t(x) for x in case.comp] if has_comp else None
        if form == "logical":
            raw, comp = TP.LogicalKV.from_list(raw), TP.LogicalKV.from_list(comp) if comp else None
        return raw, comp
    # paged rows (NaN in unused slots), block table int32 or int64
    table_dtype = torch.int64 if form == "paged64" else torch.int32

    def paged(which, seed):
        pages, table = case.paged(which, seed=seed)
        return TP.PagedKV(t(pages), torch.from_numpy(table).to(table_dtype))

    return paged("raw", 1), paged("comp", 2) if has_comp else None


def run(
    case,
    raw=None,
    comp=None,
    *,
    form="list",
    dtype=torch.float32,
    policy="adaptive",
    backend="cpu",
    meta=None,
    q=None,
    topk=None,
    **cfg,
):
    if meta is None:
        step = P.plan_step(case.batch, case.plan_config(policy=policy, **cfg), [case.layer])
        meta = TP.build_step_metadata(step, index_topk=case.topk)[case.kind]
    if raw is None:
        raw, comp = caches(case, form, dtype)
    if q is None:
        q = torch.from_numpy(case.q).to(dtype)
    if topk is None and case.kind is P.LayerKind.CSA:
        topk = torch.from_numpy(case.topk_rows)
    out = TP.prefill_attention(
        q,
        meta,
        raw,
        comp,
        sm_scale=case.sm_scale,
        attn_sink=torch.from_numpy(case.sink),
        topk_indices=topk,
        backend=backend,
    )
    return out, meta


def assert_oracle_close(out, want, dtype):
    got = out.float().double().numpy()
    name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    res = TOL.compare_out(got, want, want, name)
    assert res.passed, res.detail or res


def rounded(case):
    """The case with q and latents rounded to bf16 (the oracle of a bf16 run)."""
    case.q, case.raw, case.comp = (
        bf16_values(case.q),
        [bf16_values(x) for x in case.raw],
        [bf16_values(x) for x in case.comp],
    )
    return case


def scaled(case):
    """FlashMLA's data scale (latents x 0.1, queries x 10: the same logits), for bf16 tolerances."""
    case.q = (case.q * 10).astype(np.float32)
    case.raw = [(x * 0.1).astype(np.float32) for x in case.raw]
    case.comp = [(x * 0.1).astype(np.float32) for x in case.comp]
    return rounded(case)


# ----------------------------------------------------------------------------- against the oracle


@pytest.mark.parametrize("ratio", [0, 4, 128])
@pytest.mark.parametrize("case_no", range(4))
def test_matches_oracle_every_form_and_is_plan_invariant(ratio, case_no):
    case = boundary_cases(ratio)[case_no]
    want, _, _ = case.oracle()
    base, meta = run(case)
    assert meta.last_backend == "cpu"
    assert_oracle_close(base, want, torch.float32)
    # the plan never changes a bit: policies, length order, a budget that splits requests
    tight = max(s // ratio if case.kind.has_compressed else 0 for s in case.seq_lens) + case.window_size + 4
    variants = [dict(policy=p) for p in POLICIES[1:]] + [dict(order="length"), dict(budget_rows=tight, order="length")]
    # nor does the cache form
    variants += [dict(form=f) for f in ("logical", "paged", "paged64")]
    for kw in variants:
        out, _ = run(case, **kw)
        assert torch.equal(out, base), kw


@pytest.mark.parametrize("ratio", [0, 4, 128])
@pytest.mark.parametrize("case_no", [0, 2, 3])
def test_bf16_within_flashmla_tolerance_every_form(ratio, case_no):
    case = scaled(boundary_cases(ratio)[case_no])
    want, _, _ = case.oracle()
    base, _ = run(case, dtype=torch.bfloat16)
    assert base.dtype == torch.bfloat16
    assert_oracle_close(base, want, torch.bfloat16)
    for kw in (
        dict(policy="per_request"),
        dict(policy="fixed", order="length"),
        dict(form="paged"),
        dict(form="logical"),
        dict(form="paged64"),
    ):
        assert torch.equal(run(case, dtype=torch.bfloat16, **kw)[0], base), kw


@pytest.mark.parametrize("kind, ratio", [("CSA", 8), ("HCA", 32), ("HCA", 1), ("CSA", 1)])
@pytest.mark.parametrize("case_no", [1, 2])
def test_other_ratios(kind, ratio, case_no):
    """A small test model's CSA 8 / HCA 32, V4.1's full-length ratio 1."""
    case = boundary_cases(ratio, kind=kind)[case_no]
    want, _, _ = case.oracle()
    outs = [run(case, policy=p)[0] for p in POLICIES] + [run(case, form="paged")[0]]
    assert_oracle_close(outs[0], want, torch.float32)
    assert all(torch.equal(o, outs[0]) for o in outs)


@pytest.mark.parametrize("topk, width", [(512, 640), (1024, 1152)])
def test_csa_real_index_widths(topk, width):
    case = make_case("csa-wide", [4200, 2100], [3, 2], 4, window_size=128, topk=topk, H=2, D=16, seed=5)
    out, meta = run(case)
    assert meta.index_width == width
    want, _, _ = case.oracle()
    assert_oracle_close(out, want, torch.float32)


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_long_prefill_and_long_context(ratio):
    """A fresh 700-token prompt (many tiles of consecutive tokens) beside a long-context request."""
    case = make_case("long", [700, 9000, 130], [700, 40, 130], ratio, window_size=128, topk=64, H=4, D=64, seed=6)
    want, _, _ = case.oracle()
    out, _ = run(case)
    assert_oracle_close(out, want, torch.float32)
    assert torch.equal(run(case, form="paged", policy="per_request")[0], out)


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_v4_flash_heads_bf16_pages(ratio):
    """V4-Flash's head count and latent dim, bf16 rows in pages of 64 slots."""
    case = scaled(
        make_case("flash", [300, 77], [60, 77], ratio, window_size=128, topk=32, H=64, D=512, seed=7, block_size=64)
    )
    want, _, _ = case.oracle()
    out, _ = run(case, form="paged", dtype=torch.bfloat16)
    assert_oracle_close(out, want, torch.bfloat16)


def test_equals_reference_backend_within_tolerance():
    for ratio in (0, 4, 128):
        for dtype in (torch.float32, torch.bfloat16):
            case = boundary_cases(ratio)[2]
            case = scaled(case) if dtype == torch.bfloat16 else case
            want, _, _ = case.oracle()
            cpu, meta = run(case, form="paged", dtype=dtype, backend="auto")
            assert meta.last_backend == "cpu"
            ref, meta = run(case, form="paged", dtype=dtype, backend="reference")
            assert meta.last_backend == "reference"
            name = "bfloat16" if dtype == torch.bfloat16 else "float32"
            res = TOL.compare_out(cpu.double().numpy(), ref.double().numpy(), want, name)
            assert res.passed, (ratio, dtype, res)


# ----------------------------------------------------------------------------- fp8_ds_mla pages


def _fp8(p, view=False, table_dtype=torch.int32):
    pages, table = torch.from_numpy(p.pages), torch.from_numpy(p.block_table).to(table_dtype)
    if view:  # vLLM's nominal (num_blocks, S, 584) view of the same bytes, page stride page_bytes(S)
        pages = pages.as_strided((pages.shape[0], p.block_size, KV.SLOT_BYTES), (pages.shape[1], KV.SLOT_BYTES, 1))
        return TP.PagedKV(pages, table, kv_cache_dtype="fp8_ds_mla")
    return TP.PagedKV(pages, table, kv_cache_dtype="fp8_ds_mla", block_size=p.block_size)


def _rows_paged(rows, S, dtype):
    """The same (dequantized) values in q-dtype pages of S rows."""
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


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_fp8_pages_match_oracle_and_row_pages(ratio):
    for case, raw, comp in fp8_cases(ratio):
        want, _, _ = case.oracle()  # float64, on the rows the pages hold (dequantized)
        rk, ck = _fp8(raw), _fp8(comp) if comp else None
        out, meta = run(case, rk, ck)
        assert meta.last_backend == "cpu"
        assert_oracle_close(out, want, torch.float32)
        for dtype in (torch.float32, torch.bfloat16):
            fp8_out = out if dtype == torch.float32 else run(case, rk, ck, dtype=dtype)[0]
            # rows in q's dtype holding the dequantized values: the same bits
            same = run(
                case,
                _rows_paged(case.raw, RAW_SLOTS, dtype),
                _rows_paged(case.comp, comp.block_size, dtype) if comp else None,
                dtype=dtype,
            )[0]
            assert torch.equal(fp8_out, same), (case.name, dtype)
            # vLLM's 3-D view, int64 block tables, any plan: the same bits
            view = (_fp8(raw, view=True, table_dtype=torch.int64), _fp8(comp, view=True) if comp else None)
            assert torch.equal(run(case, *view, dtype=dtype, policy="per_request")[0], fp8_out), (case.name, dtype)


def test_fp8_pages_bf16_within_flashmla_tolerance():
    case, raw, comp = fp8_case("fp8-flash", [200, 90], [40, 90], 4, seed=9, scale=0.1, window_size=128, topk=32, H=64)
    case.q = bf16_values(case.q * 10)
    want, _, _ = case.oracle()
    out, _ = run(case, _fp8(raw, view=True), _fp8(comp), dtype=torch.bfloat16)
    assert_oracle_close(out, want, torch.bfloat16)


def test_fp8_pages_with_real_vllm_page_stride():
    """Pages of 64 slots inside a larger allocation: the page stride (stride(0)) is read, not assumed."""
    case, raw, comp = fp8_case("fp8-s64", [150, 70], [30, 70], 0, seed=10, window_size=16, H=2)
    pages = torch.from_numpy(raw.pages)
    wide = torch.full((pages.shape[0], pages.shape[1] + 576), 0xFF, dtype=torch.uint8)
    wide[:, : pages.shape[1]] = pages  # every page followed by 576 junk bytes
    view = wide.as_strided((pages.shape[0], raw.block_size, KV.SLOT_BYTES), (wide.shape[1], KV.SLOT_BYTES, 1))
    with pytest.raises(ValueError, match="pages"):  # the prefill checks vLLM's page stride on the host
        TP.PagedKV(view, torch.from_numpy(raw.block_table), kv_cache_dtype="fp8_ds_mla")
    want, _, _ = case.oracle()
    out, meta = run(case, _fp8(raw, view=True), None)
    assert_oracle_close(out, want, torch.float32)
    # The engine path (vLLM's CPU engine pads every page to one size for all layer kinds:
    # 95616-byte strides for 37440-byte SWA pages) reads the padded view through the C kernel's
    # page stride: the same bits as the packed pages.
    from dsv4_torch.kernels.cpu import attention as cpu
    from dsv4_torch.kernels.cpu.prefill import step_tokens

    table = torch.from_numpy(raw.block_table)
    q = torch.from_numpy(case.q)
    sink = torch.from_numpy(case.sink)
    got = []
    for pages in (_fp8(raw, view=True).pages, view):
        keep = []
        src = cpu.paged_source(pages, table, raw.block_size, True, q.dtype, "swa_cache", keep)
        assert src.page_stride == pages.stride(0)
        got.append(
            cpu.prefill_attention(
                q,
                step_tokens(meta.step),
                src,
                None,
                None,
                sink,
                kind="SWA",
                window=case.window_size,
                compress_ratio=1,
                sm_scale=case.sm_scale,
            )
        )
    assert torch.equal(got[0], got[1])
    assert torch.equal(got[0], out)
    short = wide.view(-1)[: wide.numel() - 577].clone().as_strided(view.shape, view.stride())  # last page short
    with pytest.raises(ValueError, match="swa_cache: the storage holds fewer than"):
        cpu.paged_source(short, table, raw.block_size, True, q.dtype, "swa_cache", [])
    narrow = pages.as_strided(view.shape, (view.stride(0) - 1152,) + view.stride()[1:])  # overlapping pages
    with pytest.raises(ValueError, match=r"swa_cache: page stride \d+ bytes is below round_up"):
        cpu.paged_source(narrow, table, raw.block_size, True, q.dtype, "swa_cache", [])


# ----------------------------------------------------------------------------- wiring


def test_auto_resolves_once_per_layer_and_skips_the_chunk_loop(monkeypatch):
    case = boundary_cases(4)[2]
    calls = []
    real = TP.resolve_backend
    monkeypatch.setattr(TP, "resolve_backend", lambda *a, **k: calls.append(a) or real(*a, **k))

    def no_chunks(*a, **k):
        raise AssertionError("the chunk loop ran")

    monkeypatch.setattr(TP, "run_backend", no_chunks)
    monkeypatch.setattr(TP, "_gather", no_chunks)
    step = P.plan_step(case.batch, case.plan_config(budget_rows=160), [case.layer])
    meta = TP.build_step_metadata(step, index_topk=case.topk)
    km = meta[case.kind]
    assert len(km.chunks) > 1
    for _ in range(2):
        out, _ = run(case, meta=km, backend="auto")
    assert km.last_backend == "cpu" and len(calls) == 1  # once per step (then reused), not per chunk
    assert meta._workspace is None  # no workspace allocated
    want, _, _ = case.oracle()
    assert_oracle_close(out, want, torch.float32)


def test_step_tokens_built_once_per_step():
    case = boundary_cases(4)[3]  # requests with query_len == 0 in the batch
    step = P.plan_step(case.batch, case.plan_config(order="length", policy="per_request"), P.V4_LAYERS)
    meta = TP.build_step_metadata(step, index_topk=case.topk)
    assert meta.cpu_tokens is None
    tok = prefill_cpu.step_tokens(meta)
    assert prefill_cpu.step_tokens(meta) is tok and tok.dtype == np.int32 and not tok.flags.writeable
    b = case.batch
    np.testing.assert_array_equal(tok, np.stack([np.arange(b.num_tokens), b.token_request, b.token_position]))
    assert b.token_request.tolist() != step[P.LayerKind.CSA].token_request.tolist()  # not the plan's local slots
    for kind in (P.LayerKind.SWA, P.LayerKind.HCA):  # the kinds of one step share the arrays
        c = make_case("x", case.seq_lens, case.query_lens, P.contract.V4_RATIOS[kind], seed=4)
        run(c, *caches(c, "paged", torch.float32), meta=meta[kind])
    assert meta.cpu_tokens is tok


def test_every_kind_of_one_step():
    """One StepMetadata, all three kinds, each against its oracle."""
    seq, qry = [300, 9, 140, 64], [33, 9, 0, 20]
    step = P.plan_step(
        P.PrefillBatch(seq, qry), P.PlanConfig(window_size=8, max_model_len=300, max_num_batched_tokens=33), P.V4_LAYERS
    )
    meta = TP.build_step_metadata(step, index_topk=6)
    for i, kind in enumerate(P.LayerKind):
        case = make_case("step", seq, qry, P.contract.V4_RATIOS[kind], seed=11 + i)
        want, _, _ = case.oracle()
        out, _ = run(case, meta=meta[kind], form="paged")
        assert meta[kind].last_backend == "cpu"
        assert_oracle_close(out, want, torch.float32)


def test_topk_int64_strided_and_out_buffers():
    case = boundary_cases(4)[2]
    base, _ = run(case)
    rows = torch.from_numpy(case.topk_rows)
    wide = torch.cat([rows, torch.full_like(rows, 10**6)], dim=1)[:, : rows.shape[1]]  # row stride 2k
    for topk in (rows.long(), wide, wide.long()):
        assert torch.equal(run(case, topk=topk)[0], base)
    q = torch.from_numpy(case.q)
    strided_q = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert torch.equal(run(case, q=strided_q)[0], base)
    step = P.plan_step(case.batch, case.plan_config(), [case.layer])
    meta = TP.build_step_metadata(step, index_topk=case.topk)[case.kind]
    raw, comp = caches(case, "list", torch.float32)
    T, H, dv = base.shape
    for out in (torch.full((T, H, dv), 7.0), torch.full((T, dv, H), 7.0).transpose(1, 2)):  # contiguous, strided
        got = TP.prefill_attention(
            q,
            meta,
            raw,
            comp,
            sm_scale=case.sm_scale,
            attn_sink=torch.from_numpy(case.sink),
            topk_indices=rows,
            out=out,
            backend="cpu",
        )
        assert got is out and torch.equal(out, base)


@pytest.mark.parametrize("ratio", [0, 128])
def test_window_only_raw_rows_with_negative_offsets(ratio):
    """A LogicalKV raw cache holding only each request's window rows (offset = start - first
    position kept, negative for the first request): only the keys the layer reads are needed."""
    case = boundary_cases(ratio)[2]
    base, _ = run(case)
    b = case.batch
    first = [max(0, s - q - (case.window_size - 1)) for s, q in zip(b.seq_lens.tolist(), b.query_lens.tolist())]
    kept = [torch.from_numpy(x[f:]) for x, f in zip(case.raw, first)]
    starts = np.concatenate([[0], np.cumsum([k.shape[0] for k in kept])[:-1]])
    offsets = torch.from_numpy(starts - np.asarray(first))
    assert offsets[0] < 0
    raw = TP.LogicalKV(torch.cat(kept), offsets)
    comp = [torch.from_numpy(x) for x in case.comp] if case.kind.has_compressed else None
    assert torch.equal(run(case, raw, comp)[0], base)


def test_strided_pages_and_threads_give_the_same_bits(monkeypatch):
    case = boundary_cases(128)[2]
    base, _ = run(case)
    raw, comp = caches(case, "paged", torch.float32)
    wide = lambda p: torch.cat([p.pages, p.pages], dim=-1)[..., : p.pages.shape[-1]]  # noqa: E731
    raw_w, comp_w = TP.PagedKV(wide(raw), raw.block_table), TP.PagedKV(wide(comp), comp.block_table)
    assert raw_w.pages.stride(1) == 2 * raw_w.pages.shape[-1]
    assert torch.equal(run(case, raw_w, comp_w)[0], base)
    for threads in (1, 3):
        monkeypatch.setattr(torch, "get_num_threads", lambda n=threads: n)
        assert torch.equal(run(case, raw, comp)[0], base), threads


def test_zero_token_step_never_reaches_the_kernel(monkeypatch):
    case = make_case("empty", [40, 9], [0, 0], 4, seed=12)

    def refuse():
        raise AssertionError("the kernel was called")

    monkeypatch.setattr(CA, "library", refuse)
    out, meta = run(case, backend="auto")
    assert out.shape == (0, 4, 32) and meta.last_backend == "cpu"


def test_gradient_or_dropout_needs_the_reference_backend():
    case = boundary_cases(0)[1]
    q = torch.from_numpy(case.q).requires_grad_()
    out, meta = run(case, q=q, backend="auto")
    assert meta.last_backend == "reference" and out.requires_grad
    with pytest.raises(BackendUnavailableError, match="backend='cpu' has no backward"):
        run(case, q=q, backend="cpu")
    raw, comp = caches(case, "list", torch.float32)
    step = P.plan_step(case.batch, case.plan_config(), [case.layer])
    meta = TP.build_step_metadata(step, index_topk=case.topk)[case.kind]
    with pytest.raises(BackendUnavailableError, match="backend='cpu' has no attention dropout"):
        TP.prefill_attention(
            torch.from_numpy(case.q), meta, raw, comp, sm_scale=case.sm_scale, backend="cpu", dropout_p=0.1
        )
    TP.prefill_attention(torch.from_numpy(case.q), meta, raw, comp, sm_scale=case.sm_scale, dropout_p=0.1)
    assert meta.last_backend == "reference"


def test_float64_and_float16_run_the_reference_backend():
    case = boundary_cases(4)[1]
    want, _, _ = case.oracle()
    out, meta = run(case, dtype=torch.float64, backend="auto")
    assert meta.last_backend == "reference" and out.dtype == torch.float64
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-10, atol=1e-10 * np.abs(want).max())
    with pytest.raises(TypeError, match="q: backend='cpu' takes bfloat16 / float32, got torch.float16"):
        run(case, dtype=torch.float16, backend="cpu")


def test_bad_inputs_name_the_argument():
    case = boundary_cases(4)[1]
    step = P.plan_step(case.batch, case.plan_config(), [case.layer])
    meta = TP.build_step_metadata(step, index_topk=case.topk)[case.kind]
    q = torch.from_numpy(case.q)
    raw, comp = caches(case, "paged", torch.float32)
    topk = torch.from_numpy(case.topk_rows)
    kw = dict(sm_scale=case.sm_scale, attn_sink=torch.from_numpy(case.sink), topk_indices=topk, backend="cpu")
    bad = [
        (dict(raw_kv=TP.PagedKV(raw.pages.double(), raw.block_table)), TypeError, "raw_kv: dtype"),
        (dict(compressed_kv=None), ValueError, "compressed_kv: required"),
        (dict(attn_sink=torch.zeros(3)), ValueError, "attn_sink: expected shape"),
        (dict(sm_scale=float("inf")), ValueError, "sm_scale: must be finite"),
        (dict(topk_indices=topk[:, :2]), ValueError, "topk_indices: expected"),
        (dict(raw_kv=TP.PagedKV(raw.pages, raw.block_table[:, :1])), ValueError, "raw_kv.block_table"),
    ]
    for change, exc, match in bad:
        args = dict(raw_kv=raw, compressed_kv=comp, **kw)
        args.update(change)
        with pytest.raises(exc, match=match):
            TP.prefill_attention(q, meta, **args)
