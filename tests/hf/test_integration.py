"""dsv4_torch.hf.enable_sparse_prefill: our prefill inside transformers' DeepSeek-V4 (issue 6).

Tiny checkpoint (layers SWA, SWA, CSA, HCA, CSA, HCA; W = 8, index_topk 8), float32. Against
transformers' eager attention: one-call prefill past 128 tokens (HCA entries), chunked prefill at
boundaries that are not multiples of 4, 128 or W, decode steps, greedy `generate`. Ragged
(padded) batches against each prompt alone, through prefill and decode. The three planners give
bitwise the same logits on the reference backend. Bad inputs and unsupported models fail clearly.
"""

import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from dsv4_torch.hf import integration as I  # noqa: E402
from dsv4_torch.hf import layer as L  # noqa: E402
from planner import LayerKind, StepPlan  # noqa: E402

TOL = 1e-5  # float32 logits (std ~1); eager itself is ~5e-6 away from a float64 run
PAD = 2


@pytest.fixture(scope="module")
def model(tiny_checkpoint_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: 1 thread is faster, and CI runs 2 test workers on 2 cores
    m = transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_checkpoint_dir).eval()
    yield m
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint_dir):
    return transformers.AutoTokenizer.from_pretrained(tiny_checkpoint_dir)


@contextlib.contextmanager
def sparse(model, **kw):
    I.enable_sparse_prefill(model, **{"backend": "reference", **kw})
    try:
        yield model
    finally:
        I.disable_sparse_prefill(model)


def ids_of(n, seed):
    return torch.randint(3, 512, (1, n), generator=torch.Generator().manual_seed(seed))


def calls(model, ids, bounds, cache=None):
    """Logits of ids fed in calls [bounds[i], bounds[i+1]) with one cache."""
    cache = DynamicCache(config=model.config) if cache is None else cache
    with torch.no_grad():
        return torch.cat(
            [model(ids[:, a:b], past_key_values=cache, use_cache=True).logits for a, b in zip(bounds, bounds[1:])], 1
        )


def err(a, b):
    return (a - b).abs().max().item()


PROMPTS = [
    "Question: Mia has 12 pencils. Noah gives Mia 30 more pencils. How many pencils does Mia have now? " * 4,
    "Question: Liam had 45 coins and gave 11 of them to Emma. How many are left?\nAnswer:",
    "Question: 7 + 5?",
]


# ----------------------------------------------------------------------------- against eager


def test_single_call_prefill_matches_eager(model):
    ids = ids_of(150, 0)  # 1 HCA entry, 37 CSA entries (top-8 selects)
    with torch.no_grad():
        eager = model(ids).logits
        with sparse(model):
            ours = model(ids).logits
            rec = I.last_forward(model)
    assert err(ours, eager) < TOL
    assert rec.backends == {"SWA": "reference", "CSA": "reference", "HCA": "reference"}
    assert isinstance(rec.step_plan, StepPlan) and rec.seq_lens == [150] and rec.query_lens == [150]
    assert set(rec.step_plan.kinds) == {LayerKind.SWA, LayerKind.CSA, LayerKind.HCA}


def test_chunked_prefill_and_decode_match_eager(model):
    ids = ids_of(136, 1)
    # calls of 1, 36, 93 (closing HCA block 0 inside), 3 tokens, then 3 decode steps; the last one
    # completes CSA block 33 (position 135)
    bounds = [0, 1, 37, 130, 133, 134, 135, 136]
    eager = calls(model, ids, bounds)
    with sparse(model):
        ours = calls(model, ids, bounds)
        one_call = calls(model, ids, [0, 136])
        assert I.last_step_plan(model).batch.seq_lens.tolist() == [136]
    assert err(ours, eager) < TOL
    assert err(ours, one_call) < TOL  # chunked prefill == one call


