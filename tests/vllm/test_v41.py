"""DeepSeek-V4.1 inside vLLM 0.33.0 through the plugin (the GPU path, checked on the CPU).

What is pinned:
- every V4.1 prefill consumer reaches the plugin's plans: vLLM's own `_forward_prefill`
  (`models/deepseek_v41/nvidia/flashmla.py`) and `_forward_prefill_mega`
  (`flash_mla_mega_attn.py`) run as shipped up to the chunk loop (its workspace request is where
  they are stopped); the ROCm layer (`amd/rocm.py`, which initialises a GPU at import) is read from
  its source;
- a V4.1 step of 40 layers plans 3 times, with bounded replay and without: ratio 0 and 2 on the
  batch, ratio 1 on the batch (no replay) or once on the kept rows, which vLLM's
  `_prepare_replay_batch` gives two metadata objects of their own (the cut's, with the batch's
  window floors, and the later layers', with `kept_kv_start`); vLLM plans 40 times;
- the plans equal vLLM's own `get_prefill_chunk_plan` on random batches at ratios 0 / 2 / 1
  (`has_compressed` as the V4.1 layers pass it), with prefix hits (`replay_start` window floors),
  replay on and off; the kept rows equal `planner.PrefillBatch.band("replay")` and vLLM's own
  `_gather_replay_batch_kernel` (Triton's interpreter);
- zero-query requests (KV-transfer loads) never form or widen a chunk, in the batch or the kept rows.
"""

import ast
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import planner
from dsv4_torch.vllm import chunk_plan

V41_KINDS = [(0, False), (2, True), (1, True)]  # (compress_ratio, has_compressed) as V4.1's layers pass them
CHUNK = 4  # DeepseekV4Attention.PREFILL_CHUNK_SIZE


class Planned(Exception):
    """Raised where a consumer asks for its workspace: it has its chunk plan by then."""


def random_v41_batch(rng, zero_queries: bool = False):
    """A prefill batch as V4.1's scheduler hands it: fresh prompts, chunked-prefill continuations
    and prefix hits whose window KV is rebuilt from `replay_start` (0 <= replay_start <= prefix)."""
    n = int(rng.choice([1, 2, 3, 5, 8, 16, 40]))
    mml = int(rng.choice([512, 8192, 65536, 1 << 20]))
    mnbt = int(rng.choice([64, 2048, 8192]))
    W = int(rng.choice([16, 64, 128]))
    style = rng.integers(3)
    if style == 0:
        seq = rng.integers(1, mml + 1, n)
    elif style == 1:
        seq = rng.integers(1, min(mml, 4 * W) + 1, n)
    else:
        seq = np.where(rng.random(n) < 0.3, rng.integers(1, mml + 1, n), rng.integers(1, min(mml, 3 * W) + 1, n))
    cap = np.minimum(seq, mnbt)
    qry = np.where(rng.random(n) < 0.4, cap, rng.integers(1, cap + 1))
    if zero_queries:
        qry = np.where(rng.random(n) < float(rng.choice([0.2, 0.5])), 0, qry)
    prefix = seq - qry
    rs = np.where(rng.random(n) < 0.5, (rng.random(n) * (prefix + 1)).astype(np.int64), 0)
    limits = dict(window_size=W, max_model_len=mml, max_num_batched_tokens=mnbt)
    return seq, qry, rs, limits


def kept_rows(seq, qry, rs, W):
    """vLLM's replay batch (`_prepare_replay_batch`, `_gather_replay_batch_kernel`): each request's
    last min(query_len, W) rows, and the window floor past the cut (`kept_kv_start`)."""
    kept = np.minimum(qry, W)
    kv_start = np.where(kept < qry, np.maximum(rs, seq - W), rs)
    return kept, kv_start


def i32(a):
    return torch.tensor(np.asarray(a), dtype=torch.int32)


