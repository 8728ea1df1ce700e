"""The JAX DeepSeek-V4.1 model (`dsv4_jax.model.v41`) against our float64 reference and fixtures.

The reference (`tests/jax/v41_reference.py`) is a float64 NumPy forward of one request written
from the model's definition, every key set from the planner's oracle (`layer_attention`).
transformers' V4.1 model is not released: the comparison with its eager model runs by hand
(docs/jax-model.md, "DeepSeek-V4.1"), never here.

Compile budget: every step of <= 128 tokens is one token bucket (min_tokens=128, pow2) and
requests pad to 4, so the tests share one set of layer programs (one per layer variant).
"""

import json

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from dsv4_jax.model import v41_attention as A  # noqa: E402
from dsv4_jax.model.engram import DEAD, EngramHasher, compressed_token_map, engram_primes, is_prime  # noqa: E402
from dsv4_jax.model.generate import JaxGenerator  # noqa: E402
from dsv4_jax.model.safetensors_io import read_safetensors  # noqa: E402
from dsv4_jax.model.v41 import DeepseekV41  # noqa: E402
from dsv4_jax.model.v41_checkpoint import load_checkpoint  # noqa: E402
from dsv4_jax.model.v41_config import V41Config  # noqa: E402
from planner.contract import preset  # noqa: E402
from tests.jax import v41_reference as ref  # noqa: E402
from tools.official_checkpoint import write_official_v41_checkpoint  # noqa: E402
from tools.tiny_checkpoint import tiny_v41_config, write_tiny_v41_checkpoint  # noqa: E402

OPTIONS = dict(
    max_batch_size=4,
    max_model_len=512,
    max_num_batched_tokens=128,
    min_tokens=128,
    token_buckets="pow2",
    min_requests=4,
    min_workspace_rows=256,
)
PROMPT = np.random.default_rng(5).integers(3, 512, 97).tolist()  # > W = 16: replay trims it
PROMPT2 = np.random.default_rng(6).integers(3, 512, 61).tolist()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-v41")
    return {
        "hf": write_tiny_v41_checkpoint(root / "hf", seed=0),
        "official": write_official_v41_checkpoint(root / "official", seed=0),
    }


@pytest.fixture(scope="module")
def loaded(ckpts):
    return load_checkpoint(ckpts["hf"])


@pytest.fixture(scope="module")
def model(loaded, ckpts):
    cfg, params = loaded
    return DeepseekV41(cfg, params, fake_quant=False, tokenizer_file=ckpts["hf"] / "tokenizer.json", **OPTIONS)


@pytest.fixture(scope="module")
def reference(loaded, ckpts):
    cfg, _ = loaded
    P = ref.params64(read_safetensors(ckpts["hf"] / "model.safetensors"))
    memo = {}

    def run(tokens, fake_quant=False):
        key = (tuple(tokens), fake_quant)
        if key not in memo:
            memo[key] = ref.forward(cfg, P, tokens, ckpts["hf"] / "tokenizer.json", fake_quant=fake_quant)
        return memo[key]

    return run


def one_pass(m, tokens, slot=0):
    cache, out = m.step(m.init_cache(), [slot], [0], [tokens], all_tokens=True)
    return np.asarray(out.request_logits()[0]), cache


# ----------------------------------------------------------------------------- the model


def test_one_pass_matches_the_float64_reference(model, reference):
    logits, _ = one_pass(model, PROMPT)
    want = reference(PROMPT)
    assert np.abs(logits - want).max() < 1e-4
    assert (logits.argmax(-1) == want.argmax(-1)).all()


def test_chunked_prefill_and_decode_equal_one_pass(model, reference):
    full = PROMPT + [77, 401]
    want, _ = one_pass(model, full)
    cache, got = model.init_cache(), []
    for a, b in ((0, 37), (37, 52), (52, 97)):  # chunk edges off the ratio-2 pairs and the window
        cache, out = model.step(cache, [2], [a], [PROMPT[a:b]], all_tokens=True)
        got.append(out.request_logits()[0])
    for i, tok in enumerate(full[97:]):  # decode steps: one token each
        cache, out = model.step(cache, [2], [97 + i], [[tok]])
        got.append(out.request_logits()[0][None])
    got = np.concatenate(got)
    assert np.abs(got - want).max() < 2e-5
    assert np.abs(got - reference(full)).max() < 1e-4


