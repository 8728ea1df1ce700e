"""Hostile inputs through every public entry point of the native library, in both frameworks.

A seeded fuzz (bad indices, lengths, block tables, page sizes, token rows and positions, sinks,
dtypes, strides) and the specific attacks found before: each call must either raise a clear
ValueError / TypeError (JAX: an XLA runtime error saying INVALID_ARGUMENT for values only known
inside a jitted call) or return a result of the right shape, whose valid parts match the float64
oracle. Never a crash, never a read or write outside the arrays: `make test-sanitize` runs this
file against an AddressSanitizer + UndefinedBehaviorSanitizer build of the library.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dsv4_torch  # noqa: E402
from dsv4_torch import kvcache as TK  # noqa: E402
from dsv4_torch import prefill as TP  # noqa: E402
from dsv4_torch.kernels.cpu import attention as TC  # noqa: E402
from dsv4_torch.kernels.cpu import library as TL  # noqa: E402
from planner import kvcache as PK  # noqa: E402
from planner import oracle  # noqa: E402

if (_reason := TL.unavailable_reason()) is not None:
    pytest.fail(f"the cpu backend cannot be built here: {_reason}", pytrace=False)

I32 = np.iinfo(np.int32)
CLEAN = (ValueError, TypeError)
N_CASES = 40


def _hostile_ints(rng, shape, lo, hi):
    """Mostly in [lo, hi), with negatives, -1, INT32 extremes and values just past hi mixed in."""
    x = rng.integers(lo, max(hi, lo + 1), shape).astype(np.int64)
    bad = rng.random(shape) < 0.3
    pool = np.array([-1, -2, I32.min, I32.max, hi, hi + 1, 1 << 30, -(1 << 30)], np.int64)
    x[bad] = rng.choice(pool, int(bad.sum()))
    return x.astype(np.int32)


# ----------------------------------------------------------------------------- sparse attention


@pytest.mark.parametrize("seed", range(N_CASES))
def test_torch_sparse_attention_fuzz(seed):
    rng = np.random.default_rng(seed)
    T, H, S, K = int(rng.integers(0, 5)), int(rng.integers(1, 20)), int(rng.integers(0, 40)), int(rng.integers(0, 70))
    D = int(rng.choice([8, 64, 512, 576]))
    dtype = rng.choice(["bfloat16", "float32", "float32", "float16", "int32"])
    tdt = getattr(torch, dtype)
    q = torch.randn(T, H, D).to(tdt) if dtype != "int32" else torch.zeros(T, H, D, dtype=tdt)
    kv = torch.randn(S, D).to(q.dtype)
    if rng.random() < 0.2 and T > 1:  # strided q (last dim contiguous) or a transposed one
        q = torch.randn(H, T, D).to(q.dtype).transpose(0, 1)
    idx = torch.from_numpy(_hostile_ints(rng, (T, K), 0, S))
    tl = None if rng.random() < 0.3 else torch.from_numpy(_hostile_ints(rng, (T,), 0, K + 1))
    sink = None if rng.random() < 0.3 else torch.from_numpy(rng.choice([-np.inf, 0.0, 3.0, 1e4, np.inf], H)).float()
    if rng.random() < 0.15:  # a shape that does not fit
        idx = idx[: max(T - 1, 0)]
    try:
        out, ml, lse = dsv4_torch.sparse_attention(q, kv, idx, 0.1, sink, tl, backend="cpu")
    except CLEAN:
        return
    assert dtype in ("bfloat16", "float32") and out.shape == (T, H, min(D, 512))
    ro, rm, rl = oracle.sparse_attention(
        q.double().numpy(),
        kv.double().numpy(),
        idx.numpy(),
        0.1,
        None if sink is None else sink.double().numpy(),
        None if tl is None else tl.numpy(),
    )
    tol = 3e-2 if dtype == "bfloat16" else 1e-4
    with np.errstate(invalid="ignore"):
        np.testing.assert_allclose(out.double().numpy(), ro, atol=tol, rtol=tol)
        np.testing.assert_array_equal(np.isposinf(lse.numpy()), np.isposinf(rl))


# ----------------------------------------------------------------------------- prefill


def _prefill_case(rng):
    """A prefill layer call with hostile block tables and page bytes, and (half the time) hostile
    token rows / requests / positions; otherwise tokens the caches can address, so the kernel walks
    pages whose ids may be garbage (those keys read as NaN)."""
    B, W, r = int(rng.integers(1, 4)), int(rng.integers(1, 9)), int(rng.integers(1, 9))
    kind = str(rng.choice(["SWA", "CSA", "HCA"]))
    H, D, S = int(rng.integers(1, 9)), 512 if rng.random() < 0.5 else 64, int(rng.choice([1, 2, 4]))
    fp8 = D == 512 and rng.random() < 0.5
    hostile = rng.random() < 0.5
    pages_per = int(rng.integers(1, 12))
    num_pages = int(rng.integers(1, B * pages_per + 2))
    table = torch.from_numpy(_hostile_ints(rng, (B, pages_per), 0, num_pages))
    if fp8:
        raw_pages = torch.from_numpy(rng.integers(0, 256, (num_pages, PK.page_bytes(S)), dtype=np.uint8))
        raw = TP.PagedKV(raw_pages, table, kv_cache_dtype="fp8_ds_mla", block_size=S)
    else:
        raw = TP.PagedKV(torch.randn(num_pages, S, D).to(torch.bfloat16), table)
    capacity = pages_per * S
    comp = None
    if kind != "SWA":
        n_rows = int(rng.integers(0, 30))
        offsets = _hostile_ints(rng, (B,), 0, 10) if hostile else rng.integers(0, 3, B).astype(np.int32)
        comp = TP.LogicalKV(torch.randn(n_rows, D).to(torch.bfloat16), torch.from_numpy(offsets).long())
        capacity = min(capacity, max(0, (n_rows - int(offsets.max()) + 1) * r - 1))
    T = int(rng.integers(0, 12))
    if hostile:
        rows = _hostile_ints(rng, (T,), 0, T)
        req = _hostile_ints(rng, (T,), 0, B)
        pos = _hostile_ints(rng, (T,), 0, 40)
    else:
        rows = rng.permutation(T).astype(np.int32)
        req = rng.integers(0, B, T).astype(np.int32)
        pos = rng.integers(0, max(capacity, 1), T).astype(np.int32)
    q = torch.randn(T, H, D).to(torch.bfloat16)
    k = int(rng.integers(0, 9))
    topk = torch.from_numpy(_hostile_ints(rng, (T if not hostile else max(T - int(rng.integers(0, 2)), 0), k), 0, 12))
    sink = torch.from_numpy(rng.choice([-np.inf, 0.5, 2.0], H)).float()
    return q, np.stack([rows, req, pos]).astype(np.int32), raw, comp, topk, sink, kind, W, r


@pytest.mark.parametrize("seed", range(N_CASES))
def test_torch_prefill_fuzz(seed):
    q, tokens, raw, comp, topk, sink, kind, W, r = _prefill_case(np.random.default_rng(1000 + seed))
    try:
        out = TC.prefill_attention(
            q, tokens, raw, comp, topk, sink, kind=kind, window=W, compress_ratio=r, sm_scale=0.05
        )
    except CLEAN:
        return
    assert out.shape == (q.shape[0], q.shape[1], min(q.shape[2], 512))


def _small_prefill():
    """A valid one-request CSA layer on bf16 rows: 6 tokens at positions 10..15, pages of 4."""
    g = torch.Generator().manual_seed(0)
    T, H, D = 6, 4, 64
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    raw = TP.PagedKV(
        torch.randn(4, 4, D, generator=g).to(torch.bfloat16), torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    )
    comp = TP.LogicalKV(torch.randn(8, D, generator=g).to(torch.bfloat16), torch.tensor([0]))
    topk = torch.tensor([[0, 1, 2, 3]] * T, dtype=torch.int32)
    tokens = np.stack([np.arange(T), np.zeros(T), 10 + np.arange(T)]).astype(np.int32)
    kw = dict(kind="CSA", window=4, compress_ratio=4, sm_scale=0.1)
    return q, tokens, raw, comp, topk, kw


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("row", 6, r"tokens\[2\]: row 6 outside q's rows 0..5"),  # past T: was a heap-buffer-overflow read
        ("row", -1, r"tokens\[2\]: row -1 outside"),  # was a use-after-free
        ("row", I32.min, r"tokens\[2\]: row -2147483648 outside"),  # was a segfault
        ("position", I32.max, r"tokens\[2\]: position 2147483647 outside"),  # was a signed overflow in make_tiles
        ("position", (1 << 31) - 2, r"tokens\[2\]: position 2147483646 outside"),  # was tens of GB allocated
        ("position", 17, r"tokens\[2\]: position 17 of request 0 is past what raw addresses \(16 entries\)"),
        ("position", -3, r"tokens\[2\]: position -3 outside"),
        ("request", 1, r"tokens\[2\]: request 1 has no row in raw's table"),
        ("request", -1, r"tokens\[2\]: request -1 < 0"),
    ],
)
def test_prefill_token_values_are_checked_before_use(field, value, message):
    q, tokens, raw, comp, topk, kw = _small_prefill()
    tokens[{"row": 0, "request": 1, "position": 2}[field], 2] = value
    with pytest.raises(ValueError, match=message):
        TC.prefill_attention(q, tokens, raw, comp, topk, **kw)


def test_prefill_table_and_dtype_errors():
    q, tokens, raw, comp, topk, kw = _small_prefill()
    TC.prefill_attention(q, tokens, raw, comp, topk, **kw)  # the valid case runs
    with pytest.raises(ValueError, match=r"tokens\[.\]: row . outside topk's 3 rows"):
        TC.prefill_attention(q, tokens, raw, comp, topk[:3], **kw)
    narrow = TP.PagedKV(raw.pages, raw.block_table[:, :2])
    with pytest.raises(ValueError, match="is past what raw addresses"):
        TC.prefill_attention(q, tokens, narrow, comp, topk, **kw)
    few = TP.LogicalKV(comp.rows[:2], comp.offsets)
    with pytest.raises(ValueError, match="sees 3 compressed entries, comp addresses 2"):
        TC.prefill_attention(q, tokens, raw, few, topk, **kw)
    with pytest.raises(TypeError, match="float16"):
        TC.prefill_attention(q.half(), tokens, raw, comp, topk, **kw)
    with pytest.raises(TypeError, match="q: backend='cpu' takes bfloat16 / float32, got torch.float16"):
        dsv4_torch.resolve_backend("cpu", q.half())
    small = torch.zeros(2, 100, dtype=torch.uint8)  # pages too small for their slots
    with pytest.raises(ValueError, match="page stride 100 bytes is not"):  # the cache type says so
        TP.PagedKV(small, raw.block_table, kv_cache_dtype="fp8_ds_mla", block_size=4)
    with pytest.raises(ValueError, match="raw_kv: page stride 100 bytes is not"):  # and so does the binding
        TC.paged_source(small, raw.block_table, 4, True, torch.bfloat16, "raw_kv", [])


# ----------------------------------------------------------------------------- gather


@pytest.mark.parametrize("seed", range(N_CASES))
def test_torch_gather_fuzz(seed):
    rng = np.random.default_rng(2000 + seed)
    S, nb, R = int(rng.choice([1, 2, 16])), int(rng.integers(1, 6)), int(rng.integers(0, 4))
    cache = torch.from_numpy(rng.integers(0, 256, (nb, PK.page_bytes(S)), dtype=np.uint8))
    seq = torch.from_numpy(_hostile_ints(rng, (R,), 0, nb * S + 3))
    glen = None if rng.random() < 0.3 else torch.from_numpy(_hostile_ints(rng, (R,), 0, nb * S + 3))
    bt = torch.from_numpy(_hostile_ints(rng, (R, int(rng.integers(0, nb + 2))), 0, nb))
    rows = int(rng.integers(0, nb * S + 4))
    big = torch.full((R, rows + 3, 512), 7.0, dtype=torch.bfloat16)
    out = big[:, :rows]
    try:
        TK.dequantize_and_gather_k_cache(
            out, cache, seq, glen, bt, S, int(rng.integers(0, 3)), backend="cpu", validate=False
        )
    except CLEAN:
        return
    assert (big[:, rows:] == 7).all()  # nothing written past out's rows


# ----------------------------------------------------------------------------- JAX


@pytest.mark.parametrize("seed", range(N_CASES // 2))
def test_jax_entry_points_fuzz(seed):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import dsv4_jax
    from dsv4_jax import prefill as JP
    from dsv4_jax.kernels.cpu import attention as JC

    rng = np.random.default_rng(3000 + seed)
    T, H, S, K, D = (
        int(rng.integers(0, 5)),
        int(rng.integers(1, 9)),
        int(rng.integers(0, 30)),
        int(rng.integers(0, 40)),
        64,
    )
    q = jnp.asarray(rng.standard_normal((T, H, D)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((S, D)), jnp.float32)
    idx = jnp.asarray(_hostile_ints(rng, (T, K), 0, S))
    tl = jnp.asarray(_hostile_ints(rng, (T,), 0, K + 1))
    out, _, lse = jax.jit(lambda q, kv, i, t: dsv4_jax.sparse_attention(q, kv, i, 0.1, None, t, backend="cpu"))(
        q, kv, idx, tl
    )
    ro, _, rl = oracle.sparse_attention(
        np.asarray(q, np.float64), np.asarray(kv, np.float64), np.asarray(idx), 0.1, None, np.asarray(tl)
    )
    np.testing.assert_allclose(np.asarray(out), ro, atol=1e-4, rtol=1e-4)

    tq, tokens, raw, comp, topk, sink, kind, W, r = _prefill_case(rng)
    to_j = lambda t: (
        jnp.asarray(t.float().numpy()).astype(jnp.bfloat16) if t.dtype == torch.bfloat16 else jnp.asarray(t.numpy())
    )  # noqa: E731
    if raw.kv_cache_dtype == "fp8_ds_mla":
        jraw = JP.PagedKV(
            jnp.asarray(raw.pages.numpy()),
            jnp.asarray(raw.block_table.numpy()),
            kv_cache_dtype="fp8_ds_mla",
            block_size=raw.block_size,
        )
    else:
        jraw = JP.PagedKV(to_j(raw.pages), jnp.asarray(raw.block_table.numpy()))
    jcomp = None if comp is None else JP.LogicalKV(to_j(comp.rows), jnp.asarray(comp.offsets.numpy().astype(np.int32)))
    jtopk = jnp.asarray(topk.numpy()) if kind == "CSA" and topk.dim() == 2 else None
    try:
        o = JC.prefill_attention(
            to_j(tq),
            jnp.asarray(tokens),
            tokens.shape[1],
            jraw,
            jcomp,
            jtopk,
            jnp.asarray(sink.numpy()),
            kind=kind,
            window=W,
            compress_ratio=r,
            sm_scale=0.05,
        )
        jax.block_until_ready(o)
    except CLEAN:
        return
    except Exception as e:  # noqa: BLE001 - values only seen inside the call: XLA's runtime error
        assert "INVALID_ARGUMENT" in str(e) or "dsv4_prefill_attention" in str(e), e
        return
    assert o.shape == (tq.shape[0], tq.shape[1], min(tq.shape[2], 512))


@pytest.mark.parametrize("seed", range(N_CASES // 2))
def test_jax_gathers_fuzz(seed):
    """The XLA FFI gathers: vLLM's gather (traced lengths and block tables) and the prefill's
    segment gather (hostile segment tables and bounds): a clear error or rows, never a stray access."""
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from dsv4_jax import kvcache as JK
    from dsv4_jax.kernels.cpu import kvcache as JCK

    rng = np.random.default_rng(4000 + seed)
    S, nb, R = int(rng.choice([1, 2, 16])), int(rng.integers(1, 6)), int(rng.integers(1, 4))
    cache = jnp.asarray(rng.integers(0, 256, (nb, PK.page_bytes(S)), dtype=np.uint8))
    seq = jnp.asarray(_hostile_ints(rng, (R,), 0, nb * S + 3))
    glen = jnp.asarray(_hostile_ints(rng, (R,), 0, nb * S + 3))
    bt = jnp.asarray(_hostile_ints(rng, (R, int(rng.integers(1, nb + 2))), 0, nb))
    rows = int(rng.integers(1, nb * S + 4))
    out = jnp.full((R, rows, 512), 7.0, jnp.bfloat16)
    try:
        got = JK.dequantize_and_gather_k_cache(out, cache, seq, glen, bt, S, 0, backend="cpu", validate=False)
        assert got.shape == out.shape
    except CLEAN:
        pass
    except Exception as e:  # noqa: BLE001 - values only seen inside the call: XLA's runtime error
        assert "INVALID_ARGUMENT" in str(e) or "dsv4_" in str(e), e
    L = int(rng.integers(1, 6))
    ws = jnp.full((int(rng.integers(1, 40)), 512), 3.0, jnp.float32)
    region = np.sort(_hostile_ints(rng, (L + 1,), 0, 20)) if rng.random() < 0.5 else _hostile_ints(rng, (L + 1,), 0, 20)
    args = [jnp.asarray(x) for x in (region, _hostile_ints(rng, (L,), 0, R), _hostile_ints(rng, (L,), 0, 30))]
    start = None if rng.random() < 0.5 else jnp.asarray(_hostile_ints(rng, (L,), 0, 8))
    s0, s1, dst = (int(x) for x in _hostile_ints(rng, (3,), 0, L + 1))
    try:
        got = JCK.gather_segments(ws, cache, bt, *args, start, s0, s1, dst, S)
        assert got.shape == ws.shape
    except CLEAN:
        pass
    except Exception as e:  # noqa: BLE001
        assert "INVALID_ARGUMENT" in str(e) or "dsv4_" in str(e), e
