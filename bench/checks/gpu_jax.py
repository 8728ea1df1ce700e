"""One-shot GPU check of the JAX path (H100/H200, about --budget seconds plus one compile).

For V4-Flash (H=64, width 640) and V4-Pro (H=128, width 1152), D=512, T=4096, S=65536, bf16:
  1. the Pallas kernel compiled by Triton against the fp32 xla reference on the GPU (all tokens,
     FlashMLA's tolerance) and against the float64 oracle on a few tokens;
  2. its run time and TFLOPS (FlashMLA's convention: 2 * valid indices * H * (512 + 512) / time)
     for the default tiling and a few alternatives (pick the fastest for default_tuning);
  3. the Mosaic GPU kernel (backend "mosaic_gpu", jax >= 0.12, SM90) against the xla reference,
     its compile time, run time and TFLOPS, before the Pallas alternatives (so the budget never
     skips it);
  4. FlashMLA on the same data when `flash_mla` and a CUDA torch are importable.
Every section is guarded: a failure prints and the script carries on. Without an NVIDIA GPU it
says so and exits 0. The summary prints each kernel's TFLOPS beside FlashMLA's published 640.

  python -m bench.checks.gpu_jax [--budget 80]
  python -m bench.checks.gpu_jax --dry-run   # the same steps on CPU: T=8, interpret (the Mosaic
                                            # kernel: 1 token, jax >= 0.12); or DSV4_GPU_CHECK_DRY_RUN=1
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

from bench.common import FLASHMLA_PUBLISHED_TFLOPS, TFLOPS_CONVENTION, median_seconds, random_sparse_inputs, tflops

START = time.time()
# Stop starting new timings after this many seconds (`--budget N`; bench.gpu_check passes its share).
BUDGET_S = 80.0

SHAPES = [("V4-Flash", 4096, 64, 512, 65536, 640), ("V4-Pro", 4096, 128, 512, 65536, 1152)]
# Dry run: every step on CPU with the Pallas interpreter and 8 tokens, to test this script.
DRY_RUN = bool(os.environ.get("DSV4_GPU_CHECK_DRY_RUN"))


def _dry_run_shapes():
    global SHAPES
    SHAPES = [(name, 8, H, D, 4096, K) for name, _, H, D, _, K in SHAPES]


if DRY_RUN:
    _dry_run_shapes()
# The tilings timed: dsv4_jax.kernels.triton.attention.ALTERNATIVE_TILINGS ((block_h, block_k, block_dv,
# num_warps, num_stages); None = default_tuning's GPU tiling, used explicitly so a dry run on CPU
# exercises the very tiling a GPU runs).
FLASHMLA_TOL = dict(abs=8e-4, rel=3 / 128)


def section(title):
    print(f"\n== {title} ({time.time() - START:.0f}s)", flush=True)


def guarded(fn):
    try:
        return fn()
    except Exception:
        traceback.print_exc(limit=4)
        print("   -> section FAILED, continuing", flush=True)
        return None


def main(argv=None):
    global BUDGET_S, DRY_RUN
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="stop starting new timings after this many seconds")
    ap.add_argument("--dry-run", action="store_true", help="every step on CPU: Pallas interpreter, 8 tokens")
    args = ap.parse_args(argv)
    BUDGET_S = args.budget
    if args.dry_run and not DRY_RUN:
        DRY_RUN = True
        _dry_run_shapes()
    try:
        import jax
        import jax.numpy as jnp
        import numpy as np

        import dsv4_jax
        from dsv4_jax.kernels.triton.attention import ALTERNATIVE_TILINGS, default_tuning, sparse_attention_pallas
        from dsv4_jax.kernels.xla.attention import sparse_attention_xla
    except Exception as e:  # noqa: BLE001
        print(f"cannot import the JAX path: {type(e).__name__}: {e}")
        return 0

    print(f"jax {jax.__version__}; devices: {jax.devices()}")
    missing = dsv4_jax.available_backends()["triton"]
    if DRY_RUN:
        print(f"DRY RUN on {jax.default_backend()}: Pallas interpreter, T=8; timings mean nothing")
    elif missing:
        print(f"no GPU check: {missing}")
        return 0

    tiling_keys = ("block_h", "block_k", "block_dv", "num_warps", "num_stages")

    def pallas(*args, tiling=None):
        H, D = args[0].shape[1:]
        tiling = tiling or tuple(getattr(default_tuning(H, D, interpret=False), k) for k in tiling_keys)
        return sparse_attention_pallas(*args, interpret=DRY_RUN, **dict(zip(tiling_keys, tiling)))

    def make_inputs(T, H, D, S, K, seed=0):
        # Like a CSA layer late in a prompt: most rows full, some shorter, -1 padding after.
        q, kv, idx, sink, tl, valid = random_sparse_inputs(T, H, D, S, K, seed, full_rows=0.8)
        bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
        return bf16(q), bf16(kv), jnp.asarray(idx), jnp.asarray(sink, jnp.float32), jnp.asarray(tl), valid

    def timed(fn, *args, repeat=10):
        return median_seconds(lambda: fn(*args), repeat, warmup=1, sync=jax.block_until_ready)

    rows = []  # (shape, what, compile s, ms, TFLOPS)
    for name, T, H, D, S, K in SHAPES:
        section(f"{name}: T={T} H={H} D={D} S={S} K={K} bf16")
        inputs = guarded(lambda: make_inputs(T, H, D, S, K))
        if inputs is None:
            continue
        q, kv, idx, sink, tl, valid = inputs
        scale = D**-0.5
        print(f"   valid indices: {valid} ({valid / (T * K):.0%} of T*K); default tiling {default_tuning(H, D, False)}")

        def check_against_reference():
            out, ml, lse = jax.jit(lambda *a: pallas(*a[:3], scale, *a[3:]))(q, kv, idx, sink, tl)
            ref = jax.jit(lambda *a: sparse_attention_xla(*a[:3], scale, *a[3:]))(q, kv, idx, sink, tl)
            o, r = np.asarray(out, np.float64), np.asarray(ref[0], np.float64)
            err = np.abs(o - r)
            ok = (err < FLASHMLA_TOL["abs"]) | (err / (np.abs(r) + 1e-6) < FLASHMLA_TOL["rel"])
            lse_err = np.max(np.abs(np.asarray(lse) - np.asarray(ref[2])) / np.maximum(np.abs(np.asarray(ref[2])), 1))
            ml_err = np.max(np.abs(np.asarray(ml) - np.asarray(ref[1])))
            verdict = "PASS" if ok.all() and lse_err < 1e-4 else "FAIL"
            print(
                f"   triton vs xla: {verdict}; out max abs err {err.max():.2e}, {(~ok).sum()} outside "
                f"FlashMLA tolerance; lse max rel err {lse_err:.2e}; max_logits max abs err {ml_err:.2e}"
            )
            return out, ml, lse

        got = guarded(check_against_reference)

        def check_against_oracle():
            from planner import oracle

            pick = np.linspace(0, T - 1, 6).astype(int)
            ref = oracle.sparse_attention(
                np.asarray(q[pick], np.float64),
                np.asarray(kv, np.float64),
                np.asarray(idx[pick]),
                scale,
                np.asarray(sink, np.float64),
                np.asarray(tl[pick]),
            )
            err = np.abs(np.asarray(got[0][pick], np.float64) - ref[0])
            ok = (err < FLASHMLA_TOL["abs"]) | (err / (np.abs(ref[0]) + 1e-6) < FLASHMLA_TOL["rel"])
            lse_err = np.max(np.abs(np.asarray(got[2][pick]) - ref[2]))
            print(
                f"   triton vs float64 oracle on 6 tokens: {'PASS' if ok.all() and lse_err < 1e-3 else 'FAIL'}"
                f" (out max abs err {err.max():.2e}, lse max abs err {lse_err:.2e})"
            )

        if got is not None:
            guarded(check_against_oracle)

        section(f"{name}: Mosaic GPU kernel")
        from dsv4_jax import backends

        mosaic = backends.ATTENTION["mosaic_gpu"]
        mosaic_missing = mosaic.interpret_unavailable() if DRY_RUN else mosaic.unavailable(())

        def check_and_time_mosaic():
            from dsv4_jax.kernels.mosaic_gpu.attention import sparse_attention_mosaic

            n = 1 if DRY_RUN else T  # interpret mode costs ~0.3 s per 32-key block per 64 heads
            args = (q[:n], kv, idx[:n], sink, tl[:n])
            fn = jax.jit(lambda *a: sparse_attention_mosaic(*a[:3], scale, *a[3:], interpret=DRY_RUN))
            t0 = time.perf_counter()
            compiled = fn.lower(*args).compile()
            compile_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            out, ml, lse = jax.block_until_ready(compiled(*args))
            first_s = time.perf_counter() - t0
            ref = jax.jit(lambda *a: sparse_attention_xla(*a[:3], scale, *a[3:]))(*args)
            o, r = np.asarray(out, np.float64), np.asarray(ref[0], np.float64)
            err = np.abs(o - r)
            ok = (err < FLASHMLA_TOL["abs"]) | (err / (np.abs(r) + 1e-6) < FLASHMLA_TOL["rel"])
            lse_err = np.max(np.abs(np.asarray(lse) - np.asarray(ref[2])) / np.maximum(np.abs(np.asarray(ref[2])), 1))
            verdict = "PASS" if ok.all() and lse_err < 1e-4 else "FAIL"
            print(
                f"   mosaic vs xla on {n} tokens: {verdict}; out max abs err {err.max():.2e}, {(~ok).sum()} outside "
                f"FlashMLA tolerance; lse max rel err {lse_err:.2e}"
            )
            seconds = first_s if DRY_RUN else timed(compiled, *args)  # interpret mode: run once
            n_valid = int(np.asarray(tl[:n]).sum())
            rows.append((name, "mosaic", compile_s, seconds * 1e3, tflops(n_valid, H, seconds)))
            print(
                f"   {'mosaic':30} compile {compile_s:5.1f}s  {seconds * 1e3:8.2f} ms  {rows[-1][4]:6.1f} TFLOPS",
                flush=True,
            )

        if mosaic_missing:
            print(f"   mosaic not run: {mosaic_missing}")
        else:
            guarded(check_and_time_mosaic)

        section(f"{name}: timing")
        for tiling in ALTERNATIVE_TILINGS:
            if time.time() - START > BUDGET_S:
                print("   time budget reached; skipping the remaining tilings")
                break

            def time_tiling():
                fn = jax.jit(lambda *a: pallas(*a[:3], scale, *a[3:], tiling=tiling))
                t0 = time.perf_counter()
                compiled = fn.lower(q, kv, idx, sink, tl).compile()
                compile_s = time.perf_counter() - t0
                seconds = timed(compiled, q, kv, idx, sink, tl)
                label = "pallas default" if tiling is None else f"pallas {tiling}"
                rows.append((name, label, compile_s, seconds * 1e3, tflops(valid, H, seconds)))
                print(
                    f"   {label:30} compile {compile_s:5.1f}s  {seconds * 1e3:8.2f} ms  {rows[-1][4]:6.1f} TFLOPS",
                    flush=True,
                )

            guarded(time_tiling)

        def time_reference():
            fn = jax.jit(lambda *a: sparse_attention_xla(*a[:3], scale, *a[3:]))
            seconds = timed(fn, q, kv, idx, sink, tl, repeat=3)
            rows.append((name, "xla reference", float("nan"), seconds * 1e3, tflops(valid, H, seconds)))
            print(f"   {'xla reference':30} {seconds * 1e3:8.2f} ms  {rows[-1][4]:6.1f} TFLOPS", flush=True)

        if time.time() - START < BUDGET_S:
            guarded(time_reference)

        def time_flashmla():
            import torch
            from flash_mla import flash_mla_sparse_fwd

            if not torch.cuda.is_available():
                print("   FlashMLA: torch has no CUDA; skipped")
                return
            to_torch = lambda x: torch.from_dlpack(x)  # noqa: E731
            tq, tkv, tidx = to_torch(q), to_torch(kv)[:, None, :], to_torch(idx)[:, None, :]
            tsink, ttl = to_torch(sink), to_torch(tl)
            kwargs = dict(attn_sink=tsink, topk_length=ttl)
            if torch.cuda.get_device_capability()[0] == 9:
                kwargs["use_legacy"] = True  # sgl-flash-mla on SM90 (spec section 2)
            fn = lambda: flash_mla_sparse_fwd(tq, tkv, tidx, scale, **kwargs)  # noqa: E731
            seconds = median_seconds(fn, 10, warmup=1, sync=lambda _: torch.cuda.synchronize())
            rows.append((name, "FlashMLA", float("nan"), seconds * 1e3, tflops(valid, H, seconds)))
            print(f"   {'FlashMLA':30} {seconds * 1e3:8.2f} ms  {rows[-1][4]:6.1f} TFLOPS")

        try:
            import flash_mla  # noqa: F401
        except Exception as e:  # noqa: BLE001
            print(f"   FlashMLA not importable ({type(e).__name__}: {e}); no side-by-side")
        else:
            guarded(time_flashmla)

    section("summary")
    print(f"{'shape':9} {'kernel':30} {'compile s':>9} {'ms':>9} {'TFLOPS':>7} {'vs 640':>7}")
    for name, what, compile_s, ms, tf in rows:
        print(f"{name:9} {what:30} {compile_s:9.1f} {ms:9.2f} {tf:7.1f} {tf / FLASHMLA_PUBLISHED_TFLOPS:7.1%}")
    print(f"{TFLOPS_CONVENTION}; 'vs 640' = share of FlashMLA's published sparse-prefill figure (H800)")
    print(f"total {time.time() - START:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