def test_ragged_batch_equals_each_request_alone(model):
    cache, out = model.step(model.init_cache(), [3, 1], [0, 0], [PROMPT2, PROMPT[:50]], all_tokens=True)
    a, b = out.request_logits()
    assert np.abs(a - one_pass(model, PROMPT2)[0]).max() < 1e-5
    assert np.abs(b - one_pass(model, PROMPT[:50])[0]).max() < 1e-5
    # and a decode step of both after a ragged prefill equals each alone
    cache, out = model.step(cache, [1, 3], [50, 61], [[PROMPT[50]], [9]])
    alone = one_pass(model, PROMPT[:51])[0][-1]
    assert np.abs(np.asarray(out.logits)[0] - alone).max() < 1e-5


def test_fake_quantization_puts_the_caches_on_their_grids(loaded, ckpts, model, reference):
    cfg, params = loaded
    m = DeepseekV41(cfg, params, fake_quant=True, tokenizer_file=ckpts["hf"] / "tokenizer.json", **OPTIONS)
    logits, cache = one_pass(m, PROMPT)
    off, cache_off = one_pass(model, PROMPT)

    def on_grid(c, fq):
        c = np.asarray(c)
        return np.array_equal(fq(c), c)  # quantizing a value on its grid keeps it

    fp8 = ref.fake_quant_fp8
    fp4_16 = lambda x: ref.fake_quant_fp4(x, 16, True)  # noqa: E731
    fp4_32 = lambda x: ref.fake_quant_fp4(x, 32, False)  # noqa: E731
    for layer in (0, 2, 5):  # window rings (slot 0: positions 82..96)
        assert on_grid(cache[layer]["window"][0], fp8) and not on_grid(cache_off[layer]["window"][0], fp8)
    for layer, n in ((1, 48), (3, 97)):  # the KV sources: compressed entries and index keys
        assert on_grid(cache[layer]["entries"][0, :n], fp4_16)
        assert on_grid(cache[layer]["index_keys"][0, :n], fp4_32)
        assert not on_grid(cache_off[layer]["entries"][0, :n], fp4_16)
    # Rows 0..7 see every visible entry (<= index_topk at ratio 1, <= 17 at ratio 2): no
    # selection to flip, so only rounding steps crossed by float noise separate the model from
    # the float64 reference's grids (1e-4 to 1e-2); later rows can differ by a whole selection.
    want = reference(PROMPT, fake_quant=True)
    assert np.abs(logits[:8] - want[:8]).max() < 2e-2
    assert np.abs(want[:8] - reference(PROMPT)[:8]).max() > 5 * np.abs(logits[:8] - want[:8]).max()
    assert np.abs(logits - off).max() > 1e-2


def test_bounded_replay(loaded, ckpts, model):
    cfg, params = loaded
    m = DeepseekV41(
        cfg, params, fake_quant=False, replay=None, tokenizer_file=ckpts["hf"] / "tokenizer.json", **OPTIONS
    )
    exact, _ = one_pass(model, PROMPT)
    cache, out = m.step(m.init_cache(), [0], [0], [PROMPT])
    plan = out.plan
    assert plan.replay and plan.num_plans == 4  # ratio 0, 2 full; ratio 1 cut and replay
    assert {str(k) for k in plan.plans} == {"SWA/full", "CSA2/full", "CSA1/cut", "CSA1/replay"}
    got = np.asarray(out.logits)[0]
    err = np.abs(got - exact[-1]).max()
    assert 0 < err < 0.5  # replay is not exact: the kept rows' early windows are clamped
    # a prompt of <= W new tokens makes no replay batch: exactly the exact model
    short = PROMPT[:16]
    _, out = m.step(m.init_cache(), [0], [0], [short])
    assert not out.plan.replay
    assert np.abs(np.asarray(out.logits)[0] - one_pass(model, short)[0][-1]).max() < 1e-6
    with pytest.raises(ValueError, match="all_tokens"):
        m.step(m.init_cache(), [0], [0], [PROMPT], all_tokens=True)
    # decoding after a replayed prefill reads only kept rows: equal to decoding after the exact one?
    # no (their KV differs), but it runs, and its plan has one band
    cache, out = m.step(cache, [0], [97], [[5]])
    assert not out.plan.replay and np.isfinite(np.asarray(out.logits)).all()
    # the host side alone: 480 new rows, 16 kept, their plans padded to 16 rows (not the step's 480)
    small = DeepseekV41(
        cfg,
        params,
        replay=None,
        tokenizer_file=ckpts["hf"] / "tokenizer.json",
        **{**OPTIONS, "min_tokens": 16, "max_num_batched_tokens": 512},
    )
    s = small.prepare_step([0], [0], [list(range(3, 483))])
    assert s.band.positions.shape == (16,) and s.full.positions.shape[0] >= 480
    assert {k.band: m.shape.padded_tokens for k, m in s.metas.items()} == {"full": 512, "cut": 16, "replay": 16}
    with pytest.raises(ValueError, match="mosaic_tpu"):
        DeepseekV41(cfg, params, replay=None, backend="mosaic_tpu", tokenizer_file=ckpts["hf"] / "tokenizer.json")


