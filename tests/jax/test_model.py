"""The JAX DeepSeek-V4 model (`dsv4_jax.model`) against transformers' `DeepseekV4ForCausalLM`.

Tiny random fp32 checkpoints (written once per session). transformers runs one request at a time
(its eager path gets ragged batches wrong in compressed layers, docs/transformers-dsv4.md
section 10), one call per sequence: its chunked path equals its one-call path to ~1e-6.
Prompt A (254 tokens) gives every layer kind compressed entries (HCA entry 0 at position 127);
decoding 4 tokens after it completes a ratio-4 block and HCA entry 1 (position 255).

Compile budget: the model compiles one program per (layer kind, bucketed shapes); the tests share
a few shapes on purpose (min_tokens=64 makes every step of <= 64 tokens one bucket; steps of
225..256 tokens are another). Torch is imported here only, never by dsv4_jax.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dsv4_jax.model import DeepseekV4, ModelConfig  # noqa: E402
from dsv4_jax.model.checkpoint import load_checkpoint, read_safetensors, to_transformers_names  # noqa: E402
from dsv4_jax.model.generate import JaxGenerator  # noqa: E402
from dsv4_jax.model.layers import rope_inv_freq  # noqa: E402
from tests.jax.model_cases import (  # noqa: E402
    DECODE_A,
    MODEL_OPTIONS,
    PROMPT_A,
    PROMPT_B,
    PROMPT_C,
    chunked_then_decode,
)
from tools.tiny_checkpoint import tiny_config  # noqa: E402

TOL = 1e-4
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def checkpoints(tiny_checkpoints):
    return tiny_checkpoints


@pytest.fixture(scope="session")
def hf_model(checkpoints):
    return transformers.DeepseekV4ForCausalLM.from_pretrained(checkpoints["hf"]).eval()


@pytest.fixture(scope="session")
def hf_logits(hf_model):
    """One-call transformers logits of a token list (float32 NumPy (T, vocab)), memoised."""
    memo = {}

    def run(ids):
        key = tuple(ids)
        if key not in memo:
            with torch.no_grad():
                memo[key] = hf_model(torch.tensor([ids]), use_cache=False).logits[0].numpy()
        return memo[key]

    return run


@pytest.fixture(scope="session")
def model(checkpoints):
    return DeepseekV4.from_checkpoint(checkpoints["hf"], dtype="float32", **MODEL_OPTIONS)


@pytest.fixture(scope="session")
def one_call_a(model):
    _, out = model.step(model.init_cache(), [0], [0], [PROMPT_A], all_tokens=True)
    return out.request_logits()[0]


def _max_err(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max())


# ----------------------------------------------------------------------------- config, loading


def test_config_from_both_name_styles_and_presets(checkpoints):
    tiny = ModelConfig.from_name("tiny")
    assert ModelConfig.from_checkpoint(checkpoints["hf"]) == tiny
    assert ModelConfig.from_checkpoint(checkpoints["deepseek"]) == tiny  # MTP slot dropped, legacy fields folded
    assert tiny == ModelConfig.from_dict(tiny_config())
    flash, pro = ModelConfig.from_name("V4-Flash"), ModelConfig.from_name("v4_pro")
    from planner.contract import ModelShape

    for cfg, shape in ((flash, ModelShape.from_name("V4-Flash")), (pro, ModelShape.from_name("V4-Pro"))):
        assert cfg.layers == shape.layers[:-1]  # the planner's list ends with the MTP layer
        assert cfg.compress_ratios == tuple(s.compress_ratio for s in shape.layers[:-1])
        assert (cfg.num_attention_heads, cfg.sliding_window, cfg.index_topk) == (
            shape.num_heads,
            shape.window_size,
            shape.index_topk,
        )
    with pytest.raises(ValueError, match="name"):
        ModelConfig.from_name("V5")
    with pytest.raises(ValueError, match="compress_ratios"):
        ModelConfig.from_dict({**tiny_config(), "layer_types": None, "compress_ratios": [0, 8, 4, 128, 4, 128]})
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_dict({"model_type": "llama"})


def test_rope_tables_equal_transformers(hf_model):
    rotary = hf_model.model.rotary_emb
    cfg = ModelConfig.from_name("tiny")
    for name, rope in (("main", cfg.rope_main), ("compress", cfg.rope_compress)):
        ours = rope_inv_freq(rope, cfg.rope_head_dim)
        theirs = getattr(rotary, f"{name}_inv_freq").numpy()
        np.testing.assert_allclose(ours, theirs, rtol=2e-7, atol=0)
    assert not np.allclose(rope_inv_freq(cfg.rope_main, 64), rope_inv_freq(cfg.rope_compress, 64))


def test_both_name_styles_load_the_same_parameters(checkpoints, model, hf_model):
    cfg_hf, params_hf = load_checkpoint(checkpoints["hf"])
    cfg_ds, params_ds = load_checkpoint(checkpoints["deepseek"])
    assert cfg_hf == cfg_ds
    flat_hf, tree_hf = jax.tree.flatten(params_hf)
    flat_ds, tree_ds = jax.tree.flatten(params_ds)
    assert tree_hf == tree_ds
    assert all(np.array_equal(a, b) for a, b in zip(flat_hf, flat_ds))
    # The conversion equals transformers' own loading, tensor by tensor.
    ours = to_transformers_names(read_safetensors(checkpoints["deepseek"]))
    theirs = hf_model.state_dict()
    assert set(ours) == set(theirs)
    for name, t in ours.items():
        np.testing.assert_array_equal(t, theirs[name].numpy(), err_msg=name)
    # ... and the same logits through the model (same shapes: no new compilation).
    deepseek = DeepseekV4.from_checkpoint(checkpoints["deepseek"], **MODEL_OPTIONS)
    tokens = PROMPT_B
    logits = [
        m.step(m.init_cache(), [1], [0], [tokens], all_tokens=True)[1].request_logits()[0] for m in (model, deepseek)
    ]
    np.testing.assert_array_equal(logits[0], logits[1])


def test_loads_what_transformers_save_pretrained_writes(hf_model, tmp_path):
    """transformers' save_pretrained undoes its load renames (attention "kv_norm" is written as
    "norm"; a model built in code writes DeepSeek's layer names under "model."): same tensors."""
    hf_model.save_pretrained(tmp_path)
    written = read_safetensors(tmp_path / "model.safetensors")
    assert "model.layers.0.self_attn.norm.weight" in written  # the quirk this test is about
    ours = to_transformers_names(written)
    theirs = hf_model.state_dict()
    assert set(ours) == set(theirs)
    for name, t in ours.items():
        np.testing.assert_array_equal(t, theirs[name].numpy(), err_msg=name)


