"""Planner benchmark: host time per step, and workspace/launches per named workload.

    .venv/bin/python -m bench.bench_planner [--repeats 200] [--json out.json]

Host time: our `PrefillBatch` + `plan_step` (all three kinds) once per step, as chunks only (what
vLLM's tuples need; a plan derives the rest on first use) and with every kind's per-segment
layout and per-token metadata made too (what the torch / JAX prefill builders read), beside a baseline that plans per layer with a per-request scalar loop
over torch CPU tensors, as vLLM does (62 attention layers of V4-Pro, MTP included). Both are timed
in alternating blocks in one run (ours: 10 steps per block); medians over blocks; the ratio is
what to read, the machine is noisy.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from bench.common import scaling_batch, workloads
from planner import LayerKind, PlanConfig, PrefillBatch, plan_step
from planner.contract import ModelShape
from planner.report import BYTES_PER_ROW, table


def vllm_style_plan(seq_t, qry_t, r, W, mml, mnbt, pcs):
    """The per-layer baseline: vLLM's scan with `.item()` per request on torch CPU tensors."""
    import torch

    area = pcs * ((0 if r <= 1 else -(-mml // r)) + W + mnbt)
    gather = qry_t + torch.clamp(seq_t - qry_t, min=0, max=W - 1)
    comp = torch.zeros_like(seq_t) if r <= 1 else torch.div(seq_t, r, rounding_mode="floor")
    n, plan, s = seq_t.shape[0], [], 0
    while s < n:
        mc, mg, e = int(comp[s].item()), int(gather[s].item()), s + 1
        while e < n:
            c, g = max(mc, int(comp[e].item())), max(mg, int(gather[e].item()))
            if (e - s + 1) * (c + g) > area:
                break
            mc, mg, e = c, g, e + 1
        plan.append((s, e, mc, mc + mg))
        s = e
    return plan


def layouts(step) -> None:
    """Make every kind's per-segment layout and per-token metadata (plans derive them on first use)."""
    for p in step.kinds.values():
        p.seg_row_base, p.seg_gather_start, p.seg_request, p.token_index, p.token_request, p.token_position
        p.chunk_token_starts


def time_host(repeats: int) -> list[dict]:
    import torch

    shape = ModelShape.from_name("V4-Pro")
    W, mml, mnbt = 128, 65536, 16384
    cfg = PlanConfig(window_size=W, max_model_len=mml, max_num_batched_tokens=mnbt)
    rows = []
    for n in (8, 64, 256, 1024):
        seq, qry = scaling_batch(n, seed=n, max_model_len=mml, tokens=mnbt)
        seq_t, qry_t = torch.tensor(seq, dtype=torch.int32), torch.tensor(qry, dtype=torch.int32)
        ours, full, base = [], [], []
        reps = max(3, repeats // (1 + n // 64))
        block = 10
        for _ in range(reps):  # alternating blocks: both see the same machine state, each warm
            t0 = time.perf_counter()
            for _ in range(block):
                step = plan_step(PrefillBatch(seq, qry), cfg, shape.layers)
            t1 = time.perf_counter()
            for _ in range(block):
                layouts(plan_step(PrefillBatch(seq, qry), cfg, shape.layers))
            t2 = time.perf_counter()
            for spec in shape.layers:  # one plan per layer
                vllm_style_plan(seq_t, qry_t, spec.compress_ratio, W, mml, mnbt, 4)
            t3 = time.perf_counter()
            ours.append((t1 - t0) / block)
            full.append((t2 - t1) / block)
            base.append(t3 - t2)
        # the baseline must plan exactly what we plan
        csa = step[LayerKind.CSA]
        assert csa.as_tuples() == vllm_style_plan(seq_t, qry_t, csa.compress_ratio, W, mml, mnbt, 4)
        o, f, b = (float(np.median(x)) * 1e6 for x in (ours, full, base))
        rows.append(
            dict(
                requests=n,
                tokens=int(sum(qry)),
                ours_us=round(o, 1),
                with_layouts_us=round(f, 1),
                per_layer_baseline_us=round(b, 1),
                speedup=round(b / o, 1),
                speedup_with_layouts=round(b / f, 1),
                chunks={k.name: p.num_chunks for k, p in step.kinds.items()},
            )
        )
    return rows


def workspace_report() -> list[dict]:
    rows = []
    for name, (seq, qry, limits) in workloads().items():
        batch = PrefillBatch(seq, qry)
        steps = {
            pol: plan_step(batch, PlanConfig(policy=pol, **limits)) for pol in ("adaptive", "fixed", "per_request")
        }
        for shape in (ModelShape.from_name("V4-Flash"), ModelShape.from_name("V4-Pro")):
            layers = shape.layers_per_kind()
            r = dict(workload=name, model=shape.name, requests=batch.num_requests, tokens=batch.num_tokens)
            for pol, step in steps.items():
                r[f"{pol}_peak_MiB"] = round(step.max_workspace_rows * BYTES_PER_ROW / 2**20, 2)
                r[f"{pol}_launches"] = sum(step[k].num_chunks * layers[k] for k in LayerKind)
            lb = max(steps["adaptive"][k].padding_free_rows for k in LayerKind)
            r["padding_free_MiB"] = round(lb * BYTES_PER_ROW / 2**20, 2)
            rows.append(r)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)

    host = time_host(args.repeats)
    print("Host time per prefill step, V4-Pro (62 attention layers), 16K-token steps, median:")
    print(
        table(
            [
                [
                    r["requests"],
                    r["tokens"],
                    r["ours_us"],
                    r["with_layouts_us"],
                    r["per_layer_baseline_us"],
                    f"{r['speedup']}x",
                    f"{r['speedup_with_layouts']}x",
                    " ".join(f"{k}:{v}" for k, v in r["chunks"].items()),
                ]
                for r in host
            ],
            [
                "requests",
                "tokens",
                "plan_step us",
                "+ layouts us",
                "per-layer baseline us",
                "speedup",
                "speedup w/ layouts",
                "chunks",
            ],
        )
    )
    ws = workspace_report()
    print("\nPeak workspace (bf16 512-d rows) and sparse-attention launches per step:")
    print(
        table(
            [
                [
                    r["workload"],
                    r["model"],
                    r["requests"],
                    r["tokens"],
                    r["adaptive_peak_MiB"],
                    r["fixed_peak_MiB"],
                    r["per_request_peak_MiB"],
                    r["padding_free_MiB"],
                    r["adaptive_launches"],
                    r["fixed_launches"],
                    r["per_request_launches"],
                ]
                for r in ws
            ],
            [
                "workload",
                "model",
                "reqs",
                "tokens",
                "adaptive MiB",
                "fixed MiB",
                "per-req MiB",
                "padding-free MiB",
                "adaptive launches",
                "fixed launches",
                "per-req launches",
            ],
        )
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(host=host, workspace=ws), f, indent=1)


if __name__ == "__main__":
    main()