def test_official_format_loads_and_equals_its_dequantized_twin(ckpts, tmp_path):
    from safetensors.numpy import save_file

    from dsv4_jax.model.quant import QuantizedWeight

    cfg, stored = load_checkpoint(ckpts["official"])
    _, deq = load_checkpoint(ckpts["official"], weights="dequantized")
    kinds = {type(w).__name__ for w in jax.tree.leaves(stored, is_leaf=lambda x: isinstance(x, QuantizedWeight))}
    assert "QuantizedWeight" in kinds
    fmts = {
        (w.fmt, w.block)
        for w in jax.tree.leaves(stored, is_leaf=lambda x: isinstance(x, QuantizedWeight))
        if isinstance(w, QuantizedWeight)
    }
    assert fmts == {("fp8", (32, 32)), ("fp4", (1, 32)), ("fp8", (1, 32))}  # linears, experts, Engram table
    kw = dict(fake_quant=False, dtype="float32", tokenizer_file=ckpts["official"] / "tokenizer.json", **OPTIONS)
    a, _ = one_pass(DeepseekV41(cfg, stored, **kw), PROMPT2)
    b, _ = one_pass(DeepseekV41(cfg, deq, **kw), PROMPT2)
    assert np.array_equal(a, b)  # FP8 / FP4 with power-of-two scales dequantize exactly
    # the same values in transformers' format load to the same model
    hf = {}
    tensors = read_safetensors(ckpts["hf"] / "model.safetensors")
    off = {}
    for f in sorted(ckpts["official"].glob("*.safetensors")):
        off.update(read_safetensors(f))
    from dsv4_jax.model.quant import dequantize_np

    for name in tensors:
        o = {"model.embed.weight": "embed.weight", "model.norm.weight": "norm.weight", "lm_head.weight": "head.weight"}
        o = o.get(name, name.removeprefix("model."))
        w = off.get(o)
        if w is None:
            continue  # the Engram scale (written with its table)
        stem = o[: -len(".weight")] + ".scale" if o.endswith(".weight") else None
        if stem in off:
            fmt = "fp4" if w.dtype == np.int8 else "fp8"
            block = (1, 32) if fmt == "fp4" or o.endswith("engram.embed.weight") else (32, 32)
            hf[name] = dequantize_np(w.view(np.uint8) if fmt == "fp4" else w, off[stem], fmt, block)
        else:
            hf[name] = np.asarray(w, np.float32)
    hf["model.layers.1.engram.embed.scale"] = tensors["model.layers.1.engram.embed.scale"]
    d = tmp_path / "twin"
    d.mkdir()
    save_file(hf, str(d / "model.safetensors"))
    for f in ("config.json", "tokenizer.json"):
        (d / f).write_text((ckpts["hf"] / f).read_text())
    cfg2, p2 = load_checkpoint(d)
    c, _ = one_pass(DeepseekV41(cfg2, p2, **kw), PROMPT2)
    assert np.abs(c - a).max() < 1e-5


def test_generator_chunked_equals_one_call_and_counts_plans(ckpts):
    kw = dict(fake_quant=False, max_batch_size=4, max_model_len=512, min_tokens=128, min_requests=4)
    kw["min_workspace_rows"] = 256
    one = JaxGenerator(ckpts["hf"], max_num_batched_tokens=128, **kw)
    chunked = JaxGenerator(ckpts["hf"], max_num_batched_tokens=40, **kw)
    prompts = [PROMPT, PROMPT2]
    a = one.generate(prompts, max_new_tokens=4)
    b = chunked.generate(prompts, max_new_tokens=4)
    assert a == b and all(len(x) == 4 for x in a)
    assert set(one.stats["chunks_per_step"]) == {"SWA/full", "CSA2/full", "CSA1/full"}
    assert chunked.stats["prefill_steps"] > one.stats["prefill_steps"]
    assert isinstance(one.generate(["Ava has 3 apples."], max_new_tokens=2)[0], str)


