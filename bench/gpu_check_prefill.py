"""GPU check of whole prefill steps: adaptive vs fixed vs per-request, PyTorch and JAX.

For each named workload (bench/workloads.py, full size) and V4-Flash / V4-Pro shapes (H 64 / 128,
D 512, top-k 512 / 1024, W 128), one layer of each kind runs through `dsv4_torch.prefill`
(backend "auto": FlashMLA where its wheel imports, else our Triton kernel) and `dsv4_jax.prefill`
(Pallas-Triton), bf16. Printed per layer kind and plan: median ms, tokens/s, chunks, peak
workspace MiB, and the step time summed over the model's layers of each kind; the adaptive plan's
output is compared with the fixed plan's (bitwise expected: same index rows, same kernel).

Run: python bench/gpu_check_prefill.py [--seconds 150] [--frameworks torch,jax] [--dry-run]
Without a GPU it exits 0 with a message; --dry-run runs tiny shapes on CPU to check the script.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.workloads import workloads  # noqa: E402
from planner import LayerKind, PlanConfig, PrefillBatch, plan_step  # noqa: E402
from planner.models import PRESETS  # noqa: E402
from planner.report import BYTES_PER_ROW, table  # noqa: E402

PLANS = ("adaptive", "fixed", "per_request")


def layer_inputs(batch: PrefillBatch, ratio: int, H: int, D: int, topk: int, seed: int = 0):
    """NumPy float32 latents of one layer (converted per framework)."""
    rng = np.random.default_rng(seed)
    raw = rng.standard_normal((int(batch.seq_lens.sum()), D), dtype=np.float32) * 0.1
    offsets = np.concatenate([[0], np.cumsum(batch.seq_lens)[:-1]]).astype(np.int32)
    comp_lens = batch.seq_lens // ratio if ratio > 1 else np.zeros_like(batch.seq_lens)
    comp = rng.standard_normal((max(1, int(comp_lens.sum())), D), dtype=np.float32) * 0.1
    comp_offsets = np.concatenate([[0], np.cumsum(comp_lens)[:-1]]).astype(np.int32)
    q = rng.standard_normal((batch.num_tokens, H, D), dtype=np.float32)
    visible = (batch.token_position.astype(np.int64) + 1) // 4
    # the most recent visible entries, as a stand-in for the indexer's choice
    rows = (visible[:, None] - 1 - np.arange(topk)[None, :]).astype(np.int32)
    rows[np.arange(topk)[None, :] >= np.minimum(visible, topk)[:, None]] = -1
    sink = rng.standard_normal(H).astype(np.float32)
    return dict(raw=raw, offsets=offsets, comp=comp, comp_offsets=comp_offsets, q=q, rows=rows, sink=sink)


def time_torch(step, ratio, x, topk, iters, dry):
    import torch

    from dsv4_torch import prefill as TP

    dev = "cpu" if dry else "cuda"
    dt = torch.float32 if dry else torch.bfloat16
    meta = TP.build_step_metadata(step, device=dev, index_topk=topk)[ratio]
    t = lambda a: torch.from_numpy(a).to(dev)
    raw = [t(x["raw"][o : o + int(s)]).to(dt) for o, s in zip(x["offsets"], step.batch.seq_lens)]
    comp = None
    if ratio > 1:
        comp = [t(x["comp"][o : o + int(s) // ratio]).to(dt) for o, s in zip(x["comp_offsets"], step.batch.seq_lens)]
    q, rows, sink = t(x["q"]).to(dt), t(x["rows"]), t(x["sink"])
    call = lambda: TP.prefill_attention(q, meta, raw, comp, sm_scale=q.shape[-1] ** -0.5, attn_sink=sink,
                                        topk_indices=rows if ratio == 4 else None)  # fmt: skip
    out = call()
    times = []
    for _ in range(iters):
        if dry:
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e3)
        else:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            call()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
    return statistics.median(times), out.float().cpu().numpy(), meta.last_backend


def time_jax(step, ratio, x, topk, iters, dry):
    import jax  # noqa: F401 - fail early if JAX is missing
    import jax.numpy as jnp

    from dsv4_jax import prefill as JP

    dt = jnp.float32 if dry else jnp.bfloat16
    meta = JP.build_step_metadata(step, index_topk=topk)
    km = meta[ratio]
    raw = JP.LogicalKV(jnp.asarray(x["raw"], dt), jnp.asarray(x["offsets"]))
    comp = JP.LogicalKV(jnp.asarray(x["comp"], dt), jnp.asarray(x["comp_offsets"])) if ratio > 1 else None
    q = jnp.asarray(meta.pad_tokens(x["q"]), dt)
    rows = jnp.asarray(meta.pad_tokens(x["rows"])) if ratio == 4 else None
    call = lambda: JP.prefill_attention(q, km, raw, comp, sm_scale=x["q"].shape[-1] ** -0.5, attn_sink=x["sink"],
                                        topk_indices=rows, backend="auto").block_until_ready()  # fmt: skip
    out = call()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), np.asarray(out[: step.batch.num_tokens], np.float32), km.last_backend


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=150, help="stop starting new measurements after this")
    ap.add_argument("--frameworks", default="torch,jax")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    start = time.time()
    dry = args.dry_run
    if not dry:
        try:
            import torch

            if not torch.cuda.is_available():
                print("gpu_check_prefill: no CUDA GPU visible to torch; nothing to do (use --dry-run on CPU)")
                return 0
            print(f"GPU: {torch.cuda.get_device_name()} (SM{''.join(map(str, torch.cuda.get_device_capability()))})")
        except ImportError:
            print("gpu_check_prefill: torch missing")
    scale = 1 / 64 if dry else 1.0
    shapes = [("V4-Flash", 64, 512), ("V4-Pro", 128, 1024)] if not dry else [("tiny", 4, 16)]
    D = 32 if dry else 512
    rows_out = []
    for wname, (seq, qry, limits) in workloads(scale=scale).items():
        batch = PrefillBatch(seq, qry)
        for mname, H, topk in shapes:
            layers = (PRESETS["v4-flash" if mname != "V4-Pro" else "v4-pro"]).layers_per_kind()
            for kind in LayerKind:
                if time.time() - start > args.seconds:
                    print(f"[time budget of {args.seconds:.0f} s spent: stopping]")
                    break
                x = layer_inputs(batch, kind.ratio, H, D, topk)
                steps = {p: plan_step(batch, PlanConfig(policy=p, **limits), [kind.ratio]) for p in PLANS}
                for fw in args.frameworks.split(","):
                    try:
                        fn = time_torch if fw == "torch" else time_jax
                        res = {p: fn(steps[p], kind.ratio, x, topk, args.iters, dry) for p in PLANS}
                    except Exception as e:  # noqa: BLE001 - keep going, report
                        print(f"[{fw} {wname} {mname} {kind.name}] {type(e).__name__}: {e}")
                        traceback.print_exc(limit=3)
                        continue
                    same = all(np.array_equal(res[p][1], res["adaptive"][1]) for p in PLANS)
                    for p in PLANS:
                        ms, _, backend = res[p]
                        kp = steps[p][kind]
                        rows_out.append([wname, mname, kind.name, fw, backend, p, kp.num_chunks, f"{ms:.2f}",
                                         f"{batch.num_tokens / ms * 1e3:.0f}",
                                         f"{kp.max_workspace_rows * BYTES_PER_ROW / 2**20:.1f}",
                                         f"{ms * layers[kind]:.1f}", "yes" if same else "NO"])  # fmt: skip
                    print(".", end="", flush=True)
    print()
    print(table(rows_out, ["workload", "model", "kind", "framework", "backend", "plan", "chunks", "ms/layer",
                           "tokens/s", "workspace MiB", "ms/step (all layers of kind)", "plans bitwise equal"]))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
