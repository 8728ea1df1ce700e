"""The JAX model with `kv_cache_dtype="fp8_ds_mla"` (dsv4_jax.model.fp8_cache).

- The fp8 window step hands the prefill exactly the fp8-rounded rows of the float window step,
  over two steps of a ragged batch (ring history, page-aligned packing, ring update).
- End to end on a tiny checkpoint of one CSA layer (its window and compressed caches; HCA's
  take the same code with another ratio; small tiles: this file pays for its own compiles): the logits are close to transformers + our
  torch path with the same fp8 cache (measured 1.1e-5 RMS of the logits: the two frameworks' float
  noise can flip an fp8 rounding, bound 1e-3) and, like it, off the float cache by what e4m3
  rounding of the latents does to this random-weight model (measured 1.0% RMS for its one layer;
  bound 0.2%..10%: it must change, and not by much; tests/hf/test_fp8_cache.py says more).
"""

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from dsv4_jax import kvcache as JK  # noqa: E402
from dsv4_jax.model import attention as A  # noqa: E402
from dsv4_jax.model import fp8_cache as F  # noqa: E402
from planner import kvcache as KV  # noqa: E402

D = KV.HEAD_DIM


def _rounded(x: np.ndarray) -> np.ndarray:
    """Rows (n, 512) -> what fp8_ds_mla pages return for them (NumPy reference)."""
    x = np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    n = x.shape[0]
    pages = np.zeros((-(-n // 64), KV.page_bytes(64)), np.uint8)
    KV.quantize_and_insert_k_cache(x, pages, np.arange(n), 64)
    out = np.zeros((1, n, D), np.float32)
    KV.dequantize_and_gather_k_cache(out, pages, [n], None, np.arange(pages.shape[0])[None], 64, 0)
    return out[0]


def _step(slots, prefix, query, B_pad=4, T_pad=16, num_slots=4):
    B, T = len(slots), sum(query)
    pad = lambda a, n, fill: np.array(list(a) + [fill] * (n - len(a)), np.int32)  # noqa: E731
    req = np.repeat(np.arange(B), query)
    pos = np.concatenate([np.arange(p, p + q) for p, q in zip(prefix, query)])
    seq = np.array(prefix) + np.array(query)
    return A.StepInputs(
        token_ids=np.zeros(T_pad, np.int32),
        positions=pad(pos, T_pad, 0),
        token_request=pad(req, T_pad, 0),
        token_valid=pad(np.ones(T, bool), T_pad, False).astype(bool),
        slot=pad(slots, B_pad, num_slots),
        prefix=pad(prefix, B_pad, 0),
        seq_len=pad(seq, B_pad, 0),
        token_start=pad(np.concatenate([[0], np.cumsum(query)[:-1]]), B_pad, T),
    )


def test_fp8_window_step_is_the_float_window_step_rounded():
    W, S, mml = 8, 4, 64
    Wc = W - 1
    rng = np.random.default_rng(0)
    steps = [_step([2, 0], [0, 0], [10, 3]), _step([2, 0, 1], [10, 3, 0], [5, 1, 2])]
    window, ring = jnp.zeros((S, Wc, D), jnp.float32), F.window_pages(S, W)
    for st in steps:
        kv = jnp.asarray(rng.standard_normal((16, D)).astype(np.float32))
        raw, window = A._window_step(window, kv, st)
        paged, ring = jax.jit(F.window_step, static_argnums=(3, 4))(ring, kv, st, W, mml)
        assert paged.kv_cache_dtype == "fp8_ds_mla" and paged.block_table.shape == (4, mml // 64)
        rows, off = np.asarray(raw.rows), np.asarray(raw.offsets)
        for b in range(int((np.asarray(st.seq_len) > 0).sum())):
            seq, prefix = int(st.seq_len[b]), int(st.prefix[b])
            first = prefix - min(prefix, W - 1)  # what a prefill reads: the window history and the new tokens
            want = _rounded(rows[off[b] + first : off[b] + seq])
            out = JK.dequantize_and_gather_k_cache(
                jnp.zeros((1, seq - first, D), jnp.bfloat16),
                paged.pages,
                jnp.asarray([seq], jnp.int32),
                jnp.asarray([seq - first], jnp.int32),
                paged.block_table[b : b + 1],
                64,
                0,
            )
            np.testing.assert_array_equal(np.asarray(out[0].astype(jnp.float32)), want)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tools.tiny_checkpoint import tiny_config, write_tiny_checkpoint

    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("fp8-ckpt") / "hf", seed=0, config=tiny_config(compress_ratios=(4,), num_hash_layers=0)
    )


BOUNDS = [0, 37, 101, 148, 149, 150]  # chunked prefill (HCA entry 0 closes at 127), two decode steps


def test_fp8_model_end_to_end_close_to_torch_fp8_and_float(checkpoint):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers import DynamicCache

    from dsv4_jax.model import DeepseekV4
    from dsv4_jax.model.generate import JaxGenerator
    from dsv4_torch.hf import integration as I
    from tests.jax.model_cases import PROMPT_A

    ids = PROMPT_A[:150]
    opts = dict(
        max_batch_size=4,
        max_model_len=512,
        max_num_batched_tokens=320,
        backend="xla",
        min_tokens=64,
        min_workspace_rows=1024,
        token_tile=16,
        gather_tile=16,
    )
    model = DeepseekV4.from_checkpoint(checkpoint, dtype="float32", kv_cache_dtype="fp8_ds_mla", **opts)
    cache, logits = model.init_cache(), []
    assert all(c["window"].dtype == jnp.uint8 and c["entries"].dtype == jnp.uint8 for c in cache)
    for a, b in zip(BOUNDS[:-1], BOUNDS[1:]):
        cache, out = model.step(cache, [3], [a], [ids[a:b]], all_tokens=True)
        logits.append(out.request_logits()[0])
    ours = np.concatenate(logits)
    assert np.isfinite(ours).all()

    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(checkpoint).eval()

    def torch_path(kv_cache_dtype):
        I.enable_sparse_prefill(hf, backend="reference", kv_cache_dtype=kv_cache_dtype)
        try:
            c, t = DynamicCache(config=hf.config), torch.tensor([ids])
            with torch.no_grad():
                return torch.cat(
                    [hf(t[:, a:b], past_key_values=c, use_cache=True).logits for a, b in zip(BOUNDS, BOUNDS[1:])], 1
                )[0].numpy()
        finally:
            I.disable_sparse_prefill(hf)

    fp8, ref = torch_path("fp8_ds_mla"), torch_path("auto")
    rms = lambda x: float(np.sqrt(np.mean(np.square(x))))  # noqa: E731
    assert rms(ours - fp8) / rms(ref) < 1e-3  # the same fp8 cache (measured 1.1e-5) ...
    assert 2e-3 < rms(ours - ref) / rms(ref) < 0.1  # ... and, like it, off the float cache (measured 1.0%)
    assert 2e-3 < rms(fp8 - ref) / rms(ref) < 0.1
    # JaxGenerator takes the option through to the model and its cache
    gen = JaxGenerator(checkpoint, backend="xla", kv_cache_dtype="fp8_ds_mla", max_batch_size=2, max_model_len=128)
    assert gen.model.kv_cache_dtype == "fp8_ds_mla" and gen.cache[0]["window"].dtype == jnp.uint8
    with pytest.raises(ValueError, match=r"kv_cache_dtype: expected one of \('auto', 'fp8_ds_mla'\), got 'fp8'"):
        DeepseekV4.from_checkpoint(checkpoint, dtype="float32", kv_cache_dtype="fp8", **opts)