def test_bad_inputs_raise(loaded, ckpts, tmp_path):
    cfg, params = loaded
    tok = ckpts["hf"] / "tokenizer.json"
    for bad in ("fp8", "mxfp8", "nvfp4", "FP8_DS_MLA", None, 1):  # every bad kv_cache_dtype, by name
        with pytest.raises(ValueError, match=rf"kv_cache_dtype: expected one of \('auto', 'fp8_ds_mla'\), got {bad!r}"):
            DeepseekV41(cfg, params, kv_cache_dtype=bad, tokenizer_file=tok)
    with pytest.raises(ValueError, match="kv_cache_dtype: mxfp8 records hold 512-dim latents, config.head_dim is 256"):
        DeepseekV41(V41Config.from_dict({**tiny_v41_config(), "head_dim": 256}), params, kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(ValueError, match="backend: 'mosaic_tpu' does not read V4.1's mxfp8 pages"):
        DeepseekV41(cfg, params, kv_cache_dtype="fp8_ds_mla", backend="mosaic_tpu", tokenizer_file=tok)
    with pytest.raises(ValueError, match=r"indexer_backend: expected one of 'auto', 'xla', 'cpu'; got 'fused'"):
        DeepseekV41(cfg, params, indexer_backend="fused", tokenizer_file=tok)
    with pytest.raises(ValueError, match=r"expert_matmul: expected one of .*got 'tiles'"):
        DeepseekV41(cfg, params, expert_matmul="tiles", tokenizer_file=tok)
    with pytest.raises(ValueError, match="fake_quant"):
        DeepseekV41(cfg, params, fake_quant=1, tokenizer_file=ckpts["hf"] / "tokenizer.json")
    with pytest.raises(ValueError, match="tokenizer"):
        DeepseekV41(cfg, params, tokenizer_file=tmp_path / "missing.json")
    bad = json.loads((ckpts["hf"] / "config.json").read_text())
    bad["text_config"]["engram_layer_ids"] = [3]  # at the cut: vLLM does not replay
    bad_cfg = V41Config.from_dict(bad)
    assert bad_cfg.schedule.replay_off_reason is not None
    with pytest.raises(ValueError, match="replay"):
        DeepseekV41(bad_cfg, params, replay=True, tokenizer_file=ckpts["hf"] / "tokenizer.json")
    from tools.tiny_checkpoint import write_tiny_checkpoint

    with pytest.raises(ValueError, match="V4.1 options"):
        JaxGenerator(write_tiny_checkpoint(tmp_path / "v4"), replay=None)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text((ckpts["hf"] / "config.json").read_text())
    st = read_safetensors(ckpts["hf"] / "model.safetensors")
    st.pop("model.layers.3.attn.indexer.wk.weight")
    from safetensors.numpy import save_file

    save_file(st, str(tmp_path / "c" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing 'layers\.3\.attn\.indexer\.wk\.weight'"):
        load_checkpoint(tmp_path / "c")


# ----------------------------------------------------------------------------- the pieces


def test_config_fields_defaults_and_rules():
    released = V41Config.from_name("V4.1")
    assert released.schedule.cut == 20 and released.hidden_size == 5120 and released.index_n_heads == 32
    assert released.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20
    tiny = tiny_v41_config()
    flat = V41Config.from_dict(tiny)
    composite = V41Config.from_dict({"model_type": "deepseek_v41", "text_config": {**tiny, "model_type": None}})
    assert flat == composite
    official = {"model_type": "deepseek_v41", "text_config": {**tiny, "n_mtp_layers": 3}, "quantization_config": {}}
    off = dict(official["text_config"])
    off["compress_ratios"] = list(tiny["compress_ratios"]) + [0, 0, 0]
    off.pop("num_nextn_predict_layers")
    assert V41Config.from_dict({**official, "text_config": off}) == flat
    defaults = V41Config.from_dict({"model_type": "deepseek_v41_text", "num_hidden_layers": 40})
    assert defaults.kv_source_layer_ids == (2, 8, 14, 20) and defaults.rms_norm_eps == 1e-20
    with pytest.raises(ValueError, match="model_type"):
        V41Config.from_dict({"model_type": "deepseek_v4"})
    with pytest.raises(ValueError, match="candidate_topk_blocks"):
        V41Config.from_dict({**tiny, "candidate_topk_blocks": 2})  # 1 * 4 + 1 < index_topk 8
    with pytest.raises(ValueError, match="kv_source_layer_ids"):
        V41Config.from_dict({**tiny, "kv_source_layer_ids": [0, 3]})  # layer 0 has ratio 0
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        V41Config.from_dict({**tiny, "engram_num_embeddings": [1, 2]})
    assert preset("V4.1-tiny")["engram_layer_ids"] == []


def test_fake_quantization_grids():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((37, 512)) * np.exp(rng.uniform(-6, 6, (37, 1)))).astype(np.float32)
    # exact ties of the e2m1 grid (0.25, 0.75, ..., 5) and of e4m3, scaled by powers of two
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4, np.float32) * np.float32(0.5)
    x[0, :32] = ties
    x[1, :32] = -ties
    x[2, :32] = 0
    # jitted, as the model runs them (eager, each op compiles on its own: 10x the time)
    assert np.array_equal(np.asarray(jax.jit(A.fake_quant_fp8)(jnp.asarray(x))), ref.fake_quant_fp8(x))
    for block, e4m3 in ((16, True), (32, False)):
        got = np.asarray(jax.jit(A.fake_quant_fp4, static_argnums=(1, 2))(jnp.asarray(x), block, e4m3))
        assert np.array_equal(got, ref.fake_quant_fp4(x, block, e4m3)), (block, e4m3)
    odd = jnp.ones((3, 40))  # a last dim that does not divide the block passes through
    assert A.fake_quant_fp8(odd) is odd and A.fake_quant_fp4(odd, 16, True) is odd


@pytest.mark.parametrize("backend", ["xla", "cpu"])
def test_index_selection_against_brute_force(backend):
    """The model's indexer call (`index_select`: the library's two-level top-k) against a float64
    brute force: ratio 2, level 1 at ratio 1 (top-k and candidate blocks), level 2 inside given
    candidates; three requests in other slots, one a decode row."""
    from dsv4_jax.backends import resolve_indexer_backend
    from dsv4_jax.model.attention import StepInputs

    if backend == "cpu" and resolve_indexer_backend("auto", jnp.zeros((1, 1, 1))) != "cpu":
        pytest.skip("the fused C indexer does not build here (no C++ compiler)")
    rng = np.random.default_rng(3)
    static = ("ratio", "n_entries", "topk", "block_size", "make_candidates", "backend")
    select = jax.jit(A.index_select, static_argnames=static)  # as the model runs it (eager: 10x the time)
    nh, dh, S, cap, topk = 16, 128, 3, 256, 8
    for ratio, make, use in ((2, None, False), (1, 4, False), (1, None, True)):
        q_lens, prefix = np.array([41, 1, 70]), np.array([0, 90, 30])
        seq = prefix + q_lens
        T = int(q_lens.sum())
        pos = np.concatenate([np.arange(p, s) for p, s in zip(prefix, seq)])
        req = np.repeat(np.arange(3), q_lens)
        slots = np.array([2, 0, 1])
        rows = StepInputs(
            token_ids=np.zeros(T, np.int32),
            positions=pos.astype(np.int32),
            token_request=req.astype(np.int32),
            token_valid=np.ones(T, bool),
            slot=slots.astype(np.int32),
            prefix=prefix.astype(np.int32),
            seq_len=seq.astype(np.int32),
            token_start=np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int32),
        )
        q = rng.standard_normal((T, nh, dh)).astype(np.float32)
        w = rng.standard_normal((T, nh)).astype(np.float32)
        keys = rng.standard_normal((S, cap, dh)).astype(np.float32)
        N = 128
        logits = np.full((T, N), -np.inf)
        for t in range(T):
            k = keys[slots[req[t]], :N].astype(np.float64)
            s = np.maximum(np.einsum("hd,nd->hn", q[t].astype(np.float64), k), 0) * dh**-0.5
            logits[t] = (s * w[t, :, None]).sum(0)
        visible = (pos + 1) // ratio
        logits[np.arange(N)[None] >= visible[:, None]] = -np.inf
        cand = sets = None
        if use:  # candidates from a brute-force level 1, as the int32 rows level 1 emits (-1 after)
            _, sets = ref._select(logits, visible, topk, None, (4, 4))
            cand = np.full((T, 4), -1, np.int32)
            for t, s in enumerate(sets):
                cand[t, : len(s)] = sorted(s, reverse=True)
        want_ids, want_sets = ref._select(
            logits, visible, topk, None if sets is None else (sets, 4), (make, 4) if make else None
        )
        got_ids, got_cand = select(
            jnp.asarray(q),
            jnp.asarray(w),
            jnp.asarray(keys),
            rows,
            ratio=ratio,
            n_entries=N,
            topk=topk,
            block_size=4,
            candidates=None if cand is None else jnp.asarray(cand),
            make_candidates=make,
            backend=backend,
        )
        got_ids = np.asarray(got_ids)
        for t in range(T):  # the order too: larger logit first (no near ties in these random logits)
            n = min(visible[t], topk) if sets is None else min(topk, sum(min(4, visible[t] - 4 * b) for b in sets[t]))
            assert got_ids[t][:n].tolist() == want_ids[t][:n].tolist(), (ratio, t)
            assert (got_ids[t][n:] == -1).all()
        if make is not None:
            got_cand = np.asarray(got_cand)
            for t in range(T):
                assert set(got_cand[t][got_cand[t] >= 0].tolist()) == want_sets[t]
                assert visible[t] == 0 or got_cand[t][0] == (visible[t] - 1) // 4  # the newest block first


