"""Per-step host cost: planning vs `build_step_metadata` (torch and JAX), side by side in one run.

    python -m bench.bench_step_metadata [--requests 256] [--max-model-len 1048576] [--tokens 8192]
                                        [--repeats 20] [--json out.json]

The step: `--requests` requests sharing `--tokens` new tokens (a full step) at random context
lengths up to `--max-model-len`, V4-Flash's layer kinds (SWA, CSA 4, HCA 128),
index_topk 512, W 128. Per framework, in alternating rounds of
BLOCK calls each (each sees the same machine state):

  plan_step        `planner.plan_step` of the step (all three kinds)
  torch metadata   `dsv4_torch.prefill_metadata.build_step_metadata(step, device="cpu")`
  jax metadata     `dsv4_jax.prefill_metadata.build_step_metadata(step)` (default device)

Host time: the call's wall time, median (and min) over rounds, untraced. With device="cpu" the
torch call's device work (if any) runs on the host too, so it is counted. Peak host memory: the
tracemalloc peak of one more call (NumPy and Python allocations; torch CPU tensors made by
`from_numpy` are NumPy memory), and the peak-RSS growth (VmHWM) of one call in a fresh process
per framework (after a warm-up call on a small step; catches allocations tracemalloc misses).
The machine may be shared: read the ratios, and rerun for absolute figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import subprocess
import sys
import time
import tracemalloc

import numpy as np

from planner import PlanConfig, PrefillBatch, plan_step
from planner.contract import ModelShape

INDEX_TOPK = 512
BLOCK = 5  # calls per framework per round
WINDOW = 128


def make_step(requests: int, max_model_len: int, tokens: int, seed: int = 0):
    """`requests` requests with `tokens` new tokens in all (a full step), contexts uniform up to
    max_model_len."""
    rng = np.random.default_rng(seed)
    qry = np.full(requests, tokens // requests, dtype=np.int64)
    qry[: tokens % requests] += 1
    seq = np.maximum(qry, rng.integers(1, max_model_len + 1, requests))
    cfg = PlanConfig(window_size=WINDOW, max_model_len=max_model_len, max_num_batched_tokens=tokens)
    layers = ModelShape.from_name("V4-Flash").layers
    return PrefillBatch(seq, qry), cfg, layers


def builders():
    """name -> f(step) for the frameworks that import here."""
    out = {}
    try:
        from dsv4_torch.prefill_metadata import build_step_metadata as torch_build

        out["torch"] = lambda step: torch_build(step, device="cpu", index_topk=INDEX_TOPK)
    except ImportError as e:  # pragma: no cover - a torch-free install
        print(f"torch: not measured ({e})")
    try:
        import jax

        from dsv4_jax.prefill_metadata import build_step_metadata as jax_build

        def run_jax(step):
            meta = jax_build(step, index_topk=INDEX_TOPK)
            return meta

        out["jax"] = run_jax
        jax.block_until_ready(jax.numpy.zeros(1))  # backend start-up outside the timings
    except ImportError as e:  # pragma: no cover
        print(f"jax: not measured ({e})")
    return out


def _timed(f, *args):
    t0 = time.perf_counter()
    out = f(*args)
    return out, time.perf_counter() - t0


def _traced_peak(f, *args) -> int:
    """Peak bytes tracemalloc sees during one call (a separate call: tracing slows allocations)."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    out = f(*args)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del out
    return peak


def _peak_rss_kib() -> int:
    """This process's peak RSS in KiB: VmHWM (reset by exec, unlike ru_maxrss, which Linux carries
    over from the parent), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def child(framework: str, requests: int, max_model_len: int, tokens: int) -> dict:
    """In a fresh process: peak-RSS growth (KiB) of one build, after a warm-up on a small step."""
    fns = builders()
    f = fns[framework]
    small_batch, small_cfg, layers = make_step(8, 4096, 256, seed=1)
    f(plan_step(small_batch, small_cfg, layers))
    batch, cfg, layers = make_step(requests, max_model_len, tokens)
    step = plan_step(batch, cfg, layers)
    before = _peak_rss_kib()
    meta = f(step)
    after = _peak_rss_kib()
    del meta
    return {"framework": framework, "rss_growth_kib": int(after - before)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=1 << 20)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=20, help="rounds")
    ap.add_argument("--block", type=int, default=BLOCK, help="calls per framework per round")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.requests, args.max_model_len, args.tokens)))
        return

    batch, cfg, layers = make_step(args.requests, args.max_model_len, args.tokens)
    step = plan_step(batch, cfg, layers)
    fns = builders()
    for f in fns.values():  # warm-up: imports, first-call caches
        f(step)
    times = {"plan_step": [], **{k: [] for k in fns}}
    calls = {
        "plan_step": lambda: plan_step(batch, cfg, layers),
        **{k: functools.partial(f, step) for k, f in fns.items()},
    }
    for _ in range(args.repeats):  # alternating blocks of BLOCK calls; one figure per call
        for name, f in calls.items():
            keep = []  # results live to the block's end: their frees are not timed
            for _ in range(args.block):
                out, dt = _timed(f)
                keep.append(out)
                times[name].append(dt)
            del keep
    peaks = {
        "plan_step": _traced_peak(plan_step, batch, cfg, layers),
        **{k: _traced_peak(f, step) for k, f in fns.items()},
    }
    rss = {}
    for name in fns:
        cmd = [
            sys.executable,
            "-m",
            "bench.bench_step_metadata",
            "--child",
            name,
            "--requests",
            str(args.requests),
            "--max-model-len",
            str(args.max_model_len),
            "--tokens",
            str(args.tokens),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rss[name] = json.loads(res.stdout.strip().splitlines()[-1])["rss_growth_kib"]

    chunks = {k.name: kp.num_chunks for k, kp in step.kinds.items()}
    rows_gathered = sum(kp.padding_free_rows for kp in step.kinds.values())
    print(
        f"step: {batch.num_requests} requests, {batch.num_tokens} tokens, contexts up to "
        f"{int(batch.seq_lens.max())} (max_model_len {args.max_model_len}), V4-Flash kinds; "
        f"chunks {chunks}; {rows_gathered} workspace rows gathered per layer set"
    )
    print(f"{'':16} {'median ms':>10} {'min ms':>9} {'tracemalloc peak MiB':>21} {'RSS growth MiB':>15}")
    results = {}
    for name, ts in times.items():
        label = name if name == "plan_step" else f"{name} metadata"
        med, lo = float(np.median(ts)) * 1e3, float(np.min(ts)) * 1e3
        mib = peaks[name] / 2**20
        r = rss.get(name)
        results[name] = dict(
            median_ms=round(med, 3),
            min_ms=round(lo, 3),
            tracemalloc_peak_mib=round(mib, 2),
            rss_growth_mib=None if r is None else round(r / 1024, 1),
        )
        rs = "" if r is None else f"{r / 1024:.1f}"
        print(f"{label:16} {med:10.3f} {lo:9.3f} {mib:21.2f} {rs:>15}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    requests=args.requests,
                    max_model_len=args.max_model_len,
                    tokens=args.tokens,
                    chunks=chunks,
                    results=results,
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
