"""Prefill and decode tokens/s: the JAX model (`dsv4_jax.model.generate`) vs transformers' eager model.

Same tiny checkpoint, same prompts (a batch of equal-length random prompts, so transformers can
run them as one unpadded batch, which it handles correctly), greedy decoding of the same number
of tokens. JAX is warmed up once (compilation), transformers once (allocator, lazy set-up); then
each configuration is timed `--repeats` times and the medians reported. Several attention
backends of each framework run side by side in one process (`--backend` for JAX, `--torch-backend`
for transformers + our `enable_sparse_prefill`): by default "auto" (on CPU: the C kernel, backend
"cpu") and the backend that ran before it ("xla" / "reference"), so one run shows before and after.

  python -m bench.bench_jax_vs_torch_model                      # writes a tiny checkpoint to a temp dir
  python -m bench.bench_jax_vs_torch_model --batch 4 --prompt-len 256 --new-tokens 32 --json out.json
  python -m bench.bench_jax_vs_torch_model --checkpoint DIR --dtype bfloat16
  python -m bench.bench_jax_vs_torch_model --backend xla --torch-backend reference,cpu
  python -m bench.bench_jax_vs_torch_model --backend '' --torch-backend cpu --threads 1   # transformers only
  python -m bench.bench_jax_vs_torch_model --backend '' --torch-backend cpu --interleave  # a shared machine
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from bench.common import checkpoint_or_tiny


def _median_run(run, repeats: int):
    """(outputs, prefill seconds, decode seconds): medians of `repeats` timed runs."""
    times = [run() for _ in range(repeats)]
    for out, _, _ in times[1:]:
        assert out == times[0][0], "greedy tokens changed between runs"
    return times[0][0], float(np.median([t[1] for t in times])), float(np.median([t[2] for t in times]))


def jax_run(ckpt, prompts, new_tokens, args, backend):
    from dsv4_jax.model.generate import JaxGenerator

    gen = JaxGenerator(
        ckpt,
        backend=backend,
        policy=args.policy,
        dtype=args.dtype,
        max_batch_size=len(prompts),
        max_model_len=args.prompt_len + new_tokens,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    t0 = time.perf_counter()
    gen.generate(prompts, new_tokens)  # warm-up: compiles every bucket the timed run uses
    warmup = time.perf_counter() - t0
    stats = []

    def run():
        gen.reset_stats()
        out = gen.generate(prompts, new_tokens)
        stats.append(dict(gen.stats))
        return out, stats[-1]["prefill_seconds"], stats[-1]["decode_seconds"]

    outputs, prefill_s, decode_s = _median_run(run, args.repeats)
    s = stats[-1]
    return outputs, {
        "prefill_tokens_per_s": s["prefill_tokens"] / prefill_s,
        "decode_tokens_per_s": s["decode_tokens"] / decode_s,
        "prefill_seconds": prefill_s,
        "decode_seconds": decode_s,
        "warmup_seconds": warmup,
        "compile_seconds_in_timed_runs": sum(x["compile_seconds"] for x in stats),
        "compiles": s["compiles"],
        "prefill_steps": s["prefill_steps"],
        "decode_steps": s["decode_steps"],
    }


def torch_run(ckpt, prompts, new_tokens, args, backend=None):
    """transformers' model: eager attention (backend None) or our sparse path on `backend`."""
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    import torch
    import transformers
    from transformers import DynamicCache

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(ckpt, dtype=dtype).eval()
    if backend is not None:
        from dsv4_torch.hf import enable_sparse_prefill

        enable_sparse_prefill(model, backend=backend)
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
    outputs, prefill_s, decode_s = _median_run(run, args.repeats)
    B = len(prompts)
    ran = None
    if backend is not None:
        from dsv4_torch.hf import last_forward

        ran = dict(last_forward(model).backends)
    return outputs, {
        "backends_ran": ran,
        "prefill_tokens_per_s": B * len(prompts[0]) / prefill_s,
        "decode_tokens_per_s": B * (new_tokens - 1) / decode_s,
        "prefill_seconds": prefill_s,
        "decode_seconds": decode_s,
    }


