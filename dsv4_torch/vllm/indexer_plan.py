"""The plan behind vLLM's indexer prefill split, from our planner.

vLLM 0.33.0 calls `DeepseekV32IndexerMetadataBuilder._split_indexer_prefill_chunks` (a static
method) in every indexer metadata build (once per step per indexer cache group: DeepSeek-V4.0's
ratio-4 group; V4.1's ratio-2 and ratio-1 groups, and the ratio-1 group again for the bounded
replay's kept rows) with the step's compressed lengths and query lengths as CPU tensors; its own
loop reads two tensor items per request. The replacement, `planner.indexer_plan.split_indexer_prefill_chunks`
itself (same arguments, same list; a tensor on a device is refused by name), reads each length
vector in one `tolist()` and makes one pass over the requests. vLLM's CPU and ROCm builders keep
their own overrides (the CPU one returns a single chunk).

DeepSeek-V4.1's sparse-logits indexer builder (`DeepseekV41SparseIndexerMetadataBuilder`,
`attention_config.indexer_sparse_logits`, SM100) first clamps the compressed lengths from below at
its candidate blocks' width (`_prefill_split_seq_lens`: `seq_lens_cpu.clamp(min=min_split_seq_len)`,
a tensor operation every build); `prefill_split_seq_lens` hands the split the lengths and the
minimum instead (`planner.indexer_plan.KeysAtLeast`), which it applies in its one pass.

The plugin installs both (`dsv4_torch.vllm.plugin`). Nothing here imports vLLM.
"""

from __future__ import annotations

from planner.indexer_plan import KeysAtLeast, split_indexer_prefill_chunks

# vLLM 0.33.0's parameters, checked by the plugin before it replaces the methods.
PARAMS = ["compressed_seq_lens_cpu", "prefill_query_lens_cpu", "workspace_size", "max_logits_bytes", "request_offset"]
SPLIT_LENS_PARAMS = ["self", "seq_lens_cpu"]


def prefill_split_seq_lens(self, seq_lens_cpu):
    """`DeepseekV41SparseIndexerMetadataBuilder._prefill_split_seq_lens`: the lengths the prefill
    split budgets, each at least `self.min_split_seq_len` (the candidate blocks' sparse logits
    row, in fp32 units), as `KeysAtLeast` for our split to clamp in its pass. A builder whose
    split is not ours gets vLLM's clamped tensor (the function this one replaced)."""
    if type(self)._split_indexer_prefill_chunks is split_indexer_prefill_chunks:
        return KeysAtLeast(seq_lens_cpu, self.min_split_seq_len)
    return prefill_split_seq_lens.__dsv4_prefill_original__(self, seq_lens_cpu)


__all__ = ["PARAMS", "SPLIT_LENS_PARAMS", "prefill_split_seq_lens", "split_indexer_prefill_chunks"]