def test_v41_plans_equal_vllm_on_random_batches(make_metadata, vllm_plan):
    """2000 random batches: the batch's plans at ratios 0 / 2 / 1 and, under replay, the kept
    rows' ratio-1 plan on both of vLLM's metadata objects: vLLM's own method's tuples; the two
    kept objects share one plan; the kept rows are the planner's replay band."""
    rng = np.random.default_rng(4141)
    chunk_plan.forget_steps()
    compared = multi = replayed = hits = 0
    for _ in range(2000):
        seq, qry, rs, limits = random_v41_batch(rng)
        W = limits["window_size"]
        md = make_metadata(seq, qry, replay_start=i32(rs), **limits)
        for r, hc in V41_KINDS:
            want = vllm_plan(make_metadata(seq, qry, **limits), r, CHUNK, hc)
            got = md.get_prefill_chunk_plan(compress_ratio=r, prefill_chunk_size=CHUNK, has_compressed=hc)
            assert got == want, (seq.tolist(), qry.tolist(), limits, r)
            compared += 1
            multi += len(want) > 1
        hits += bool((rs > 0).any())
        if rng.random() < 0.5 and (qry > W).any():  # vLLM makes a replay batch only then
            kept, kv_start = kept_rows(seq, qry, rs, W)
            band = planner.PrefillBatch(seq, qry, replay_start=rs).band("replay", W)
            assert band.query_lens.tolist() == kept.tolist() and band.window_starts.tolist() == kv_start.tolist()
            cut = make_metadata(seq, kept, replay_start=i32(rs), **limits)
            past = make_metadata(seq, kept, replay_start=i32(kv_start), **limits)
            want = vllm_plan(make_metadata(seq, kept, replay_start=i32(kv_start), **limits), 1, CHUNK, True)
            got = cut.get_prefill_chunk_plan(1, CHUNK, True)
            assert got == want, (seq.tolist(), kept.tolist(), limits)
            assert past.get_prefill_chunk_plan(1, CHUNK, True) is got  # once for both objects
            compared += 1
            replayed += 1
    assert compared > 6000 and multi > 600 and replayed > 300 and hits > 500, (compared, multi, replayed, hits)


def test_v41_zero_query_requests(make_metadata, vllm_plan):
    """V4.1 batches with KV-transfer loads: no chunk holds one, in the batch or its kept rows;
    between them each run is planned exactly as vLLM plans it alone."""
    rng = np.random.default_rng(51486)
    empty_in_vllm = 0
    for _ in range(300):
        seq, qry, rs, limits = random_v41_batch(rng, zero_queries=True)
        kept, _ = kept_rows(seq, qry, rs, limits["window_size"])
        for q in (qry, kept):
            for r, hc in V41_KINDS:
                got = make_metadata(seq, q, **limits).get_prefill_chunk_plan(r, CHUNK, hc)
                assert [i for s, e, _, _ in got for i in range(s, e)] == np.flatnonzero(q > 0).tolist()
                want, i = [], 0
                while i < len(q):  # vLLM's plan of each run of requests with queries
                    if q[i] == 0:
                        i += 1
                        continue
                    j = i
                    while j < len(q) and q[j] > 0:
                        j += 1
                    sub = vllm_plan(make_metadata(seq[i:j], q[i:j], **limits), r, CHUNK, hc)
                    want += [(s + i, e + i, n, m) for s, e, n, m in sub]
                    i = j
                assert got == want
                theirs = vllm_plan(make_metadata(seq, q, **limits), r, CHUNK, hc)
                empty_in_vllm += any(q[s:e].sum() == 0 for s, e, _, _ in theirs)
    assert empty_in_vllm > 0, "vLLM's own plan should hand FlashMLA empty chunks here (vLLM #51486)"


@pytest.fixture(scope="module")
def v41_consumers(vllm_plugins, sparse_swa):
    """vLLM's V4.1 NVIDIA prefill methods (guarded by the plugin), stopped at their workspace request."""
    import vllm.models.deepseek_v41.nvidia.flash_mla_mega_attn as mega
    import vllm.models.deepseek_v41.nvidia.flashmla as flashmla

    from dsv4_torch.vllm.plugin import original

    mp = pytest.MonkeyPatch()

    def stop():
        raise Planned

    for module in (flashmla, mega):
        mp.setattr(module, "current_workspace_manager", stop)
    flash_cls, mega_cls = flashmla.DeepseekV4FlashMLAAttention, mega.DeepseekV4MegaAttnAttention
    assert original(flash_cls._forward_prefill) is not None and original(mega_cls._forward_prefill_mega) is not None

    def flash(layer, md):
        flash_cls._forward_prefill(layer, None, None, None, None, None, None, swa_metadata=md)

    def mega_call(layer, md):
        mega_cls._forward_prefill_mega(layer, None, None, None, swa_metadata=md, out=None, token_base=0)

    yield {"flashmla": (flash_cls, flash), "mega": (mega_cls, mega_call)}
    mp.undo()


