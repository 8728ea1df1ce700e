"""Named prefill workloads shared by the benchmarks: batches with the engine limits they run under."""

from __future__ import annotations

import numpy as np

from planner.report import SPEC_LIMITS, SPEC_QUERY_LENS, SPEC_SEQ_LENS


def _limits(window_size=128, max_model_len=65536, max_num_batched_tokens=8192, prefill_chunk_size=4):
    return dict(window_size=window_size, max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens, prefill_chunk_size=prefill_chunk_size)  # fmt: skip


def workloads(seed: int = 0, scale: float = 1.0) -> dict[str, tuple[list[int], list[int], dict]]:
    """name -> (seq_lens, query_lens, limits). `scale` < 1 shrinks lengths for CPU attention runs."""
    rng = np.random.default_rng(seed)
    s = lambda x: max(1, int(x * scale))
    ints = lambda lo, hi, n: [int(x) for x in rng.integers(s(lo), max(s(lo) + 1, s(hi)), n)]
    out = {"spec-example": (list(SPEC_SEQ_LENS), list(SPEC_QUERY_LENS), dict(SPEC_LIMITS))}

    # Many short chats: fresh prompts of 16..256 tokens filling an 8K-token step.
    q = []
    while sum(q) < s(8192) - 256:
        q.append(int(rng.integers(s(16), s(256) + 1)))
    out["short-chats"] = (q, q, _limits(max_num_batched_tokens=s(8192)))

    # Long-context RAG: four 60K..64K documents, each in the middle of a 2K-token prefill chunk.
    seq = ints(60000, 64001, 4)
    out["long-rag"] = (seq, [s(2048)] * 4, _limits(max_model_len=s(65536), max_num_batched_tokens=s(8192)))

    # Mixed: one long continuation, medium documents, short chats, and KV-transfer loads (q = 0).
    seq = [s(50000)] + ints(2000, 8000, 6) + ints(20, 200, 16)
    qry = [s(1024)] + [s(256)] * 6 + seq[7:]
    seq += [s(30000), s(12000)]
    qry += [0, 0]
    out["mixed"] = (seq, qry, _limits(max_model_len=s(65536), max_num_batched_tokens=s(8192)))
    return out


def scaling_batch(num_requests: int, seed: int = 0, max_model_len: int = 65536, tokens: int = 16384):
    """`num_requests` requests sharing a `tokens` budget, at random context lengths."""
    rng = np.random.default_rng(seed)
    per = max(1, tokens // num_requests)
    qry = rng.integers(1, per + 1, num_requests)
    seq = np.maximum(qry, rng.integers(1, max_model_len + 1, num_requests))
    return seq.tolist(), qry.tolist()
