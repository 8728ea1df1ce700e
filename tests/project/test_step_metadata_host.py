"""Per-step metadata is O(requests + tokens) on the host: 1M-token contexts cost what 1K ones do."""

import tracemalloc

import numpy as np
import pytest

import planner as P
from dsv4_jax import prefill_metadata as jax_metadata
from dsv4_torch import prefill_metadata as torch_metadata


def _step(max_len: int):
    rng = np.random.default_rng(0)
    qry = np.full(256, 32)
    seq = np.maximum(qry, rng.integers(max_len // 2, max_len + 1, 256))
    cfg = P.PlanConfig(window_size=128, max_model_len=1 << 20, max_num_batched_tokens=8192)
    return P.plan_step(P.PrefillBatch(seq, qry), cfg, P.V4_LAYERS)


def _peak(f) -> int:
    tracemalloc.start()
    out = f()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del out
    return peak


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_metadata_host_memory_independent_of_context_length(framework):
    build = (torch_metadata if framework == "torch" else jax_metadata).build_step_metadata
    short, long = _step(1024), _step(1 << 20)
    assert long.kinds[P.LayerKind.CSA].padding_free_rows > 30_000_000  # rows gathered per layer: 1000x more
    build(short, index_topk=512)  # warm-up (imports, first-call caches)
    peaks = [_peak(lambda s=s: build(s, index_topk=512)) for s in (short, long)]
    assert peaks[1] < 4 * 2**20, peaks  # a few MiB (per token, per segment, per chunk arrays) ...
    assert peaks[1] < 2 * peaks[0] + 2**20, peaks  # ... as for 1K-token contexts