def test_loader_rejects_bad_checkpoints(checkpoints, tmp_path):
    tensors = read_safetensors(checkpoints["hf"])
    cfg = ModelConfig.from_name("tiny")
    from dsv4_jax.model.checkpoint import load_params

    missing = dict(tensors)
    del missing["model.layers.2.self_attn.compressor.position_bias"]
    with pytest.raises(ValueError, match="missing 'model.layers.2.self_attn.compressor.position_bias'"):
        load_params(cfg, missing)
    wrong = {**tensors, "model.layers.0.self_attn.sinks": np.zeros(7, np.float32)}
    with pytest.raises(ValueError, match="sinks.*shape"):
        load_params(cfg, wrong)
    with pytest.raises(ValueError, match="dtype"):
        load_params(cfg, tensors, dtype="float64")
    with pytest.raises(ValueError, match="no config.json"):
        load_checkpoint(tmp_path)


# ----------------------------------------------------------------------------- against transformers


def test_one_call_prefill_matches_transformers(one_call_a, hf_logits):
    reference = hf_logits(PROMPT_A + DECODE_A)[: len(PROMPT_A)]
    assert reference.std() > 0.5  # the comparison is not between near-zero numbers
    assert _max_err(one_call_a, reference) < TOL


@pytest.fixture(scope="session")
def chunked_a(model):
    return chunked_then_decode(model)


