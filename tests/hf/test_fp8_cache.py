"""enable_sparse_prefill(model, kv_cache_dtype="fp8_ds_mla") on the tiny checkpoint (float32, CPU).

The fp8 path must be exactly the model run on fp8-rounded latents: the default (float) path with
every raw and compressed row it reads replaced by what vLLM's fp8_ds_mla pages would hand back
(NumPy reference writer + reader) gives the same bits, through chunked prefill, decode and beam
search (the cache reorder moves fp8 slots). Against the float cache it is close, not equal: see
`test_fp8_cache_stays_close_to_the_float_cache`.
"""

import contextlib

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from dsv4_torch.hf import integration as I  # noqa: E402
from dsv4_torch.hf import layer as L  # noqa: E402
from planner import kvcache as KV  # noqa: E402


@pytest.fixture(scope="module")
def model(tiny_checkpoint_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    m = transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_checkpoint_dir).eval()
    yield m
    torch.set_num_threads(threads)


@contextlib.contextmanager
def sparse(model, **kw):
    I.enable_sparse_prefill(model, backend="reference", **kw)
    try:
        yield model
    finally:
        I.disable_sparse_prefill(model)


def _fp8_rounded(t: torch.Tensor) -> torch.Tensor:
    """Rows (..., 512) -> the values fp8_ds_mla pages return for them (NumPy reference)."""
    x = t.detach().float().numpy().reshape(-1, KV.HEAD_DIM).astype(ml_dtypes.bfloat16).astype(np.float32)
    n, S = x.shape[0], 64
    pages = np.zeros((-(-n // S), KV.page_bytes(S)), np.uint8)
    KV.quantize_and_insert_k_cache(x, pages, np.arange(n), S)
    out = np.zeros((1, n, KV.HEAD_DIM), np.float32)
    KV.dequantize_and_gather_k_cache(out, pages, [n], None, np.arange(pages.shape[0])[None], S, 0)
    return torch.from_numpy(out[0]).view(t.shape).to(t.dtype)


def rounded_source(src):
    """A float cache (the window regions' `LogicalKV`, the entries' `PagedKV`) with `_fp8_rounded` rows."""
    if isinstance(src, L.LogicalKV):
        return L.LogicalKV(_fp8_rounded(src.rows), src.offsets)
    return L.PagedKV(_fp8_rounded(src.pages), src.block_table)


@contextlib.contextmanager
def float_path_on_fp8_rounded_rows(model, monkeypatch):
    """The default cache, but every page the prefill reads holds fp8-rounded rows."""
    real = L.prefill_attention

    def rounded(q, meta, raw, comp=None, **kw):
        raw = rounded_source(raw)
        comp = None if comp is None else rounded_source(comp)
        return real(q, meta, raw, comp, **kw)

    with monkeypatch.context() as m:
        m.setattr(L, "prefill_attention", rounded)
        with sparse(model):
            yield


def calls(model, ids, bounds):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = torch.cat(
            [model(ids[:, a:b], past_key_values=cache, use_cache=True).logits for a, b in zip(bounds, bounds[1:])], 1
        )
    return out, cache


IDS = torch.randint(3, 512, (2, 150), generator=torch.Generator().manual_seed(0))
BOUNDS = [0, 37, 130, 148, 149, 150]  # chunked prefill (HCA block 0 closes in the 2nd call), 2 decode steps


@pytest.fixture(scope="module")
def fp8_run(model):
    with sparse(model, kv_cache_dtype="fp8_ds_mla"):
        return calls(model, IDS, BOUNDS)


def test_fp8_cache_is_the_model_on_fp8_rounded_latents(model, fp8_run, monkeypatch):
    fp8, cache = fp8_run
    state = cache._dsv4_sparse_state
    for idx, layer in state.layers.items():  # the caches are fp8_ds_mla pages (the indexer's keys are not)
        assert layer.window.dtype == torch.uint8 and layer.window.shape[1] == KV.page_bytes(64), idx
        if "compressor" in layer.compressors:
            assert layer.compressors["compressor"].entries.dtype == torch.uint8
            assert (
                layer.compressors.get("indexer") is None or layer.compressors["indexer"].entries.dtype == torch.float32
            )
    with float_path_on_fp8_rounded_rows(model, monkeypatch):
        want, _ = calls(model, IDS, BOUNDS)
    assert torch.equal(fp8, want)


def test_fp8_cache_stays_close_to_the_float_cache(model, fp8_run):
    """Tolerance: e4m3 keeps 3 mantissa bits, so every cached latent moves by up to 2^-4 of its
    value (about 3% RMS over a 64-dim group); this random-weight tiny model amplifies that through
    its 6 layers to about 12% RMS of the logits (measured; a trained model is robust to it: fp8 KV
    is DeepSeek-V4's native cache). The bound is 2x the measured error; most greedy tokens agree."""
    with sparse(model):
        ref, _ = calls(model, IDS, BOUNDS)
    fp8 = fp8_run[0]
    rms = lambda t: t.pow(2).mean().sqrt().item()  # noqa: E731
    assert 1e-3 < rms(fp8 - ref) / rms(ref) < 0.25  # changed (the cache is fp8), but not by much
    assert (fp8.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.75


def test_fp8_cache_beam_search_reorders_fp8_slots(model, monkeypatch, tiny_checkpoint_dir):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_checkpoint_dir)
    enc = tok(["Question: Liam had 45 coins and gave 11 of them to Emma. How many are left?"], return_tensors="pt")
    kw = dict(max_new_tokens=4, num_beams=3, do_sample=False)
    with torch.no_grad():
        with sparse(model, kv_cache_dtype="fp8_ds_mla"):
            fp8 = model.generate(**enc, **kw)
        with float_path_on_fp8_rounded_rows(model, monkeypatch):
            want = model.generate(**enc, **kw)
    assert torch.equal(fp8, want)


def test_fp8_cache_bad_settings(model):
    with pytest.raises(ValueError, match=r"kv_cache_dtype: expected one of \('auto', 'fp8_ds_mla'\), got 'fp8'"):
        I.enable_sparse_prefill(model, kv_cache_dtype="fp8")
    assert not I.is_sparse_prefill_enabled(model)
    # bytes carry no gradient: a forward that could be differentiated is refused, not run half-way
    with (
        sparse(model, kv_cache_dtype="fp8_ds_mla"),
        pytest.raises(ValueError, match=r"kv_cache_dtype: the fp8_ds_mla caches hold bytes"),
    ):
        model(IDS[:1, :9], use_cache=False)
