"""dsv4-prefill main job: plan a prefill step, then run its attention in PyTorch and JAX.

    python demo.py                                   # the spec's worked example batch
    python demo.py --seq-lens 4096,900,17 --query-lens 512,900,17 --window-size 128
    python demo.py --heads 64 --frameworks torch     # V4-Flash head count, PyTorch only

Part 1 prints the planner's tables (adaptive vs fixed plans, workspace, kernel launches for
V4-Flash and V4-Pro). Part 2 runs one attention layer of each kind on random latents through
`dsv4_torch.prefill` and `dsv4_jax.prefill` ("auto" backends) under both plans, and checks every
result against the float64 oracle and the plans against each other.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from planner import V4_LAYERS, LayerKind, LayerSpec, PlanConfig, PrefillBatch, Schedule, oracle, plan_step
from planner.report import (
    SPEC_LIMITS,
    SPEC_QUERY_LENS,
    SPEC_SEQ_LENS,
    V41_QUERY_LENS,
    V41_SEQ_LENS,
    plan_report,
    table,
    v41_report,
)

FRAMEWORKS = ("torch", "jax")
PLANS = ("adaptive", "fixed")


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--seq-lens", type=int_list, default=list(SPEC_SEQ_LENS), help="context length of each request after this step"
    )
    p.add_argument(
        "--query-lens", type=int_list, default=list(SPEC_QUERY_LENS), help="new tokens of each request this step"
    )
    p.add_argument("--window-size", type=int, default=SPEC_LIMITS["window_size"])
    p.add_argument("--max-model-len", type=int, default=SPEC_LIMITS["max_model_len"])
    p.add_argument("--max-num-batched-tokens", type=int, default=SPEC_LIMITS["max_num_batched_tokens"])
    p.add_argument("--prefill-chunk-size", type=int, default=SPEC_LIMITS["prefill_chunk_size"])
    p.add_argument("--heads", type=positive_int, default=16, help="query heads (V4-Flash 64, V4-Pro 128)")
    p.add_argument("--head-dim", type=positive_int, default=512, help="latent width D (512 in DeepSeek-V4)")
    p.add_argument("--index-topk", type=positive_int, default=512, help="CSA top-k (V4-Flash 512, V4-Pro 1024)")
    p.add_argument("--frameworks", default="torch,jax", help="comma-separated: torch, jax; empty to skip part 2")
    p.add_argument("--backend", default="auto", help="backend for both frameworks (auto, reference/xla, ...)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def random_layer(batch: PrefillBatch, spec: LayerSpec, H: int, D: int, topk: int, rng):
    """Latents of one layer: per-request raw and compressed KV, queries, valid top-k rows (CSA
    only, else None), sink."""
    r = spec.compress_ratio
    raw = [rng.standard_normal((int(s), D), dtype=np.float32) for s in batch.seq_lens]
    comp = [
        rng.standard_normal((int(s) // r if spec.has_compressed else 0, D), dtype=np.float32) for s in batch.seq_lens
    ]
    q = rng.standard_normal((batch.num_tokens, H, D), dtype=np.float32)
    rows = None
    if spec.kind is LayerKind.CSA:
        visible = (batch.token_position.astype(np.int64) + 1) // r
        scores = rng.random((batch.num_tokens, int(visible.max(initial=0)) or 1))
        scores[np.arange(scores.shape[1])[None, :] >= visible[:, None]] = -1  # an indexer: best visible first
        rows = np.argsort(-scores, axis=1, kind="stable")[:, :topk].astype(np.int32)
        rows = np.pad(rows, ((0, 0), (0, max(0, topk - rows.shape[1]))), constant_values=-1)
        rows[np.arange(topk)[None, :] >= np.minimum(visible, topk)[:, None]] = -1
    return raw, comp, q, rows, rng.standard_normal(H).astype(np.float32)


def run_torch(step, spec, layer, topk, scale, backend):
    import torch

    from dsv4_torch import prefill as TP

    raw, comp, q, rows, sink = layer
    meta = TP.build_step_metadata(step, index_topk=topk)[spec.kind]
    args = dict(
        sm_scale=scale,
        attn_sink=torch.from_numpy(sink),
        backend=backend,
        topk_indices=None if rows is None else torch.from_numpy(rows),
    )
    raw_kv = TP.LogicalKV.from_list([torch.from_numpy(x) for x in raw])  # packed once, as JAX's below
    comp_kv = TP.LogicalKV.from_list([torch.from_numpy(x) for x in comp]) if spec.has_compressed else None
    q_t = torch.from_numpy(q)
    call = lambda: TP.prefill_attention(q_t, meta, raw_kv, comp_kv, **args)
    out, first, steady = timed(call)
    return out.numpy(), first, steady, meta.last_backend


REPEATS = 5  # timed calls per row, after the first


def timed(call):
    """(the last output, the first call's seconds, the median of REPEATS more calls): the first
    call carries one-off set-up (JAX's compile, the kernels' first build or load), so it is shown
    on its own and never counted in the steady figure."""
    t0 = time.perf_counter()
    out = call()
    first = time.perf_counter() - t0
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        out = call()
        times.append(time.perf_counter() - t0)
    return out, first, float(np.median(times))


def run_jax(step, spec, layer, topk, scale, backend):
    from dsv4_jax import prefill as JP

    raw, comp, q, rows, sink = layer
    meta = JP.build_step_metadata(step, index_topk=topk)
    kmeta = meta[spec.kind]
    import jax.numpy as jnp

    # on the device once (NumPy rows would be copied to it on every call)
    raw_kv = JP.LogicalKV.from_list([jnp.asarray(x) for x in raw])
    comp_kv = JP.LogicalKV.from_list([jnp.asarray(x) for x in comp]) if spec.has_compressed else None
    q_pad = jnp.asarray(meta.pad_tokens(q))
    rows_pad = None if rows is None else jnp.asarray(meta.pad_tokens(rows))
    sink = jnp.asarray(sink)
    call = lambda: JP.prefill_attention(
        q_pad, kmeta, raw_kv, comp_kv, sm_scale=scale, attn_sink=sink, topk_indices=rows_pad, backend=backend
    ).block_until_ready()
    out, first, steady = timed(call)
    return np.asarray(out)[: q.shape[0]], first, steady, kmeta.last_backend


def attention_report(batch: PrefillBatch, limits: dict, args) -> str:
    """Part 2: one layer per kind, both plans, each framework, against the float64 oracle."""
    frameworks = [f for f in args.frameworks.split(",") if f]
    for f in frameworks:
        if f not in FRAMEWORKS:
            raise ValueError(f"--frameworks: expected some of {FRAMEWORKS}, got {f!r}")
    rng = np.random.default_rng(args.seed)
    steps = {p: plan_step(batch, PlanConfig(policy=p, **limits)) for p in PLANS}
    scale = args.head_dim**-0.5
    rows = []
    for spec in V4_LAYERS:  # one layer per kind, at DeepSeek-V4.0's ratios (plan_step's default)
        kind = spec.kind
        layer = random_layer(batch, spec, args.heads, args.head_dim, args.index_topk, rng)
        raw, comp, q, topk_rows, sink = layer
        want, _, _ = oracle.prefill_attention(
            q,
            raw,
            comp,
            batch.seq_lens,
            batch.query_lens,
            kind=kind,
            compress_ratio=spec.compress_ratio,
            window_size=limits["window_size"],
            sm_scale=scale,
            attn_sink=sink,
            topk_rows=topk_rows,
        )
        results = {}
        for fw in frameworks:
            run = run_torch if fw == "torch" else run_jax
            for plan in PLANS:
                out, first, seconds, backend = run(steps[plan], spec, layer, args.index_topk, scale, args.backend)
                results[fw, plan] = out
                err = np.abs(out - want).max() / np.abs(want).max()
                rows.append(
                    [
                        kind.name,
                        fw,
                        backend,
                        plan,
                        steps[plan][kind].num_chunks,
                        f"{first * 1e3:.1f}",
                        f"{seconds * 1e3:.1f}",
                        f"{batch.num_tokens / seconds:.0f}",
                        f"{err:.1e}",
                    ]
                )
            rows[-1].append("yes" if np.array_equal(results[fw, "adaptive"], results[fw, "fixed"]) else "NO")
            rows[-2].append("")
        if len(frameworks) == 2:
            diff = np.abs(results["torch", "adaptive"] - results["jax", "adaptive"]).max() / np.abs(want).max()
            rows[-1].append(f"{diff:.1e}")
    header = [
        "kind",
        "framework",
        "backend",
        "plan",
        "chunks",
        "first call ms",
        f"ms (median of {REPEATS})",
        "tokens/s",
        "max rel err vs oracle",
        "plans bitwise equal",
        "torch vs jax",
    ][: max(len(r) for r in rows)]
    rows = [r + [""] * (len(header) - len(r)) for r in rows]
    return (
        f"One attention layer per kind: {args.heads} heads, D={args.head_dim}, CSA top-k {args.index_topk}, "
        f"float32, random latents; errors relative to the largest output of the float64 oracle.\n" + table(rows, header)
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    limits = dict(
        window_size=args.window_size,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_chunk_size=args.prefill_chunk_size,
    )
    try:
        batch = PrefillBatch(args.seq_lens, args.query_lens, args.max_model_len, args.max_num_batched_tokens)
        print(plan_report(batch, limits))
        print()
        v41 = Schedule.from_name("V4.1")
        print(v41_report(batch, limits, v41))
        if not (batch.query_lens > v41.sliding_window).any():  # show replay on a batch of fresh prompts too
            fresh_limits = {**limits, "max_model_len": max(args.max_model_len, 2048), "max_num_batched_tokens": 4096}
            fresh = PrefillBatch(V41_SEQ_LENS, V41_QUERY_LENS, fresh_limits["max_model_len"], 4096)
            print()
            print(v41_report(fresh, fresh_limits, v41))
        if args.frameworks:
            print()
            print(attention_report(batch, limits, args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
