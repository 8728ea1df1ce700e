"""The plugin's get_prefill_chunk_plan against vLLM 0.33.0's own, on the real metadata class."""

import numpy as np
import pytest

from dsv4_torch.vllm import chunk_plan
from planner import ModelShape

# (compress_ratio, has_compressed) as vLLM's callers pass them: V4.0 layers (SWA is ratio 1 in
# vLLM, has_compressed left to the default), V4.1's explicit has_compressed (ratio-1 layers that
# gather a full-length compressed cache, ratio-2 layers, SWA ratio 0 with False).
V40_KINDS = [(1, None), (4, None), (128, None)]
V41_KINDS = [(1, True), (2, True), (4, True), (128, True), (0, False), (4, False)]


def random_batch(rng, zero_queries: bool = False):
    n = int(rng.choice([1, 2, 3, 4, 5, 8, 13, 32, 64, 100]))
    mml = int(rng.choice([256, 4096, 65536, 1 << 20]))
    mnbt = int(rng.choice([16, 512, 8192]))
    W = int(rng.choice([4, 64, 128]))
    pcs = int(rng.choice([1, 2, 4, 8]))
    style = rng.integers(3)
    if style == 0:  # anywhere up to the model length
        seq = rng.integers(1, mml + 1, n)
    elif style == 1:  # short requests (small, packed chunks)
        seq = rng.integers(1, min(mml, 300) + 1, n)
    else:  # a mix of long and short
        seq = np.where(rng.random(n) < 0.3, rng.integers(1, mml + 1, n), rng.integers(1, min(mml, 64) + 1, n))
    cap = np.minimum(seq, mnbt)
    qry = np.where(rng.random(n) < 0.5, cap, rng.integers(1, cap + 1))  # whole prompts or chunks
    if zero_queries:
        qry = np.where(rng.random(n) < float(rng.choice([0.2, 0.5, 0.9])), 0, qry)
    return seq, qry, dict(window_size=W, max_model_len=mml, max_num_batched_tokens=mnbt), pcs


def test_equal_to_vllm_on_random_batches(make_metadata, vllm_plan):
    """>= 1000 random batches, every request with queries: the same tuples as vLLM's method."""
    rng = np.random.default_rng(2026)
    compared = chunks = multi = 0
    for _ in range(1000):
        seq, qry, limits, pcs = random_batch(rng)
        for r, hc in V40_KINDS + V41_KINDS:
            want = vllm_plan(make_metadata(seq, qry, **limits), r, pcs, hc)
            got = make_metadata(seq, qry, **limits).get_prefill_chunk_plan(r, pcs, hc)
            assert got == want, (seq.tolist(), qry.tolist(), limits, pcs, r, hc)
            compared += 1
            chunks += len(want)
            multi += len(want) > 1
    assert compared == 1000 * len(V40_KINDS + V41_KINDS)
    assert multi > compared // 10, "the random batches should often need several chunks"


def test_keyword_arguments_as_vllm_callers_pass_them(make_metadata, vllm_plan):
    seq, qry = [256, 320, 448, 640, 1024, 1536, 3072, 4096, 6144, 8192], [4, 8, 8, 8, 16, 16, 32, 32, 32, 32]
    limits = dict(window_size=64, max_model_len=16384, max_num_batched_tokens=4096)
    md = make_metadata(seq, qry, **limits)
    # vLLM's PR #45061 example (spec section 4)
    assert md.get_prefill_chunk_plan(compress_ratio=4, prefill_chunk_size=4) == [(0, 10, 2048, 2143)]
    assert md.get_prefill_chunk_plan(compress_ratio=1, prefill_chunk_size=4) == [(0, 10, 0, 95)]
    assert md.get_prefill_chunk_plan(compress_ratio=128, prefill_chunk_size=4, has_compressed=None) == [
        (0, 10, 64, 159)
    ]
    assert md.get_prefill_chunk_plan(compress_ratio=1, prefill_chunk_size=4, has_compressed=True) == vllm_plan(
        make_metadata(seq, qry, **limits), compress_ratio=1, prefill_chunk_size=4, has_compressed=True
    )


def test_no_prefills_and_bad_arguments(make_metadata):
    md = make_metadata([], [], window_size=128, max_model_len=1024, max_num_batched_tokens=64)
    assert md.get_prefill_chunk_plan(4, 4) == []
    md = make_metadata([10], [5], window_size=128, max_model_len=1024, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="compress_ratio"):
        md.get_prefill_chunk_plan(4.0, 4)
    with pytest.raises(ValueError, match="has_compressed"):
        md.get_prefill_chunk_plan(4, 4, has_compressed="yes")
    with pytest.raises(ValueError, match="compress_ratio"):  # vLLM would divide by zero here
        md.get_prefill_chunk_plan(0, 4, has_compressed=True)
    md = make_metadata([10], [11], window_size=128, max_model_len=1024, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="query_lens"):
        md.get_prefill_chunk_plan(4, 4)

    md = make_metadata([10], [5], window_size=128, max_model_len=1024, max_num_batched_tokens=64)
    md.prefill_seq_lens_cpu = md.prefill_seq_lens_cpu.to("meta")  # not on the host
    with pytest.raises(ValueError, match="prefill_seq_lens_cpu: expected a CPU tensor"):
        md.get_prefill_chunk_plan(4, 4)


