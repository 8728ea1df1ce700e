"""JAX prefill benchmark on CPU: tokens/s per plan, compiles, and bucket padding waste.

    python -m bench.bench_jax_prefill [--scale 0.125] [--heads 16] [--dim 128]
        [--repeats 7] [--kinds SWA,CSA,HCA] [--workloads NAME,...] [--stream 500] [--stream-only]
        [--json out.json]

Part 1: for each named workload of `bench.common.workloads` (lengths scaled by --scale so a CPU
finishes), each layer kind and each plan (adaptive / fixed / per_request), one
`dsv4_jax.prefill.prefill_attention` layer call on the xla backend: the first call's extra
time (trace + compile), the median steady-state time (the three plans timed round-robin),
prefill tokens/s, and what the buckets
and tile ladders pad (tokens: bucketed / real and attended / real; rows: gathered / real and the
bucketed workspace / the largest chunk). Then the Pallas kernel in interpret mode on the
smallest workload (much slower by nature; it checks the path, not speed). Ratios within one
run are what to read; the machine is noisy.

Part 2: a random stream of batches (host only), for each `sizes` mode: aggregate padding
waste (tokens, workspace rows, HCA index width), and how many distinct compiled programs the
stream needs (per layer kind, and for a model jitted whole: all kinds' keys together) versus
distinct exact shapes. `--stream-only` runs just this part (seconds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import time_interleaved, workloads
from dsv4_jax import prefill as JP
from planner import V4_LAYERS, LayerKind, PlanConfig, PrefillBatch
from planner.report import table as _table
from planner.sizes import pow2_bucket

POLICIES = ("adaptive", "fixed", "per_request")
TOPK = 512  # V4-Flash


def table(rows: list[dict]) -> str:
    return _table([list(r.values()) for r in rows], list(rows[0]))


def make_inputs(batch: PrefillBatch, padded_tokens: int, H: int, D: int, rng):
    """Random q, logical caches (compressed ones per kind, at V4.0's ratios: what the metadata plans)
    and valid top-k rows for one batch."""
    ratio = {s.kind: s.compress_ratio for s in V4_LAYERS}
    raw = JP.LogicalKV.from_list([rng.standard_normal((s, D), dtype=np.float32) for s in batch.seq_lens.tolist()])
    comps = {
        k: JP.LogicalKV.from_list(
            [rng.standard_normal((s // ratio[k], D), dtype=np.float32) for s in batch.seq_lens.tolist()]
        )
        for k in (LayerKind.CSA, LayerKind.HCA)
    }
    q = rng.standard_normal((padded_tokens, H, D), dtype=np.float32)
    visible = (batch.token_position.astype(np.int64) + 1) // ratio[LayerKind.CSA]
    topk = (rng.random((padded_tokens, TOPK)) * np.pad(visible, (0, padded_tokens - visible.shape[0]))[:, None]).astype(
        np.int32
    )
    topk[
        np.arange(TOPK)[None, :] >= np.pad(np.minimum(visible, TOPK), (0, padded_tokens - visible.shape[0]))[:, None]
    ] = -1
    sink = rng.standard_normal(H).astype(np.float32)
    return jnp.asarray(q), raw, comps, jnp.asarray(topk), jnp.asarray(sink)


def layer_call(q, meta, raw, comp, topk, sink, backend: str, interpret=False):
    D = q.shape[2]
    return lambda: JP.prefill_attention(
        q, meta, raw, comp, sm_scale=D**-0.5, attn_sink=sink, topk_indices=topk, backend=backend, interpret=interpret
    ).block_until_ready()


# The backends of the Pallas comparison: (label, backend, interpret).
PALLAS_PAIR = (("xla", "xla", False), ("triton (interpreted)", "triton", True))


def layer_rows(args, names, kinds) -> list[dict]:
    rows = []
    rng = np.random.default_rng(0)
    for name, (seq, qry, limits) in workloads(scale=args.scale).items():
        if names and name not in names:
            continue
        batch = PrefillBatch(seq, qry)
        cfg = PlanConfig(**limits)
        metas = {p: JP.build_step_metadata(batch, config=cfg, policy=p, index_topk=TOPK) for p in POLICIES}
        q, raw, comps, topk, sink = make_inputs(batch, metas["adaptive"].padded_tokens, args.heads, args.dim, rng)
        for kind in kinds:
            calls = {p: layer_call(q, metas[p][kind], raw, comps.get(kind), topk, sink, "xla") for p in POLICIES}
            timed = time_interleaved(calls, args.repeats)
            for policy in POLICIES:
                meta = metas[policy][kind]
                compile_s, steady = timed[policy]
                pad = meta.padding()
                rows.append(
                    dict(
                        workload=name,
                        kind=kind.name,
                        plan=policy,
                        chunks=meta.plan.num_chunks,
                        T=pad["tokens"],
                        T_pad=pad["padded_tokens"],
                        attended=round(pad["attended_tokens"] / max(1, pad["tokens"]), 3),
                        rows_x=round(pad["gathered_rows"] / max(1, pad["rows"]), 3),
                        ws_rows=pad["workspace_rows"],
                        ws_x=round(pad["workspace_rows"] / max(1, pad["max_chunk_rows"]), 3),
                        compile_s=round(compile_s, 2),
                        ms=round(steady * 1e3, 1),
                        tok_per_s=round(pad["tokens"] / steady),
                        vs_adaptive=round(timed["adaptive"][1] / steady, 2),
                    )
                )
            print(
                f"  {name} {kind.name}: " + ", ".join(f"{r['plan']} {r['ms']} ms" for r in rows[-3:]),
                file=sys.stderr,
                flush=True,
            )
    print(table(rows))
    return rows


def pallas_rows(args) -> list[dict]:
    """Pallas in interpret mode on the smallest workload, SWA and CSA, adaptive plan."""
    seq, qry, limits = workloads(scale=args.scale)["spec-example"]
    batch = PrefillBatch(seq, qry)
    meta = JP.build_step_metadata(batch, config=PlanConfig(**limits), index_topk=TOPK)
    q, raw, comps, topk, sink = make_inputs(batch, meta.padded_tokens, args.heads, args.dim, np.random.default_rng(1))
    rows = []
    for kind in (LayerKind.SWA, LayerKind.CSA):
        m = meta[kind]
        outs = {}
        timed = time_interleaved(
            {label: layer_call(q, m, raw, comps.get(kind), topk, sink, b, i) for label, b, i in PALLAS_PAIR}, 3
        )
        for label, backend, interpret in PALLAS_PAIR:
            compile_s, steady = timed[label]
            outs[label] = np.asarray(
                JP.prefill_attention(
                    q,
                    m,
                    raw,
                    comps.get(kind),
                    sm_scale=args.dim**-0.5,
                    attn_sink=sink,
                    topk_indices=topk,
                    backend=backend,
                    interpret=interpret,
                )
            )
            rows.append(
                dict(
                    workload="spec-example",
                    kind=kind.name,
                    backend=label,
                    T=batch.num_tokens,
                    compile_s=round(compile_s, 2),
                    ms=round(steady * 1e3, 1),
                    tok_per_s=round(batch.num_tokens / steady),
                )
            )
        err = np.abs(outs[PALLAS_PAIR[1][0]] - outs["xla"]).max() / np.abs(outs["xla"]).max()
        rows[-1]["max_rel_diff_vs_xla"] = rows[-2]["max_rel_diff_vs_xla"] = f"{err:.1e}"
    return rows


STREAM_MODES = [(sizes, "fine") for sizes in JP.SIZES] + [("bucket", "pow2")]


def stream_report(num_batches: int, seed: int = 1) -> list[dict]:
    """Padding waste and distinct programs over a random stream of batches (V4-Flash kinds).

    Per `sizes` mode of `build_step_metadata` (and, last, the default sizes with tokens padded
    to powers of two by the caller, as `DeepseekV4(token_buckets="pow2")` does): distinct static
    keys per kind (each is one compilation of the layer call) and, for a model jitted whole,
    distinct (tokens, every kind's key) combinations, beside the distinct exact shapes an
    unbucketed design would compile for.
    """
    cfg = PlanConfig(window_size=128, max_model_len=65536, max_num_batched_tokens=8192)
    out = []
    for sizes, tokens in STREAM_MODES:
        rng = np.random.default_rng(seed)
        totals, keys, models, exact, per_batch = {}, set(), set(), set(), []
        for _ in range(num_batches):
            n = int(rng.integers(1, 33))
            qry = np.exp(rng.uniform(0, np.log(4096), n)).astype(np.int64)
            qry[rng.random(n) < 0.1] = 0  # KV-transfer loads
            qry = (qry * min(1.0, 8192 / max(1, qry.sum()))).astype(np.int64)
            seq = qry + np.exp(rng.uniform(0, np.log(60000), n)).astype(np.int64)
            policy = str(rng.choice(POLICIES))
            batch = PrefillBatch(seq, qry)
            padded = pow2_bucket(batch.num_tokens, 16) if tokens == "pow2" else None
            smeta = JP.build_step_metadata(
                batch, config=cfg, policy=policy, index_topk=TOPK, sizes=sizes, padded_tokens=padded
            )
            for kind, meta in smeta.kinds.items():
                pad = meta.padding()
                for k, v in pad.items():
                    totals[k] = totals.get(k, 0) + v
                if kind is LayerKind.HCA:  # the only width that varies (CSA's and SWA's are fixed)
                    for k in ("needed_width", "index_width"):
                        totals["hca_" + k] = totals.get("hca_" + k, 0) + pad[k]
                if pad["tokens"]:
                    per_batch.append(pad["attended_tokens"] / pad["tokens"])
                keys.add(meta.shape)
                exact.add((kind, pad["tokens"], pad["max_chunk_rows"], int(seq.max())))
            models.add(tuple(m.shape for m in smeta.kinds.values()))
        out.append(
            dict(
                sizes=sizes,
                tokens=tokens,
                batches=num_batches,
                padded_tokens_x=round(totals["padded_tokens"] / totals["tokens"], 3),
                attended_tokens_x=round(totals["attended_tokens"] / totals["tokens"], 3),
                worst_batch_attended_x=round(max(per_batch), 2),
                gathered_rows_x=round(totals["gathered_rows"] / totals["rows"], 3),
                workspace_rows_x=round(totals["workspace_rows"] / totals["max_chunk_rows"], 3),
                hca_width_x=round(totals["hca_index_width"] / totals["hca_needed_width"], 3),
                layer_programs=len(keys),
                model_programs=len(models),
                exact_shapes=len(exact),
            )
        )
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=0.125)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--kinds", default="SWA,CSA,HCA")
    ap.add_argument("--workloads", default="", help="comma-separated names (default: all)")
    ap.add_argument("--stream", type=int, default=500, help="random batches for the padding report")
    ap.add_argument("--no-pallas", action="store_true")
    ap.add_argument("--stream-only", action="store_true", help="part 2 only (host only, seconds)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    kinds = [LayerKind[k] for k in args.kinds.split(",") if k]
    names = [n for n in args.workloads.split(",") if n]
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; H={args.heads} D={args.dim} scale={args.scale}\n")

    result = {}
    if not args.stream_only:
        cache0 = JP._prefill_jit._cache_size()
        t0 = time.perf_counter()
        rows = layer_rows(args, names, kinds)
        compiles = JP._prefill_jit._cache_size() - cache0
        keys = len({(r["workload"], r["kind"], r["plan"]) for r in rows})
        print(
            f"\nlayer calls: {len(rows)} configurations, {compiles} compilations, "
            f"{sum(r['compile_s'] for r in rows):.1f} s compiling, {time.perf_counter() - t0:.0f} s in all"
        )
        result = dict(layers=rows, compilations=compiles, configurations=keys)
    if not args.no_pallas and not args.stream_only:
        print("\nPallas kernel, interpret mode (CPU), vs the xla backend:")
        result["pallas"] = pallas_rows(args)
        print(table(result["pallas"]))
    print(f"\nRandom stream (V4-Flash kinds, W=128, topk={TOPK}, max_num_batched_tokens=8192):")
    result["stream"] = stream_report(args.stream)
    print(table(result["stream"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
