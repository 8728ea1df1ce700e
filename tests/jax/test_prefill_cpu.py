"""dsv4_jax prefill on backend "cpu": one C kernel call per layer, straight from the caches.

Against the chunk-free float64 oracle (SWA, CSA, HCA; float32 and bf16; every instruction set);
bit for bit the same under every plan (adaptive, fixed, per_request, length order, a budget that
splits requests) and every cache form (logical rows, paged rows, per-request lists, fp8_ds_mla
pages == float rows of the same values); == the generic kernel call on the workspace and index
rows the chunk loop builds; under a user's jax.jit; padding never read; the same bits as the
kernel called through ctypes (what torch calls); the FFI handler's checks of traced metadata.
"""

from __future__ import annotations

import ctypes
import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import dsv4_jax
import planner as P
from dsv4_cpu import binding as ckernel
from dsv4_jax import prefill as JP
from dsv4_jax.kernels.cpu import attention as cpu_attention
from dsv4_jax.kernels.cpu import library as cpu_library
from dsv4_jax.kernels.cpu import prefill as prefill_cpu
from tests.cases import boundary_cases, make_case
from tests.fp8_cases import fp8_cases
from tests.jax.test_prefill import FAST, POLICIES, logical, paged

if (_reason := cpu_library.unavailable_reason()) is not None:
    pytest.skip(f"the C kernel cannot be built here: {_reason}", allow_module_level=True)

ISAS = [isa for isa, ok in ckernel.isa_supported().items() if ok]
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def bf16_case(case):
    """The case on FlashMLA's test data (the values / 10, what its bf16 tolerance is made for),
    q and the caches rounded to bf16: the oracle then sees what the kernel reads."""
    bf = lambda a: (0.1 * np.asarray(a, np.float32)).astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
    return dataclasses.replace(case, q=bf(case.q), raw=[bf(x) for x in case.raw], comp=[bf(x) for x in case.comp])


def sources(case, cache: str, dtype):
    """(raw, comp) of a case in one cache form: "logical", "paged" or "list" (per-request arrays)."""
    if cache == "logical":
        return logical(case.raw, dtype), (logical(case.comp, dtype) if case.kind.has_compressed else None)
    if cache == "paged":
        return paged(case, "raw", dtype, 1), (paged(case, "comp", dtype, 2) if case.kind.has_compressed else None)
    as_list = lambda xs: [jnp.asarray(np.asarray(x, dtype)) for x in xs]  # noqa: E731
    return as_list(case.raw), (as_list(case.comp) if case.kind.has_compressed else None)


def run(case, *, dtype="float32", cache="logical", backend="cpu", srcs=None, **cfg):
    step = P.plan_step(case.batch, case.plan_config(**cfg), [case.layer])
    smeta = JP.build_step_metadata(step, index_topk=case.topk, **FAST)
    meta = smeta[case.kind]
    raw, comp = sources(case, cache, DTYPES[dtype]) if srcs is None else srcs
    q = jnp.asarray(smeta.pad_tokens(case.q).astype(DTYPES[dtype]))
    topk = smeta.pad_tokens(case.topk_rows) if case.kind is P.LayerKind.CSA else None
    out = JP.prefill_attention(
        q, meta, raw, comp, sm_scale=case.sm_scale, attn_sink=jnp.asarray(case.sink), topk_indices=topk, backend=backend
    )
    assert meta.last_backend == ("cpu" if backend in ("cpu", "auto") else backend)
    assert out.shape == (smeta.padded_tokens,) + case.q.shape[1:2] + (min(case.q.shape[2], 512),)
    out = np.asarray(out)
    assert not out[case.batch.num_tokens :].astype(np.float32).any()  # padding rows stay 0
    return out[: case.batch.num_tokens]


def check_oracle(out, case, dtype):
    want, _, _ = case.oracle()
    got = out.astype(np.float64)
    assert not np.isnan(got).any()
    if dtype == "bfloat16":  # FlashMLA's rule, against float64 on the same bf16-rounded inputs
        err = np.abs(got - want)
        assert (err <= np.maximum(8e-4, 3 / 128 * (np.abs(want) + 1e-6))).all(), err.max()
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def bits(x):
    return np.asarray(x).view({2: np.uint16, 4: np.uint32}[np.asarray(x).dtype.itemsize])