def test_chunked_prefill_then_decode_matches_transformers(chunked_a, hf_logits, one_call_a):
    reference = hf_logits(PROMPT_A + DECODE_A)
    n = len(PROMPT_A)
    assert _max_err(chunked_a[:n], reference[:n]) < TOL
    assert _max_err(chunked_a[n:], reference[n:]) < TOL
    assert _max_err(chunked_a[:n], one_call_a) < 1e-5


def test_pallas_backend_inside_the_model(checkpoints, chunked_a):
    """The same steps with backend="triton" (the Pallas kernel; interpreted on CPU)."""
    pallas = DeepseekV4.from_checkpoint(
        checkpoints["hf"], **{**MODEL_OPTIONS, "backend": "triton", "interpret": jax.default_backend() != "gpu"}
    )
    assert _max_err(chunked_then_decode(pallas), chunked_a) < 1e-5


def test_ragged_chunked_batch_equals_each_prompt_alone(model, hf_logits, one_call_a):
    """Three requests of different lengths, slots out of order, ragged chunks with different
    prefixes in one step (prompt B decodes while A and C still prefill)."""
    cache = model.init_cache()
    steps = [
        ([2, 0, 1], [0, 0, 0], [PROMPT_A[:120], PROMPT_B, PROMPT_C[:80]]),
        ([2, 0, 1], [120, 37, 80], [PROMPT_A[120:], [99], PROMPT_C[80:]]),
    ]
    got = {0: [], 1: [], 2: []}
    for slots, prefixes, tokens in steps:
        cache, out = model.step(cache, slots, prefixes, tokens, all_tokens=True)
        assert out.plan.batch.num_requests == 3
        for b, logits in enumerate(out.request_logits()):
            got[b].append(logits)
    a, b, c = (np.concatenate(got[i]) for i in range(3))
    assert _max_err(a, one_call_a) < 1e-5
    assert _max_err(a, hf_logits(PROMPT_A)) < TOL
    assert _max_err(b, hf_logits(PROMPT_B + [99])) < TOL
    assert _max_err(c, hf_logits(PROMPT_C)) < TOL


def test_other_compress_rates_match_transformers(tiny_checkpoint_other_ratios):
    """A kind and a ratio vary apart: CSA 8 / HCA 32 (kinds from `layer_types`, ratios from
    `compress_rates`), chunked prefill at boundaries that are not multiples of 8, 32 or W, then
    decode steps (the last completes CSA block 18), against transformers' one-call logits."""
    cfg = ModelConfig.from_checkpoint(tiny_checkpoint_other_ratios)
    assert (cfg.compress_rate_csa, cfg.compress_rate_hca) == (8, 32)
    assert cfg.compress_ratios == (0, 0, 8, 32, 8, 32) and cfg.compress_ratio("HCA") == 32
    tokens = PROMPT_A[:152]  # 4 HCA entries, 19 CSA entries (top-8 selects)
    with torch.no_grad():
        hf = transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_checkpoint_other_ratios).eval()
        reference = hf(torch.tensor([tokens]), use_cache=False).logits[0].numpy()
    model = DeepseekV4.from_checkpoint(tiny_checkpoint_other_ratios, dtype="float32", **MODEL_OPTIONS)
    cache, got = model.init_cache(), []
    for a, b in zip([0, 37, 101, 149, 150, 151], [37, 101, 149, 150, 151, 152]):  # every step <= 64 tokens
        cache, out = model.step(cache, [1], [a], [tokens[a:b]], all_tokens=True)
        got.append(out.request_logits()[0])
    assert {k.name: p.compress_ratio for k, p in out.plan.kinds.items()} == {"SWA": 0, "CSA": 8, "HCA": 32}
    assert reference.std() > 0.5
    assert _max_err(np.concatenate(got), reference) < TOL


