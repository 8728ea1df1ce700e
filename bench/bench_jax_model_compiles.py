"""How many programs the JAX model compiles for varied ragged batches (bucketed shapes).

Generates greedily for several rounds of random prompts (random lengths, so every prefill step
and every decode batch is shaped differently) and prints, per round, the steps run, the traces
of each jitted function so far and the seconds spent in steps that compiled. With bucketing,
later rounds add few or no compilations.

  python -m bench.bench_jax_model_compiles
  python -m bench.bench_jax_model_compiles --rounds 4 --prompts 16 --max-len 400 --new-tokens 16
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import checkpoint_or_tiny


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", help="checkpoint dir (default: write the tiny one to a temp dir)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=12, help="prompts per round")
    ap.add_argument("--max-len", type=int, default=400, help="prompt lengths are uniform in 8..max-len")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    with checkpoint_or_tiny(args.checkpoint) as ckpt:
        run(ckpt, args)


def run(ckpt: str, args) -> None:
    from dsv4_jax.model.generate import JaxGenerator

    gen = JaxGenerator(
        ckpt,
        backend=args.backend,
        max_batch_size=args.max_batch_size,
        max_model_len=args.max_len + args.new_tokens,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    rng = np.random.default_rng(args.seed)
    print(f"{'round':>5s} {'steps':>6s} {'tokens':>7s} {'seconds':>8s} {'compile s':>9s}  traces so far")
    for r in range(args.rounds):
        lens = rng.integers(8, args.max_len + 1, size=args.prompts)
        prompts = [[0] + rng.integers(3, gen.config.vocab_size, size=n - 1).tolist() for n in lens]
        gen.reset_stats()
        t0 = time.perf_counter()
        gen.generate(prompts, args.new_tokens)
        s = gen.stats
        steps = s["prefill_steps"] + s["decode_steps"]
        tokens = s["prefill_tokens"] + s["decode_tokens"]
        print(
            f"{r:5d} {steps:6d} {tokens:7d} {time.perf_counter() - t0:8.1f} {s['compile_seconds']:9.1f}  {s['compiles']}"
        )


if __name__ == "__main__":
    main()
