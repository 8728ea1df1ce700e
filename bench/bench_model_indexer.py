"""The CSA layers' Lightning Indexer inside both models, before and after the fused C kernel: prefill time and tokens.

    python -m bench.bench_model_indexer                         # tiny + official-format checkpoints, temp dirs
    python -m bench.bench_model_indexer --prompt-len 4096 --new-tokens 8 --json out.json

For each checkpoint (the tiny random one, `tools.tiny_checkpoint`, index_topk 8; and the
official-format one of `tools.official_checkpoint.vllm_cpu_config`, index_topk 512 with 16 index
heads of 128 dims), one prompt of `--prompt-len` random tokens, greedy decoding of
`--new-tokens`:

- the JAX model (`dsv4_jax.model.generate.JaxGenerator`, attention backend "auto") with
  `indexer_backend` "xla" (the indexer the model ran before: gathered keys, einsum, lax.top_k
  order) and "cpu" (the fused C kernel, what "auto" runs on a CPU);
- transformers + our sparse path (`dsv4_torch.hf.enable_sparse_prefill`, attention "auto") with
  `indexer_backend` "reference" (torch ops, the path before) and "cpu".

Reported: the prefill seconds (JAX: the prompt's generate steps after a warm-up run that
compiles; transformers: the faster of two fresh forwards of the prompt, and the seconds spent in
`dsv4_torch.indexer.indexer_topk` within it) and whether the greedy tokens are the same as the
"before" backend's.
The machine may be shared: read ratios, rerun on a quiet machine for absolute figures.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

from planner.report import table


def jax_prefill(ckpt, prompt, new_tokens, indexer_backend):
    from dsv4_jax.model.generate import JaxGenerator

    gen = JaxGenerator(
        ckpt,
        max_batch_size=1,
        max_model_len=len(prompt) + new_tokens,
        max_num_batched_tokens=len(prompt),
        indexer_backend=indexer_backend,
    )
    gen.generate([prompt], new_tokens)  # compiles
    gen.reset_stats()
    out = gen.generate([prompt], new_tokens)
    return out[0], float(gen.stats["prefill_seconds"]), None  # (the indexer runs inside the jitted layers)


def torch_prefill(ckpt, prompt, new_tokens, indexer_backend):
    """(greedy tokens, prefill seconds: the faster of two fresh prefills, the indexer's seconds in it)."""
    import torch
    import transformers
    from transformers import DynamicCache

    from dsv4_torch import indexer
    from dsv4_torch.hf import enable_sparse_prefill

    model = transformers.DeepseekV4ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to(torch.float32).eval()
    enable_sparse_prefill(model, indexer_backend=indexer_backend)
    ids = torch.tensor([prompt])
    spent = [0.0]
    real = indexer.indexer_topk

    def timed_indexer(*a, **k):
        t = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t

    best = (float("inf"), 0.0)
    indexer.indexer_topk = timed_indexer  # (dsv4_torch.hf.layer looks it up at every call)
    try:
        with torch.no_grad():
            for _ in range(2):
                cache = DynamicCache(config=model.config)
                spent[0] = 0.0
                t0 = time.perf_counter()
                tok = model(ids, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
                best = min(best, (time.perf_counter() - t0, spent[0]))
            out = [int(tok)]
            for _ in range(new_tokens - 1):
                tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
                out.append(int(tok))
    finally:
        indexer.indexer_topk = real
    return out, best[0], best[1]


def checkpoints(tmp: str, which: list[str]) -> dict[str, str]:
    from tools.official_checkpoint import vllm_cpu_config, write_official_checkpoint
    from tools.tiny_checkpoint import write_tiny_checkpoint

    out = {}
    if "tiny" in which:
        out["tiny (index_topk 8)"] = str(write_tiny_checkpoint(os.path.join(tmp, "tiny"), seed=0))
    if "official" in which:
        cfg = vllm_cpu_config()
        out["official-format (index_topk 512)"] = str(
            write_official_checkpoint(os.path.join(tmp, "off"), seed=0, config=cfg)
        )
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-len", type=int, default=3072)
    ap.add_argument("--new-tokens", type=int, default=6)
    ap.add_argument("--checkpoints", default="tiny,official", help="comma-separated: tiny, official")
    ap.add_argument("--frameworks", default="jax,torch", help="comma-separated: jax, torch")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    prompt = [0] + rng.integers(3, 512, size=args.prompt_len - 1).tolist()
    rows = []
    runs = {"jax": (jax_prefill, ("xla", "cpu")), "torch": (torch_prefill, ("reference", "cpu"))}
    with tempfile.TemporaryDirectory() as tmp:
        for name, ckpt in checkpoints(tmp, args.checkpoints.split(",")).items():
            for fw in args.frameworks.split(","):
                fn, (before, after) = runs[fw]
                toks_b, sec_b, idx_b = fn(ckpt, prompt, args.new_tokens, before)
                toks_a, sec_a, idx_a = fn(ckpt, prompt, args.new_tokens, after)
                rows.append(
                    dict(
                        checkpoint=name,
                        framework=fw,
                        before=before,
                        before_s=round(sec_b, 3),
                        after=after,
                        after_s=round(sec_a, 3),
                        speedup=round(sec_b / sec_a, 2),
                        indexer_before_s=None if idx_b is None else round(idx_b, 3),
                        indexer_after_s=None if idx_a is None else round(idx_a, 3),
                        same_tokens=toks_a == toks_b,
                        tokens=toks_a,
                    )
                )
                print(rows[-1], flush=True)
    print(f"\nModel prefill of one {args.prompt_len}-token prompt, indexer before -> after (seconds; shared machine):")
    print(
        table(
            [
                [r["checkpoint"], r["framework"], f"{r['before']} {r['before_s']}", f"{r['after']} {r['after_s']}",
                 f"{r['speedup']}x", "-" if r["indexer_before_s"] is None else
                 f"{r['indexer_before_s']} -> {r['indexer_after_s']}", r["same_tokens"]]
                for r in rows
            ],
            ["checkpoint", "framework", "before", "after", "prefill speedup", "indexer s in it", "same greedy tokens"],
        )
    )  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if not all(r["same_tokens"] for r in rows):
        raise SystemExit("greedy tokens changed with the indexer backend")


if __name__ == "__main__":
    main()
