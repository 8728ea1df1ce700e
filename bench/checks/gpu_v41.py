"""GPU check of DeepSeek-V4.1 prefill in vLLM 0.33's chunk layout (issue 35, the GPU path).

    python -m bench.checks.gpu_v41 [--budget 60] [--dry-run]

1. plans: a V4.1 step (the released 40-layer schedule: window 128, top-k 512, ratios 0 / 2 / 1)
   planned with bounded replay and without (`planner.plan_step`): 3 and 4 distinct plans, every
   chunk's index rows in vLLM's layout (`planner.build_chunk_indices(..., allow_invalid=True)`:
   the indexer's -1 picks stay in the row and count in topk_length, as V4.1's
   `combine_topk_swa_indices` leaves them; the replay band's windows clamped to the kept rows).
2. kernels: every chunk through the sparse-attention kernels the GPU has (`dsv4_torch` backends
   "flashmla", FlashMLA's `flash_mla_sparse_fwd`, where its wheel imports, and "triton", ours),
   bf16, against the fp32 reference backend on the same inputs (FlashMLA's own tolerance,
   `bench.checks.gpu_torch.compare`); ms per plan and TFLOPS (vs FlashMLA's published 640).
3. V4.1's SM100 kernels that read the 528-byte mxfp8 records in place (vLLM's `_flashmla_C`
   mega-attention, `fused_norm_rope_attn_rope_cast_decode`) and vLLM's candidate-block kernels
   (`select_candidate_blocks`, `apply_candidate_mask`): they are vLLM's CUDA build (not on the
   device image; its wheel is over the device tool's 64 MiB carry limit) and the former an sm_10x
   GPU: reported as not run, with the reason, unless both are there.

Without a GPU it exits 0 with a message; --dry-run runs tiny shapes on the CPU (the reference
against our Triton kernel in Triton's interpreter) to check the script.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import numpy as np

from bench.common import FLASHMLA_PUBLISHED_TFLOPS, TFLOPS_CONVENTION, tflops, torch_time_ms


def v41_step(dry: bool, replay: bool):
    """The planned step and the shapes: (StepPlan, H, D, topk)."""
    import planner

    if dry:
        cfg = dict(planner.contract.preset("V4.1"), sliding_window=4, index_topk=4)
        sched = planner.Schedule.from_config(cfg)
        seq, qry, rs = [19, 9, 11], [8, 9, 3], [0, 0, 5]
        config = planner.PlanConfig(window_size=4, max_model_len=32, max_num_batched_tokens=16, replay=replay)
        return planner.plan_step(planner.PrefillBatch(seq, qry, replay_start=rs), config, sched), 2, 64, 4
    sched = planner.Schedule.from_name("V4.1")
    # a long prompt's chunk, a prefix hit (its window rebuilt from replay_start), short prompts
    seq, qry, rs = [16384, 5000, 3000, 700, 129, 40], [2048, 1200, 600, 700, 129, 40], [0, 3600, 0, 0, 0, 0]
    config = planner.PlanConfig(window_size=128, max_model_len=16384, max_num_batched_tokens=4096, replay=replay)
    return planner.plan_step(planner.PrefillBatch(seq, qry, replay_start=rs), config, sched), 64, 512, 512


def topk_rows(batch, ratio: int, topk: int, seed: int) -> np.ndarray:
    """(T, topk) request-local picks among each token's visible entries, about 5% of them -1
    (V4.1's indexer writes -1 for a pick it could not make)."""
    rng = np.random.default_rng(seed)
    p = batch.token_position.astype(np.int64)
    visible = (p + 1) // ratio
    rows = np.full((p.shape[0], topk), -1, dtype=np.int64)
    for t, v in enumerate(visible.tolist()):
        k = min(v, topk)
        rows[t, :k] = rng.choice(v, k, replace=False) if v > 4 * k else rng.permutation(v)[:k]
    rows[(rng.random(rows.shape) < 0.05) & (rows >= 0)] = -1
    return rows.astype(np.int32)


def check_plans(args, device: str, results: list) -> bool:
    import torch

    import dsv4_torch
    import planner
    from bench.checks.gpu_torch import compare, gpu_backends

    backends = gpu_backends(device)
    print(f"backends: {backends or 'none'} (reference: fp32, same device)", flush=True)
    if not backends:
        return True
    dt = torch.float32 if args.dry_run else torch.bfloat16
    ok, t_end = True, time.time() + args.budget
    for replay in (True, False):
        step, H, D, topk = v41_step(args.dry_run, replay)
        print(f"\nV4.1 step, replay {'on' if step.replay else 'off'}: {step.num_plans} plans")
        for key, plan in step.plans.items():
            if time.time() > t_end:
                print(f"  budget spent: {key} not run")
                continue
            r = plan.compress_ratio if plan.layer.has_compressed else 0
            sel = topk_rows(step.batch, r, topk, seed=r) if r else None
            g = torch.Generator(device=device).manual_seed(r)
            totals = {b: [0.0, 0] for b in backends}
            plan_ok, tokens = True, 0
            for c in plan.chunks:
                idx, lens = planner.build_chunk_indices(plan, c, sel, allow_invalid=True)
                S = (c.end - c.start) * c.M
                q = (torch.randn(c.num_tokens, H, D, generator=g, device=device) * 0.5).to(dt)
                kv = (torch.randn(max(S, 1), D, generator=g, device=device) * 0.5).to(dt)
                case = dict(
                    q=q,
                    kv=kv,
                    indices=torch.as_tensor(idx, device=device),
                    sm_scale=D**-0.5,
                    attn_sink=torch.randn(H, generator=g, device=device).float(),
                    topk_length=torch.as_tensor(lens, device=device),
                )
                want = dsv4_torch.sparse_attention(**dict(case, q=q.float(), kv=kv.float()), backend="reference")
                valid = int(lens.sum())
                tokens += c.num_tokens
                for b in backends:
                    got = dsv4_torch.sparse_attention(**case, backend=b)
                    plan_ok &= compare(got, want, f"{key} chunk {c.index} ({c.num_tokens} tokens) {b}")
                    warmup, iters = (1, 1) if args.dry_run else (3, 10)
                    ms = torch_time_ms(
                        lambda b=b: dsv4_torch.sparse_attention(**case, backend=b), device, warmup, iters
                    )
                    totals[b][0] += ms
                    totals[b][1] += valid
            for b, (ms, valid) in totals.items():
                row = dict(
                    replay=step.replay,
                    plan=str(key),
                    chunks=plan.num_chunks,
                    tokens=tokens,
                    backend=b,
                    ms=ms,
                    tflops=tflops(valid, H, ms / 1e3) if ms > 0 else 0.0,
                    ok=plan_ok,
                )
                results.append(row)
                print(
                    f"  {key}: {plan.num_chunks} chunks, {row['tokens']} tokens, {b}: {ms:.3f} ms, "
                    f"{row['tflops']:.1f} TFLOPS ({row['tflops'] / FLASHMLA_PUBLISHED_TFLOPS:.0%} of "
                    f"{FLASHMLA_PUBLISHED_TFLOPS:.0f}), {'PASS' if plan_ok else 'FAIL'}",
                    flush=True,
                )
            ok &= plan_ok
    return ok


def sm100_and_vllm_kernels(device: str) -> None:
    """Section 3: run only where vLLM's CUDA build and an sm_10x GPU are both there."""
    import torch

    cap = torch.cuda.get_device_capability() if device == "cuda" else None
    try:
        import vllm  # noqa: F401

        have_vllm = True
    except Exception as e:  # noqa: BLE001
        have_vllm, why = False, f"{type(e).__name__}: {e}"
    reasons = []
    if cap is None or cap[0] != 10:
        reasons.append(f"needs an sm_10x GPU (B200/GB200) for the 528-byte record kernels; this is {cap or 'no GPU'}")
    if not have_vllm:
        reasons.append(f"needs vLLM 0.33.0's CUDA build (not on the device image: {why})")
    if reasons:
        print("not run: V4.1's SM100 mega-attention on 528-byte mxfp8 records, vLLM's candidate-block kernels:")
        for r in reasons:
            print(f"  - {r}")
        return
    # Both present: report what vLLM's build exposes; a measured check belongs here once a B200 is lent.
    ops = torch.ops._flashmla_C
    for name in ("fused_norm_rope_attn_rope_cast_decode", "permute_q_b_proj"):
        print(f"  torch.ops._flashmla_C.{name}: {'present' if hasattr(ops, name) else 'absent'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=60, help="seconds for section 2")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (interpreted Triton)")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before dsv4_torch's Triton kernel is imported
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if device == "cpu" and not args.dry_run:
        print("no GPU visible: bench.checks.gpu_v41 has nothing to measure here (--dry-run checks the script)")
        return 0
    print(TFLOPS_CONVENTION)
    results: list = []
    ok = True
    try:
        ok = check_plans(args, device, results)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        ok = False
    try:
        sm100_and_vllm_kernels(device)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    print(f"\nV4.1 plans through the kernels: {'PASS' if ok else 'FAIL'} ({len(results)} rows)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
