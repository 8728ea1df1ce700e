"""transformers' DeepSeek-V4 eager attention == our float64 prefill oracle, fed transformers' own
query, raw KV, compressed KV, indexer top-k and sink (issue 5's external reference).

One SWA, one CSA and one HCA layer of the tiny checkpoint in float64, for a single-call prefill
and for a chunked prefill with a cache (boundaries 37 and 211: not multiples of 4 or W = 8)
followed by one decode step that completes a ratio-4 block.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dsv4_torch.hf.capture import capture_attention, capture_attention_layers  # noqa: E402
from planner import LayerKind  # noqa: E402
from planner.oracle import prefill_attention  # noqa: E402
from tools.tiny_checkpoint import write_tiny_checkpoint  # noqa: E402

LAYERS = {"SWA": 1, "CSA": 2, "HCA": 3}  # layer index of each kind in the tiny preset
PROMPT_LEN = 299  # 2 HCA entries, 74 CSA entries; the decode step at position 299 completes entry 74
CHUNKS = [(0, 37), (37, 211), (211, 299), (299, 300)]  # the last call is a decode step


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)
    # float64 needs the eager experts loop: the default grouped_mm rejects float64.
    m = transformers.DeepseekV4ForCausalLM.from_pretrained(path, experts_implementation="eager")
    return m.double().eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 512, (1, CHUNKS[-1][1]), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def captures(model, ids):
    """{kind: (single-call capture, [capture of each chunked call])}."""
    layers = list(LAYERS.values())
    single, _ = capture_attention_layers(model, ids[:, :PROMPT_LEN], layers)
    cache = transformers.DynamicCache(config=model.config)
    chunked = [
        capture_attention_layers(model, ids[:, a:b], layers, past_key_values=cache, use_cache=True)[0]
        for a, b in CHUNKS
    ]
    return {kind: (single[i], [c[i] for c in chunked]) for kind, i in LAYERS.items()}


def oracle_output(cap):
    """Our chunk-free reference on transformers' own inputs (one request, this call's lengths)."""
    comp = None if cap.compressed_kv is None else [cap.compressed_kv.numpy()]
    topk = None if cap.topk_indices is None else cap.topk_indices.numpy()
    out, _, _ = prefill_attention(
        cap.query.numpy(),
        [cap.raw_kv().numpy()],
        comp,
        [cap.seq_len],
        [cap.query_len],
        kind=cap.kind,
        compress_ratio=cap.compress_ratio,
        window_size=cap.window_size,
        sm_scale=cap.sm_scale,
        attn_sink=cap.sink.numpy(),
        topk_rows=topk,
    )
    return out


def spec_keys(cap, t):
    """Spec section 1: (window positions, compressed entries) of query token t of the capture."""
    p = int(cap.positions[t])
    window = list(range(max(0, p - cap.window_size + 1), p + 1))
    if cap.kind is LayerKind.SWA:
        return window, []
    visible = (p + 1) // cap.compress_ratio
    if cap.kind is LayerKind.HCA:
        return window, list(range(visible))
    return window, sorted(cap.topk_indices[t, : min(visible, cap.topk_indices.shape[1])].tolist())


@pytest.mark.parametrize("kind", LAYERS)
def test_oracle_equals_eager_single_call(captures, kind):
    cap = captures[kind][0]
    assert cap.kind.name == kind and cap.query_len == cap.seq_len == PROMPT_LEN
    np.testing.assert_allclose(oracle_output(cap), cap.output.numpy(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", LAYERS)
def test_oracle_equals_eager_chunked_prefill_and_decode(captures, kind):
    for (a, b), cap in zip(CHUNKS, captures[kind][1]):
        assert (cap.seq_len, cap.query_len) == (b, b - a)
        np.testing.assert_allclose(oracle_output(cap), cap.output.numpy(), rtol=0, atol=1e-12, err_msg=f"{a}:{b}")


@pytest.mark.parametrize("kind", LAYERS)
def test_transformers_masks_are_the_spec_key_sets(captures, kind):
    single, chunked = captures[kind]
    for cap in [single, *chunked]:
        for t, seen in enumerate(cap.visible_keys()):
            assert seen == spec_keys(cap, t), (kind, int(cap.positions[t]))


@pytest.mark.parametrize("kind", LAYERS)
def test_capture_shapes_follow_the_cache(model, captures, kind):
    W, H, D = model.config.sliding_window, model.config.num_attention_heads, model.config.head_dim
    for (a, b), cap in zip(CHUNKS, captures[kind][1]):
        T = b - a
        assert cap.query.shape == (T, H, D) and cap.output.shape == (T, H, D) and cap.sink.shape == (H,)
        assert cap.window_kv.shape == (T + min(a, W - 1), D) and cap.window_start == b - cap.window_kv.shape[0]
        assert cap.sm_scale == D**-0.5
        if kind == "SWA":
            assert cap.compressed_kv is None and cap.topk_indices is None
        else:
            assert cap.compressed_kv.shape == (b // cap.compress_ratio, D)
        if kind == "CSA":
            assert cap.topk_indices.shape == (T, min(model.config.index_topk, b // 4))
        raw = cap.raw_kv()
        assert torch.isnan(raw[: cap.window_start]).all() and not torch.isnan(raw[cap.window_start :]).any()


@pytest.mark.parametrize("kind", LAYERS)
def test_inverse_rope_touches_only_the_last_64_dims(model, captures, kind):
    cap = captures[kind][0]
    rope = model.config.qk_rope_head_dim
    torch.testing.assert_close(cap.output_derotated[..., :-rope], cap.output[..., :-rope], rtol=0, atol=0)
    pairs = lambda x: x[..., -rope:].reshape(*x.shape[:-1], rope // 2, 2).norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(pairs(cap.output_derotated), pairs(cap.output), rtol=1e-6, atol=1e-6)
    moved = (cap.output_derotated[1:, :, -rope:] - cap.output[1:, :, -rope:]).abs().amax()
    assert moved > 1e-3  # positions > 0 really rotate back


@pytest.mark.parametrize("kind", LAYERS)
def test_chunked_prefill_sees_what_single_call_sees(captures, kind):
    """transformers' chunked prefill is the same computation; only its float32 islands round."""
    single, chunked = captures[kind]
    for (a, b), cap in zip(CHUNKS[:-1], chunked[:-1]):
        torch.testing.assert_close(cap.query, single.query[a:b], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cap.output, single.output[a:b], rtol=1e-5, atol=1e-5)
        if kind != "SWA":
            n = cap.compressed_kv.shape[0]
            torch.testing.assert_close(cap.compressed_kv, single.compressed_kv[:n], rtol=1e-5, atol=1e-5)
        if kind == "CSA":
            assert torch.equal(cap.topk_indices, single.topk_indices[a:b, : cap.topk_indices.shape[1]])