# --- the oracle, plans, cache forms ---------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_matches_oracle_bitwise_across_plans_and_caches(ratio, dtype):
    for case in boundary_cases(ratio):
        case = bf16_case(case) if dtype == "bfloat16" else case
        base = run(case, dtype=dtype, backend="auto")  # "auto" on the CPU is the C kernel
        check_oracle(base, case, dtype)
        tight = max(s // ratio if case.kind.has_compressed else 0 for s in case.seq_lens) + case.window_size + 4
        variants = [dict(policy=p) for p in POLICIES[1:]] + [dict(order="length"), dict(budget_rows=tight)]
        variants += [dict(cache="paged"), dict(cache="list", policy="per_request")]
        for kw in variants:
            np.testing.assert_array_equal(bits(run(case, dtype=dtype, **kw)), bits(base), err_msg=f"{case.name} {kw}")


@pytest.mark.parametrize("isa", ISAS)
def test_every_isa(isa, monkeypatch):
    monkeypatch.setenv("DSV4_PREFILL_CPU_ISA", isa)
    for ratio in (4, 128):
        case = boundary_cases(ratio)[2]  # long prefixes
        for dtype in DTYPES:
            c = bf16_case(case) if dtype == "bfloat16" else case
            check_oracle(run(c, dtype=dtype, cache="paged"), c, dtype)


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_model_shapes(ratio):
    """H 64 and 128 with D 512 (a V4 layer), W 128 and top-k 512, bf16, two plans."""
    case = bf16_case(
        make_case("v4-shape", [700, 300], [200, 37], ratio, window_size=128, topk=512, H=64, D=512, seed=8)
    )
    out = run(case, dtype="bfloat16", cache="paged")
    check_oracle(out, case, "bfloat16")
    np.testing.assert_array_equal(bits(run(case, dtype="bfloat16", policy="per_request")), bits(out))


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_fp8_pages_equal_float_rows_of_the_same_values(ratio):
    """fp8_ds_mla pages, dequantized inside the kernel: the oracle on the rows the pages hold, and
    the same bits as float / bf16 rows holding those values, under every plan."""
    for case, raw, comp in fp8_cases(ratio):
        fp8 = lambda p: (
            None
            if p is None
            else JP.PagedKV(p.pages, p.block_table, kv_cache_dtype="fp8_ds_mla", block_size=p.block_size)
        )  # noqa: E731
        for dtype in DTYPES:
            got = run(case, dtype=dtype, srcs=(fp8(raw), fp8(comp)))
            if dtype == "float32":  # (bf16: the same bits as bf16 rows, checked against the oracle above)
                check_oracle(got, case, dtype)
            rows = run(case, dtype=dtype, cache="logical")
            np.testing.assert_array_equal(bits(got), bits(rows), err_msg=f"{case.name} {dtype}")
            for policy in POLICIES[1:]:
                again = run(case, dtype=dtype, srcs=(fp8(raw), fp8(comp)), policy=policy)
                np.testing.assert_array_equal(bits(again), bits(got), err_msg=f"{case.name} {dtype} {policy}")


def test_equals_the_generic_call_on_the_chunk_loops_workspace():
    """The fused call reads the keys the chunk loop gathers, in the same order: per chunk,
    sparse_attention(backend="cpu") on `gather_workspace` + `build_indices` gives the same bits."""
    for ratio in (0, 4, 128):
        case = bf16_case(boundary_cases(ratio)[2])
        tight = max(s // ratio if case.kind.has_compressed else 0 for s in case.seq_lens) + case.window_size + 4
        step = P.plan_step(case.batch, case.plan_config(budget_rows=tight), [case.layer])
        smeta = JP.build_step_metadata(step, index_topk=case.topk, **FAST)
        meta, kp = smeta[case.kind], step[case.kind]
        assert kp.num_chunks > 1
        raw, comp = sources(case, "paged", ml_dtypes.bfloat16)
        topk = smeta.pad_tokens(case.topk_rows) if case.kind is P.LayerKind.CSA else None
        q = jnp.asarray(smeta.pad_tokens(case.q).astype(ml_dtypes.bfloat16))
        out = np.asarray(
            JP.prefill_attention(
                q,
                meta,
                raw,
                comp,
                sm_scale=case.sm_scale,
                attn_sink=jnp.asarray(case.sink),
                topk_indices=topk,
                backend="cpu",
            )
        )
        for c in range(kp.num_chunks):
            ws = JP.gather_workspace(meta, c, raw, comp, dtype=jnp.bfloat16)
            idx, length = JP.build_indices(meta, c, topk)
            rows = kp.token_index[kp.chunk_token_starts[c] : kp.chunk_token_starts[c + 1]]
            got, _, _ = dsv4_jax.sparse_attention(
                q[rows], ws, idx, case.sm_scale, jnp.asarray(case.sink), length, backend="cpu"
            )
            np.testing.assert_array_equal(bits(got), bits(out[rows]), err_msg=f"{case.name} ratio {ratio} chunk {c}")


# --- jit, padding, metadata -----------------------------------------------------------------


def test_user_jit_and_padding_never_read():
    case = boundary_cases(4)[3]
    step = P.plan_step(case.batch, case.plan_config(), [case.layer])
    smeta = JP.build_step_metadata(step, index_topk=case.topk, **FAST)
    raw, comp = sources(case, "paged", np.float32)
    T = case.batch.num_tokens
    q = np.asarray(smeta.pad_tokens(case.q))
    topk = np.asarray(smeta.pad_tokens(case.topk_rows))
    kw = dict(sm_scale=case.sm_scale, attn_sink=jnp.asarray(case.sink), backend="cpu")
    eager = np.asarray(
        JP.prefill_attention(jnp.asarray(q), smeta[case.kind], raw, comp, topk_indices=jnp.asarray(topk), **kw)
    )
    q[T:], topk[T:] = np.nan, 2**31 - 1  # padding: NaN queries, junk top-k ids
    layer = jax.jit(lambda q, meta, raw, comp, topk: JP.prefill_attention(q, meta, raw, comp, topk_indices=topk, **kw))
    fresh = JP.build_step_metadata(step, index_topk=case.topk, **FAST)[case.kind]
    jitted = np.asarray(layer(jnp.asarray(q), fresh, raw, comp, jnp.asarray(topk)))
    np.testing.assert_array_equal(jitted, eager)
    assert not jitted[T:].any()


@pytest.mark.parametrize("policy", POLICIES)
def test_step_tokens_name_the_batch_request(policy):
    """TOK_REQUEST is chunk-local: the kernel gets the batch request (q rows are request-major, so
    a token's request is the one whose query rows hold its q row), and each token's lowest window
    position (its segment's gather start)."""
    case = boundary_cases(4)[2]
    tight = max(s // 4 for s in case.seq_lens) + case.window_size + 4
    extra = dict(budget_rows=tight) if policy == "adaptive" else {}  # (the fixed plan has its own budget)
    step = P.plan_step(case.batch, case.plan_config(policy=policy, order="length", **extra), [case.layer])
    kp = step[case.kind]
    meta = JP.build_step_metadata(step, index_topk=case.topk, **FAST)[case.kind]
    tokens, count = jax.jit(prefill_cpu.step_tokens)(meta.table)
    T = case.batch.num_tokens
    assert int(count) == T and (kp.num_chunks > 1 or policy == "fixed")
    owner = np.repeat(np.arange(len(case.query_lens)), case.query_lens)
    start = np.concatenate([c.gather_starts[c.token_request] for c in kp.chunks])  # the segment's gather start
    np.testing.assert_array_equal(
        np.asarray(tokens)[:, :T], np.stack([kp.token_index, owner[kp.token_index], kp.token_position, start])
    )


def test_ffi_handler_checks_traced_tokens():
    """Metadata the host could not check (traced) never reads or writes outside the arrays:
    a q row or position out of range raises; tokens past the count are skipped, their rows 0."""
    rng = np.random.default_rng(0)
    rows = jnp.asarray(rng.standard_normal((64, 16)).astype(np.float32))
    kv = JP.LogicalKV(rows, jnp.asarray([0, 30], jnp.int32))
    q = jnp.asarray(rng.standard_normal((8, 2, 16)).astype(np.float32))

    def call(tokens, count):
        f = jax.jit(
            lambda q, t, c, raw: cpu_attention.prefill_attention(
                q, t, c, raw, None, None, None, kind="SWA", window=4, compress_ratio=1, sm_scale=0.25
            )
        )
        return np.asarray(f(q, jnp.asarray(tokens, jnp.int32), jnp.int32(count), kv))

    good = [[0, 1, 2, 5], [0, 0, 1, 1], [3, 4, 0, 9]]  # q row, request, position
    full = call(good, 4)
    assert full[[0, 1, 2, 5]].any(axis=(1, 2)).all() and not full[[3, 4, 6, 7]].any()
    some = call(good, 2)  # the last two are padding
    np.testing.assert_array_equal(some[[0, 1]], full[[0, 1]])
    assert not some[2:].any()
    np.testing.assert_array_equal(call(good, 99), full)  # a count past the arrays: all of them
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"token 2: q row 8 outside 0..7"):
        call([[0, 1, 8], [0, 0, 0], [1, 2, 3]], 3)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"token 0: position -1 < 0"):
        call([[0], [0], [-1]], 1)


# --- the kernel torch calls: the same bits ----------------------------------------------------


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


@pytest.mark.parametrize("fmt", ["paged", "fp8"])
def test_same_bits_as_the_kernel_called_through_ctypes(fmt):
    """dsv4_prefill_attention through ctypes (what dsv4_torch calls) on the same arrays, with the
    tokens from the host plan: the JAX layer call's bits."""
    if fmt == "fp8":
        case, raw, comp = fp8_cases(4)[1]
        pages = [raw, comp]
        srcs = tuple(
            JP.PagedKV(p.pages, p.block_table, kv_cache_dtype="fp8_ds_mla", block_size=p.block_size) for p in pages
        )
    else:
        case = bf16_case(boundary_cases(4)[2])
        srcs = sources(case, "paged", ml_dtypes.bfloat16)
    step = P.plan_step(case.batch, case.plan_config(policy="per_request"), [case.layer])
    out = run(case, dtype="bfloat16", srcs=srcs, policy="per_request")
    kp = step[case.kind]
    owner = np.repeat(np.arange(len(case.query_lens)), case.query_lens).astype(np.int32)
    row, pos = np.ascontiguousarray(kp.token_index, np.int32), np.ascontiguousarray(kp.token_position, np.int32)
    req = np.ascontiguousarray(owner[row])
    topk = np.ascontiguousarray(case.topk_rows, np.int32)
    tk = ckernel.PrefillTokens(
        ckernel.KIND_CODES[case.kind.name],
        case.window_size,
        case.ratio,
        len(row),
        _ptr(row),
        _ptr(req),
        _ptr(pos),
        _ptr(topk),
        0,
        topk.shape[1],
        topk.shape[1],
        topk.shape[0],
    )
    keep = []

    def source(src):
        data, table = np.ascontiguousarray(np.asarray(src.pages)), np.ascontiguousarray(np.asarray(src.block_table))
        keep.extend([data, table])
        if src.fp8:
            return ckernel.KVSource(
                1,
                ckernel.BF16,
                _ptr(data),
                0,
                0,
                data.shape[1],
                data.shape[0],
                src.page_size,
                _ptr(table),
                0,
                table.shape[1],
                table.shape[1],
                table.shape[0],
            )
        n, S, D = data.shape
        return ckernel.KVSource(
            0,
            ckernel.BF16,
            _ptr(data),
            D,
            n * S,
            S * D,
            n,
            S,
            _ptr(table),
            0,
            table.shape[1],
            table.shape[1],
            table.shape[0],
        )

    q = np.ascontiguousarray(case.q.astype(ml_dtypes.bfloat16))
    T, H, D = q.shape
    dv = min(D, 512)
    got = np.zeros((T, H, dv), ml_dtypes.bfloat16)
    outs = ckernel.Outputs(_ptr(got), H * dv, dv, None, None, 0)
    sink = np.ascontiguousarray(case.sink, np.float32)
    r, c = source(srcs[0]), source(srcs[1])
    rc = ckernel.library().dsv4_prefill_attention(
        _ptr(q),
        H * D,
        D,
        ckernel.BF16,
        T,
        H,
        D,
        ctypes.byref(tk),
        ctypes.byref(r),
        ctypes.byref(c),
        case.sm_scale,
        _ptr(sink),
        ctypes.byref(outs),
        ctypes.byref(ckernel.parallel(2)),
        -1,
    )
    ckernel.check(rc)
    np.testing.assert_array_equal(bits(got), bits(out))


@pytest.mark.parametrize("fmt", ["paged", "fp8"])
def test_same_bits_as_dsv4_torch(fmt):
    """dsv4_torch's prefill on backend "cpu" and ours, on the same tensors (crossed by DLPack)."""
    try:
        import torch

        from dsv4_torch import prefill as TP
    except ImportError:
        pytest.skip("the torch side needs torch (the jax-only `make test-jax-new` run has none)")
    if fmt == "fp8":
        case, raw, comp = fp8_cases(128)[1]
        kw = dict(kv_cache_dtype="fp8_ds_mla")
        pages = [
            (torch.from_numpy(p.pages), torch.from_numpy(p.block_table), dict(kw, block_size=p.block_size))
            for p in (raw, comp)
        ]
    else:
        case = bf16_case(boundary_cases(128)[2])
        pages = []
        for which, seed in (("raw", 1), ("comp", 2)):
            p, t = case.paged(which, seed=seed)
            pages.append((torch.from_numpy(p).to(torch.bfloat16), torch.from_numpy(t), {}))
    step = P.plan_step(case.batch, case.plan_config(policy="per_request"), [case.layer])
    tq = torch.from_numpy(case.q).to(torch.bfloat16)
    t_out = TP.prefill_attention(
        tq,
        TP.build_step_metadata(step)[case.kind],
        *(TP.PagedKV(p, t, **k) for p, t, k in pages),
        sm_scale=case.sm_scale,
        attn_sink=torch.from_numpy(case.sink),
        backend="cpu",
    )
    srcs = [JP.PagedKV(jax.dlpack.from_dlpack(p), jax.dlpack.from_dlpack(t), **k) for p, t, k in pages]
    smeta = JP.build_step_metadata(step, **FAST)
    q = smeta.pad_tokens(jax.dlpack.from_dlpack(tq))
    j_out = JP.prefill_attention(
        q, smeta[case.kind], *srcs, sm_scale=case.sm_scale, attn_sink=jnp.asarray(case.sink), backend="cpu"
    )
    T = case.batch.num_tokens
    np.testing.assert_array_equal(t_out.view(torch.int16).numpy(), bits(np.asarray(j_out)[:T]).view(np.int16))


# --- bad inputs, no backward ----------------------------------------------------------------


def test_float16_runs_xla_and_a_named_cpu_raises():
    case = boundary_cases(0)[0]
    step = P.plan_step(case.batch, case.plan_config(), [case.layer])
    smeta = JP.build_step_metadata(step, **FAST)
    meta = smeta[case.kind]
    raw, _ = sources(case, "logical", np.float16)
    q = jnp.asarray(smeta.pad_tokens(case.q).astype(np.float16))
    JP.prefill_attention(q, meta, raw, sm_scale=case.sm_scale)
    assert meta.last_backend == "xla"
    with pytest.raises(TypeError, match=r"q: backend='cpu' takes bfloat16 / float32, got float16"):
        JP.prefill_attention(q, meta, raw, sm_scale=case.sm_scale, backend="cpu")


def test_gradient_raises():
    case = boundary_cases(128)[0]
    step = P.plan_step(case.batch, case.plan_config(), [case.layer])
    smeta = JP.build_step_metadata(step, **FAST)
    raw, comp = sources(case, "logical", np.float32)
    q = jnp.asarray(smeta.pad_tokens(case.q))
    f = lambda q: JP.prefill_attention(q, smeta[case.kind], raw, comp, sm_scale=0.2, backend="cpu").sum()  # noqa: E731
    with pytest.raises(NotImplementedError, match=r"prefill_attention: backend='cpu' .* has no backward pass"):
        jax.grad(f)(q)


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_a_donated_out_buffer_gets_the_result(backend):
    """`out=`: the result is written into the donated buffer (the cpu backend's FFI call aliases
    it; the others let XLA reuse it): the same bits as without it, stale contents never shown."""
    case = next(iter(boundary_cases(4)))
    step = P.plan_step(case.batch, case.plan_config(), [case.layer])
    smeta = JP.build_step_metadata(step, index_topk=case.topk, **FAST)
    meta = smeta[case.kind]
    raw, comp = sources(case, "logical", np.float32)
    q = jnp.asarray(smeta.pad_tokens(case.q).astype(np.float32))
    topk = smeta.pad_tokens(case.topk_rows)
    kw = dict(sm_scale=case.sm_scale, attn_sink=jnp.asarray(case.sink), topk_indices=topk, backend=backend)
    want = np.asarray(JP.prefill_attention(q, meta, raw, comp, **kw))
    out = jnp.full(want.shape, np.nan, jnp.float32)  # stale contents: NaN must not survive
    for _ in range(2):
        out = JP.prefill_attention(q, meta, raw, comp, out=out, **kw)
        np.testing.assert_array_equal(bits(out), bits(want))
    with pytest.raises(ValueError, match="out: expected"):
        JP.prefill_attention(q, meta, raw, comp, out=jnp.zeros((3, 2, 1), jnp.float32), **kw)
