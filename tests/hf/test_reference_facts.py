"""Pinned behaviours of transformers' DeepSeek-V4 that our integration must work around
(docs/transformers-dsv4.md, "Bugs and limitations"). If one of these starts failing, transformers
changed: update the notes and the integration."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tools.tiny_checkpoint import tiny_config, write_tiny_checkpoint  # noqa: E402

PAD = 2


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    load = transformers.DeepseekV4ForCausalLM.from_pretrained
    return {
        "compressed": load(write_tiny_checkpoint(root / "full")).eval(),
        "swa_only": load(write_tiny_checkpoint(root / "swa", config=tiny_config(compress_ratios=(0,) * 6))).eval(),
    }


def padded_error(model, side: str) -> float:
    """Max |logit difference| of a padded short prompt in a batch vs the prompt alone."""
    g = torch.Generator().manual_seed(0)
    long, short = torch.randint(3, 512, (1, 40), generator=g), torch.randint(3, 512, (1, 22), generator=g)
    pad = torch.full((1, 18), PAD)
    row = torch.cat([pad, short], 1) if side == "left" else torch.cat([short, pad], 1)
    mask = (row != PAD).long()
    ids = torch.cat([long, row])
    mask = torch.cat([torch.ones_like(long), mask])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # what generate() passes
    with torch.no_grad():
        alone = model(short, use_cache=False).logits[0]
        batch = model(ids, attention_mask=mask, position_ids=pos, use_cache=False).logits[1]
    real = batch[18:] if side == "left" else batch[:22]
    return (real - alone).abs().max().item()


def test_left_padding_breaks_compressed_layers_only(models):
    assert padded_error(models["compressed"], "left") > 1e-2  # compressor pools pad slots, misaligned blocks
    assert padded_error(models["swa_only"], "left") < 1e-4  # the dense mask handles padding
    assert padded_error(models["compressed"], "right") < 1e-4  # pads after the prompt are never visible


def test_custom_attention_function_gets_no_mask(models, monkeypatch):
    """A function registered in AttentionInterface receives attention_mask=None: the window mask
    and the compressors' causal / top-k block bias are both lost."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mod

    seen = []

    def spy(module, q, k, v, attention_mask, **kwargs):
        seen.append((module.layer_idx, k.shape[2], attention_mask))
        return mod.eager_attention_forward(module, q, k, v, attention_mask, **kwargs)

    transformers.AttentionInterface.register("dsv4_test_spy", spy)
    model = models["compressed"]
    ids = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager = model(ids).logits
        model.set_attn_implementation("dsv4_test_spy")
        try:
            spied = model(ids).logits
        finally:
            model.set_attn_implementation("eager")
    assert seen and all(mask is None for _, _, mask in seen)
    assert {n for i, n, _ in seen if model.config.layer_types[i] == "compressed_sparse_attention"} == {40 + 40 // 4}
    assert (spied - eager).abs().max() > 1e-2


def _chunked_vs_single(model, ids, bounds):
    with torch.no_grad():
        full = model(ids).logits
        cache = transformers.DynamicCache(config=model.config)
        parts = [model(ids[:, a:b], past_key_values=cache, use_cache=True).logits for a, b in zip(bounds, bounds[1:])]
    return (torch.cat(parts, 1) - full).abs().max().item()


@pytest.mark.slow
def test_float64_model_keeps_float32_islands_and_chunking_is_exact_without_them(tmp_path, monkeypatch):
    """In a .double() model, norms / mHC / RoPE / gate softmaxes / indexer scores still run in float32,
    so chunked and one-call logits differ at ~1e-7. Forcing those casts to float64 leaves ~1e-14:
    transformers' chunked prefill and decode are the same computation as its one-call prefill."""
    model = (
        transformers.DeepseekV4ForCausalLM.from_pretrained(
            write_tiny_checkpoint(tmp_path / "ckpt"), experts_implementation="eager"
        )
        .double()
        .eval()
    )
    ids = torch.randint(3, 512, (1, 133), generator=torch.Generator().manual_seed(2))
    bounds = [0, 1, 37, 130, 132, 133]  # one-token calls, an HCA block closing inside a call, a decode step
    assert 1e-10 < _chunked_vs_single(model, ids, bounds) < 1e-4

    for module in model.modules():  # RoPE inv_freq buffers are float32 even after .double()
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.dtype == torch.float32:
                module._buffers[name] = buf.double()
    f64 = lambda d: torch.float64 if d is torch.float32 else d  # noqa: E731
    to, softmax = torch.Tensor.to, torch.Tensor.softmax

    def to_f64(self, *args, **kwargs):
        args = tuple(f64(a) if isinstance(a, torch.dtype) else a for a in args)
        if "dtype" in kwargs:
            kwargs["dtype"] = f64(kwargs["dtype"])
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "float", lambda self: to(self, torch.float64))
    monkeypatch.setattr(torch.Tensor, "to", to_f64)
    monkeypatch.setattr(
        torch.Tensor,
        "softmax",
        lambda self, *a, **k: softmax(self, *a, **({**k, "dtype": f64(k["dtype"])} if "dtype" in k else k)),
    )
    assert _chunked_vs_single(model, ids, bounds) < 1e-12
