"""The plugin's indexer prefill chunks against vLLM 0.33.0's own `_split_indexer_prefill_chunks`."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch


def _vllm_builder(vllm_plugins):
    import vllm.v1.attention.backends.mla.indexer as module

    return module.DeepseekV32IndexerMetadataBuilder


def test_plugin_replaced_the_static_method(vllm_plugins):
    from dsv4_torch.vllm import indexer_plan
    from dsv4_torch.vllm.plugin import original

    cls = _vllm_builder(vllm_plugins)
    assert cls._split_indexer_prefill_chunks is indexer_plan.split_indexer_prefill_chunks
    theirs = original(cls._split_indexer_prefill_chunks)
    assert theirs is not None and theirs.__module__ == "vllm.v1.attention.backends.mla.indexer"
    # vLLM's CPU builder keeps its own override (one chunk per step)
    from vllm.models.deepseek_v4.cpu.cpu_mla import DeepseekV4CPUIndexerMetadataBuilder as cpu

    assert cpu._split_indexer_prefill_chunks is not indexer_plan.split_indexer_prefill_chunks


def random_batch(rng):
    """Prefill batches as vLLM's builder passes them: compressed lengths seq_len // 4 (int32 CPU
    tensors), query lengths up to the batched-token budget, the workspace and logits budgets of
    real configurations and small ones that force splits."""
    n = int(rng.choice([1, 2, 3, 5, 8, 16, 64, 256]))
    mml = int(rng.choice([1024, 65536, 1 << 20]))
    seq = np.where(rng.random(n) < 0.3, rng.integers(1, mml + 1, n), rng.integers(1, min(mml, 2048) + 1, n))
    qry = np.minimum(seq, rng.integers(1, int(rng.choice([16, 512, 8192])) + 1, n))
    if rng.random() < 0.2:
        qry[rng.random(n) < 0.3] = 0
    comp = seq // 4
    workspace = int(rng.choice([mml // 4, 4 * mml // 4, 1024, 64]))
    logits_mb = int(rng.choice([0, 1, 16, 512]))
    if logits_mb == 0:  # VLLM_SPARSE_INDEXER_MAX_LOGITS_MB=0: vLLM's function is defined there too
        qry = np.minimum(qry, 8)
    return comp, qry, workspace, logits_mb << 20, int(rng.integers(0, 3))


def test_equal_to_vllm_on_random_batches(vllm_plugins):
    from dsv4_torch.vllm.plugin import original

    cls = _vllm_builder(vllm_plugins)
    ours = cls._split_indexer_prefill_chunks
    theirs = original(ours)
    rng = np.random.default_rng(2828)
    chunks = multi = pieces = 0
    for _ in range(3000):
        comp, qry, workspace, logits, offset = random_batch(rng)
        args = (torch.tensor(comp, dtype=torch.int32), torch.tensor(qry, dtype=torch.int32), workspace, logits)
        want = theirs(*args, request_offset=offset)
        got = ours(*args, request_offset=offset)
        assert got == want, (comp.tolist(), qry.tolist(), workspace, logits, offset)
        chunks += len(want)
        multi += len({(r.start, r.stop) for r, _ in want}) > 1
        pieces += len({(r.start, r.stop) for r, _ in want}) < len(want)
    assert multi > 300 and pieces > 300, "the random batches should often need several chunks and query pieces"


def test_called_by_vllms_builder_signature(vllm_plugins):
    """The call as vLLM's build() makes it (positional, request_offset keyword)."""
    cls = _vllm_builder(vllm_plugins)
    comp = torch.tensor([4096, 16, 0, 70000], dtype=torch.int32)
    qry = torch.tensor([8192, 64, 3, 2048], dtype=torch.int32)
    got = cls._split_indexer_prefill_chunks(comp, qry, 65536, 64 << 20, request_offset=7)
    # request 0 alone (8192 x 4096 x 4 bytes > 64 MiB) in two query pieces of 4096; requests 1-2
    # together; request 3 alone (70000 keys > the workspace) in pieces of 16 Mi // 70000 = 239
    assert got[:3] == [(slice(7, 8), slice(0, 4096)), (slice(7, 8), slice(4096, 8192)), (slice(8, 10), slice(0, 67))]
    assert got[3:] == [(slice(10, 11), slice(a, min(a + 239, 2048))) for a in range(0, 2048, 239)]
    from dsv4_torch.vllm.plugin import original

    assert got == original(cls._split_indexer_prefill_chunks)(comp, qry, 65536, 64 << 20, request_offset=7)