def test_engram_hashes_cross_chunks_and_follow_the_formula(ckpts):
    cfg = V41Config.from_checkpoint(ckpts["hf"])
    tok = ckpts["hf"] / "tokenizer.json"
    primes = engram_primes(cfg)
    flat = [p for layer in primes for per in layer for p in per]
    assert all(is_prime(p) and p > cfg.engram_vocab_size - 1 for p in flat) and len(set(flat)) == len(flat)
    lookup, size = compressed_token_map(tok)
    assert size == cfg.engram_compressed_vocab_size < lookup.shape[0]
    one = EngramHasher(cfg, tok, 2, 512)
    whole = one.hash_ids([1], [0], [PROMPT])
    pieces = EngramHasher(cfg, tok, 2, 512)
    parts = [pieces.hash_ids([1], [a], [PROMPT[a:b]]) for a, b in ((0, 1), (1, 30), (30, 97))]
    assert np.array_equal(np.concatenate(parts), whole)
    # the formula, position by position: XOR of compressed id * multiplier over the n-gram
    mult, N, heads = one.multipliers[0], cfg.engram_max_ngram_size, cfg.engram_n_heads
    for p in (0, 1, 2, 50):
        ids = [int(lookup[PROMPT[p - s]]) if p - s >= 0 else int(lookup[cfg.engram_pad_id]) for s in range(N)]
        acc, cols = ids[0] * int(mult[0]), []
        for n in range(1, N):
            acc ^= ids[n] * int(mult[n])
            cols += [acc % primes[0][n - 1][h] for h in range(heads)]
        offsets = np.concatenate([[0], np.cumsum([q for per in primes[0] for q in per])[:-1]])
        assert whole[p, 0].tolist() == (np.array(cols) + offsets).tolist()
    assert (one.history[1, :97] != DEAD).all() and (one.history[0] == DEAD).all()
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        EngramHasher(V41Config.from_dict({**tiny_v41_config(), "engram_compressed_vocab_size": 7}), tok, 1, 8)


