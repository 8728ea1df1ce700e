"""Time dsv4_jax.sparse_attention: compile time and run time per backend.

On CPU: the "xla" reference against the Pallas kernel in interpret mode, on shapes a CPU can
run. With an NVIDIA GPU also: the Pallas kernel compiled by Triton on V4-sized shapes, with
TFLOPS by FlashMLA's convention, 2 * (valid indices) * H * (512 + 512) / time.

  python -m bench.bench_jax_sparse_attention            # all sections this machine can run
  python -m bench.bench_jax_sparse_attention --repeat 5
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import dsv4_jax
from bench.common import TFLOPS_CONVENTION, median_seconds, random_sparse_inputs, tflops

# (name, T, H, D, S, K, dtype): CPU-sized; the V4 head counts and dims at few tokens.
CPU_SHAPES = [
    ("small", 64, 16, 64, 1024, 256, jnp.float32),
    ("V4-Flash-like", 16, 64, 512, 4096, 640, jnp.bfloat16),
    ("V4-Pro-like", 8, 128, 576, 4096, 1152, jnp.bfloat16),
]
GPU_SHAPES = [
    ("V4-Flash", 4096, 64, 512, 65536, 640, jnp.bfloat16),
    ("V4-Pro", 4096, 128, 512, 65536, 1152, jnp.bfloat16),
]


def make_inputs(T, H, D, S, K, dtype, seed=0):
    """q, kv, indices, sink, topk_length, with 50-100% of each row valid (then -1 padding)."""
    q, kv, idx, sink, tl, valid = random_sparse_inputs(T, H, D, S, K, seed)
    q, kv, sink = jnp.asarray(q, dtype), jnp.asarray(kv, dtype), jnp.asarray(sink, jnp.float32)
    return q, kv, jnp.asarray(idx), sink, jnp.asarray(tl), valid


def time_backend(backend, inputs, sm_scale, repeat, interpret=False):
    """(compile seconds, median run seconds) for one backend (in its interpreter when
    `interpret`) on one input set."""
    q, kv, idx, sink, topk_length = inputs
    fn = jax.jit(
        lambda q, kv, idx, sink, tl: dsv4_jax.sparse_attention(
            q, kv, idx, sm_scale, sink, tl, backend=backend, interpret=interpret
        )
    )
    t0 = time.perf_counter()
    compiled = fn.lower(q, kv, idx, sink, topk_length).compile()
    compile_s = time.perf_counter() - t0
    run = lambda: compiled(q, kv, idx, sink, topk_length)  # noqa: E731
    return compile_s, median_seconds(run, repeat, warmup=1, sync=jax.block_until_ready)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    available = dsv4_jax.available_backends()
    print(f"jax {jax.__version__}, devices {jax.devices()}")
    print("backends:", {k: v or "available" for k, v in available.items()})

    print("\nCPU-sized shapes: xla reference vs the Pallas-Triton kernel in Pallas' interpreter")
    print(
        f"{'shape':14} {'T':>5} {'H':>4} {'D':>4} {'K':>5} {'dtype':8} {'backend':17} {'compile s':>9} {'run ms':>9} {'tok/s':>9}"
    )
    for name, T, H, D, S, K, dtype in CPU_SHAPES:
        q, kv, idx, sink, tl, _ = make_inputs(T, H, D, S, K, dtype)
        results = {}
        for backend in ("xla", "triton:interpret"):
            try:
                name_, interp = backend.split(":")[0], backend.endswith(":interpret")
                compile_s, run_s = time_backend(name_, (q, kv, idx, sink, tl), D**-0.5, args.repeat, interp)
                results[backend] = run_s
                print(
                    f"{name:14} {T:5} {H:4} {D:4} {K:5} {jnp.dtype(dtype).name:8} {backend:17}"
                    f" {compile_s:9.2f} {run_s * 1e3:9.1f} {T / run_s:9.0f}",
                    flush=True,
                )
            except Exception as e:  # keep going: one failing shape should not hide the rest
                print(f"{name:14} {backend:17} FAILED: {type(e).__name__}: {e}")
        if len(results) == 2:
            print(f"{'':14} interpret / xla = {results['triton:interpret'] / results['xla']:.1f}x")

    if available["triton"] is not None:
        print(f"\nPallas-Triton section skipped: {available['triton']}")
        return
    print(f"\nGPU: Pallas-Triton vs xla reference, {TFLOPS_CONVENTION}")
    print(f"{'shape':9} {'backend':14} {'compile s':>9} {'run ms':>9} {'TFLOPS':>7}")
    for name, T, H, D, S, K, dtype in GPU_SHAPES:
        q, kv, idx, sink, tl, num_valid = make_inputs(T, H, D, S, K, dtype)
        for backend in ("triton", "xla"):
            try:
                compile_s, run_s = time_backend(backend, (q, kv, idx, sink, tl), D**-0.5, max(args.repeat, 10))
                print(f"{name:9} {backend:14} {compile_s:9.2f} {run_s * 1e3:9.2f} {tflops(num_valid, H, run_s):7.1f}")
            except Exception as e:
                print(f"{name:9} {backend:14} FAILED: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