@pytest.mark.parametrize("model", ["v4-flash", "v4-pro"])
def test_one_plan_per_kind_per_step(make_metadata, vllm_plan, model, monkeypatch):
    """A simulated step: every attention layer (MTP included) asks, as `_forward_prefill` does."""

    chunk_plan.forget_steps()  # v4-flash's steps had these very batches
    calls = []
    real = chunk_plan.StepPlans.plan
    monkeypatch.setattr(chunk_plan.StepPlans, "plan", lambda self, *a: calls.append(a[0]) or real(self, *a))
    # vLLM's DeepseekV4Attention: compress_ratio = max(1, ratio) (SWA layers ask with 1)
    ratios = [max(1, spec.compress_ratio) for spec in ModelShape.from_name(model).layers]
    assert len(ratios) == {"v4-flash": 44, "v4-pro": 62}[model]
    rng = np.random.default_rng(7)
    limits = dict(window_size=128, max_model_len=1 << 20, max_num_batched_tokens=8192)
    for step in range(3):
        seq = rng.integers(1, 1 << 20, 64)
        qry = rng.integers(1, 128, 64)
        md = make_metadata(seq, qry, **limits)  # vLLM builds fresh metadata every step
        plans = [md.get_prefill_chunk_plan(compress_ratio=r, prefill_chunk_size=4) for r in ratios]
        assert sorted(calls[3 * step :]) == [1, 4, 128], "one plan per kind per step"
        assert chunk_plan.step_plans(md).planned == 3
        for r, p in zip(ratios, plans):
            assert p == vllm_plan(make_metadata(seq, qry, **limits), r, 4)
            assert p is plans[ratios.index(r)]  # layers of one kind share the step's plan
    assert len(calls) == 9


def test_cache_follows_reassigned_fields(make_metadata):
    import torch

    limits = dict(window_size=8, max_model_len=1024, max_num_batched_tokens=64)
    md = make_metadata([100, 200], [10, 10], **limits)
    first = md.get_prefill_chunk_plan(4, 1)
    md.prefill_seq_lens_cpu = torch.tensor([1000, 1000], dtype=torch.int32)
    assert md.get_prefill_chunk_plan(4, 1) != first
    assert md.get_prefill_chunk_plan(4, 1) == make_metadata([1000, 1000], [10, 10], **limits).get_prefill_chunk_plan(
        4, 1
    )


def _runs(qry):
    """Maximal runs [a, b) of requests with queries."""
    runs, a = [], None
    for i, q in enumerate(list(qry) + [0]):
        if q > 0 and a is None:
            a = i
        elif q == 0 and a is not None:
            runs.append((a, i))
            a = None
    return runs


def test_zero_query_requests_never_form_or_widen_a_chunk(make_metadata, vllm_plan):
    """Batches with query_len == 0 requests (KV-transfer loads, padded rows): no chunk holds one;
    between them, each run of requests with queries is planned exactly as vLLM plans it alone."""
    rng = np.random.default_rng(51486)
    empty_in_vllm = 0
    for _ in range(400):
        seq, qry, limits, pcs = random_batch(rng, zero_queries=True)
        for r, hc in V40_KINDS + [(1, True)]:
            got = make_metadata(seq, qry, **limits).get_prefill_chunk_plan(r, pcs, hc)
            covered = [i for s, e, _, _ in got for i in range(s, e)]
            assert covered == [i for i in range(len(qry)) if qry[i] > 0]  # each once, in order, no zero
            assert all(qry[s:e].sum() > 0 for s, e, _, _ in got)
            want = []
            for a, b in _runs(qry):
                sub = vllm_plan(make_metadata(seq[a:b], qry[a:b], **limits), r, pcs, hc)
                want += [(s + a, e + a, n, m) for s, e, n, m in sub]
            assert got == want
            theirs = vllm_plan(make_metadata(seq, qry, **limits), r, pcs, hc)
            empty_in_vllm += any(qry[s:e].sum() == 0 for s, e, _, _ in theirs)
    assert empty_in_vllm > 0, "vLLM's own plan should show the empty chunks of vLLM #51486 here"


def test_zero_query_examples(make_metadata, vllm_plan):
    limits = dict(window_size=128, max_model_len=65536, max_num_batched_tokens=8192)
    # a long KV-transfer load (no queries) between two short prefills
    seq, qry = [100, 60000, 100], [10, 0, 10]
    theirs = vllm_plan(make_metadata(seq, qry, **limits), 4, 4)
    assert theirs == [(0, 3, 15000, 15000 + 127)]  # the load widens N to 15000 rows
    assert make_metadata(seq, qry, **limits).get_prefill_chunk_plan(4, 4) == [
        (0, 1, 25, 25 + 100),
        (2, 3, 25, 25 + 100),
    ]
    # only loads: vLLM plans a chunk with zero query rows (the FlashMLA crash); we plan nothing
    assert vllm_plan(make_metadata([500, 700], [0, 0], **limits), 4, 4) == [(0, 2, 175, 175 + 127)]
    assert make_metadata([500, 700], [0, 0], **limits).get_prefill_chunk_plan(4, 4) == []
