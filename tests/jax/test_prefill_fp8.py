"""dsv4_jax prefill on vLLM's fp8_ds_mla pages: oracle on the dequantized rows, fp8 pages == float
pages of the same values, an exact workspace (== NumPy, == torch bitwise), bad inputs.

Compiles are what cost here: the full layer call runs on one CSA case (the format only changes the
gathers, which the workspace test checks for every kind)."""

import jax.numpy as jnp
import numpy as np
import pytest

import planner as P
from dsv4_jax import prefill as JP
from planner import kvcache as KV
from tests.fp8_cases import fp8_cases

TILES = dict(token_tile=16, gather_tile=64)  # small ladders: faster compiles


def _fp8(p):
    return JP.PagedKV(p.pages, p.block_table, kv_cache_dtype="fp8_ds_mla", block_size=p.block_size)


def _meta(case, **cfg):
    step = P.plan_step(case.batch, case.plan_config(**cfg), [case.layer])
    return step, JP.build_step_metadata(step, index_topk=case.topk, **TILES)


def test_fp8_prefill_matches_oracle_and_float_pages():
    case, raw, comp = fp8_cases(4)[1]
    _, m = _meta(case)
    meta = m[case.kind]
    kw = dict(sm_scale=case.sm_scale, attn_sink=case.sink, topk_indices=m.pad_tokens(case.topk_rows), backend="xla")
    q = jnp.asarray(m.pad_tokens(case.q))
    T = case.q.shape[0]
    out = np.asarray(JP.prefill_attention(q, meta, _fp8(raw), _fp8(comp), **kw))[:T]
    assert meta.last_backend == "xla"
    want, _, _ = case.oracle()  # float64 on the rows the pages hold
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    same = JP.prefill_attention(q, meta, [jnp.asarray(x) for x in case.raw], [jnp.asarray(x) for x in case.comp], **kw)
    assert np.array_equal(np.asarray(same)[:T], out)  # the same values as float rows: the same bits


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_fp8_workspace_exact_and_equal_to_torch(ratio):
    case, raw, comp = fp8_cases(ratio)[1]
    budget = (max(case.seq_lens) // ratio if ratio else 0) + case.window_size + 13  # several chunks
    step, m = _meta(case, budget_rows=budget)
    kp, meta = step[case.kind], m[case.kind]
    assert kp.num_chunks > 1
    try:
        import torch

        from dsv4_torch import prefill as TP

        t_meta = TP.build_step_metadata(step, index_topk=case.topk)[case.kind]
        t_src = [
            TP.PagedKV(
                torch.from_numpy(p.pages),
                torch.from_numpy(p.block_table),
                kv_cache_dtype="fp8_ds_mla",
                block_size=p.block_size,
            )
            if p
            else None
            for p in (raw, comp)
        ]
    except ImportError:  # the jax-only CI run (make test-jax-new) has no torch
        t_meta = None
    for c in range(kp.num_chunks):
        want = P.layout.gather_workspace(kp, c, case.raw, case.comp if comp else None, fill=np.nan)
        written = ~np.isnan(want[:, 0])
        ws = JP.gather_workspace(meta, c, _fp8(raw), _fp8(comp) if comp else None)
        assert ws.dtype == jnp.bfloat16
        got = np.asarray(ws.astype(jnp.float32))[: want.shape[0]]
        np.testing.assert_array_equal(got[written], want[written])  # exact
        if t_meta is not None:  # torch == JAX, bit for bit
            t_ws = TP.gather_workspace(t_meta, c, *t_src)
            j_bits = np.asarray(ws).view(np.uint16)[: want.shape[0]]
            assert np.array_equal(t_ws.view(torch.int16).numpy().view(np.uint16)[written], j_bits[written])


def test_fp8_bad_inputs():
    case, raw, comp = fp8_cases(4)[1]
    _, m = _meta(case)
    meta = m[case.kind]
    q = jnp.asarray(m.pad_tokens(case.q))
    S = raw.block_size
    fp8 = dict(kv_cache_dtype="fp8_ds_mla", block_size=S)

    def call(raw_kv, compressed_kv=_fp8(comp), q=q):
        return JP.prefill_attention(
            q,
            meta,
            raw_kv,
            compressed_kv,
            sm_scale=case.sm_scale,
            topk_indices=m.pad_tokens(case.topk_rows),
            backend="xla",
        )

    with pytest.raises(TypeError, match=r"pages: fp8_ds_mla pages are uint8 bytes, got float32"):
        JP.PagedKV(raw.pages.astype(np.float32), raw.block_table, **fp8)
    with pytest.raises(TypeError, match=r"pages: uint8 pages hold fp8_ds_mla bytes: pass kv_cache_dtype='fp8_ds_mla'"):
        JP.PagedKV(raw.pages[:, None], raw.block_table)
    with pytest.raises(ValueError, match=r"block_size: required for fp8_ds_mla pages"):
        JP.PagedKV(raw.pages, raw.block_table, kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(
        ValueError, match=rf"pages: page stride {KV.page_bytes(S) - 576} bytes is not round_up\({S} \* 584, 576\)"
    ):
        JP.PagedKV(raw.pages[:, :-576], raw.block_table, **fp8)
    with pytest.raises(
        ValueError, match=r"pages: a \(38, 16, 584\) array has a page stride of 9344 bytes, not page_bytes\(16\) = 9792"
    ):
        JP.PagedKV(np.zeros((38, S, KV.SLOT_BYTES), np.uint8), raw.block_table, kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(ValueError, match=r"kv_cache_dtype: expected one of \('auto', 'fp8_ds_mla'\), got 'fp8'"):
        JP.PagedKV(raw.pages, raw.block_table, kv_cache_dtype="fp8", block_size=S)
    bad = raw.block_table.copy()
    bad[1, 5] = raw.pages.shape[0]
    with pytest.raises(
        ValueError,
        match=rf"raw_kv: block_table\[1\] lists page {raw.pages.shape[0]}, outside 0..{raw.pages.shape[0] - 1}",
    ):
        call(JP.PagedKV(raw.pages, bad, **fp8))
    with pytest.raises(
        ValueError,
        match=r"raw_kv: block_table covers 16 entries per request \(1 pages of 16\), but request 1 needs 517",
    ):
        call(JP.PagedKV(raw.pages, raw.block_table[:, :1], **fp8))
    with pytest.raises(
        TypeError,
        match=r"raw_kv: fp8_ds_mla pages dequantize to bf16 values: q must be bfloat16 or float32, got float16",
    ):
        call(_fp8(raw), q=q.astype(jnp.float16))
    with pytest.raises(ValueError, match=r"raw_kv: fp8_ds_mla pages hold 512-dim rows, but q's head dim is 256"):
        call(_fp8(raw), q=q[..., :256])
    packed = JP.LogicalKV(raw.pages.reshape(-1)[: 10 * 512].reshape(10, 512), np.zeros(3, np.int32))
    with pytest.raises(
        TypeError, match=r"raw_kv: dtype uint8 differs from q's float32 \(fp8_ds_mla bytes come as PagedKV"
    ):
        call(packed)


def test_cpu_gather_path_equals_tile_decode(monkeypatch):
    """On CPU the prefill gathers fp8 pages with the C kernel (an XLA FFI call, where it builds):
    the same bits as the tiles' exact decode it replaces, workspace and layer output."""
    import jax

    from dsv4_jax.kernels.cpu import kvcache as cpu_kvcache
    from dsv4_jax.kernels.cpu import library as cpu_library

    if (reason := cpu_library.unavailable_reason()) is not None:
        pytest.skip(f"the cpu backend's FFI kernel cannot be built here: {reason}")
    assert JP._cpu_gather()
    case, raw, comp = fp8_cases(4)[1]
    step, m = _meta(case, budget_rows=max(case.seq_lens) // 4 + case.window_size + 13)
    meta = m[case.kind]
    kw = dict(sm_scale=case.sm_scale, attn_sink=case.sink, topk_indices=m.pad_tokens(case.topk_rows), backend="xla")
    q = jnp.asarray(m.pad_tokens(case.q))
    calls = []
    real = cpu_kvcache.gather_segments
    monkeypatch.setattr(cpu_kvcache, "gather_segments", lambda *a: calls.append(1) or real(*a))
    jax.clear_caches()  # the jitted layer call / gathers trace again, with and without the kernel
    got = {
        dt: np.asarray(JP.prefill_attention(q.astype(dt), meta, _fp8(raw), _fp8(comp), **kw))
        for dt in (jnp.float32, jnp.bfloat16)
    }
    ws = [np.asarray(JP.gather_workspace(meta, c, _fp8(raw), _fp8(comp))) for c in range(step[case.kind].num_chunks)]
    assert calls  # the kernel ran
    monkeypatch.setattr(JP, "_cpu_gather", lambda: False)
    jax.clear_caches()
    for dt, g in got.items():
        assert np.array_equal(np.asarray(JP.prefill_attention(q.astype(dt), meta, _fp8(raw), _fp8(comp), **kw)), g), dt
    for c, w in enumerate(ws):
        want = np.asarray(JP.gather_workspace(meta, c, _fp8(raw), _fp8(comp)))
        assert np.array_equal(want.view(np.uint16), w.view(np.uint16)), c
    jax.clear_caches()
