"""DeepSeek-V4.1's two-level indexer top-k on CPU: level 1 (the candidate source) and level 2 (a later
index source) of our fused C kernel at long contexts, against the same run's matmul ceiling.

    python -m bench.bench_v41_indexer [--cases 4096@16K,4096@64K,4096@256K] [--repeats 1] [--json out.json]

One process, one shared input per case: V4.1 indexer shapes (32 heads of 128 dims, ratio 1: one
index key per position), keys written as vLLM's fp8 index pages (`dsv4_torch.index_cache`, 64
slots a page, pages shuffled), e4m3 queries and float32 weights; "N@C" = one request, N new tokens
ending a C-token context. Per case, all through `dsv4_torch.indexer.indexer_topk(backend="cpu")`:

- plain: the ordinary top-512 (every visible key scored: V4's kernel at ratio 1);
- level 1: the same call with `candidate_block_size=8, candidate_topk_blocks=2048`: the top-512
  and each token's candidate blocks (a running top-2048 of block maxima fed from the same
  logits). Its GEMM part is the logits, 2 H D x the visible entries of every token: GFLOP/s over
  the whole call (top-k and block selection included, so a lower bound of the GEMM part's) and
  its share of the matmul; "level 1 / plain" is what the block selection adds;
- level 2: `candidates=` level 1's rows: each token scores only its candidates' entries
  (min(visible, 2048 x 8 = 16,384)), so its time should stay flat beyond 16K; its GFLOP/s over
  those entries.

The ceiling: `bench.common.cpu_ceiling`, the matmul of the one dtype our kernels run as here
(float32 on an AVX2 machine, bf16 where they use AVX512-BF16), 2048^3 on the same threads, the
best of 5 calls before and after the cases, the better of the two; also in CPU time (GFLOP per CPU
second of the process's threads, times the threads: what a call reaches while it is not
descheduled; on a shared machine the CPU-time ratios are the steadier). Seconds: median of `--repeats`
(the first call of a case warms up when it is under `--warmup-gflop`). Peak: the call's resident
memory above the process's before it (Linux VmHWM). Check: level 2's rows lie inside their
candidates, and on `--check` sampled tokens the selected sets equal the torch reference backend's
(same candidates) up to near ties. The machine may be shared: read ratios side by side.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import time

import numpy as np

from planner.report import table

H, D, RATIO, PAGE, TOPK, BS, NB = 32, 128, 1, 64, 512, 8, 2048
DEFAULT_CASES = "4096@16K,4096@64K,4096@256K"


def parse_case(s: str) -> tuple[int, int]:
    """(new tokens, context) of an "N@C[K|M]" case."""
    m = re.fullmatch(r"(\d+)@(\d+)([KM]?)", s)
    if not m:
        raise SystemExit(f"--cases: cannot read {s!r} (expected N@C[K|M])")
    return int(m[1]), int(m[2]) * {"": 1, "K": 1024, "M": 1 << 20}[m[3]]


class Peak:
    """Peak resident memory of a call above the resident memory before it (Linux)."""

    def __enter__(self):
        self.ok = os.path.exists("/proc/self/clear_refs")
        if self.ok:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # resets VmHWM to the current RSS
            except OSError:
                self.ok = False
        self.base = self._read("VmRSS")
        return self

    def __exit__(self, *exc):
        self.mb = (self._read("VmHWM") - self.base) / 1024 if self.ok else float("nan")

    @staticmethod
    def _read(field: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        return 0


def make_case(n: int, ctx: int, seed: int = 0) -> dict:
    """Shuffled fp8 index pages (one key per position), block table, e4m3 q, weights and tokens."""
    import torch

    from dsv4_torch.index_cache import indexer_k_quant_and_cache

    g = torch.Generator().manual_seed(seed)
    m = ctx // RATIO
    pages = -(-m // PAGE)
    perm = torch.randperm(pages, generator=g).to(torch.int32)
    cache = torch.zeros((pages, PAGE, D + 4), dtype=torch.uint8)
    bt = perm[None].contiguous()
    for e0 in range(0, m, 1 << 16):  # in slices: the keys never exist whole in float32
        e = torch.arange(e0, min(m, e0 + (1 << 16)))
        keys = torch.randn((e.shape[0], D), generator=g)
        indexer_k_quant_and_cache(keys, cache, bt[0, e // PAGE].to(torch.int64) * PAGE + e % PAGE, D)
    q = (torch.randn((n, H, D), generator=g) * 8).clamp(-448, 448).to(torch.float8_e4m3fn)
    w = torch.rand((n, H), generator=g) * (H**-0.5 * D**-0.5)
    req = np.zeros(n, np.int64)
    pos = np.arange(ctx - n, ctx, dtype=np.int64)
    vis = (pos + 1) // RATIO
    return dict(cache=cache, bt=bt, q=q, w=w, req=req, pos=pos, flops=float(vis.sum()) * 2 * H * D,
                flops2=float(np.minimum(vis, NB * BS).sum()) * 2 * H * D)  # fmt: skip


def call(c, backend="cpu", **kw):
    from dsv4_torch.indexer import indexer_topk

    return indexer_topk(c["q"], c["w"], c["cache"], c["req"], c["pos"], RATIO, TOPK, block_table=c["bt"],
                        backend=backend, **kw)  # fmt: skip


def timed(fn, repeats, warmup):
    """(wall seconds, CPU seconds of the process (every thread's), peak MB, the last result):
    medians of `repeats` calls."""
    if warmup:
        fn()
    times, cpus, peaks, out = [], [], [], None
    for _ in range(repeats):
        with Peak() as p:
            t0, c0 = time.perf_counter(), time.process_time()
            out = fn()
            times.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        peaks.append(p.mb)
    return float(np.median(times)), float(np.median(cpus)), float(max(peaks)), out


def matmul_cpu_gflops(dtype: str, threads: int, repeats: int = 5, n: int = 2048) -> float:
    """The ceiling in CPU time: the best of `repeats` n^3 torch.matmul calls as GFLOP per CPU
    second of all `threads` threads, times `threads` (what the matmul reaches while it is not
    descheduled: on a shared machine the CPU-time ratios are the steadier ones)."""
    import torch

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
    a @ b
    best = min(_cpu_of(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best * threads / 1e9


def _cpu_of(fn) -> float:
    c0 = time.process_time()
    fn()
    return time.process_time() - c0


def check(c, blocks, idx2, sample: int) -> float:
    """Level 2's rows inside their candidates (every token; AssertionError otherwise), and the share
    of `sample` tokens whose sets equal the torch reference backend's on the same candidates."""
    import torch

    cand = blocks.numpy()
    got = idx2.numpy()
    for t in range(got.shape[0]):
        live = got[t][got[t] >= 0]
        if not np.isin(live // BS, cand[t]).all():
            raise AssertionError(f"level 2: token {t} selected entries outside its candidate blocks")
    if sample <= 0:
        return float("nan")
    rows = np.unique(np.linspace(0, got.shape[0] - 1, sample).astype(np.int64))
    sub = dict(c, q=c["q"][torch.from_numpy(rows)], w=c["w"][torch.from_numpy(rows)], req=c["req"][rows],
               pos=c["pos"][rows])  # fmt: skip
    ref = call(sub, "reference", candidates=cand[rows], candidate_block_size=BS).indices.numpy()
    same = [set(a[a >= 0].tolist()) == set(b[b >= 0].tolist()) for a, b in zip(ref, got[rows])]
    return float(np.mean(same))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=DEFAULT_CASES)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--plain-cases", default=None, help="cases that also time the plain top-k (default: every case)")
    ap.add_argument("--warmup-gflop", type=float, default=200.0, help="calls above this much work skip the warm-up")
    ap.add_argument("--check", type=int, default=8, help="tokens checked against the reference backend (0: none)")
    ap.add_argument("--threads", type=int, default=None, help="torch's threads")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    import torch

    from bench.common import cpu_ceiling, describe_ceiling
    from dsv4_cpu import binding

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    top = cpu_ceiling(threads)
    top["cpu_gflops"] = matmul_cpu_gflops(top["dtype"], threads)
    isa = binding.kernel_isas().get("indexer fp8")
    print(f"the ceiling: {describe_ceiling(top)}; threads {threads}; the indexer's fp8 kernel: {isa}", flush=True)
    rows = []
    for name in args.cases.split(","):
        n, ctx = parse_case(name)
        c = make_case(n, ctx)
        warm1 = c["flops"] / 1e9 <= args.warmup_gflop
        warm2 = c["flops2"] / 1e9 <= args.warmup_gflop
        plain = args.plain_cases is None or name in args.plain_cases.split(",")
        pt, pc, pm, r0 = timed(functools.partial(call, c), args.repeats, warm1) if plain else (None,) * 4
        l1 = functools.partial(call, c, candidate_block_size=BS, candidate_topk_blocks=NB)
        t1, c1, m1, r1 = timed(l1, args.repeats, warm1)
        l2 = functools.partial(call, c, candidates=r1.candidates, candidate_block_size=BS)
        t2, c2, m2, r2 = timed(l2, args.repeats, warm2)
        row = dict(
            case=name, tokens=n, context=ctx, gflop=c["flops"] / 1e9, gflop2=c["flops2"] / 1e9,
            plain_s=pt, plain_peak_mb=pm, level1_s=t1, level1_peak_mb=m1, level2_s=t2, level2_peak_mb=m2,
            level1_gflops=c["flops"] / t1 / 1e9, level2_gflops=c["flops2"] / t2 / 1e9,
            plain_cpu_s=pc, level1_cpu_s=c1, level2_cpu_s=c2,
            level1_cpu_gflops=c["flops"] / c1 * threads / 1e9, level2_cpu_gflops=c["flops2"] / c2 * threads / 1e9,
            level1_topk_equal=None if r0 is None else bool((r1.indices == r0.indices).all()),  # the plain one
            checked_same=check(c, r1.candidates, r2.indices, args.check),
        )  # fmt: skip
        rows.append(row)
        print(row, flush=True)
        c = r0 = r1 = r2 = None  # (frees the case before the next)

    end = cpu_ceiling(threads)
    end_cpu = matmul_cpu_gflops(top["dtype"], threads)
    print(
        f"after the cases: {describe_ceiling(end)}; in CPU time {top['cpu_gflops']:.0f} before, {end_cpu:.0f} after; "
        "ratios use the better of the two runs",
        flush=True,
    )
    top["gflops"] = max(top["gflops"], end["gflops"])
    top["cpu_gflops"] = max(top["cpu_gflops"], end_cpu)
    for r in rows:
        r["level1_of_matmul"] = r["level1_gflops"] / top["gflops"]
        r["level2_of_matmul"] = r["level2_gflops"] / top["gflops"]
        r["level1_cpu_of_matmul"] = r["level1_cpu_gflops"] / top["cpu_gflops"]
        r["level2_cpu_of_matmul"] = r["level2_cpu_gflops"] / top["cpu_gflops"]
    print(
        f"\nV4.1 two-level indexer, H={H}, D={D}, ratio {RATIO}, fp8 pages of {PAGE}, top-{TOPK}, "
        f"{NB} blocks of {BS} (median of {args.repeats}; ceiling {top['dtype']} matmul {top['gflops']:.0f} GFLOP/s, "
        f"{top['cpu_gflops']:.0f} in CPU time):"
    )
    print(
        table(
            [
                [r["case"], f"{r['gflop']:.0f}", "-" if r["plain_s"] is None else f"{r['plain_s']:.2f}",
                 f"{r['level1_s']:.2f}",
                 "-" if r["plain_s"] is None else f"{r['level1_cpu_s'] / r['plain_cpu_s']:.2f}",
                 f"{r['level1_gflops']:.1f}",
                 f"{r['level1_of_matmul']:.0%} / {r['level1_cpu_of_matmul']:.0%}",
                 f"{r['level2_s']:.2f} / {r['level2_cpu_s']:.2f}", f"{r['level2_gflops']:.1f}",
                 f"{r['level2_of_matmul']:.0%} / {r['level2_cpu_of_matmul']:.0%}",
                 f"{r['level1_peak_mb']:.0f} / {r['level2_peak_mb']:.0f}", f"{r['checked_same']:.2f}"]
                for r in rows
            ],
            ["case", "L1 GFLOP", "plain s", "level 1 s", "L1 / plain (CPU s)", "L1 GFLOP/s",
             f"L1 of {top['dtype']} mm (wall / CPU)", "level 2 s (wall / CPU)", "L2 GFLOP/s",
             f"L2 of {top['dtype']} mm (wall / CPU)", "peak MB L1 / L2", "L2 = reference"],
        )
    )  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(ceiling=top, threads=threads, isa=isa, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
