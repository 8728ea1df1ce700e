"""The JAX DeepSeek-V4.1 model with `kv_cache_dtype="fp8_ds_mla"` (`dsv4_jax.model.mxfp8_cache`:
V4.1's 528-byte mxfp8 records for the window and compressed caches).

- The mxfp8 window step hands the prefill (a `PagedKV` of interleaved records) exactly the
  records of the float window step's rows, over two steps of a ragged batch (ring history copied
  as bytes, page-aligned packing, ring update); compressed entries written and read back through
  their block table likewise. The expected values come from the NumPy record reference
  (`planner.kvcache_v41.encode` / `decode`), the reads from the library's gather.
  Rows on the mxfp8 grid already (transformers' FP8 fake quantization of the window latents) are
  held exactly.
- End to end on the tiny V4.1 checkpoint: with the cached values rounded to mxfp8 first, the
  record model equals the float-cache model (so the records' error is their rounding alone), and
  chunked prefill + decode through the records equals one pass through them.
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from dsv4_jax import kvcache_v41 as JK  # noqa: E402
from dsv4_jax.model import mxfp8_cache as M  # noqa: E402
from dsv4_jax.model.attention import StepInputs, _window_step  # noqa: E402
from dsv4_jax.prefill import PagedKV  # noqa: E402
from planner import kvcache_v41 as KV  # noqa: E402

D = 512
MXFP8 = KV.RECORDS["mxfp8"]


def _rounded(x) -> np.ndarray:
    """Rows (n, 512) -> what mxfp8 records return for them (NumPy reference, bf16-read)."""
    return KV.decode(*KV.encode(np.asarray(x, np.float32), MXFP8), MXFP8)


def _gather(paged: PagedKV, b: int, first: int, seq: int) -> np.ndarray:
    """Positions first .. seq - 1 of request b, read from its block-table row by the library."""
    out = JK.dequantize_and_gather_k_cache(
        jnp.zeros((1, seq - first, D), jnp.float32),
        paged.pages,
        jnp.asarray([seq], jnp.int32),
        jnp.asarray([seq - first], jnp.int32),
        paged.block_table[b : b + 1],
        layout=M.LAYOUT,
    )
    return np.asarray(out[0])


def _step(slots, prefix, query, B_pad=4, T_pad=80, num_slots=4):
    B, T = len(slots), sum(query)
    pad = lambda a, n, fill: np.array(list(a) + [fill] * (n - len(a)), np.int32)  # noqa: E731
    pos = np.concatenate([np.arange(p, p + q) for p, q in zip(prefix, query)])
    return StepInputs(
        token_ids=np.zeros(T_pad, np.int32),
        positions=pad(pos, T_pad, 0),
        token_request=pad(np.repeat(np.arange(B), query), T_pad, 0),
        token_valid=pad(np.ones(T, bool), T_pad, False).astype(bool),
        slot=pad(slots, B_pad, num_slots),
        prefix=pad(prefix, B_pad, 0),
        seq_len=pad(np.array(prefix) + np.array(query), B_pad, 0),
        token_start=pad(np.concatenate([[0], np.cumsum(query)[:-1]]), B_pad, T),
    )


def test_window_step_hands_the_prefill_the_float_rows_records():
    W, S, mml = 8, 4, 192
    rng = np.random.default_rng(0)
    # a request past a page boundary (positions 60..75), a ring wrapping, a new request
    steps = [_step([2, 0], [0, 0], [13, 3]), _step([2, 0, 1], [13, 3, 0], [5, 66, 2])]
    window, ring = jnp.zeros((S, W - 1, D), jnp.float32), M.window_pages(S, W)
    assert ring.dtype == jnp.uint8 and ring.shape[1:] == (M.PAGE, M.RECORD)
    step_fn = jax.jit(M.window_step, static_argnums=(3, 4))
    for st in steps:
        kv = jnp.asarray(rng.standard_normal((80, D)).astype(np.float32) * np.exp(rng.uniform(-4, 4, (80, 1))))
        raw, window = _window_step(window, kv, st)
        paged, ring = step_fn(ring, kv, st, W, mml)
        assert isinstance(paged, PagedKV) and paged.kv_cache_dtype == "fp8_ds_mla" and paged.layout == "interleaved"
        assert paged.block_table.shape == (4, -(-mml // M.PAGE))
        rows, off = np.asarray(raw.rows), np.asarray(raw.offsets)
        for b in range(int((np.asarray(st.seq_len) > 0).sum())):
            seq, prefix = int(st.seq_len[b]), int(st.prefix[b])
            first = prefix - min(prefix, W - 1)  # the window history and the new tokens
            want = _rounded(rows[off[b] + first : off[b] + seq])
            np.testing.assert_array_equal(_gather(paged, b, first, seq), want)
    # rows on the mxfp8 grid already (transformers' FP8 fake quantization) are held exactly
    from dsv4_jax.model.v41_attention import fake_quant_fp8

    fq = np.asarray(jax.jit(fake_quant_fp8)(kv))
    np.testing.assert_array_equal(_rounded(fq), fq)
    paged, _ = step_fn(ring, jnp.asarray(fq), steps[0], W, mml)
    np.testing.assert_array_equal(_gather(paged, 0, 0, 13), fq[:13])
    # the ring: slot s's last W - 1 positions, each its row's record (bytes copied, not requantized)
    for s, seq in ((2, 18), (0, 69)):
        got = np.asarray(M.read_rows(ring, s * (W - 1), W - 1))
        np.testing.assert_array_equal(got, _rounded(np.asarray(window[s])))


def test_entries_written_and_read_through_their_block_table():
    S, mml, ratio = 3, 300, 2
    cap = M.entry_capacity(mml, ratio)
    assert cap == 192 and cap % M.PAGE == 0
    pages = M.entry_pages(S, mml, ratio)
    assert pages.shape == (S * cap // M.PAGE, M.PAGE, M.RECORD)
    rng = np.random.default_rng(1)
    entries = np.zeros((S, cap, D), np.float32)
    for slot, w0, n in ((1, 0, 70), (0, 0, 5), (1, 70, 3), (2, 120, 30)):
        x = rng.standard_normal((n, D)).astype(np.float32)
        dst = jnp.asarray(np.r_[np.full(n, slot), [S]], jnp.int32)  # and one to a slot outside: dropped
        pages = M.write_entries(
            pages, dst, jnp.asarray(np.r_[np.arange(w0, w0 + n), [0]], jnp.int32), np.r_[x, x[:1]], cap
        )
        entries[slot, w0 : w0 + n] = x
    step = _step([1, 2, 0], [0, 0, 0], [1, 1, 1])
    paged = M.entries_kv(pages, step, cap)
    assert isinstance(paged, PagedKV) and paged.kv_cache_dtype == "fp8_ds_mla"
    for b, (slot, n) in enumerate(((1, 73), (2, 150), (0, 5))):
        np.testing.assert_array_equal(_gather(paged, b, 0, n), _rounded(entries[slot, :n]))


# ----------------------------------------------------------------------------- the model

OPTIONS = dict(
    max_batch_size=4,
    max_model_len=512,
    max_num_batched_tokens=128,
    min_tokens=128,
    token_buckets="pow2",
    min_requests=4,
    min_workspace_rows=256,
)
PROMPT = np.random.default_rng(5).integers(3, 512, 97).tolist()


def test_model_through_mxfp8_records_equals_a_float_cache_of_their_values(tmp_path, monkeypatch):
    """The records' error is their rounding and nothing else: with the window latents and the
    compressed entries rounded to mxfp8 before any cache stores them (the fake quantization's
    hooks pointed at the record's rounding: FP8 per 32 dims for both, index q / k unquantized),
    the record model computes the float-cache model's logits (the records then hold their values
    exactly, so a slot, page or ring mix-up would show): a ragged batch and a decode step; and
    chunked prefill + decode through the records equals one pass through them (ring history
    copied as bytes across steps and pages).

    As they stand (fake quantization off), the records move this random 7-layer model's logits
    by 0.26 RMS relative to the float caches (measured; transformers' FP8 fake quantization of
    the window, the same rounding, with its FP4 roundings moves them by 0.30)."""
    from dsv4_jax.model import v41_attention as A
    from dsv4_jax.model.v41 import DeepseekV41
    from dsv4_jax.model.v41_checkpoint import load_checkpoint
    from tools.tiny_checkpoint import write_tiny_v41_checkpoint

    ckpt = write_tiny_v41_checkpoint(tmp_path / "hf", seed=0, fmt="hf")
    cfg, params = load_checkpoint(ckpt)
    fq8 = A.fake_quant_fp8
    monkeypatch.setattr(A, "fake_quant_fp4", lambda x, block, e4m3_scales=False: fq8(x, 32) if e4m3_scales else x)
    jax.clear_caches()  # these programs trace the hooks above: none of them may serve another test
    try:
        kw = dict(fake_quant=True, tokenizer_file=ckpt / "tokenizer.json", **OPTIONS)
        flt = DeepseekV41(cfg, params, **kw)
        fp8 = DeepseekV41(cfg, params, kv_cache_dtype="fp8_ds_mla", **kw)
        assert fp8.kv_cache_dtype == "fp8_ds_mla" and flt.kv_cache_dtype == "auto"
        cache8 = fp8.init_cache()
        assert all(c["window"].dtype == jnp.uint8 and c["window"].shape[-1] == M.RECORD for c in cache8)
        assert [("entries" in c) for c in cache8] == [("entries" in c) for c in flt.init_cache()]
        assert all(c["entries"].dtype == jnp.uint8 for c in cache8 if "entries" in c)
        out, caches = {}, {}
        for name, m in (("float", flt), ("fp8", fp8)):
            cache, o = m.step(m.init_cache(), [3, 1], [0, 0], [PROMPT, PROMPT[:61]], all_tokens=True)
            cache, d = m.step(cache, [3, 1], [97, 61], [[5], [7]])
            out[name] = np.concatenate([*map(np.asarray, o.request_logits()), np.asarray(d.logits)[:2]])
            caches[name] = cache
        assert np.abs(out["fp8"] - out["float"]).max() < 2e-5
        Wc = cfg.sliding_window - 1  # layer 0 reads nothing else: its rings hold the float rings' values
        for slot in (1, 3):
            got = np.asarray(M.read_rows(caches["fp8"][0]["window"], slot * Wc, Wc))
            np.testing.assert_array_equal(got, np.asarray(caches["float"][0]["window"][slot]))

        full = PROMPT + [77, 401]
        _, one = fp8.step(fp8.init_cache(), [2], [0], [full], all_tokens=True)
        cache, parts = fp8.init_cache(), []
        for a, b in ((0, 37), (37, 52), (52, 97)):  # chunk edges off the ratio-2 pairs, pages and window
            cache, o = fp8.step(cache, [2], [a], [PROMPT[a:b]], all_tokens=True)
            parts.append(o.request_logits()[0])
        for i, tok in enumerate(full[97:]):  # decode steps
            cache, o = fp8.step(cache, [2], [97 + i], [[tok]])
            parts.append(o.request_logits()[0][None])
        np.testing.assert_allclose(np.concatenate(parts), np.asarray(one.request_logits()[0]), atol=2e-5, rtol=0)
    finally:
        jax.clear_caches()