def layer_of(cls, ratio: int, W: int, tokens: int):
    """What the prefill method reads of a DeepseekV4Attention before it plans."""
    return SimpleNamespace(
        compress_ratio=ratio,
        window_size=W,
        PREFILL_CHUNK_SIZE=cls.PREFILL_CHUNK_SIZE,
        max_num_batched_tokens=tokens,
        topk_indices_buffer=torch.full((tokens, 512), -1, dtype=torch.int32),
        _prefill_num_heads=64,
    )


def full_metadata(make_metadata, seq, qry, rs, limits):
    """A prefill-only step's SWA metadata with the fields the consumers read before planning."""
    qsl = i32(np.concatenate([[0], np.cumsum(qry)]))
    return make_metadata(
        seq,
        qry,
        replay_start=i32(rs),
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        prefill_seq_lens=i32(seq),
        prefill_gather_lens=i32(qry + np.minimum(np.maximum(seq - qry - rs, 0), limits["window_size"] - 1)),
        **limits,
    )


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
@pytest.mark.parametrize("consumer", ["flashmla", "mega"])
def test_v41_step_plans_three_times(v41_consumers, make_metadata, vllm_plan, monkeypatch, consumer, replay):
    """The released 40-layer schedule, every layer's prefill method as vLLM calls it: layers
    before the cut on the batch's metadata; under replay the cut on the kept rows' first-SWA
    metadata and layers 21-39 on the replay batch's. 3 plans a step either way (vLLM: 40), each
    layer's equal to vLLM's."""
    cls, call = v41_consumers[consumer]
    sched = planner.Schedule.from_name("V4.1")
    W, limits = sched.sliding_window, dict(window_size=128, max_model_len=1 << 17, max_num_batched_tokens=8192)
    rng = np.random.default_rng(40 + replay)
    seq = rng.integers(1, 1 << 17, 24)
    qry = np.minimum(seq, rng.integers(1, 8192 // 24, 24))
    qry[:3] = np.minimum(seq[:3], 300)  # some requests longer than the window: vLLM replays
    rs = np.where(rng.random(24) < 0.5, (seq - qry) // 2, 0)  # prefix hits
    kept, kv_start = kept_rows(seq, qry, rs, W)
    batch = full_metadata(make_metadata, seq, qry, rs, limits)
    cut = full_metadata(make_metadata, seq, kept, rs, limits)
    past = full_metadata(make_metadata, seq, kept, kv_start, limits)

    chunk_plan.forget_steps()
    planned, seen = [], []
    real_plan = chunk_plan.StepPlans.plan
    monkeypatch.setattr(chunk_plan.StepPlans, "plan", lambda self, *a: planned.append(a) or real_plan(self, *a))
    method = type(batch).get_prefill_chunk_plan
    monkeypatch.setattr(
        type(batch),
        "get_prefill_chunk_plan",
        lambda md, *a, **k: seen.append((md, a, k, method(md, *a, **k))) or seen[-1][-1],
    )
    for i, role in enumerate(sched):
        md = batch if not replay or i < sched.cut else cut if i == sched.cut else past
        with pytest.raises(Planned):
            call(layer_of(cls, role.compress_ratio, W, 8192), md)
    assert len(seen) == 40 and len(planned) == 3
    for i, (md, a, k, plan) in enumerate(seen):
        r = sched[i].compress_ratio
        assert a == () and k == dict(compress_ratio=r, prefill_chunk_size=CHUNK, has_compressed=r != 0)
        q = qry if md is batch else kept
        assert plan == vllm_plan(make_metadata(seq, q, **limits), r, CHUNK, r != 0), i
    if replay:  # the kept rows' two metadata objects share one step
        assert chunk_plan.step_plans(cut) is chunk_plan.step_plans(past) is not chunk_plan.step_plans(batch)
    # a step whose prefills have no query tokens: the guard returns before the plan
    seen.clear()
    empty = full_metadata(make_metadata, seq[:2], np.zeros(2, np.int64), np.zeros(2, np.int64), limits)
    assert call(layer_of(cls, 1, W, 8192), empty) is None and seen == []


def test_rocm_v41_consumer_reads_the_patched_plan(vllm_plugins, sparse_swa):
    """vLLM's V4.1 ROCm layer (not importable without a GPU): its `_forward_prefill` takes
    `swa_metadata`, which the plugin's guard needs, and plans through the shared metadata method
    (its metadata class inherits it), with V4.1's arguments."""
    import vllm

    from dsv4_torch.vllm import plugin

    module, cls_name, method = next(c for c in plugin.PREFILL_CONSUMERS if c[0].endswith("deepseek_v41.amd.rocm"))
    path = os.path.join(os.path.dirname(vllm.__file__), *module.split(".")[1:]) + ".py"
    tree = ast.parse(open(path).read())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    fn = next(n for n in classes[cls_name].body if isinstance(n, ast.FunctionDef) and n.name == method)
    assert "swa_metadata" in [a.arg for a in fn.args.args]
    calls = [
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get_prefill_chunk_plan"
    ]
    assert len(calls) == 1 and ast.unparse(calls[0].func.value) == "swa_metadata"
    assert {k.arg: ast.unparse(k.value) for k in calls[0].keywords} == {
        "compress_ratio": "self.compress_ratio",
        "prefill_chunk_size": "self.PREFILL_CHUNK_SIZE",
        "has_compressed": "not swa_only",
    }
    md_cls = classes["DeepseekV41ROCMAiterSparseSWAMetadata"]
    assert [ast.unparse(b) for b in md_cls.bases] == ["DeepseekSparseSWAMetadata"]
    assert not any(getattr(n, "name", None) == "get_prefill_chunk_plan" for n in md_cls.body)


def test_kept_rows_equal_vllms_gather_kernel(vllm_plugins, make_metadata, vllm_plan):
    """vLLM 0.33's own `_gather_replay_batch_kernel` (Triton's interpreter) on random batches: its
    kept query_start_loc and window floors are the planner's replay band; the plugin's plan of the
    kept metadata vLLM then builds is vLLM's."""
    from vllm.models.deepseek_v41.nvidia.model_state import _gather_replay_batch_kernel

    rng = np.random.default_rng(33)
    rows = 0
    for case in range(12):
        W = int(rng.choice([16, 32]))
        n = int(rng.integers(1, 7))
        seq = rng.integers(1, 6 * W, n)
        qry = np.where(rng.random(n) < 0.4, seq, rng.integers(0, seq + 1))
        rs = np.where(rng.random(n) < 0.5, (rng.random(n) * (seq - qry + 1)).astype(np.int64), 0)
        batch = planner.PrefillBatch(seq, qry, replay_start=rs)
        band = batch.band("replay", W)
        B, T = n, batch.num_tokens
        kept = np.minimum(qry, W)
        qsl, kept_qsl = batch.query_start_loc, np.concatenate([[0], np.cumsum(kept)])
        out_rows = torch.zeros(max(T, 1), dtype=torch.int64)
        out_qsl = torch.zeros(B + 1, dtype=torch.int32)
        out_pos = torch.zeros(max(T, 1), dtype=torch.int64)
        slots = torch.arange(max(T, 1), dtype=torch.int64).reshape(1, -1)
        out_slots = torch.zeros_like(slots)
        kv_start = torch.zeros(B, dtype=torch.int32)
        _gather_replay_batch_kernel[(B,)](
            i32(qsl), i32(qsl - kept_qsl), i32(seq), i32(rs), torch.tensor(batch.token_position, dtype=torch.int64),
            slots, slots.stride(0), out_rows, out_qsl, out_pos, out_slots, out_slots.stride(0), kv_start, W,
            NUM_GROUPS=1, BLOCK=1024,
        )  # fmt: skip
        nk = int(kept.sum())
        assert out_rows.numpy()[:nk].tolist() == band.token_index.tolist(), case
        assert np.diff(out_qsl.numpy()).tolist() == band.query_lens.tolist(), case
        assert kv_start.numpy().tolist() == band.window_starts.tolist(), case
        limits = dict(window_size=W, max_model_len=512, max_num_batched_tokens=256)
        md = make_metadata(seq, np.diff(kept_qsl), replay_start=kv_start, **limits)  # as the builder reads it
        got = md.get_prefill_chunk_plan(1, CHUNK, True)
        if (kept > 0).all():
            assert got == vllm_plan(make_metadata(seq, np.diff(kept_qsl), **limits), 1, CHUNK, True), case
        else:  # loads keep no rows and join no chunk (test_v41_zero_query_requests)
            assert [i for s, e, _, _ in got for i in range(s, e)] == np.flatnonzero(kept).tolist(), case
        rows += nk
    assert rows > 50
