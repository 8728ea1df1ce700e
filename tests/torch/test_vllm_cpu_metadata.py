"""The plugin's host metadata for vLLM's CPU engine (`dsv4_torch.vllm.cpu.metadata`), without vLLM.

Each array against a plain per-token loop written from the rules vLLM's Triton kernels implement
(docs: real-formats.md section 4): token -> request, compressed slot mapping, window / visible
slot lists, the indexer's row bounds. Random ragged batches (decodes first, zero-query requests,
padding rows) and bad inputs.
"""

import numpy as np
import pytest

from dsv4_torch.vllm.cpu import metadata as cm


def _batch(seed: int, num_decodes: int = 2, num_prefills: int = 3, pad: int = 3, page: int = 4):
    g = np.random.default_rng(seed)
    q = np.concatenate([np.ones(num_decodes, np.int64), g.integers(0, 40, num_prefills)])
    seq = q + g.integers(0, 300, q.shape[0])
    qsl = np.zeros(q.shape[0] + 1, np.int32)
    np.cumsum(q, out=qsl[1:])
    width = int(-(-seq.max() // page)) + 2
    bt = g.permutation(q.shape[0] * width).reshape(q.shape[0], width).astype(np.int32)
    n = int(qsl[-1]) + pad
    slots = g.integers(0, 1000, n)
    slots[int(qsl[-1]) :] = -1
    slots[g.integers(0, n, 2)] = -1  # replayed tokens write nothing
    return qsl, seq.astype(np.int32), bt, n, slots


def _loop_tokens(qsl, seq, n):
    req, pos = [0] * n, [-1] * n
    for b in range(len(qsl) - 1):
        for i in range(qsl[b], qsl[b + 1]):
            if i < n:
                req[i], pos[i] = b, int(seq[b] - (qsl[b + 1] - qsl[b]) + (i - qsl[b]))
    return np.array(req), np.array(pos)


@pytest.mark.parametrize("seed", range(4))
def test_token_arrays_match_a_loop(seed):
    qsl, seq, _, n, _ = _batch(seed)
    req, pos = cm.token_positions(qsl, seq, n)
    lreq, lpos = _loop_tokens(qsl, seq, n)
    np.testing.assert_array_equal(req, lreq)
    np.testing.assert_array_equal(pos, lpos)
    np.testing.assert_array_equal(cm.token_to_request(qsl, n), lreq)
    assert req.dtype == np.int32 and pos.dtype == np.int32


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("ratio,page", [(4, 64), (128, 2), (4, 3)])
def test_compressed_slot_mapping_matches_a_loop(seed, ratio, page):
    qsl, seq, bt, n, slots = _batch(seed, page=page)
    bt = bt[:, : int(-(-seq.max() // ratio // page)) + 1]
    got = cm.compressed_slot_mapping(slots, qsl, seq, bt, page, ratio, n)
    req, pos = _loop_tokens(qsl, seq, n)
    want = np.full(n, -1)
    for i in range(n):
        if pos[i] >= 0 and (pos[i] + 1) % ratio == 0 and slots[i] != -1:
            e = pos[i] // ratio
            want[i] = bt[req[i], e // page] * page + e % page
    np.testing.assert_array_equal(got, want)
    assert (got >= 0).sum() > 0 or ratio == 128  # some tokens write (ratio 4 always has some)


@pytest.mark.parametrize("seed", range(3))
def test_window_and_visible_slots_match_a_loop(seed):
    qsl, seq, bt, n, _ = _batch(seed, page=16)
    W, r, page = 8, 4, 16
    step = cm.StepMetadata(qsl, seq, n, 2, int(qsl[2]))
    req, pos = _loop_tokens(qsl, seq, n)
    win = step.window_slots(bt, page, W, n)
    width = int(-(-seq.max() // r))
    vis = step.visible_slots(bt, page, r, width, n)
    for i in range(n):
        keys = [p for p in range(max(0, pos[i] - W + 1), pos[i] + 1)] if pos[i] >= 0 else []
        want = [bt[req[i], p // page] * page + p % page for p in keys] + [-1] * (W - len(keys))
        np.testing.assert_array_equal(win[i], want)
        ents = list(range(max(0, (pos[i] + 1) // r)))
        want = [bt[req[i], e // page] * page + e % page for e in ents] + [-1] * (width - len(ents))
        np.testing.assert_array_equal(vis[i], want)
    assert step.window_slots(bt, page, W, n) is win  # once per step


def test_step_prefill_tokens_follow_the_decodes():
    qsl, seq, bt, n, _ = _batch(7, num_decodes=3, num_prefills=4)
    step = cm.StepMetadata(qsl, seq, n, 3, int(qsl[3]), max_model_len=4096, max_num_batched_tokens=4096)
    req, pos = _loop_tokens(qsl, seq, n)
    rows = np.arange(int(qsl[3]), int(qsl[-1]))
    np.testing.assert_array_equal(step.prefill_row, rows)
    np.testing.assert_array_equal(step.prefill_request, req[rows])
    np.testing.assert_array_equal(step.prefill_position, pos[rows])
    assert step.num_prefill_tokens == rows.size and step.num_actual_tokens == int(qsl[-1])


def test_zero_query_requests_contribute_no_tokens():
    qsl = np.array([0, 1, 1, 5, 5], np.int32)  # decode, empty, 4 tokens, empty
    seq = np.array([10, 7, 20, 3], np.int32)
    step = cm.StepMetadata(qsl, seq, 5, 1, 1)
    np.testing.assert_array_equal(step.prefill_request, [2, 2, 2, 2])
    np.testing.assert_array_equal(step.prefill_position, [16, 17, 18, 19])


@pytest.mark.parametrize("seed", range(3))
def test_indexer_rows_match_a_loop(seed):
    qsl, seq, _, n, _ = _batch(seed, num_decodes=2, num_prefills=4)
    r = 4
    rows = cm.IndexerPrefill(qsl, seq, 2, 4, r)
    req, pos = _loop_tokens(qsl, seq, n)
    comp = seq[2:6] // r
    cu = np.concatenate([[0], np.cumsum(comp)])
    toks = range(int(qsl[2]), int(qsl[6]))
    np.testing.assert_array_equal(rows.cu_seq_lens, cu)
    np.testing.assert_array_equal(rows.cu_seqlen_ks, [cu[req[t] - 2] for t in toks])
    np.testing.assert_array_equal(rows.cu_seqlen_ke, [cu[req[t] - 2] + (pos[t] + 1) // r for t in toks])
    np.testing.assert_array_equal(rows.token_to_seq, np.repeat(np.arange(4), comp))
    assert (rows.token_start, rows.token_end, rows.total_seq_lens) == (int(qsl[2]), int(qsl[6]), int(cu[-1]))


def test_local_to_global_marks_missing_entries():
    bt = np.array([[5, 9], [7, -1]], np.int32)
    loc = np.array([[0, 3, 4, -1, 8], [1, 4, 0, -1, -1]])
    got = cm.local_to_global(loc, np.array([0, 1]), bt, 4)
    np.testing.assert_array_equal(got, [[20, 23, 36, -1, -1], [29, -1, 28, -1, -1]])


def test_bad_inputs_are_named():
    qsl, seq = np.array([0, 2, 5], np.int32), np.array([4, 6], np.int32)
    with pytest.raises(ValueError, match="query_start_loc"):
        cm.token_to_request(np.array([0, 3, 2]), 3)
    with pytest.raises(ValueError, match="seq_lens"):
        cm.token_positions(qsl, np.array([1, 6], np.int32), 5)
    with pytest.raises(ValueError, match="num_decode_tokens"):
        cm.StepMetadata(qsl, seq, 5, 1, 3)
    with pytest.raises(ValueError, match="request"):
        cm.local_to_global(np.zeros((2, 3), np.int64), np.array([0, 5]), np.zeros((2, 2), np.int32), 4)
    with pytest.raises(ValueError, match="slot_mapping"):
        cm.compressed_slot_mapping(np.zeros(3, np.float32), qsl, seq, np.zeros((2, 2), np.int32), 4, 4)
    with pytest.raises(ValueError, match="compress_ratio"):
        cm.compressed_slot_mapping(np.zeros(5, np.int64), qsl, seq, np.zeros((2, 2), np.int32), 4, 0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        cm.StepMetadata(np.array([0, 3]), np.array([9]), 3, 0, 0, max_num_batched_tokens=2)