def test_greedy_generate_matches_eager(model, tokenizer):
    enc = tokenizer(PROMPTS[0], return_tensors="pt")
    assert enc["input_ids"].shape[1] > 128
    kw = dict(max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        eager = model.generate(**enc, **kw)
        with sparse(model):
            ours = model.generate(**enc, **kw)
            assert I.last_forward(model).query_lens == [1]  # the last step was a decode step
    assert torch.equal(ours, eager)


def test_other_compress_rates_match_eager(tiny_checkpoint_other_ratios):
    """A kind and a ratio vary apart: CSA 8 / HCA 32 (kinds from `layer_types`, ratios from
    `compress_rates`) end to end, one call and chunked at boundaries that are not multiples of 8,
    32 or W, then decode steps, and a ragged batch against each prompt alone."""
    m = transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_checkpoint_other_ratios).eval()
    assert dict(m.config.compress_rates) == {"compressed_sparse_attention": 8, "heavily_compressed_attention": 32}
    ids = ids_of(152, 11)  # 4 HCA entries, 19 CSA entries (top-8 selects)
    # calls of 37, 64 and 48 tokens (HCA entries 1, 2 and 3 close inside them), then 3 decode steps;
    # the last one completes CSA block 18 (position 151)
    bounds = [0, 37, 101, 149, 150, 151, 152]
    with torch.no_grad():
        eager_one, eager = m(ids).logits, calls(m, ids, bounds)
        with sparse(m):
            ours_one = m(ids).logits
            plan = I.last_step_plan(m)
            ours = calls(m, ids, bounds)
            g = torch.Generator().manual_seed(12)
            prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (133, 70, 9)]
            pids, mask = left_padded(prompts)
            batch = m(pids, attention_mask=mask).logits
        alone = [m(torch.tensor([p])).logits[0] for p in prompts]
    assert {k: (p.compress_ratio, p.has_compressed) for k, p in plan.kinds.items()} == {
        LayerKind.SWA: (0, False),
        LayerKind.CSA: (8, True),
        LayerKind.HCA: (32, True),
    }
    assert err(ours_one, eager_one) < TOL
    assert err(ours, eager) < TOL
    L = pids.shape[1]
    for i, (p, a) in enumerate(zip(prompts, alone)):
        assert err(batch[i, L - len(p) :], a) < TOL, i


# ----------------------------------------------------------------------------- ragged batches


def left_padded(prompts):
    L = max(map(len, prompts))
    ids = torch.full((len(prompts), L), PAD)
    mask = torch.zeros((len(prompts), L), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p) :] = torch.tensor(p)
        mask[i, L - len(p) :] = 1
    return ids, mask


