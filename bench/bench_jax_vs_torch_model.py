"""Prefill and decode tokens/s: the JAX model (`dsv4_jax.model.generate`) vs transformers' eager model.

Same tiny checkpoint, same prompts (a batch of equal-length random prompts, so transformers can
run them as one unpadded batch, which it handles correctly), greedy decoding of the same number
of tokens. JAX is warmed up once (compilation) and then timed for one run; transformers is timed
for one run after a short warm-up. If this branch has `dsv4_torch.hf.enable_sparse_prefill`
(transformers with our prefill path), that is timed too.

  python -m bench.bench_jax_vs_torch_model                      # writes a tiny checkpoint to a temp dir
  python -m bench.bench_jax_vs_torch_model --batch 4 --prompt-len 256 --new-tokens 32 --json out.json
  python -m bench.bench_jax_vs_torch_model --checkpoint DIR --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from bench.common import checkpoint_or_tiny


def jax_run(ckpt, prompts, new_tokens, args):
    from dsv4_jax.model.generate import JaxGenerator

    gen = JaxGenerator(
        ckpt,
        backend=args.backend,
        policy=args.policy,
        dtype=args.dtype,
        max_batch_size=len(prompts),
        max_model_len=args.prompt_len + new_tokens,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    t0 = time.perf_counter()
    gen.generate(prompts, new_tokens)  # warm-up: compiles every bucket the timed run uses
    warmup = time.perf_counter() - t0
    gen.reset_stats()
    outputs = gen.generate(prompts, new_tokens)
    s = gen.stats
    return outputs, {
        "prefill_tokens_per_s": s["prefill_tokens"] / s["prefill_seconds"],
        "decode_tokens_per_s": s["decode_tokens"] / s["decode_seconds"],
        "prefill_seconds": s["prefill_seconds"],
        "decode_seconds": s["decode_seconds"],
        "warmup_seconds": warmup,
        "compile_seconds_in_timed_run": s["compile_seconds"],
        "compiles": s["compiles"],
        "prefill_steps": s["prefill_steps"],
        "decode_steps": s["decode_steps"],
    }


def torch_run(ckpt, prompts, new_tokens, args, sparse_prefill=False):
    import torch
    import transformers
    from transformers import DynamicCache

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(ckpt, dtype=dtype).eval()
    if sparse_prefill:
        from dsv4_torch.hf import enable_sparse_prefill

        enable_sparse_prefill(model)
    ids = torch.tensor(prompts)

    def run():
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            t0 = time.perf_counter()
            logits = model(ids, past_key_values=cache, use_cache=True).logits[:, -1]
            tok = logits.argmax(-1, keepdim=True)
            t1 = time.perf_counter()
            out = [tok]
            for _ in range(new_tokens - 1):
                tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
                out.append(tok)
            t2 = time.perf_counter()
        return torch.cat(out, 1).tolist(), t1 - t0, t2 - t1

    run()  # warm-up (allocator, lazy initialisation)
    outputs, prefill_s, decode_s = run()
    B = len(prompts)
    return outputs, {
        "prefill_tokens_per_s": B * len(prompts[0]) / prefill_s,
        "decode_tokens_per_s": B * (new_tokens - 1) / decode_s,
        "prefill_seconds": prefill_s,
        "decode_seconds": decode_s,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", help="checkpoint dir (default: write the tiny one to a temp dir)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--backend", default="auto", help="JAX attention backend: auto, xla, pallas")
    ap.add_argument(
        "--policy",
        "--planner",
        dest="policy",
        default="adaptive",
        choices=("adaptive", "fixed", "per_request"),
        help="the chunk plan (--planner: the same)",
    )
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if args.new_tokens < 2:
        ap.error("--new-tokens: need >= 2 (one from the prefill, the rest decoded)")

    with checkpoint_or_tiny(args.checkpoint, dtype=args.dtype) as ckpt:
        return run(ckpt, args)


def run(ckpt: str, args) -> dict:
    rng = np.random.default_rng(args.seed)
    prompts = [[0] + rng.integers(3, 512, size=args.prompt_len - 1).tolist() for _ in range(args.batch)]

    import jax

    import dsv4_torch.hf as hf_helpers

    results = {"setup": {**vars(args), "checkpoint": ckpt, "jax_devices": str(jax.devices())}}
    jax_out, results["jax"] = jax_run(ckpt, prompts, args.new_tokens, args)
    torch_out, results["torch_eager"] = torch_run(ckpt, prompts, args.new_tokens, args)
    results["same_tokens_jax_vs_torch_eager"] = jax_out == torch_out
    runs = ["torch_eager"]
    if hasattr(hf_helpers, "enable_sparse_prefill") or "enable_sparse_prefill" in getattr(hf_helpers, "_LAZY", {}):
        sparse_out, results["torch_sparse_prefill"] = torch_run(ckpt, prompts, args.new_tokens, args, True)
        results["same_tokens_jax_vs_torch_sparse_prefill"] = jax_out == sparse_out
        runs.append("torch_sparse_prefill")
    else:
        results["torch_sparse_prefill"] = "not in this branch (dsv4_torch.hf.enable_sparse_prefill missing)"

    j = results["jax"]
    print(
        f"batch {args.batch} x prompt {args.prompt_len} + {args.new_tokens} new tokens, {args.dtype}, "
        f"JAX backend {args.backend}, policy {args.policy}"
    )
    print(f"{'':22s} {'prefill tok/s':>14s} {'decode tok/s':>13s}")
    print(f"{'jax':22s} {j['prefill_tokens_per_s']:14.1f} {j['decode_tokens_per_s']:13.1f}")
    for name in runs:
        t = results[name]
        print(f"{name:22s} {t['prefill_tokens_per_s']:14.1f} {t['decode_tokens_per_s']:13.1f}")
        ratio = {k: j[f"{k}_tokens_per_s"] / t[f"{k}_tokens_per_s"] for k in ("prefill", "decode")}
        results[f"ratio_jax_over_{name}"] = ratio
        print(f"{'  jax / ' + name:22s} {ratio['prefill']:13.2f}x {ratio['decode']:12.2f}x")
    print(
        f"JAX warm-up (compilation) {j['warmup_seconds']:.1f} s, compiles {j['compiles']}; "
        f"same greedy tokens as torch eager: {results['same_tokens_jax_vs_torch_eager']}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return results


if __name__ == "__main__":
    main()
