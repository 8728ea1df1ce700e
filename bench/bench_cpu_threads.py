"""The CPU kernel between torch ops, as in a serving step: on torch's own threads vs a pool of its own.

A serving engine's step alternates torch ops (GEMMs on torch's OpenMP threads, which keep
spinning for a while after each op) with our attention kernel. Before the kernel ran on torch's
threads, it ran on a pool of its own, and the two sets of threads fought for the cores. This
script times that loop, in one process and interleaved, three ways:

- `torch threads`: the kernel on `at::parallel_for` (what `dsv4_torch.kernels.cpu` does now);
- `own pool`: the same kernel on the library's own pool, beside torch's OpenMP threads (the old way);
- `1 thread`: the kernel on the calling thread only (no contention, no parallelism).

Each iteration: one fp32 GEMM of the step's tokens (T x 2048 by 2048 x 2048, an MLP-sized op),
then one prefill layer of the kernel (SWA, H 64, D 512, bf16 rows, window 128); medians over
repeats, the GEMM and the kernel timed separately inside the loop. With default OpenMP settings
(OMP_WAIT_POLICY unset) the own pool's threads wait behind torch's spinning workers.

    python -m bench.bench_cpu_threads [--tokens 512] [--repeats 9]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import numpy as np


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--iters", type=int, default=4, help="GEMM + kernel pairs per timed repeat")
    args = ap.parse_args(argv)

    import torch

    from dsv4_cpu import binding
    from dsv4_torch import prefill as TP
    from dsv4_torch.kernels.cpu import attention as TC
    from dsv4_torch.kernels.cpu import library as TL

    T, H, D, W = args.tokens, args.heads, 512, 128
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    rows = torch.randn(T + W, D, generator=g).to(torch.bfloat16)
    raw = TP.LogicalKV(rows, torch.tensor([0]))
    tokens = np.stack([np.arange(T), np.zeros(T), W + np.arange(T)]).astype(np.int32)
    a = torch.randn(T, 2048, generator=g)
    b = torch.randn(2048, 2048, generator=g)
    out = torch.empty(T, H, D, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    run_torch = TL.runner()  # at::parallel_for
    modes = {
        "torch threads": binding.parallel(threads, run_torch),
        "own pool": binding.parallel(threads),
        "1 thread": binding.parallel(1),
    }
    lib = binding.library()
    keep: list = []
    src = TC._kv_source(raw, "raw_kv", q, keep)
    tk = binding.PrefillTokens(
        0, W, 1, T, tokens[0].ctypes.data, tokens[1].ctypes.data, tokens[2].ctypes.data, None, 0, 0, 0, 0
    )
    outs = binding.Outputs(out.data_ptr(), out.stride(0), out.stride(1), None, None, 0)

    def kernel(par):
        rc = lib.dsv4_prefill_attention(
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            binding.BF16,
            T,
            H,
            D,
            ctypes.byref(tk),
            ctypes.byref(src),
            None,
            0.04,
            None,
            ctypes.byref(outs),
            ctypes.byref(par),
            -1,
        )
        binding.check(rc)

    def step(par):
        gemm = kern = 0.0
        for _ in range(args.iters):
            t0 = time.perf_counter()
            torch.mm(a, b)
            t1 = time.perf_counter()
            kernel(par)
            t2 = time.perf_counter()
            gemm += t1 - t0
            kern += t2 - t1
        return gemm, kern

    for par in modes.values():  # warm-up: pools started, scratch allocated
        step(par)
    seen = {name: [] for name in modes}
    for _ in range(args.repeats):  # interleaved, so a noisy moment hits every mode
        for name, par in modes.items():
            seen[name].append(step(par))
    flop = 2.0 * T * min(W, T) * H * (D + D)
    print(
        f"# {args.iters} x (fp32 GEMM {T}x2048x2048 + SWA prefill layer T={T} H={H} D={D} W={W}) per repeat; "
        f"torch threads {threads}; OMP_WAIT_POLICY default; medians of {args.repeats}"
    )
    print("| kernel runs on | step ms | GEMM ms | kernel ms | kernel GFLOP/s |")
    print("|---|---:|---:|---:|---:|")
    for name, runs in seen.items():
        gemm = statistics.median(r[0] for r in runs) / args.iters
        kern = statistics.median(r[1] for r in runs) / args.iters
        print(f"| {name} | {(gemm + kern) * 1e3:.1f} | {gemm * 1e3:.1f} | {kern * 1e3:.1f} | {flop / kern / 1e9:.0f} |")


if __name__ == "__main__":
    main()