def test_one_layer_capture_equals_the_multi_layer_one(model, ids, captures):
    cap, out = capture_attention(model, ids[:, :PROMPT_LEN], LAYERS["CSA"])
    ref = captures["CSA"][0]
    for field in ("query", "window_kv", "compressed_kv", "topk_indices", "attention_mask", "output"):
        assert torch.equal(getattr(cap, field), getattr(ref, field)), field
    assert out.logits.shape == (1, PROMPT_LEN, model.config.vocab_size)


def test_capture_rejects_bad_inputs(model, ids):
    with pytest.raises(ValueError, match="layer_idx"):
        capture_attention(model, ids[:, :8], len(model.model.layers))
    with pytest.raises(ValueError, match="input_ids"):
        capture_attention(model, ids[:, :8].repeat(2, 1), 0)
    with pytest.raises(ValueError, match="position_ids"):
        capture_attention(model, ids[:, :8], 0, position_ids=torch.arange(8)[None])
    with pytest.raises(TypeError, match="model"):
        capture_attention(model.lm_head, ids[:, :8], 0)


def test_unsupported_transformers_version_fails_loudly(monkeypatch):
    from dsv4_torch.hf import versions

    assert versions.require_supported_transformers() == transformers.__version__
    monkeypatch.setattr(versions.metadata, "version", lambda name: "5.30.1")
    with pytest.raises(ImportError, match="5.30.1"):
        versions.require_supported_transformers()
