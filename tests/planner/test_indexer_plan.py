"""planner.indexer_plan: the indexer's prefill chunks (vLLM's rule and the streaming mode), token arrays.

Equality with vLLM 0.33.0's own `_split_indexer_prefill_chunks` is checked in
tests/vllm/test_indexer_plan.py (`make test-vllm`); here the plan is checked against a plain
request-by-request loop of the rule as documented (written for this test) and on its invariants.
"""

import numpy as np
import pytest

import planner
from planner.indexer_plan import (
    CandidateLayout,
    IndexerPlan,
    KeysAtLeast,
    plan_indexer,
    split_indexer_prefill_chunks,
)


def loop_rule(comp, qry, workspace, logits_bytes, offset=0):
    """The documented rule, one request at a time (independent of the planner's bisection)."""
    elems = logits_bytes // 4
    out, end, n = [], 0, len(comp)
    while end < n:
        start, m, k = end, 0, 0
        while end < n and k + comp[end] <= workspace and (m + qry[end]) * (k + comp[end]) <= elems:
            m, k = m + qry[end], k + comp[end]
            end += 1
        if end == start:
            m, k = qry[end], comp[end]
            end += 1
        step = max(1, elems // k) if k > 0 else max(1, m)
        out += [(slice(start + offset, end + offset), slice(a, min(a + step, m))) for a in range(0, m, step)]
    return out


def random_case(rng):
    n = int(rng.choice([0, 1, 2, 3, 7, 16, 100]))
    comp = rng.integers(0, int(rng.choice([2, 64, 4096, 1 << 18])) + 1, n)
    qry = rng.integers(0, int(rng.choice([1, 16, 2048, 8192])) + 1, n)
    if rng.random() < 0.3:
        qry[rng.random(n) < 0.4] = 0
    if rng.random() < 0.3:
        comp[rng.random(n) < 0.4] = 0
    workspace = int(rng.choice([0, 1, 64, 4096, 1 << 16, 1 << 22]))
    logits = int(rng.choice([0, 3, 4, 4096, 1 << 20, 64 << 20, 1 << 34]))
    if logits < 1 << 34:  # pieces of few query tokens: keep the lists short
        qry = np.minimum(qry, 64)
    return comp, qry, workspace, logits, int(rng.integers(0, 4))


def test_equal_to_the_rule_on_random_batches():
    rng = np.random.default_rng(28)
    pieces = split = 0
    for _ in range(1000):
        comp, qry, workspace, logits, offset = random_case(rng)
        want = loop_rule(comp.tolist(), qry.tolist(), workspace, logits, offset)
        got = split_indexer_prefill_chunks(comp, qry, workspace, logits, offset)
        assert got == want, (comp.tolist(), qry.tolist(), workspace, logits, offset)
        pieces += len(got)
        split += len({(r.start, r.stop) for r, _ in got}) < len(got)
    assert pieces > 1000 and split > 50, "the random cases should often give several chunks and query pieces"


def test_examples():
    # two requests share a chunk while 2 * (100 + 200) * 4 bytes fit; the third alone is too large
    assert split_indexer_prefill_chunks([100, 200, 5000], [1, 1, 4], 10_000, 4 * 600) == [
        (slice(0, 2), slice(0, 2)),
        (slice(2, 3), slice(0, 1)),
        (slice(2, 3), slice(1, 2)),
        (slice(2, 3), slice(2, 3)),
        (slice(2, 3), slice(3, 4)),
    ]
    # the workspace bound alone
    assert split_indexer_prefill_chunks([3, 3, 3], [1, 1, 1], 6, 1 << 30, request_offset=5) == [
        (slice(5, 7), slice(0, 2)),
        (slice(7, 8), slice(0, 1)),
    ]
    # a chunk without query tokens gets no piece (vLLM's rule); no requests, no chunks
    assert split_indexer_prefill_chunks([10, 10], [0, 3], 10, 1 << 20) == [(slice(1, 2), slice(0, 3))]
    assert split_indexer_prefill_chunks([], [], 10, 100) == []


def test_streaming_mode_has_no_logits_budget():
    seq = np.array([4096, 100, 65536, 0, 9000])
    qry = np.array([4096, 100, 2048, 0, 1])
    p = plan_indexer(seq, qry, 4)
    assert isinstance(p, IndexerPlan) and p.mode == "streaming"
    assert p.as_slices() == [(slice(0, 5), slice(0, int(qry.sum())))]
    # a key workspace bound still splits by requests, never along queries
    p = plan_indexer(seq, qry, 4, workspace_size=16384)
    assert p.as_slices() == [
        (slice(0, 2), slice(0, 4196)),
        (slice(2, 4), slice(0, 2048)),  # request 3 holds no keys: it joins
        (slice(4, 5), slice(0, 1)),
    ]
    assert p.keys.tolist() == [1024 + 25, 16384, 2250]
    # vLLM's mode: the same plan as split_indexer_prefill_chunks on the compressed lengths
    p = plan_indexer(seq, qry, 4, workspace_size=1 << 20, max_logits_bytes=8 << 20, request_offset=2)
    assert p.mode == "vllm"
    assert p.as_slices() == split_indexer_prefill_chunks(seq // 4, qry, 1 << 20, 8 << 20, 2)
    assert (p.logits_bytes <= 8 << 20).all()


def test_token_arrays():
    seq, qry = [10, 3, 7], [4, 0, 7]
    p = plan_indexer(seq, qry, 4)
    assert p.token_request.tolist() == [0] * 4 + [2] * 7
    assert p.token_position.tolist() == [6, 7, 8, 9, 0, 1, 2, 3, 4, 5, 6]
    assert p.token_visible.tolist() == [1, 2, 2, 2, 0, 0, 0, 1, 1, 1, 1]
    assert p.token_request.dtype == np.int32 and not p.token_position.flags.writeable


class _DeviceTensor:
    """What the planner sees of a torch tensor on a GPU: an int32 vector whose `is_cpu` is False."""

    dtype, ndim, is_cpu, device = "torch.int32", 1, False, "cuda:0"

    def tolist(self):
        raise AssertionError("read a device tensor")


def test_every_input_kind_gives_the_same_chunks():
    """Lists, NumPy vectors of each integer width and CPU tensors: the same list (the fast paths
    read integer vectors with one tolist())."""
    torch = pytest.importorskip("torch", reason="torch: the CPU-tensor input of vLLM's call")
    comp, qry = [70000, 16, 0, 4096, 3], [2048, 64, 3, 8192, 0]
    want = loop_rule(comp, qry, 65536, 64 << 20, 2)
    kinds = [list, *(lambda v, t=t: np.asarray(v, t) for t in (np.int32, np.int64, np.uint32))]
    kinds += [lambda v, t=t: torch.tensor(v, dtype=t) for t in (torch.int32, torch.int64)]
    for kind in kinds:
        assert split_indexer_prefill_chunks(kind(comp), kind(qry), 65536, 64 << 20, 2) == want
    assert split_indexer_prefill_chunks(np.asarray(comp, np.uint64), qry, 65536, 64 << 20, 2) == want


def test_keys_at_least_is_the_clamp_then_the_split():
    """DeepSeek-V4.1's sparse-logits builder clamps the compressed lengths from below before the
    split; KeysAtLeast does both in one pass: equal to the rule on the clamped lengths."""
    torch = pytest.importorskip("torch", reason="torch: the CPU-tensor input of vLLM's call")
    rng = np.random.default_rng(41)
    for _ in range(300):
        comp, qry, workspace, logits, offset = random_case(rng)
        lo = int(rng.choice([0, 1, 64, 8192]))
        want = loop_rule(np.maximum(comp, lo).tolist(), qry.tolist(), workspace, logits, offset)
        for values in (comp, torch.tensor(comp, dtype=torch.int32), comp.tolist()):
            assert split_indexer_prefill_chunks(KeysAtLeast(values, lo), qry, workspace, logits, offset) == want
    with pytest.raises(ValueError, match=r"compressed_seq_lens\[1\] = -1"):
        split_indexer_prefill_chunks(KeysAtLeast([5, -1], 8), [1, 1], 10, 10)
    with pytest.raises(TypeError, match="query_lens: KeysAtLeast"):
        split_indexer_prefill_chunks([5], KeysAtLeast([1], 8), 10, 10)
    with pytest.raises(ValueError, match="minimum: must be >= 0"):
        KeysAtLeast([5], -1)


def test_candidate_layout():
    """The released V4.1 schedule: 2048 blocks of 8 entries, DeepGEMM blocks of 8 (8 does not
    divide by 16), 16384 sparse columns, split lengths at least 8192; rows per step: every prefill
    token without replay, each request's last min(query_len, W) rows with it (the candidate source
    is the cut)."""
    layout = CandidateLayout.of(planner.Schedule.from_name("V4.1"))
    assert (layout.topk_blocks, layout.block_size, layout.index_topk) == (2048, 8, 512)
    assert (layout.sparse_block_kv, layout.num_sparse_blocks, layout.num_sparse_cols) == (8, 2048, 16384)
    assert layout.min_split_keys == 8192
    assert CandidateLayout(64, 32, 16).sparse_block_kv == 16 and CandidateLayout(64, 32, 16).num_sparse_blocks == 128
    assert layout.buffers(3) == {
        "candidate_blocks": (3, 2048),
        "sparse_indices": (3, 2048),
        "end": (3,),
        "col_indices": (3, 512),
    }
    sched = planner.Schedule.from_name("V4.1")
    batch = planner.PrefillBatch([5000, 300, 100, 7], [1000, 300, 50, 7])
    for replay, rows in ((False, 1357), (True, 128 + 128 + 50 + 7)):
        config = planner.PlanConfig(window_size=128, max_model_len=8192, max_num_batched_tokens=2048, replay=replay)
        assert layout.rows(planner.plan_step(batch, config, sched)) == rows
    config = planner.PlanConfig(window_size=128, max_model_len=8192, max_num_batched_tokens=2048)
    with pytest.raises(ValueError, match="step: planned from a list of layers"):
        layout.rows(planner.plan_step(batch, config))
    off = planner.Schedule.from_config(dict(planner.contract.preset("V4.1"), candidate_source_layer_id=-1))
    assert CandidateLayout.of(off) is None
    with pytest.raises(ValueError, match="block_size: 12 is not a multiple"):
        CandidateLayout(2048, 12, 512)
    with pytest.raises(ValueError, match="topk_blocks: must be >= 1"):
        CandidateLayout(0, 8, 512)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: split_indexer_prefill_chunks([1, 2], [1], 10, 10), "query_lens: 1 entries for 2 requests"),
        (lambda: split_indexer_prefill_chunks([1, -2], [1, 1], 10, 10), r"compressed_seq_lens\[1\] = -2"),
        (lambda: split_indexer_prefill_chunks([1], [1.5], 10, 10), "query_lens: expected integers"),
        (lambda: split_indexer_prefill_chunks([1], [1], -1, 10), "workspace_size: must be >= 0"),
        (lambda: split_indexer_prefill_chunks([1], [1], 10, None), "max_logits_bytes: expected an integer"),
        (lambda: split_indexer_prefill_chunks([1], [True], 10, 10), "query_lens"),
        (lambda: split_indexer_prefill_chunks(np.array([[1]]), [1], 10, 10), "compressed_seq_lens: expected a 1-D"),
        (lambda: split_indexer_prefill_chunks(np.array([1, -3], np.int32), [1, 1], 10, 10), r"\[1\] = -3"),
        (lambda: split_indexer_prefill_chunks(_DeviceTensor(), [1], 10, 10), "compressed_seq_lens: expected a host"),
        (lambda: split_indexer_prefill_chunks([1], [1], 10, 10, 1.0), "request_offset: expected an integer"),
        (lambda: split_indexer_prefill_chunks([1], [1], True, 10), "workspace_size: expected an integer"),
        (lambda: plan_indexer([4], [5], 4), r"query_lens\[0\] = 5 exceeds seq_lens\[0\] = 4"),
        (lambda: plan_indexer([4], [1], 0), "compress_ratio: must be >= 1"),
        (lambda: plan_indexer([[4]], [1], 4), "seq_lens: expected a 1-D array"),
    ],
)
def test_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()