def test_tiny_v41_writer_is_deterministic(ckpts, tmp_path):
    again = write_tiny_v41_checkpoint(tmp_path / "again", seed=0)
    assert (again / "model.safetensors").read_bytes() == (ckpts["hf"] / "model.safetensors").read_bytes()
    cfg = json.loads((again / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v41" and cfg["text_config"]["model_type"] == "deepseek_v41_text"
    off = json.loads((ckpts["official"] / "config.json").read_text())
    assert off["quantization_config"]["weight_block_size"] == [32, 32]


SHARDED_SCRIPT = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, numpy as np
from jax.sharding import Mesh
from dsv4_jax.model.v41 import DeepseekV41
from tests.jax.test_v41_model import OPTIONS, PROMPT
mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
m = DeepseekV41.from_checkpoint(sys.argv[1], mesh=mesh, fake_quant=False, backend="xla", **OPTIONS)
_, out = m.step(m.init_cache(), [0], [0], [PROMPT], all_tokens=True)
np.save(sys.argv[2], np.asarray(out.request_logits()[0]))
"""


@pytest.mark.slow
def test_sharded_over_two_devices_equals_one(ckpts, model, tmp_path):
    """2 simulated devices (a subprocess: XLA_FLAGS is read at JAX start-up): heads, experts and
    the vocabulary split, the rest stored split; the logits equal the single-device model's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("XLA_FLAGS", None)
    out = tmp_path / "sharded.npy"
    proc = subprocess.run(
        [sys.executable, "-c", SHARDED_SCRIPT, str(ckpts["hf"]), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert np.abs(np.load(out) - one_pass(model, PROMPT)[0]).max() < 1e-5
