"""Every GPU check in one command, sized for a short lease on one H100/H200/B200.

    python -m bench.gpu_check [--budget 270] [--model-seconds 90] [--kvcache-seconds 60] [--v41-seconds 60]

The default budget keeps the GPU tests and the first three checks under five minutes on an H200
(each script stops starting new measurements at its share and prints every row as it is
measured, so a cap loses nothing done); the model and KV-cache checks have their own caps on top
(`--model-seconds`, `--kvcache-seconds`, `--v41-seconds`).

Runs, each in its own process with its own time cap, and prints their tables:
  0. pytest -m gpu            the test suite's GPU-only tests (marked `gpu`: FlashMLA against the
                              oracle, Triton grids past CUDA's limits, ...); without a GPU they skip
  1. bench.checks.gpu_torch    FlashMLA (where its wheel imports) and our Triton kernel vs the
                              reference; TFLOPS vs FlashMLA's published 640
  2. bench.checks.gpu_jax      Mosaic GPU and Pallas-Triton kernels vs xla; TFLOPS vs 640
  3. bench.checks.gpu_prefill  whole prefill layers, adaptive vs fixed vs per-request, both frameworks
  4. bench.checks.gpu_model    one V4-Flash-sized layer in the official FP8/FP4 format: load time,
                              device bytes, prefill tokens/s of the JAX model
  5. bench.checks.gpu_kvcache  vLLM's fp8_ds_mla pages: writer/gather bytes vs the NumPy reference,
                              gather GB/s vs HBM peak and a device copy (torch Triton, JAX
                              Pallas-Triton), prefill layers on fp8 vs bf16 pages (ms, bitwise)
  6. bench.checks.gpu_v41      DeepSeek-V4.1 in vLLM's chunk layout: a V4.1 step's plans with
                              replay and without, every chunk's index rows (-1 picks, replay
                              windows) through FlashMLA / our Triton kernel vs the reference;
                              names why V4.1's SM100 record kernels and vLLM's candidate-block
                              kernels are not run (no sm_10x GPU, no vLLM CUDA build there)
Logs go to $OUT (when set, as on the device tool) or ./out/gpu-check/.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from bench.common import ROOT, child_env, module_command


def gpu_test_files() -> list[str]:
    """The test files that hold tests marked `gpu` (found by their marker, so new ones run too)."""
    tests = os.path.join(ROOT, "tests")
    found = []
    for folder, _, files in sorted(os.walk(tests)):
        for name in sorted(files):
            path = os.path.join(folder, name)
            if name.startswith("test_") and name.endswith(".py") and "mark.gpu" in open(path).read():
                found.append(os.path.relpath(path, ROOT))
    return found


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=270, help="seconds for checks 1-3 together")
    ap.add_argument("--model-seconds", type=float, default=90, help="cap of check 4 (the JAX model on one layer)")
    ap.add_argument("--kvcache-seconds", type=float, default=60, help="cap of check 5 (fp8_ds_mla pages)")
    ap.add_argument("--v41-seconds", type=float, default=60, help="cap of check 6 (DeepSeek-V4.1 chunks)")
    args = ap.parse_args(argv)
    out_dir = os.environ.get("OUT") or os.path.join(ROOT, "out", "gpu-check")
    os.makedirs(out_dir, exist_ok=True)
    b = args.budget
    # module, its arguments, share of the budget: each script's own budget leaves ~25% of its share
    # for the measurement it has started and its summary (a kill at the cap loses only the summary).
    # The GPU tests take 15% of the budget, checks 1-3 the rest, as before in proportion.
    checks = [
        ("pytest", ["-m", "gpu", "-v", "-rs", "-p", "no:cacheprovider", *gpu_test_files()], 0.15),
        ("bench.checks.gpu_torch", ["--budget", f"{0.22 * b:.0f}", "--sweep-seconds", f"{0.07 * b:.0f}"], 0.3),
        ("bench.checks.gpu_jax", ["--budget", f"{0.19 * b:.0f}"], 0.25),
        ("bench.checks.gpu_prefill", ["--seconds", f"{0.21 * b:.0f}"], 0.3),
        ("bench.checks.gpu_model", [], args.model_seconds / b),
        # its own budget leaves ~25% of the cap for the measurement it has started
        ("bench.checks.gpu_kvcache", ["--budget", f"{0.75 * args.kvcache_seconds:.0f}"], args.kvcache_seconds / b),
        ("bench.checks.gpu_v41", ["--budget", f"{0.6 * args.v41_seconds:.0f}"], args.v41_seconds / b),
    ]
    # JAX would take 75% of GPU memory at start-up; the prefill check runs torch and JAX in one process.
    env = child_env(PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    for module, extra, share in checks:
        cap = share * b
        log = os.path.join(out_dir, module.split(".")[-1] + ".log")
        print(f"\n##### {module} (cap {cap:.0f} s, log {log})", flush=True)
        t0 = time.time()
        with open(log, "w") as f:
            try:
                p = subprocess.run(
                    module_command(module, *extra),
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    timeout=cap,
                    env=env,
                )
                text, rc = p.stdout, p.returncode
            except subprocess.TimeoutExpired as e:
                text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                rc = f"timeout after {cap:.0f} s"
            f.write(text)
        print(text[-12000:])
        print(f"##### {module}: exit {rc}, {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
