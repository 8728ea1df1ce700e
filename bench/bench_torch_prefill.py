"""PyTorch prefill attention throughput per plan: adaptive vs fixed vs per-request.

    .venv/bin/python -m bench.bench_torch_prefill [--scale 0.125] [--heads 16] [--dim 128]

For each named workload (`bench.common.workloads`, lengths scaled down for CPU) and each layer kind,
one layer's `dsv4_torch.prefill.prefill_attention` is timed per plan, interleaved, median of repeats.
Tokens/s and the ratio to the adaptive plan are printed, with chunks and peak workspace.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from bench.common import recent_topk_rows, time_interleaved, workloads
from dsv4_torch import prefill as TP
from planner import V4_LAYERS, LayerKind, LayerSpec, PlanConfig, PrefillBatch, plan_step
from planner.report import table

POLICIES = ("adaptive", "fixed", "per_request")


def layer_inputs(batch: PrefillBatch, layer: LayerSpec, H: int, D: int, topk: int, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = layer.compress_ratio
    raw = [torch.randn(int(s), D, generator=g, dtype=torch.float32).to(dtype) for s in batch.seq_lens]
    comp = (
        [torch.randn(int(s) // r, D, generator=g).to(dtype) for s in batch.seq_lens] if layer.has_compressed else None
    )
    q = torch.randn(batch.num_tokens, H, D, generator=g).to(dtype)
    rows = None
    if layer.kind is LayerKind.CSA:
        rows = torch.from_numpy(recent_topk_rows(batch.token_position, topk, layer.compress_ratio))
    sink = torch.randn(H, generator=g)
    return q, raw, comp, rows, sink


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=0.125, help="length scale of the workloads")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(os.cpu_count() or 1)
    rows_out = []
    for name, (seq, qry, limits) in workloads(scale=args.scale).items():
        batch = PrefillBatch(seq, qry)
        for layer in V4_LAYERS:  # one layer per kind at DeepSeek-V4.0's ratios
            kind = layer.kind
            q, raw, comp, topk_rows, sink = layer_inputs(batch, layer, args.heads, args.dim, args.topk, dtype)
            metas = {}
            for pol in POLICIES:
                step = plan_step(batch, PlanConfig(policy=pol, **limits), [layer])
                metas[pol] = TP.build_step_metadata(step, index_topk=args.topk)[kind]
            outs = {}

            def call(pol):
                outs[pol] = TP.prefill_attention(
                    q,
                    metas[pol],
                    raw,
                    comp,
                    sm_scale=args.dim**-0.5,
                    attn_sink=sink,
                    topk_indices=topk_rows,
                    backend="reference",
                )

            # the first call of each warms up; then the plans run interleaved, round-robin
            timed = time_interleaved({pol: lambda pol=pol: call(pol) for pol in POLICIES}, args.repeats)
            same = all(torch.equal(outs[p], outs["adaptive"]) for p in POLICIES)
            med = {p: timed[p][1] for p in POLICIES}
            rows_out.append(
                [name, kind.name, batch.num_tokens]
                + [
                    f"{batch.num_tokens / med[p]:.0f} ({metas[p].plan.num_chunks}ch, {metas[p].plan.max_workspace_rows} rows)"
                    for p in POLICIES
                ]
                + [f"{med['fixed'] / med['adaptive']:.2f}", f"{med['per_request'] / med['adaptive']:.2f}", same]
            )
            print(".", end="", flush=True, file=sys.stderr)
    print(file=sys.stderr)
    print(
        f"Prefill attention, one layer, reference backend, {args.dtype}, H={args.heads}, D={args.dim}, "
        f"topk={args.topk}, lengths x{args.scale}; tokens/s (chunks, peak workspace rows):"
    )
    print(
        table(
            rows_out,
            [
                "workload",
                "kind",
                "tokens",
                "adaptive",
                "fixed",
                "per-request",
                "fixed/adaptive time",
                "per-req/adaptive time",
                "bitwise equal",
            ],
        )
    )


if __name__ == "__main__":
    main()
