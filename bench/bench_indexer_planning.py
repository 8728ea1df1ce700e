"""Host time of the indexer's prefill chunk plan per step inside vLLM 0.33.0: vLLM's own vs the plugin's.

    .venv-vllm/bin/python -m bench.bench_indexer_planning [--seconds 1.0] [--json out.json]

vLLM calls `DeepseekV32IndexerMetadataBuilder._split_indexer_prefill_chunks` once per indexer
metadata build (every step with prefills) with CPU int32 tensors: the compressed lengths
(seq_len // 4) and the query lengths of the step's prefill requests, its workspace
(`get_max_prefill_buffer_size(...) // 4`: max_model_len * 8 * factor // 4, factor 2 beyond 256K
tokens) and `VLLM_SPARSE_INDEXER_MAX_LOGITS_MB` (512 by default). "vLLM" is its own static method
(the one the plugin replaced, reached through `plugin.original`), "plugin" the installed
replacement (`planner.indexer_plan`); both get the same tensors, and their results are checked
equal first. Batches: `bench.common.scaling_batch` (contexts up to 1M tokens, 8192 batched tokens
shared by the requests), 8 to 1024 requests. Alternating blocks in one process, medians over
blocks; read the ratio, the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from bench.common import scaling_batch
from planner.report import table

MAX_MODEL_LEN, MAX_BATCHED, RATIO = 1 << 20, 8192, 4
FACTOR = 5 if MAX_MODEL_LEN <= 256 * 1024 else 2  # vLLM's sparse_mla_prefill_workspace_factor default
WORKSPACE = MAX_MODEL_LEN * (576 * 2 // 132) * FACTOR // RATIO
LOGITS_BYTES = 512 * 1024 * 1024
SIZES = (8, 64, 256, 1024)


def methods():
    """(vLLM's own static method, the plugin's), the plugin loaded by vLLM's loader."""
    import vllm.plugins

    vllm.plugins.load_general_plugins()
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerMetadataBuilder as cls

    from dsv4_torch.vllm.plugin import original

    ours = cls._split_indexer_prefill_chunks
    theirs = original(ours)
    if theirs is None:
        raise SystemExit("the dsv4_prefill plugin is not active (is dsv4-prefill installed in this venv?)")
    return theirs, ours


def time_calls(fn, args, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - t0) / calls


def measure(seconds: float) -> list[dict]:
    import torch

    theirs, ours = methods()
    rows = []
    for n in SIZES:
        seq, qry = scaling_batch(n, seed=n, max_model_len=MAX_MODEL_LEN, tokens=MAX_BATCHED)
        comp = torch.tensor(np.asarray(seq) // RATIO, dtype=torch.int32)
        args = (comp, torch.tensor(qry, dtype=torch.int32), WORKSPACE, LOGITS_BYTES)
        plan = theirs(*args)
        assert ours(*args) == plan, n
        one = time_calls(theirs, args, 1)
        calls_v = max(1, int(0.05 / max(one, 1e-6)))
        calls_p = calls_v * 10
        tv, tp, t_end = [], [], time.perf_counter() + seconds
        while time.perf_counter() < t_end or len(tv) < 5:
            tv.append(time_calls(theirs, args, calls_v))
            tp.append(time_calls(ours, args, calls_p))
        v, p = float(np.median(tv)) * 1e6, float(np.median(tp)) * 1e6
        rows.append(
            dict(requests=n, tokens=int(sum(qry)), chunks=len(plan), vllm_us=round(v, 1), plugin_us=round(p, 1))
        )
        rows[-1]["ratio"] = round(v / p, 1)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.0, help="time per size and side, at least 5 blocks")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    rows = measure(args.seconds)
    print(
        f"Indexer prefill chunk plan per step, vLLM 0.33.0 (max_model_len {MAX_MODEL_LEN}, workspace {WORKSPACE} "
        f"keys, {LOGITS_BYTES >> 20} MiB logits; median of alternating blocks, one process):"
    )
    print(
        table(
            [[r["requests"], r["tokens"], r["chunks"], r["vllm_us"], r["plugin_us"], f"{r['ratio']}x"] for r in rows],
            ["requests", "tokens", "chunks", "vLLM us", "plugin us", "ratio"],
        )
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
