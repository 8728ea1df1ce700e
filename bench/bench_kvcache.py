"""CPU throughput of the fp8_ds_mla gather-dequantize, beside a plain copy of the same bytes.

    python -m bench.bench_kvcache [--rows 65536] [--requests 4] [--block-size 64] [--reps 7]
    python -m bench.bench_kvcache --record mxfp8 [--layout interleaved|split]   (DeepSeek-V4.1's 528 B records)

Each request holds `rows / requests` slots on pages in random order; one call gathers all of
them (gather_lens = None, offset 0) into a bf16 workspace. Throughput is cache bytes read
(584 per row: 576 data + 8 scale bytes) per second. The copy baseline copies the same number of
bytes, one contiguous buffer to another (torch `copy_`, i.e. memcpy); its ratio is the figure
the issue targets (>= 50%). A gather also writes 1024 bytes per row (the bf16 row), so moving
bytes at the copy's speed would give 2 * 584 / (584 + 1024) = 73% of it.

`--record mxfp8`: the same on DeepSeek-V4.1's 528-byte records (`planner.kvcache_v41`; pages
(num_pages, S, 528) in `--layout`), through `dsv4_torch.kvcache_v41` / `dsv4_jax.kvcache_v41`
(528 bytes read per row: the ceiling is 2 * 528 / (528 + 1024) = 68% of the copy).

Timings interleave the contenders rep by rep (each after a 10 ms pause, so the previous one's
spinning worker threads are idle) and report the median and the best rep, so a shared
machine's noise hits them alike. `cpu` columns: process CPU time, all threads. GPU figures: bench/checks/gpu_kvcache.py.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from planner import kvcache as P

SLOT_BYTES = P.SLOT_DATA_BYTES + P.SLOT_SCALE_BYTES
# idle time before each timed call: the previous contender's worker threads (OpenMP's, XLA's)
# spin for a while after their work ends and would steal the cores from the next one
SETTLE_S = 0.01


def workload(rows: int, requests: int, S: int, seed: int = 0):
    """Pages written by the reference from random bf16 rows; block tables in random page order."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    per = rows // requests
    blocks = -(-per // S)
    nb = blocks * requests
    cache = np.zeros((nb, P.page_bytes(S)), np.uint8)
    k = rng.standard_normal((min(nb * S, 8192), 512)) * rng.choice([0.01, 1, 30], (min(nb * S, 8192), 1))
    k = k.astype(ml_dtypes.bfloat16).astype(np.float32)
    for start in range(0, nb * S, k.shape[0]):  # the same rows over and over: realistic bytes, cheap to write
        n = min(k.shape[0], nb * S - start)
        P.quantize_and_insert_k_cache(k[:n], cache, np.arange(start, start + n), S)
    perm = rng.permutation(nb).astype(np.int32)
    block_table = perm.reshape(requests, blocks)
    seq_lens = np.full(requests, per, np.int32)
    return cache, seq_lens, block_table


def workload_v41(rows: int, requests: int, S: int, layout: str, seed: int = 0):
    """`workload` on DeepSeek-V4.1's mxfp8 pages (num_pages, S, 528) in `layout`."""
    import ml_dtypes

    from planner import kvcache_v41 as V

    rng = np.random.default_rng(seed)
    per = rows // requests
    blocks = -(-per // S)
    nb = blocks * requests
    cache = np.zeros((nb, S, 528), np.uint8)
    n = min(nb * S, 8192)
    k = rng.standard_normal((n, 512)) * rng.choice([0.01, 1, 30], (n, 1))
    k = k.astype(ml_dtypes.bfloat16).astype(np.float32)
    for start in range(0, nb * S, n):
        m = min(n, nb * S - start)
        V.quantize_and_insert_k_cache(k[:m], cache, np.arange(start, start + m), layout=layout)
    perm = rng.permutation(nb).astype(np.int32)
    return cache, np.full(requests, per, np.int32), perm.reshape(requests, blocks)


def _time(fns: dict, reps: int) -> tuple[dict, dict]:
    """Wall and process-CPU seconds per rep (CPU time, all threads: what a shared machine's
    waiting does not inflate)."""
    wall = {name: [] for name in fns}
    cpu = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up (and JAX compilation)
    for _ in range(reps):
        for name, fn in fns.items():
            time.sleep(SETTLE_S)
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return wall, cpu


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=65536, help="rows gathered per call, all requests together")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=64, help="slots per page S (64: window/CSA caches, 2: HCA)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--frameworks", default="torch,jax")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--record", choices=("fp8_ds_mla", "mxfp8"), default="fp8_ds_mla", help="mxfp8: V4.1's 528 B")
    ap.add_argument("--layout", choices=("interleaved", "split"), default="interleaved", help="mxfp8 pages' layout")
    args = ap.parse_args(argv)
    S, R = args.block_size, args.requests
    v41 = args.record == "mxfp8"
    if v41:
        cache, seq_lens, block_table = workload_v41(args.rows, R, S, args.layout)
    else:
        cache, seq_lens, block_table = workload(args.rows, R, S)
    per = int(seq_lens[0])
    n_rows = per * R
    read = n_rows * (528 if v41 else SLOT_BYTES)
    fns = {}
    frameworks = [f for f in args.frameworks.split(",") if f]

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    src = torch.randint(0, 256, (read,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    fns["copy (torch copy_)"] = lambda: dst.copy_(src)

    if v41:
        fns.update(_v41_contenders(frameworks, cache, seq_lens, block_table, S, R, per, args.layout))
    if "torch" in frameworks and not v41:
        from dsv4_torch import kvcache as TK

        t_cache, t_seq, t_bt = torch.from_numpy(cache), torch.from_numpy(seq_lens), torch.from_numpy(block_table)
        t_out = torch.empty((R, per, 512), dtype=torch.bfloat16)
        fns["torch reference"] = lambda: TK.dequantize_and_gather_k_cache(
            t_out, t_cache, t_seq, None, t_bt, S, 0, backend="reference", validate=False
        )
        if TK.resolve_backend("auto", t_cache) == "cpu":
            fns["torch cpu (C kernel)"] = lambda: TK.dequantize_and_gather_k_cache(
                t_out, t_cache, t_seq, None, t_bt, S, 0, backend="cpu", validate=False
            )
        else:
            print(f"torch cpu (C kernel): skipped, {TK.cpu_unavailable_reason()}")
    if "jax" in frameworks and not v41:
        import jax
        import jax.numpy as jnp

        from dsv4_jax import kvcache as JK

        j_cache, j_seq, j_bt = jnp.asarray(cache), jnp.asarray(seq_lens), jnp.asarray(block_table)
        j_out = jnp.zeros((R, per, 512), jnp.bfloat16)
        gather = jax.jit(
            lambda o, c, s, b: JK.dequantize_and_gather_k_cache(o, c, s, None, b, S, 0, backend="xla"),
            donate_argnums=0,
        )
        state = {"out": j_out}

        def run_jax():
            state["out"] = gather(state["out"], j_cache, j_seq, j_bt)
            state["out"].block_until_ready()

        fns["jax xla"] = run_jax
        if JK.resolve_backend("auto", j_cache) == "cpu":
            gather_c = jax.jit(
                lambda o, c, s, b: JK.dequantize_and_gather_k_cache(o, c, s, None, b, S, 0, backend="cpu"),
                donate_argnums=0,
            )
            state_c = {"out": jnp.zeros((R, per, 512), jnp.bfloat16)}

            def run_jax_c():
                state_c["out"] = gather_c(state_c["out"], j_cache, j_seq, j_bt)
                state_c["out"].block_until_ready()

            fns["jax cpu (C kernel, FFI)"] = run_jax_c
        else:
            from dsv4_jax.kernels.cpu import library as JC

            print(f"jax cpu (C kernel, FFI): skipped, {JC.unavailable_reason()}")

    print(
        f"gather-dequantize {args.record}{f' ({args.layout})' if v41 else ''} {n_rows} rows ({R} requests x {per}, "
        f"S = {S}): {read / 1e6:.1f} MB of cache read, "
        f"{n_rows * 1024 / 1e6:.1f} MB of bf16 written; torch threads {torch.get_num_threads()}"
    )
    times, cpu = _time(fns, args.reps)
    copy_med = statistics.median(times["copy (torch copy_)"])
    copy_cpu = statistics.median(cpu["copy (torch copy_)"])
    print(
        f"{'':26s} {'median ms':>10s} {'best ms':>9s} {'GB/s read':>10s} {'vs copy':>8s} {'cpu ms':>9s} {'cpu vs copy':>12s}"
    )
    for name, ts in times.items():
        med, best, c = statistics.median(ts), min(ts), statistics.median(cpu[name])
        print(
            f"{name:26s} {med * 1e3:10.2f} {best * 1e3:9.2f} {read / med / 1e9:10.2f} {copy_med / med:8.0%} "
            f"{c * 1e3:9.2f} {copy_cpu / c:12.0%}"
        )
    return times


def _v41_contenders(frameworks, cache, seq_lens, block_table, S, R, per, layout) -> dict:
    """The V4.1 gathers (`kvcache_v41`): torch reference / cpu, JAX xla / cpu, each where it runs."""
    fns = {}
    if "torch" in frameworks:
        import torch

        from dsv4_torch import kvcache_v41 as TV

        t_cache, t_seq, t_bt = torch.from_numpy(cache), torch.from_numpy(seq_lens), torch.from_numpy(block_table)
        t_out = torch.empty((R, per, 512), dtype=torch.bfloat16)
        for name, backend in (("torch reference", "reference"), ("torch cpu (C kernel)", "cpu")):
            if backend == "cpu" and TV.resolve_backend("auto", t_cache, "gather_mxfp8") != "cpu":
                print("torch cpu (C kernel): skipped, the C library does not build here")
                continue
            fns[name] = lambda b=backend: TV.dequantize_and_gather_k_cache(
                t_out, t_cache, t_seq, None, t_bt, S, 0, layout=layout, backend=b, validate=False
            )
    if "jax" in frameworks:
        import jax
        import jax.numpy as jnp

        from dsv4_jax import kvcache_v41 as JV

        j_cache, j_seq, j_bt = jnp.asarray(cache), jnp.asarray(seq_lens), jnp.asarray(block_table)
        for name, backend in (("jax xla", "xla"), ("jax cpu (C kernel, FFI)", "cpu")):
            if backend == "cpu" and JV.resolve_backend("auto", j_cache, op="gather_mxfp8") != "cpu":
                print("jax cpu (C kernel, FFI): skipped, the C library does not build here")
                continue
            gather = jax.jit(
                lambda o, c, s, b, backend=backend: JV.dequantize_and_gather_k_cache(
                    o, c, s, None, b, S, 0, layout=layout, backend=backend
                ),
                donate_argnums=0,
            )
            state = {"out": jnp.zeros((R, per, 512), jnp.bfloat16)}

            def run(gather=gather, state=state):
                state["out"] = gather(state["out"], j_cache, j_seq, j_bt)
                state["out"].block_until_ready()

            fns[name] = run
    return fns


if __name__ == "__main__":
    main()
