"""The plan behind vLLM's `DeepseekV32IndexerMetadataBuilder._split_indexer_prefill_chunks`, from our planner.

vLLM 0.33.0 calls this static method in every indexer metadata build (once per step per indexer
cache group) with the step's compressed lengths and query lengths as CPU tensors; its own loop
reads two tensor items per request. The replacement, `planner.indexer_plan.split_indexer_prefill_chunks`
itself (same arguments, same list; a tensor on a device is refused by name), reads each length
vector in one `tolist()` and makes one pass over the requests. The plugin installs it on GPU builds
of vLLM (`dsv4_torch.vllm.plugin`); vLLM's CPU and ROCm builders keep their own overrides (the CPU
one returns a single chunk).

Nothing here imports vLLM.
"""

from __future__ import annotations

from planner.indexer_plan import split_indexer_prefill_chunks

# vLLM 0.33.0's parameters, checked by the plugin before it replaces the method.
PARAMS = ["compressed_seq_lens_cpu", "prefill_query_lens_cpu", "workspace_size", "max_logits_bytes", "request_offset"]

__all__ = ["PARAMS", "split_indexer_prefill_chunks"]
