"""The plan behind vLLM's `DeepseekV32IndexerMetadataBuilder._split_indexer_prefill_chunks`, from our planner.

vLLM 0.33.0 calls this static method in every indexer metadata build (once per step per indexer
cache group) with the step's compressed lengths and query lengths as CPU tensors; its own loop
reads two tensor items per request. The replacement (`planner.indexer_plan`) returns the same
`[(request_slice, query_slice), ...]` from cumulative sums and a bisection per chunk. The plugin
installs it on GPU builds of vLLM (`dsv4_torch.vllm.plugin`); vLLM's CPU and ROCm builders keep
their own overrides (the CPU one returns a single chunk).

Nothing here imports vLLM.
"""

from __future__ import annotations

import numpy as np

from planner import indexer_plan

# vLLM 0.33.0's parameters, checked by the plugin before it replaces the method.
PARAMS = ["compressed_seq_lens_cpu", "prefill_query_lens_cpu", "workspace_size", "max_logits_bytes", "request_offset"]


def _host(t, name: str) -> np.ndarray:
    try:
        return t.numpy() if hasattr(t, "numpy") else np.asarray(t)
    except TypeError as e:  # a tensor on a device: reading it would wait for the device
        raise ValueError(f"{name}: expected a CPU tensor ({e})") from None


def split_indexer_prefill_chunks(
    compressed_seq_lens_cpu,
    prefill_query_lens_cpu,
    workspace_size: int,
    max_logits_bytes: int,
    request_offset: int = 0,
) -> list[tuple[slice, slice]]:
    """vLLM's `_split_indexer_prefill_chunks` (same arguments, same list), planned by
    `planner.indexer_plan.split_indexer_prefill_chunks`."""
    return indexer_plan.split_indexer_prefill_chunks(
        _host(compressed_seq_lens_cpu, "compressed_seq_lens_cpu"),
        _host(prefill_query_lens_cpu, "prefill_query_lens_cpu"),
        workspace_size,
        max_logits_bytes,
        request_offset,
    )
