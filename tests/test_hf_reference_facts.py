"""Pinned behaviours of transformers' DeepSeek-V4 that our integration must work around
(docs/transformers-dsv4.md, "Bugs and limitations"). If one of these starts failing, transformers
changed: update the notes and the integration."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dsv4_torch.hf.tiny_checkpoint import tiny_config, write_tiny_checkpoint  # noqa: E402

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
