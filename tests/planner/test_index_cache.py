"""planner.index_cache: vLLM's indexer key cache bytes (fp8 values then float32 scales per page)."""

import ml_dtypes
import numpy as np
import pytest

from planner import index_cache as ic


def test_layout_and_round_trip():
    rng = np.random.default_rng(0)
    D, S = 128, 4
    k = (rng.standard_normal((5, D)) * np.array([1, 1e-3, 300, 1e-6, 7])[:, None]).astype(np.float32)
    cache = np.full((3, S, D + 4), 0xEE, np.uint8)
    slots = np.array([1, 4, 11, 6, -1])
    ic.indexer_k_quant_and_cache(k, cache, slots, D)
    page = cache.reshape(3, -1)
    kb = k.astype(ml_dtypes.bfloat16).astype(np.float32)
    for t, s in enumerate(slots[:4]):
        p, j = divmod(int(s), S)
        data = page[p, j * D : (j + 1) * D].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        scale = float(page[p, S * D + 4 * j : S * D + 4 * j + 4].view("<f4")[0])
        amax = max(float(np.abs(kb[t]).max()), 1e-4)
        assert scale == 2.0 ** np.ceil(np.log2(np.float32(amax) * np.float32(1 / 448)))  # ue8m0
        assert np.abs(data).max() <= 448
        assert np.allclose(data * scale, kb[t], rtol=2**-3, atol=scale * 2**-9)
        want = np.clip(kb[t] / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        assert (page[p, j * D : (j + 1) * D] == want).all()
    untouched = np.ones((3, S * (D + 4)), bool)
    for s in slots[:4]:
        p, j = divmod(int(s), S)
        untouched[p, j * D : (j + 1) * D] = False
        untouched[p, S * D + 4 * j : S * D + 4 * j + 4] = False
    assert (page[untouched] == 0xEE).all()
    keys = ic.gather_index_keys(cache, np.array([[0, 1, 2]]), [12])[0]
    vals, scales = ic.read_index_slots(cache, slots[:4])
    assert np.array_equal(keys[slots[:4]], vals * scales[:, None])


def test_strided_pages():
    rng = np.random.default_rng(1)
    k = rng.standard_normal((3, 16)).astype(np.float32)
    big = np.zeros((2, 3, 2, 20), np.uint8)  # a per-layer view with a larger page stride
    ic.indexer_k_quant_and_cache(k, big[:, 1], [0, 3, 2], 16)
    assert (big[:, 0] == 0).all() and (big[:, 2] == 0).all()
    vals, scales = ic.read_index_slots(big[:, 1], [0, 3, 2])
    assert np.allclose(vals * scales[:, None], k, rtol=2**-3, atol=1e-6)


@pytest.mark.parametrize(
    "args, err, match",
    [
        (dict(quant_block_size=64), ValueError, "quant_block_size: the cache holds one scale per key"),
        (dict(k=np.zeros((2, 8), np.float32)), ValueError, r"k: expected shape \[T, 16\]"),
        (dict(k=np.full((2, 16), np.inf, np.float32)), ValueError, "k: must be finite"),
        (dict(slot_mapping=[0, 99]), ValueError, "slot_mapping: slot_mapping\\[1\\] = 99"),
        (dict(slot_mapping=[1, 1]), ValueError, "slot 1 appears more than once"),
        (dict(kv_cache=np.zeros((2, 4, 20), np.int8)), TypeError, "kv_cache: expected uint8"),
        (dict(kv_cache_dtype="mxfp8"), ValueError, "kv_cache_dtype: expected 'ue8m0'"),
        (dict(kv_cache_dtype=None), ValueError, "kv_cache_dtype: expected 'ue8m0'"),
    ],
)
def test_bad_inputs(args, err, match):
    kw = dict(k=np.ones((2, 16), np.float32), kv_cache=np.zeros((2, 4, 20), np.uint8), slot_mapping=[0, 5])
    kw["quant_block_size"] = 16
    kw.update(args)
    with pytest.raises(err, match=match):
        ic.indexer_k_quant_and_cache(**kw)