def torch_interleaved(ckpt, prompts, new_tokens, args, backends) -> tuple[dict, dict]:
    """eager and our path on each of `backends`, one model each, run in turn call by call: every
    prefill, then every decode step, the order reversed at each call, so that a shared machine's
    load falls on all of them alike. Rates from the medians of the per-call times (prefill: of
    `repeats` prefills; decode: of every timed decode step)."""
    import torch
    import transformers
    from transformers import DynamicCache

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    names = ["torch_eager"] + [f"torch_sparse.{b}" for b in backends]
    models = {}
    for name, b in zip(names, [None, *backends]):
        models[name] = transformers.DeepseekV4ForCausalLM.from_pretrained(ckpt, dtype=dtype).eval()
        if b is not None:
            from dsv4_torch.hf import enable_sparse_prefill

            enable_sparse_prefill(models[name], backend=b)
    ids = torch.tensor(prompts)
    prefill = {n: [] for n in names}
    decode = {n: [] for n in names}
    outputs = {}
    flip = 0

    def turn():
        nonlocal flip
        flip ^= 1
        return names if flip else names[::-1]

    def timed(name, x, cache):
        t0 = time.perf_counter()
        tok = models[name](x, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        return tok, time.perf_counter() - t0

    with torch.no_grad():
        for rep in range(args.repeats + 1):  # the first: warm-up, not timed
            caches = {n: DynamicCache(config=models[n].config) for n in names}
            toks = {n: [] for n in names}
            for n in turn():
                tok, dt = timed(n, ids, caches[n])
                toks[n].append(tok)
                if rep:
                    prefill[n].append(dt)
            for _ in range(new_tokens - 1):
                for n in turn():
                    tok, dt = timed(n, toks[n][-1], caches[n])
                    toks[n].append(tok)
                    if rep:
                        decode[n].append(dt)
            for n in names:
                out = torch.cat(toks[n], 1).tolist()
                assert outputs.setdefault(n, out) == out, "greedy tokens changed between runs"
    B, results = len(prompts), {}
    for i, n in enumerate(names):
        ran = None
        if i:
            from dsv4_torch.hf import last_forward

            ran = dict(last_forward(models[n]).backends)
        p, d = float(np.median(prefill[n])), float(np.median(decode[n]))
        results[n] = {
            "backends_ran": ran,
            "prefill_tokens_per_s": B * len(prompts[0]) / p,
            "decode_tokens_per_s": B / d,
            "prefill_seconds": p,
            "decode_step_seconds": d,
        }
    return outputs, results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", help="checkpoint dir (default: write the tiny one to a temp dir)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument(
        "--backend",
        default="auto,xla",
        help="JAX attention backends, comma-separated (auto, cpu, xla, pallas; '' for none)",
    )
    ap.add_argument(
        "--torch-backend",
        default="auto,reference",
        help="backends of transformers + our sparse path, comma-separated (auto, cpu, reference, triton; '' for none)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (medians)")
    ap.add_argument("--threads", type=int, default=None, help="torch's threads (default: torch's own choice)")
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="transformers' runs (eager, each --torch-backend) in turn call by call, medians of per-call "
        "times: for a shared machine",
    )
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
    if args.repeats < 1:
        ap.error(f"--repeats: need >= 1, got {args.repeats}")
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads: need >= 1, got {args.threads}")
    args.backend = [b for b in args.backend.split(",") if b]
    args.torch_backend = [b for b in args.torch_backend.split(",") if b]

    with checkpoint_or_tiny(args.checkpoint, dtype=args.dtype) as ckpt:
        return run(ckpt, args)


def run(ckpt: str, args) -> dict:
    rng = np.random.default_rng(args.seed)
    prompts = [[0] + rng.integers(3, 512, size=args.prompt_len - 1).tolist() for _ in range(args.batch)]

    from dsv4_cpu.binding import bf16_matmul_native

    devices = "not run"
    if args.backend:  # --backend '': transformers only
        import jax

        devices = str(jax.devices())
    # bf16 on a CPU without AVX512-BF16 / AMX-BF16: both frameworks' matmuls (the model's
    # projections) run emulated, hundreds of times slower than float32; the run says so
    emulated = args.dtype == "bfloat16" and not bf16_matmul_native()
    results = {"setup": {**vars(args), "checkpoint": ckpt, "jax_devices": devices, "bf16_gemm_emulated": emulated}}
    outputs = {}
    for b in args.backend:
        outputs[f"jax.{b}"], results[f"jax.{b}"] = jax_run(ckpt, prompts, args.new_tokens, args, b)
    if args.interleave:
        got, res = torch_interleaved(ckpt, prompts, args.new_tokens, args, args.torch_backend)
        outputs.update(got)
        results.update(res)
    else:
        outputs["torch_eager"], results["torch_eager"] = torch_run(ckpt, prompts, args.new_tokens, args)
        for b in args.torch_backend:
            outputs[f"torch_sparse.{b}"], results[f"torch_sparse.{b}"] = torch_run(
                ckpt, prompts, args.new_tokens, args, b
            )
    eager = results["torch_eager"]
    results["same_tokens_as_torch_eager"] = {k: v == outputs["torch_eager"] for k, v in outputs.items()}
    print(
        f"batch {args.batch} x prompt {args.prompt_len} + {args.new_tokens} new tokens, {args.dtype}, "
        f"policy {args.policy}, medians of {args.repeats}, torch threads {args.threads or 'default'}"
        + (", transformers' runs interleaved call by call" if args.interleave else "")
    )
    print(f"{'':34s} {'prefill tok/s':>14s} {'decode tok/s':>13s} {'vs eager':>16s}  same tokens as eager")
    for name in outputs:
        t = results[name]
        ratio = {k: t[f"{k}_tokens_per_s"] / eager[f"{k}_tokens_per_s"] for k in ("prefill", "decode")}
        t["over_torch_eager"] = ratio
        ran = t.get("backends_ran")
        label = name + (f" ({','.join(sorted(set(ran.values())))})" if ran else "")
        print(
            f"{label:34s} {t['prefill_tokens_per_s']:14.1f} {t['decode_tokens_per_s']:13.1f} "
            f"{ratio['prefill']:6.2f}x {ratio['decode']:6.2f}x  {results['same_tokens_as_torch_eager'][name]}"
        )
    for b in args.backend:
        j = results[f"jax.{b}"]
        print(f"JAX {b}: warm-up (compilation) {j['warmup_seconds']:.1f} s, compiles {j['compiles']}")
    if emulated:
        print(
            "bfloat16 on a CPU without AVX512-BF16 / AMX-BF16: torch's and XLA's bf16 matmuls (the model's "
            "projections) are emulated here; these figures measure that emulation, use --dtype float32"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return results


if __name__ == "__main__":
    main()
