"""Host time of the indexer's prefill chunk plan per step inside vLLM 0.33.0: vLLM's own vs the plugin's.

    .venv-vllm/bin/python -m bench.bench_indexer_planning [--seconds 1.0] [--sizes 8,64,256,1024]
        [--groups V4.0,V4.1 r2,...] [--json out.json]

vLLM calls `DeepseekV32IndexerMetadataBuilder._split_indexer_prefill_chunks` once per indexer
metadata build (every step with prefills, once per indexer cache group) with CPU int32 tensors:
the compressed lengths and the query lengths of the step's prefill requests, its workspace
(`get_max_prefill_buffer_size(...) // ratio`: max_model_len * 8 * factor // ratio, factor 2 beyond
256K tokens) and `VLLM_SPARSE_INDEXER_MAX_LOGITS_MB` (512 by default). "vLLM" is its own static
method (the one the plugin replaced, reached through `plugin.original`), "plugin" the installed
replacement (`planner.indexer_plan`); both get the same tensors, and their results are checked
equal first. Groups:

- "V4.0": DeepSeek-V4.0's ratio-4 group (lengths seq_len // 4);
- "V4.1 r2", "V4.1 r1": DeepSeek-V4.1's ratio-2 and ratio-1 groups (seq_len // 2, seq_len);
- "V4.1 r1 kept": the ratio-1 group's build for the bounded replay's kept rows (each request's
  last min(query_len, 128) rows: a third build in a replaying step);
- "V4.1 sparse": the ratio-1 group under `attention_config.indexer_sparse_logits`
  (`DeepseekV41SparseIndexerMetadataBuilder`): vLLM clamps the lengths at the candidate blocks'
  width first (`_prefill_split_seq_lens`, 8192 for the released 2048 x 8 blocks) and splits the
  result; the plugin hands the minimum to its split (`KeysAtLeast`). Both sides' time includes
  their clamp.

Batches: `bench.common.scaling_batch` (contexts up to 1M tokens, 8192 batched tokens shared by the
requests), 8 to 1024 requests. Alternating blocks in one process, medians over blocks; read the
ratio, the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from bench.common import scaling_batch
from planner.report import table

MAX_MODEL_LEN, MAX_BATCHED, RATIO, WINDOW = 1 << 20, 8192, 4, 128
FACTOR = 5 if MAX_MODEL_LEN <= 256 * 1024 else 2  # vLLM's sparse_mla_prefill_workspace_factor default
WORKSPACE = MAX_MODEL_LEN * (576 * 2 // 132) * FACTOR // RATIO
LOGITS_BYTES = 512 * 1024 * 1024
SIZES = (8, 64, 256, 1024)
GROUPS = ("V4.0", "V4.1 r2", "V4.1 r1", "V4.1 r1 kept", "V4.1 sparse")
CANDIDATES = (2048, 8, 512)  # the released V4.1 schedule's candidate_topk_blocks, candidate_block_size, index_topk


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


def time_calls(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


class _SparseBuilder:
    """What `_prefill_split_seq_lens` reads of vLLM's sparse-logits builder (its class's split: the plugin's)."""

    def __init__(self, split, min_split_seq_len: int):
        self._split = split
        self.min_split_seq_len = min_split_seq_len


def group_calls(group: str, seq, qry, theirs, ours):
    """(vLLM's call, the plugin's call) for one build of `group` on this batch, as closures."""
    import torch

    from dsv4_torch.vllm import indexer_plan
    from planner.indexer_plan import CandidateLayout

    ratio = {"V4.0": RATIO, "V4.1 r2": 2}.get(group, 1)
    if group == "V4.1 r1 kept":
        qry = [min(q, WINDOW) for q in qry]
    comp = torch.tensor(np.asarray(seq) // ratio, dtype=torch.int32)
    q = torch.tensor(qry, dtype=torch.int32)
    workspace = MAX_MODEL_LEN * (576 * 2 // 132) * FACTOR // ratio
    if group != "V4.1 sparse":
        return (lambda: theirs(comp, q, workspace, LOGITS_BYTES)), (lambda: ours(comp, q, workspace, LOGITS_BYTES))
    minimum = CandidateLayout(*CANDIDATES).min_split_keys

    class Builder(_SparseBuilder):
        _split_indexer_prefill_chunks = staticmethod(ours)

    builder = Builder(ours, minimum)
    their_lens = indexer_plan.prefill_split_seq_lens.__dsv4_prefill_original__
    our_lens = indexer_plan.prefill_split_seq_lens
    return (
        lambda: theirs(their_lens(builder, comp), q, workspace, LOGITS_BYTES),
        lambda: ours(our_lens(builder, comp), q, workspace, LOGITS_BYTES),
    )


def measure(seconds: float, sizes=SIZES, groups=GROUPS) -> list[dict]:
    import vllm.v1.attention.backends.mla.sparse_indexer  # noqa: F401  (the plugin patches its clamp on import)

    theirs, ours = methods()
    rows = []
    for group in groups:
        for n in sizes:
            seq, qry = scaling_batch(n, seed=n, max_model_len=MAX_MODEL_LEN, tokens=MAX_BATCHED)
            fv, fp = group_calls(group, seq, qry, theirs, ours)
            plan = fv()
            assert fp() == plan, (group, n)
            one = time_calls(fv, 1)
            calls_v = max(1, int(0.05 / max(one, 1e-6)))
            calls_p = calls_v * 10
            tv, tp, t_end = [], [], time.perf_counter() + seconds
            while time.perf_counter() < t_end or len(tv) < 5:
                tv.append(time_calls(fv, calls_v))
                tp.append(time_calls(fp, calls_p))
            v, p = float(np.median(tv)) * 1e6, float(np.median(tp)) * 1e6
            rows.append(
                dict(
                    group=group,
                    requests=n,
                    tokens=int(sum(qry)),
                    chunks=len(plan),
                    vllm_us=round(v, 1),
                    plugin_us=round(p, 1),
                )
            )
            rows[-1]["ratio"] = round(v / p, 1)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.0, help="time per size and side, at least 5 blocks")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="requests per step, comma-separated")
    ap.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated, of {GROUPS}")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    groups = tuple(g.strip() for g in args.groups.split(","))
    bad = [g for g in groups if g not in GROUPS]
    if bad:
        ap.error(f"--groups: {bad} not in {GROUPS}")
    rows = measure(args.seconds, tuple(int(x) for x in args.sizes.split(",")), groups)
    print(
        f"Indexer prefill chunk plan per build, vLLM 0.33.0 (max_model_len {MAX_MODEL_LEN}, workspace "
        f"{MAX_MODEL_LEN * (576 * 2 // 132) * FACTOR} keys / ratio, {LOGITS_BYTES >> 20} MiB logits; "
        "median of alternating blocks, one process):"
    )
    print(
        table(
            [
                [r["group"], r["requests"], r["tokens"], r["chunks"], r["vllm_us"], r["plugin_us"], f"{r['ratio']}x"]
                for r in rows
            ],
            ["group", "requests", "tokens", "chunks", "vLLM us", "plugin us", "ratio"],
        )
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