def test_greedy_generation_matches_transformers(checkpoints, hf_model):
    """5 prompts, 4 slots (the last waits for a free one), 64-token prefill steps, then decode."""
    prompts = [PROMPT_A, PROMPT_B, PROMPT_C, PROMPT_B[:20], PROMPT_C[:50]]
    gen = JaxGenerator(checkpoints["hf"], **{**MODEL_OPTIONS, "max_num_batched_tokens": 64})
    outputs = gen.generate(prompts, max_new_tokens=6, stop_token_ids=(1,))
    for prompt, got in zip(prompts, outputs):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt) :]
        assert got == ref.tolist()
    s = gen.stats
    assert s["prefill_tokens"] == sum(map(len, prompts))
    assert s["decode_tokens"] == sum(len(o) - 1 for o in outputs)  # the first token comes from the prefill
    assert s["prefill_steps"] >= -(-s["prefill_tokens"] // 64)
    assert s["peak_workspace_rows"] > 0 and set(s["chunks_per_step"]) == {"SWA", "CSA", "HCA"}
    # a stop token ends a request early and is kept
    first = outputs[1][0]
    again = gen.generate([PROMPT_B], max_new_tokens=6, stop_token_ids=(first,))
    assert again == [[first]]


def test_bad_inputs_raise(model, checkpoints):
    cache = model.init_cache()
    with pytest.raises(ValueError, match="slots"):
        model.step(cache, [0, 0], [0, 0], [[5], [6]])
    with pytest.raises(ValueError, match="slots"):
        model.step(cache, [4], [0], [[5]])
    with pytest.raises(ValueError, match="tokens"):
        model.step(cache, [0], [0], [[512]])
    with pytest.raises(ValueError, match="new token"):
        model.step(cache, [0], [0], [[]])
    with pytest.raises(ValueError, match="max_model_len"):
        model.step(cache, [0], [510], [[5, 6, 7]])
    with pytest.raises(ValueError, match="backend"):
        DeepseekV4.from_checkpoint(checkpoints["hf"], **{**MODEL_OPTIONS, "backend": "cuda"})
    with pytest.raises(ValueError, match="policy"):
        DeepseekV4.from_checkpoint(checkpoints["hf"], **{**MODEL_OPTIONS, "policy": "greedy"})
    gen = JaxGenerator(checkpoints["hf"], **MODEL_OPTIONS)
    with pytest.raises(ValueError, match="prompts\\[0\\]"):
        gen.generate([[]], 4)
    with pytest.raises(ValueError, match="max_model_len"):
        gen.generate([[1] * 500], 20)
    with pytest.raises(ValueError, match="max_new_tokens"):
        gen.generate([[1]], -1)


def test_runtime_modules_do_not_import_torch():
    code = "import sys, dsv4_jax.model.generate, dsv4_jax.model.checkpoint; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


# ----------------------------------------------------------------------------- head-sharded attention

SHARDED_SCRIPT = """
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np
from jax.sharding import Mesh
from dsv4_jax.model import DeepseekV4
from tests.jax.model_cases import MODEL_OPTIONS, chunked_then_decode
assert len(jax.devices()) == 8
mesh = Mesh(np.array(jax.devices()), ("heads",))
np.save(sys.argv[2], chunked_then_decode(DeepseekV4.from_checkpoint(sys.argv[1], mesh=mesh, **MODEL_OPTIONS)))
"""


def test_head_sharded_attention_inside_the_model(checkpoints, chunked_a, tmp_path):
    """8 simulated devices (a subprocess: XLA_FLAGS is read at JAX start-up), one query head
    each: the chunked prefill + decode logits equal the single-device model's."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    out = tmp_path / "sharded.npy"
    proc = subprocess.run(
        [sys.executable, "-c", SHARDED_SCRIPT, str(checkpoints["hf"]), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _max_err(np.load(out), chunked_a) < 1e-5