def test_ragged_batch_equals_each_prompt_alone(model):
    """A left-padded batch (as generate feeds it) through prefill and three decode steps equals
    each prompt run alone through transformers' eager attention."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (141, 57, 9)]
    ids, mask = left_padded(prompts)
    L = ids.shape[1]
    with torch.no_grad():
        with sparse(model):
            cache = DynamicCache(config=model.config)
            out = model(
                ids,
                attention_mask=mask,
                position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                past_key_values=cache,
                use_cache=True,
            ).logits
            assert I.last_forward(model).query_lens == [141, 57, 9]
            steps, fed = [], []  # decode steps with a growing mask, no position_ids (from the cache)
            tokens = out[:, -1].argmax(-1)
            for _ in range(3):
                fed.append(tokens)
                mask = torch.cat([mask, torch.ones((3, 1), dtype=torch.long)], 1)
                steps.append(model(tokens[:, None], attention_mask=mask, past_key_values=cache).logits[:, 0])
                tokens = steps[-1].argmax(-1)
            assert cache.get_seq_length() == L + 3  # padded columns, as generate expects

            # right padding, and a pad in the middle of a row, work the same way
            right, rmask = torch.full_like(ids, PAD), torch.zeros_like(ids)
            for i, p in enumerate(prompts):
                cols = [c for c in range(len(p) + 1) if not (i == 2 and c == 3)][: len(p)]
                right[i, cols], rmask[i, cols] = torch.tensor(p), 1
            out_r = model(right, attention_mask=rmask).logits

        for i, p in enumerate(prompts):
            alone_cache = DynamicCache(config=model.config)
            alone = model(torch.tensor([p]), past_key_values=alone_cache, use_cache=True).logits[0]
            assert err(out[i, L - len(p) :], alone) < TOL, i
            assert err(out_r[i][rmask[i].bool()], alone) < TOL, i
            for tok, s in zip(fed, steps):
                step = model(tok[i].view(1, 1), past_key_values=alone_cache, use_cache=True).logits[0, 0]
                assert err(s[i], step) < TOL, i


def test_ragged_generate_matches_each_prompt_alone(model, tokenizer):
    """What users do: tokenizer left padding + generate; each row equals its prompt alone (eager)."""
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        alone = [model.generate(**tokenizer(p, return_tensors="pt"), **kw)[0].tolist() for p in PROMPTS]
        with sparse(model):
            enc = tokenizer(PROMPTS, padding=True, padding_side="left", return_tensors="pt")
            batch = model.generate(**enc, **kw)
    L = enc["input_ids"].shape[1]
    for i, a in enumerate(alone):
        n = int(enc["attention_mask"][i].sum())
        new = batch[i, L:].tolist()
        want = a[n:]
        assert new[: len(want)] == want, i
        assert all(t == tokenizer.pad_token_id for t in new[len(want) :]), i  # finished early: padded


def test_rows_without_new_tokens_keep_their_state(model):
    """A row whose new columns are all padding (mask 0) is skipped and continues unchanged later."""
    g = torch.Generator().manual_seed(7)
    a, b = (torch.randint(3, 512, (n,), generator=g) for n in (30, 43))
    ids, mask = left_padded([a[:27].tolist(), b[:40].tolist()])
    with torch.no_grad():
        with sparse(model):
            cache = DynamicCache(config=model.config)
            model(ids, attention_mask=mask, past_key_values=cache)
            for t in range(3):  # row 1 sits out the first step; row 0 sits out the second
                live = torch.tensor([[t != 1], [t != 0]], dtype=torch.long)
                mask = torch.cat([mask, live], 1)
                feed = torch.stack([a[27 + t - (t > 1)], b[40 + t - 1 if t else 0]])[:, None]
                out = model(torch.where(live.bool(), feed, PAD), attention_mask=mask, past_key_values=cache).logits
                assert I.last_forward(model).query_lens == live[:, 0].tolist()
            assert I.last_forward(model).seq_lens == [29, 42]
        assert err(out[0, 0], model(a[None, :29]).logits[0, -1]) < TOL
        assert err(out[1, 0], model(b[None, :42]).logits[0, -1]) < TOL


def test_triton_backend_through_the_model(model):
    """The Triton kernel (interpreted on CPU, `TRITON_INTERPRET=1` from conftest) runs the same path."""
    from planner.contract import BackendUnavailableError

    ids, mask = left_padded([ids_of(40, 8)[0].tolist(), ids_of(15, 9)[0].tolist()])
    with torch.no_grad():
        with sparse(model):
            ref = model(ids, attention_mask=mask).logits
        try:
            I.enable_sparse_prefill(model, backend="triton")
        except BackendUnavailableError as e:
            pytest.skip(f"triton cannot run on CPU tensors here: {e}")
        try:
            out = model(ids, attention_mask=mask).logits
            assert I.last_forward(model).backends == {"SWA": "triton", "CSA": "triton", "HCA": "triton"}
        finally:
            I.disable_sparse_prefill(model)
    real = mask.bool()
    assert err(out[real], ref[real]) < TOL


def test_planners_give_bitwise_identical_logits(model):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (140, 33, 70, 9, 131)]
    ids, mask = left_padded(prompts)

    def run(**kw):  # prefill, then one decode step; returns the logits and the prefill's plan
        with sparse(model, **kw), torch.no_grad():
            cache = DynamicCache(config=model.config)
            a = model(ids, attention_mask=mask, past_key_values=cache).logits
            plan = I.last_step_plan(model)
            m2 = torch.cat([mask, torch.ones((5, 1), dtype=torch.long)], 1)
            b = model(a[:, -1:].argmax(-1), attention_mask=m2, past_key_values=cache).logits
            return torch.cat([a, b], 1), plan

    ref, plan = run(policy="adaptive")
    assert all(plan[k].num_chunks == 1 for k in LayerKind)  # the default budget holds the whole step
    fixed, plan = run(policy="fixed", prefill_chunk_size=2)
    assert plan[LayerKind.CSA].num_chunks == 3  # 5 requests in chunks of 2
    per_request, plan = run(policy="per_request")
    assert plan[LayerKind.HCA].num_chunks == 5
    split, plan = run(policy="adaptive", budget_rows=64)  # cuts the long requests along their queries
    assert plan[LayerKind.HCA].split_requests.tolist() == [0, 2, 4]
    assert torch.equal(fixed, ref) and torch.equal(per_request, ref) and torch.equal(split, ref)


def test_beam_search_reorders_the_per_request_state(model, tokenizer):
    enc = tokenizer(PROMPTS[1], return_tensors="pt")
    kw = dict(max_new_tokens=4, num_beams=3, do_sample=False)
    with torch.no_grad():
        eager = model.generate(**enc, **kw)
        with sparse(model):
            ours = model.generate(**enc, **kw)
    assert torch.equal(ours, eager)


# ----------------------------------------------------------------------------- plumbing


def test_metadata_built_once_per_forward_and_disable_restores_eager(model, monkeypatch):
    ids = ids_of(40, 4)
    with torch.no_grad():
        before = model(ids).logits
        built = []
        real_build = I.build_step_metadata
        monkeypatch.setattr(I, "build_step_metadata", lambda *a, **k: built.append(1) or real_build(*a, **k))
        with sparse(model):
            assert model.config._attn_implementation == I.ATTN_IMPLEMENTATION
            assert I.is_sparse_prefill_enabled(model)
            calls(model, ids, [0, 20, 40])
        assert len(built) == 2  # one per forward, shared by the 6 layers
        assert not I.is_sparse_prefill_enabled(model)
        assert model.config._attn_implementation == "eager"
        assert "forward" not in model.model.layers[0].self_attn.__dict__
        assert torch.equal(model(ids).logits, before)


def test_layer_code_never_reads_the_device(model, monkeypatch):
    """Between the pre-hook (one host read of the mask) and the end of the forward, our per-layer
    code (projections, ragged state, pooling, indexer) asks nothing of the device: with the kernel
    stubbed out (the reference kernel itself reads on CPU), every host read raises."""
    g = torch.Generator().manual_seed(6)
    ids, mask = left_padded([torch.randint(3, 512, (n,), generator=g).tolist() for n in (133, 20)])

    def stub(q, meta, raw_kv, compressed_kv=None, **kw):
        return q.new_zeros(q.shape)  # D = 512: out has q's shape

    def trap(*a, **k):
        raise AssertionError("host read of a tensor inside the layer loop")

    real_layer = L.sparse_layer

    def guarded(*args):
        with monkeypatch.context() as m:
            for name in ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"):
                m.setattr(torch.Tensor, name, trap)
            with pytest.raises(AssertionError, match="host read"):
                bool(torch.ones(1))  # the trap is armed
            return real_layer(*args)

    monkeypatch.setattr(L, "prefill_attention", stub)
    monkeypatch.setattr(L, "sparse_layer", guarded)
    with sparse(model), torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids, attention_mask=mask, past_key_values=cache)
        model(ids[:, :1], attention_mask=torch.cat([mask, torch.ones_like(mask[:, :1])], 1), past_key_values=cache)
        assert I.last_forward(model).seq_lens == [134, 21]


def test_unsupported_models_and_settings_fail_clearly(model, monkeypatch):
    with pytest.raises(TypeError, match="model: expected a transformers DeepseekV4ForCausalLM"):
        I.enable_sparse_prefill(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="backend: expected one of"):
        I.enable_sparse_prefill(model, backend="sdpa")
    with pytest.raises(ValueError, match="policy: expected one of"):
        I.enable_sparse_prefill(model, policy="greedy")
    with pytest.raises(TypeError, match="planner"):  # the old keyword is gone, not silently ignored
        I.enable_sparse_prefill(model, planner="adaptive")
    with pytest.raises(ValueError, match="max_model_len"):
        I.enable_sparse_prefill(model, max_model_len=0)
    from planner.contract import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match="flashmla"):
        I.enable_sparse_prefill(model, backend="flashmla")  # CPU model
    monkeypatch.setitem(model.config.compress_rates, "compressed_sparse_attention", 0)  # any ratio >= 1 is fine
    with pytest.raises(
        ValueError, match=r"compress_rates\['compressed_sparse_attention'\]: .*CSA layers need a ratio >= 1, got 0"
    ):
        I.enable_sparse_prefill(model)
    monkeypatch.undo()
    from dsv4_torch.hf import versions

    monkeypatch.setattr(versions.metadata, "version", lambda name: "5.24.0")
    with pytest.raises(ImportError, match=r"transformers 5.24.0 is not supported.*>=5.23.0,<5.24.0"):
        I.enable_sparse_prefill(model)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="not enabled"):
        I.last_step_plan(model)
    assert not I.is_sparse_prefill_enabled(model)  # nothing was left half enabled


def test_bad_inputs_fail_clearly(model):
    ids = ids_of(12, 5)
    with sparse(model), torch.no_grad():
        mask = torch.ones_like(ids)
        with pytest.raises(ValueError, match="position_ids: row 0 column 3 has position 7"):
            model(ids, attention_mask=mask, position_ids=torch.arange(12)[None] + 4 * (torch.arange(12) == 3))
        with pytest.raises(ValueError, match="attention_mask: only 2-D"):
            model(ids, attention_mask=torch.ones((1, 1, 12, 12)))
        with pytest.raises(ValueError, match=r"attention_mask: expected \(1, 12\)"):
            model(ids, attention_mask=torch.ones((1, 5)))
        with pytest.raises(ValueError, match="output_attentions"):
            model(ids, output_attentions=True)
        cache = DynamicCache(config=model.config)
        model(ids, past_key_values=cache)
        with pytest.raises(ValueError, match="batch of 2 rows, but past_key_values holds 1"):
            model(ids.repeat(2, 1)[:, :1], past_key_values=cache)
        with pytest.raises(NotImplementedError, match="rolled back"):
            cache.crop(3)
    with torch.no_grad(), pytest.raises(RuntimeError, match="filled by dsv4_torch.hf's sparse prefill"):
        model(ids[:, :1], past_key_values=cache)  # eager attention cannot continue our cache
    eager_cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=eager_cache)
    with sparse(model), torch.no_grad(), pytest.raises(ValueError, match="written by transformers' own attention"):
        model(ids[:, :1], past_key_values=eager_cache)


def test_host_plans_of_the_ragged_state():
    """The per-forward layouts on small numbers (what every layer then gathers with)."""
    from dsv4_torch.hf import ragged as R

    prefix, query = np.array([5, 0, 9]), np.array([3, 2, 0])
    raw = R.plan_raw(prefix, query, W=4)
    # stream = [windows: req0 positions 2..4, req2 6..8 | new: req0 5..7, req1 0..1]
    np.testing.assert_array_equal(raw.keep, [6, 7, 8, 9, 10, 3, 4, 5])  # new windows: 5..7, 0..1, 6..8
    pages = raw.src.reshape(-1, R.RAW_PAGE)
    np.testing.assert_array_equal(pages[raw.table[0, 0], 2:8], [0, 1, 2, 6, 7, 8])  # positions 2..7
    np.testing.assert_array_equal(pages[raw.table[1, 0], 0:2], [9, 10])

    c = R.plan_compress(prefix, query, 4, R.EntryLayout.empty(3))
    # req0: buffer (position 4) + 3 new -> block 1 (positions 4..7); req1: 2 buffered; req2: nothing new
    assert c.n_windows == 1 and c.positions.tolist() == [4]
    np.testing.assert_array_equal(c.usable, [0, 2, 3, 4])  # stream = [buffers: req0 pos 4, req2 pos 8 | new]
    np.testing.assert_array_equal(c.leftover, [5, 6, 1])
    assert c.prev.tolist() == [1 + 0]  # first half from req0's overlap (it has entry 0 already)
    assert c.overlap.tolist() == [0, 2, 3]  # req0 takes this call's window; the others keep theirs
    assert c.layout.count.tolist() == [2, 0, 2] and c.layout.cap.tolist() == [64, 0, 64]


def test_window_regions_hold_every_position_a_call_reads():
    """`plan_window` over random call sequences (a NumPy stand-in for the layer's writes): after
    each call, request i's positions max(0, prefix - W + 1) .. seq - 1 sit at rows offsets[i] + p
    inside its region; a region is rebuilt only when this call's tokens do not fit, and a rebuilt
    one has room for W more tokens (decode rewrites no window but every W + 1 or more steps)."""
    from dsv4_torch.hf import ragged as R

    rng = np.random.default_rng(0)
    for case in range(40):
        B, W = int(rng.integers(1, 5)), int(rng.choice([1, 2, 8, 128]))
        seen, lay, buf = np.zeros(B, np.int64), R.WindowLayout.empty(B), np.zeros(0, np.int64)
        for step in range(60):
            query = np.ones(B, np.int64) if step > 2 and rng.random() < 0.8 else rng.integers(0, 300, B)
            plan = R.plan_window(seen, query, W, lay)
            assert plan.relayout == bool((lay.count + query > lay.cap).any())
            if plan.relayout:
                assert (plan.layout.cap - plan.layout.count >= W).all()
                grown = np.full(plan.layout.total_rows, -1, np.int64)
                grown[plan.move_dst] = buf[plan.move_src]
                buf = grown
            else:
                assert plan.move_src.size == 0 and (plan.layout.start == lay.start).all()
            buf[plan.append_dst] = np.concatenate([seen[i] + np.arange(query[i]) for i in range(B)])
            seq = seen + query
            for i in range(B):
                pos = np.arange(max(0, seen[i] - W + 1), seq[i])
                rows = plan.offsets[i] + pos
                np.testing.assert_array_equal(buf[rows], pos, err_msg=f"case {case} step {step} request {i}")
                start, cap = plan.layout.start[i], plan.layout.cap[i]
                assert rows.size == 0 or (rows.min() >= start and rows.max() < start + cap)
            seen, lay = seq, plan.layout


def test_bf16_on_a_cpu_without_bf16_dot_products_warns_once(model, monkeypatch):
    """A bf16 model on such a CPU (torch's bf16 matmul emulated there) gets one RuntimeWarning."""
    import warnings

    from dsv4_torch import devices

    monkeypatch.setattr(devices, "_bf16_matmul_native", lambda: False)
    monkeypatch.setattr(devices, "_BF16_WARNED", set())
    assert devices.emulated_bf16_gemm(torch.bfloat16, "cpu") and not devices.emulated_bf16_gemm(torch.float32, "cpu")
    with pytest.warns(RuntimeWarning, match="emulated"):
        assert devices.warn_emulated_bf16_gemm(torch.bfloat16, "cpu", "x")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert devices.warn_emulated_bf16_gemm(torch.bfloat16, "cpu", "x")  # once per process and name
        assert not devices.warn_emulated_bf16_gemm(torch.float32, "cpu", "y")
    monkeypatch.setattr(devices, "_bf16_matmul_native", lambda: True)
    assert not devices.emulated_bf16_gemm(torch.bfloat16, "cpu")


def test_rope_is_transformers_bit_for_bit():
    """dsv4_torch.hf.layer.rope (no expanded cos / sin) == transformers' apply_rotary_pos_emb."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for shape, cshape, dim in (
            ((5, 8, 512), (5, 32), 1),
            ((5, 1, 512), (5, 32), 1),
            ((1, 16, 5, 128), (1, 5, 32), 1),
        ):
            x = (torch.randn(shape, generator=g) * 3).to(dtype)
            cos, sin = (torch.randn(cshape, generator=g).to(dtype) for _ in range(2))
            for s in (sin, -sin):
                assert torch.equal(L.rope(x, cos, s, dim), apply_rotary_pos_emb(x, cos, s, dim)), (dtype, shape)