def v41_batch(rng):
    """A DeepSeek-V4.1 indexer build's inputs: the ratio-2 group (compressed lengths seq // 2) or
    the ratio-1 group (seq), on the batch or on the bounded replay's kept rows (min(query, 128))."""
    ratio = int(rng.choice([1, 2]))
    n = int(rng.choice([1, 2, 3, 5, 8, 16, 64, 256]))
    mml = int(rng.choice([1024, 65536, 1 << 20]))
    seq = np.where(rng.random(n) < 0.3, rng.integers(1, mml + 1, n), rng.integers(1, min(mml, 2048) + 1, n))
    qry = np.minimum(seq, rng.integers(1, int(rng.choice([16, 512, 8192])) + 1, n))
    if rng.random() < 0.5:
        qry = np.minimum(qry, 128)  # the replay batch's kept rows
    if rng.random() < 0.2:
        qry[rng.random(n) < 0.3] = 0
    factor = 5 if mml <= 256 * 1024 else 2
    workspace = int(rng.choice([mml * 8 * factor // ratio, 1024, 64]))  # get_max_prefill_buffer_size // ratio
    logits_mb = int(rng.choice([1, 16, 512]))
    return seq // ratio, qry, workspace, logits_mb << 20, int(rng.integers(0, 3))


def test_v41_groups_equal_to_vllm(vllm_plugins):
    """V4.1's ratio-2 and ratio-1 indexer groups, the batch and the replay batch's kept rows."""
    from dsv4_torch.vllm.plugin import original

    cls = _vllm_builder(vllm_plugins)
    ours = cls._split_indexer_prefill_chunks
    theirs = original(ours)
    rng = np.random.default_rng(4141)
    pieces = 0
    for _ in range(1000):
        comp, qry, workspace, logits, offset = v41_batch(rng)
        args = (torch.tensor(comp, dtype=torch.int32), torch.tensor(qry, dtype=torch.int32), workspace, logits)
        want = theirs(*args, request_offset=offset)
        assert ours(*args, request_offset=offset) == want, (comp.tolist(), qry.tolist(), workspace, logits, offset)
        pieces += len({(r.start, r.stop) for r, _ in want}) < len(want)
    assert pieces > 50


@pytest.fixture(scope="module")
def sparse_builder(vllm_plugins):
    """vLLM's DeepSeek-V4.1 sparse-logits indexer builder, its own __init__ run on this CPU: the
    base builder's init and the SM100 / DeepGEMM / DeepSelect checks are stood in for (they need a
    GPU), everything it sizes from the model config is vLLM's."""
    import vllm.v1.attention.backends.mla.indexer as base
    import vllm.v1.attention.backends.mla.sparse_indexer as module

    mp = pytest.MonkeyPatch()

    def base_init(self, kv_cache_spec, layer_names, vllm_config, device, **kwargs):
        self.kv_cache_spec, self.vllm_config, self.device = kv_cache_spec, vllm_config, device
        self.dcp_world_size, self.use_pcp, self.supports_varlen = 1, False, True
        self.arange_buffer = torch.arange(vllm_config.scheduler_config.max_num_batched_tokens, dtype=torch.int32)
        self.max_prefill_buffer_size = (1 << 20) * 8 * 2

    mp.setattr(base.DeepseekV32IndexerMetadataBuilder, "__init__", base_init)
    mp.setattr(module, "dsa_indexer_uses_fp4", lambda config: True)
    mp.setattr(module, "has_deep_gemm_sparse_mqa", lambda: True)
    mp.setattr(module, "has_deep_select", lambda: True)
    mp.setattr(module, "check_deep_select_layout", lambda cols, topk: None)
    mp.setattr(module.current_platform, "is_cuda", lambda: True)
    mp.setattr(module.current_platform, "is_device_capability_family", lambda family: family == 100)

    def make(topk_blocks, block_size, index_topk, tokens=64):
        hf = SimpleNamespace(candidate_block_size=block_size, candidate_topk_blocks=topk_blocks, index_topk=index_topk)
        config = SimpleNamespace(
            model_config=SimpleNamespace(hf_text_config=hf),
            kernel_config=SimpleNamespace(sparse_indexer_topk_backend="auto"),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=tokens),
        )
        return module.DeepseekV41SparseIndexerMetadataBuilder(
            SimpleNamespace(block_size=256), ["layer"], config, torch.device("cpu")
        )

    yield module.DeepseekV41SparseIndexerMetadataBuilder, make
    mp.undo()


def test_candidate_layout_is_vllms(sparse_builder):
    """planner.indexer_plan.CandidateLayout: vLLM's sparse block size, block count, split minimum
    and scratch widths, for the released schedule and others."""
    from planner.indexer_plan import CandidateLayout

    _, make = sparse_builder
    for topk_blocks, block_size, index_topk in [(2048, 8, 512), (4, 16, 8), (64, 32, 16), (1024, 24, 256)]:
        b = make(topk_blocks, block_size, index_topk)
        layout = CandidateLayout(topk_blocks, block_size, index_topk)
        assert (layout.sparse_block_kv, layout.num_sparse_blocks) == (b.sparse_block_kv, b.num_sparse_blocks)
        assert layout.min_split_keys == b.min_split_seq_len
        rows = b.arange_buffer.shape[0]
        shapes = layout.buffers(rows)
        assert shapes["sparse_indices"] == tuple(b.sparse_indices_buffer.shape)
        assert shapes["end"] == tuple(b.end_buffer.shape)
        assert shapes["col_indices"] == tuple(b.col_indices_buffer.shape)


def test_v41_sparse_logits_split_equal_to_vllm(sparse_builder):
    """The sparse-logits builder's split (its lengths clamped at the candidate blocks' width, then
    split) through the plugin equals vLLM's clamp and split, as its build() calls them."""
    from dsv4_torch.vllm import indexer_plan
    from dsv4_torch.vllm.plugin import original

    cls, make = sparse_builder
    assert cls._prefill_split_seq_lens is indexer_plan.prefill_split_seq_lens
    their_lens = original(cls._prefill_split_seq_lens)
    their_split = original(cls._split_indexer_prefill_chunks)
    rng = np.random.default_rng(2048)
    builders = [make(2048, 8, 512), make(4, 16, 8), make(64, 32, 16)]
    raised = 0
    for _ in range(1000):
        b = builders[int(rng.integers(len(builders)))]
        comp, qry, workspace, logits, offset = v41_batch(rng)
        lens, q = torch.tensor(comp, dtype=torch.int32), torch.tensor(qry, dtype=torch.int32)
        want = their_split(their_lens(b, lens), q, workspace, logits, request_offset=offset)
        got = b._split_indexer_prefill_chunks(
            b._prefill_split_seq_lens(lens), q, workspace, logits, request_offset=offset
        )
        assert got == want, (comp.tolist(), qry.tolist(), workspace, logits, offset, b.min_split_seq_len)
        raised += bool((comp < b.min_split_seq_len).any())
    assert raised > 250, "the clamp should often apply"
