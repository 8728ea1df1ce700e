"""The plugin's indexer prefill chunks against vLLM 0.33.0's own `_split_indexer_prefill_chunks`."""

import numpy as np
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
