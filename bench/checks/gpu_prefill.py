"""GPU check of whole prefill steps: adaptive vs fixed vs per-request, PyTorch and JAX.

For each named workload (`bench.common.workloads`, full size) and V4-Flash / V4-Pro shapes (H 64 / 128,
D 512, top-k 512 / 1024, W 128), one layer of each kind runs through `dsv4_torch.prefill`
(backend "auto": FlashMLA where its wheel imports, else our Triton kernel) and `dsv4_jax.prefill`
(Pallas-Triton), bf16. Printed per layer kind and plan: median ms, tokens/s, chunks, peak
workspace MiB, and the step time summed over the model's layers of each kind; the adaptive plan's
output is compared with the fixed plan's (bitwise expected: same index rows, same kernel).

Run: python -m bench.checks.gpu_prefill [--seconds 150] [--frameworks torch,jax] [--workloads a,b] [--dry-run]
Without a GPU it exits 0 with a message; --dry-run runs tiny shapes on CPU to check the script.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import numpy as np

from bench.common import median_seconds, recent_topk_rows, torch_time_ms, workloads
from planner import V4_LAYERS, LayerKind, PlanConfig, PrefillBatch, plan_step
from planner.contract import ModelShape
from planner.report import BYTES_PER_ROW, table

PLANS = ("adaptive", "fixed", "per_request")


def packed_offsets(lens) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int32)


def torch_inputs(batch, layer, H, D, topk, dry, seed=0):
    """Random latents made on the device (NumPy would spend seconds per GiB), caches packed once."""
    import torch

    from dsv4_torch import prefill as TP

    dev = "cpu" if dry else "cuda"
    dt = torch.float32 if dry else torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(seed)
    randn = lambda *shape: (torch.randn(shape, generator=g, device=dev, dtype=torch.float32) * 0.1).to(dt)  # noqa: E731
    seq = batch.seq_lens
    raw = TP.LogicalKV(randn(int(seq.sum()), D), torch.as_tensor(packed_offsets(seq), device=dev))
    comp = None
    if layer.has_compressed:
        clen = seq // layer.compress_ratio
        comp = TP.LogicalKV(randn(max(1, int(clen.sum())), D), torch.as_tensor(packed_offsets(clen), device=dev))
    q = randn(batch.num_tokens, H, D) * 10
    rows = None
    if layer.kind is LayerKind.CSA:
        rows = torch.as_tensor(recent_topk_rows(batch.token_position, topk, layer.compress_ratio), device=dev)
    sink = randn(H).float() * 10
    return dict(q=q, raw=raw, comp=comp, rows=rows, sink=sink)


def time_torch(step, layer, x, topk, iters, dry):
    from dsv4_torch import prefill as TP

    dev = "cpu" if dry else "cuda"
    meta = TP.build_step_metadata(step, device=dev, index_topk=topk)[layer.kind]
    q = x["q"]
    call = lambda: TP.prefill_attention(
        q,
        meta,
        x["raw"],
        x["comp"],
        sm_scale=q.shape[-1] ** -0.5,  # noqa: E731
        attn_sink=x["sink"],
        topk_indices=x["rows"],
    )
    out = call()  # also the warm-up
    ms = torch_time_ms(call, dev, 0, iters)
    return ms, out.float().cpu().numpy(), meta.last_backend


def jax_inputs(batch, layer, H, D, topk, dry, seed=0):
    import jax
    import jax.numpy as jnp

    from dsv4_jax import prefill as JP

    dt = jnp.float32 if dry else jnp.bfloat16
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    seq = batch.seq_lens
    raw = JP.LogicalKV(jax.random.normal(keys[0], (int(seq.sum()), D), dt) * 0.1, jnp.asarray(packed_offsets(seq)))
    comp = None
    if layer.has_compressed:
        clen = seq // layer.compress_ratio
        comp = JP.LogicalKV(
            jax.random.normal(keys[1], (max(1, int(clen.sum())), D), dt) * 0.1, jnp.asarray(packed_offsets(clen))
        )
    q = jax.random.normal(keys[2], (batch.num_tokens, H, D), dt)
    rows = recent_topk_rows(batch.token_position, topk, layer.compress_ratio) if layer.kind is LayerKind.CSA else None
    sink = np.asarray(jax.random.normal(keys[3], (H,), jnp.float32))
    return dict(q=q, raw=raw, comp=comp, rows=rows, sink=sink)


def time_jax(step, layer, x, topk, iters, dry):
    import jax.numpy as jnp

    from dsv4_jax import prefill as JP

    meta = JP.build_step_metadata(step, index_topk=topk)
    km = meta[layer.kind]
    q = meta.pad_tokens(x["q"])
    rows = jnp.asarray(meta.pad_tokens(x["rows"])) if x["rows"] is not None else None
    call = lambda: JP.prefill_attention(
        q,
        km,
        x["raw"],
        x["comp"],
        sm_scale=q.shape[-1] ** -0.5,  # noqa: E731
        attn_sink=x["sink"],
        topk_indices=rows,
        backend="auto",
    ).block_until_ready()
    out = call()  # also the warm-up
    ms = median_seconds(call, iters, warmup=0) * 1e3
    return ms, np.asarray(out[: step.batch.num_tokens], np.float32), km.last_backend


HEADER = [
    "workload",
    "model",
    "kind",
    "framework",
    "backend",
    "plan",
    "chunks",
    "ms/layer",
    "tokens/s",
    "workspace MiB",
    "ms/step (all layers of kind)",
    "plans bitwise equal",
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=150, help="stop starting new measurements after this")
    ap.add_argument("--frameworks", default="torch,jax")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--workloads", default="", help="comma-separated names of bench.common.workloads (default: all)")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    start = time.time()
    dry = args.dry_run
    if not dry:
        try:
            import torch

            if not torch.cuda.is_available():
                print("bench.checks.gpu_prefill: no CUDA GPU visible to torch; nothing to do (use --dry-run on CPU)")
                return 0
            print(f"GPU: {torch.cuda.get_device_name()} (SM{''.join(map(str, torch.cuda.get_device_capability()))})")
        except ImportError:
            print("bench.checks.gpu_prefill: torch missing")
    scale = 1 / 64 if dry else 1.0
    shapes = [("V4-Flash", 64, 512), ("V4-Pro", 128, 1024)] if not dry else [("tiny", 4, 16)]
    D = 32 if dry else 512
    rows_out, skipped = [], []
    chosen = workloads(scale=scale)
    if args.workloads:
        unknown = set(args.workloads.split(",")) - set(chosen)
        if unknown:
            ap.error(f"--workloads: unknown {sorted(unknown)}; choose from {sorted(chosen)}")
        chosen = {k: v for k, v in chosen.items() if k in args.workloads.split(",")}
    for wname, (seq, qry, limits) in chosen.items():
        batch = PrefillBatch(seq, qry)
        for mname, H, topk in shapes:
            layers = ModelShape.from_name("V4-Pro" if mname == "V4-Pro" else "V4-Flash").layers_per_kind()
            for layer in V4_LAYERS:  # one layer per kind, at DeepSeek-V4.0's ratios
                kind = layer.kind
                if time.time() - start > args.seconds:
                    skipped.append(f"{wname}/{mname}/{kind.name}")
                    continue
                steps = {p: plan_step(batch, PlanConfig(policy=p, **limits), [layer]) for p in PLANS}
                for fw in args.frameworks.split(","):
                    try:
                        make, fn = (torch_inputs, time_torch) if fw == "torch" else (jax_inputs, time_jax)
                        x = make(batch, layer, H, D, topk, dry)
                        res = {p: fn(steps[p], layer, x, topk, args.iters, dry) for p in PLANS}
                        del x
                    except Exception as e:  # noqa: BLE001 - keep going, report
                        print(f"[{fw} {wname} {mname} {kind.name}] {type(e).__name__}: {e}")
                        traceback.print_exc(limit=3)
                        continue
                    same = all(np.array_equal(res[p][1], res["adaptive"][1]) for p in PLANS)
                    for p in PLANS:
                        ms, _, backend = res[p]
                        kp = steps[p][kind]
                        rows_out.append(
                            [
                                wname,
                                mname,
                                kind.name,
                                fw,
                                backend,
                                p,
                                kp.num_chunks,
                                f"{ms:.2f}",
                                f"{batch.num_tokens / ms * 1e3:.0f}",
                                f"{kp.max_workspace_rows * BYTES_PER_ROW / 2**20:.1f}",
                                f"{ms * layers[kind]:.1f}",
                                "yes" if same else "NO",
                            ]
                        )
                    # Each row as soon as it is measured: a run stopped at its time cap keeps them.
                    print(table(rows_out[-len(PLANS) :], HEADER), flush=True)
    if skipped:
        print(f"\n[time budget of {args.seconds:.0f} s spent: not measured: {', '.join(skipped)}]")
    print("\nall rows:")
    print(table(rows_out, HEADER))
    return 0


if __name__ == "__main__":
    sys.exit(main())
