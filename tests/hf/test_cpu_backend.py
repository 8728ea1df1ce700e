"""enable_sparse_prefill(model) with backend "auto" on CPU: inference runs the fused C kernel ("cpu").

Tiny checkpoint, float32. Without a gradient (generate, `torch.no_grad()`), "auto" resolves to "cpu"
for every layer kind, and the logits match transformers' eager attention within the float32
tolerance of tests/hf/test_integration.py, through one-call and chunked prefill, decode steps and
`generate`; on fp8_ds_mla pages they are exactly the float path's on the pages' values. With a
gradient needed "auto" stays on the reference backend (the only one with a backward), and a named
"cpu" refuses.
"""

import contextlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from dsv4_cpu import binding as ckernel  # noqa: E402
from dsv4_torch import BackendUnavailableError  # noqa: E402
from dsv4_torch.hf import integration as I  # noqa: E402
from dsv4_torch.hf import layer as L  # noqa: E402

_REASON = ckernel.unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"the C kernel cannot be built here: {_REASON}")

TOL = 1e-5  # as tests/hf/test_integration.py: float32 logits against eager
CPU = {"SWA": "cpu", "CSA": "cpu", "HCA": "cpu"}


@pytest.fixture(scope="module")
def model(tiny_checkpoint_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    m = transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_checkpoint_dir).eval()
    yield m
    torch.set_num_threads(threads)


@contextlib.contextmanager
def sparse(model, **kw):
    I.enable_sparse_prefill(model, **kw)
    try:
        yield model
    finally:
        I.disable_sparse_prefill(model)


def ids_of(n, seed, rows=1):
    return torch.randint(3, 512, (rows, n), generator=torch.Generator().manual_seed(seed))


def calls(model, ids, bounds):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        return torch.cat(
            [model(ids[:, a:b], past_key_values=cache, use_cache=True).logits for a, b in zip(bounds, bounds[1:])], 1
        )


def err(a, b):
    return (a - b).abs().max().item()


def test_auto_runs_cpu_and_matches_eager(model):
    ids = ids_of(150, 0, rows=2)  # HCA entry 0 closes; 37 CSA entries (top-8 selects)
    bounds = [0, 37, 130, 148, 149, 150]  # chunked prefill, then two decode steps
    with torch.no_grad():
        eager_one = model(ids).logits
    eager = calls(model, ids, bounds)
    with sparse(model):
        with torch.no_grad():
            one = model(ids).logits
        assert I.last_forward(model).backends == CPU
        chunked = calls(model, ids, bounds)
        assert I.last_forward(model).backends == CPU and I.last_forward(model).query_lens == [1, 1]
    assert err(one, eager_one) < TOL
    assert err(chunked, eager) < TOL


def test_generate_matches_eager(model, tiny_checkpoint_dir):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_checkpoint_dir)
    enc = tok("Question: Mia has 12 pencils. Noah gives Mia 30 more pencils. How many now? " * 5, return_tensors="pt")
    assert enc["input_ids"].shape[1] > 128
    kw = dict(max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        eager = model.generate(**enc, **kw)
        with sparse(model):
            ours = model.generate(**enc, **kw)
            assert I.last_forward(model).backends == CPU
    assert torch.equal(ours, eager)


def test_fp8_cache_is_the_model_on_fp8_rounded_latents(model, monkeypatch):
    """fp8_ds_mla pages on "auto" (the kernel dequantizes them) give exactly the bits of the float
    cache on "auto" whose rows are the pages' values (tests/hf/test_fp8_cache.py's check, on the
    cpu backend). Against another backend the fp8 cache is no fair test: e4m3 rounding steps
    amplify last-bit differences through the layers (and flip CSA's top-k)."""
    from tests.hf.test_fp8_cache import rounded_source

    ids = ids_of(150, 1, rows=2)
    bounds = [0, 37, 130, 148, 149, 150]
    with sparse(model, kv_cache_dtype="fp8_ds_mla"):
        fp8 = calls(model, ids, bounds)
        assert I.last_forward(model).backends == CPU
    real = L.prefill_attention

    def rounded(q, meta, raw, comp=None, **kw):
        raw = rounded_source(raw)
        comp = None if comp is None else rounded_source(comp)
        return real(q, meta, raw, comp, **kw)

    monkeypatch.setattr(L, "prefill_attention", rounded)
    with sparse(model):
        want = calls(model, ids, bounds)
        assert I.last_forward(model).backends == CPU
    assert torch.equal(fp8, want)


def test_gradient_keeps_the_reference_backend(model):
    ids = ids_of(40, 2)
    with sparse(model):
        model(ids).logits.sum().backward()  # grad mode on: the sinks require grad
        assert I.last_forward(model).backends == {"SWA": "reference", "CSA": "reference", "HCA": "reference"}
    model.zero_grad(set_to_none=True)
    with sparse(model, backend="cpu"):
        with pytest.raises(BackendUnavailableError, match="backend='cpu' has no backward"):
            model(ids)
        with torch.no_grad():
            model(ids)
        assert I.last_forward(model).backends == CPU


def test_long_decode_through_window_rebuilds_matches_eager(model):
    """20 single-token calls after a 50-token prefill: every layer's window region (64 rows: 50
    tokens + room for W = 8) fills at the 14th step and is rebuilt from its last W-1 rows; logits
    stay eager's."""
    ids = ids_of(70, 3, rows=2)
    bounds = [0, 50, *range(51, 71)]
    eager = calls(model, ids, bounds)
    with sparse(model):
        steps = calls(model, ids, bounds)
        assert I.last_forward(model).backends == CPU
    assert err(steps, eager) < TOL


def test_cache_moves_between_inference_mode_and_no_grad(model):
    """State written under torch.inference_mode (inference tensors, which torch refuses to change
    in place outside it) continues under no_grad and back, with the same logits."""
    ids = ids_of(40, 4, rows=2)
    bounds = [0, 30, 31, 32, 33]
    with sparse(model):
        ref = calls(model, ids, bounds)
        cache, out = DynamicCache(config=model.config), []
        for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
            with torch.inference_mode() if k % 2 == 0 else torch.no_grad():
                out.append(model(ids[:, a:b], past_key_values=cache, use_cache=True).logits.clone())
    assert torch.equal(torch.cat(out, 1), ref)
