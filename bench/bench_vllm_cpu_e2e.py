"""End to end in vLLM's CPU engine: prefill tokens/s and time to first token, three ways in one run.

    .venv-vllm-cpu/bin/python -m bench.bench_vllm_cpu_e2e [--prompts 16] [--min-len 1024] [--max-len 4096]
        [--max-num-batched-tokens 4096] [--heads 16] [--no-jax] [--json out.json]
    (`make bench-vllm-cpu`)

One prefill-heavy batch (random prompts of --min-len..--max-len tokens, one new token each, all
submitted at once) on the official-format checkpoint of `tools.official_checkpoint.vllm_cpu_config`
(head_dim 512, index_topk 512, window 128, 64 experts top-6, FP8 / FP4 weights; hidden 256 and
--heads query heads: V4-Flash's attention geometry per head at a width 2 CPU cores finish):
1. vLLM + the plugin's metadata, vLLM's own kernels (`flash_mla_with_kvcache_cpu`, the indexer's
   `fp8_paged_mqa_logits_cpu` + `topk_transform_512_cpu`): DSV4_PREFILL_VLLM_CPU_PREFILL=vllm;
2. vLLM + the plugin, our attention kernel (dsv4_cpu), vLLM's indexer: =dsv4-attention;
3. vLLM + the plugin, our attention kernel and our fused indexer: =dsv4 (the default);
   (same engine, the kernels switched by that variable per step, prefix caching off, after an
   untimed warm-up batch; the three alternate for --repeats rounds, medians reported);
4. our JAX model (`dsv4_jax.model.generate.JaxGenerator`, bfloat16, fp8_ds_mla cache) on the same
   prompts, in the main venv (./.venv), after an untimed run of the same batch (compiles).
For each run: prefill tokens/s (prompt tokens / wall time of the batch) and per CPU-second (the
process's CPU time: on a shared machine the steadier figure), time to first token
(median and max over requests, vLLM's per-request timestamps), and where the step's time went: the
plugin's own counters (host metadata, our kernel, vLLM's kernel) and torch's profiler over one
batch (vLLM's kernels are torch ops: fused MoE, FP8 GEMMs, indexer logits / top-k, compressor...).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")

ROOT = Path(__file__).resolve().parents[1]
MAIN_PYTHON = ROOT / ".venv" / "bin" / "python"
KERNELS = ("vllm", "dsv4-attention", "dsv4")  # DSV4_PREFILL_VLLM_CPU_PREFILL values, in run order
NAMES = {
    "vllm": "vLLM's kernels (plugin metadata)",
    "dsv4-attention": "our attention, vLLM's indexer",
    "dsv4": "our attention and indexer",
}


def make_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    g = np.random.default_rng(seed)
    lens = np.linspace(lo, hi, n).round().astype(int) if n > 1 else [hi]
    return [g.integers(3, 512, int(k)).tolist() for k in g.permutation(lens)]


def cpu_seconds() -> float:
    """CPU time of this process, all threads (the engine runs in it): what a batch costs the
    machine, which other jobs on a shared machine do not inflate the way they inflate wall time."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def vllm_batch(llm, prompts) -> dict:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    c, t = cpu_seconds(), time.perf_counter()
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    wall, cpu = time.perf_counter() - t, cpu_seconds() - c
    ttft = [r.metrics.first_token_ts - r.metrics.queued_ts for r in res if r.metrics is not None]
    return {"wall": wall, "cpu": cpu, "ttft": ttft, "tokens": [r.outputs[0].token_ids[0] for r in res]}


def profile_batch(llm, prompts, rows: int = 14) -> list[dict]:
    """torch's profiler over one batch: the ops with the most self time."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        vllm_batch(llm, prompts)
    ev = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in ev) or 1
    return [
        {"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "share": e.self_cpu_time_total / total, "calls": e.count}
        for e in ev[:rows]
    ]


def run_vllm(ckpt: str, prompts, args) -> dict:
    from vllm import LLM

    from dsv4_torch.vllm.cpu import engine as cpu_engine

    llm = LLM(
        model=ckpt,
        dtype="bfloat16",
        max_model_len=max(4096, args.max_len + 16),
        enforce_eager=True,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=max(len(prompts), 1),
        seed=0,
        enable_prefix_caching=False,
        disable_log_stats=False,
    )
    warm = make_prompts(2, args.min_len, args.min_len, seed=99)
    for k in KERNELS:
        os.environ[cpu_engine.PREFILL_ENV] = k
        vllm_batch(llm, warm)
    out = {k: {"wall": [], "cpu": [], "ttft_median": [], "ttft_max": [], "stats": None} for k in KERNELS}
    tokens = {}
    for _ in range(args.repeats):
        for k in KERNELS:
            os.environ[cpu_engine.PREFILL_ENV] = k
            before = dict(cpu_engine.STATS)
            r = vllm_batch(llm, prompts)
            stats = {s: cpu_engine.STATS[s] - before[s] for s in before}
            stats["threads"] = cpu_engine.STATS["threads"]
            out[k]["wall"].append(r["wall"])
            out[k]["cpu"].append(r["cpu"])
            out[k]["ttft_median"].append(statistics.median(r["ttft"]))
            out[k]["ttft_max"].append(max(r["ttft"]))
            out[k]["stats"] = stats
            tokens[k] = r["tokens"]
            att = stats["vllm_kernel_seconds"] + stats["dsv4_prefill_seconds"]
            idx = stats["vllm_indexer_seconds"] + stats["dsv4_indexer_seconds"]
            print(
                f"  vllm+plugin prefill={k}: {r['wall']:.2f} s wall, {r['cpu']:.2f} s CPU, attention {att:.2f} s, "
                f"indexer {idx:.2f} s, metadata {stats['metadata_seconds']:.3f} s",
                flush=True,
            )
    # (the summary table is printed after this; the lines above already hold every timed figure:
    # torch 2.13's profiler has crashed (SIGSEGV in kineto's transferCpuTrace) inside vLLM's worker)
    for k in KERNELS:
        os.environ[cpu_engine.PREFILL_ENV] = k
        out[k]["profile"] = profile_batch(llm, prompts) if args.profile else None
    out["same_first_tokens"] = {k: sum(a == b for a, b in zip(tokens["vllm"], tokens[k])) for k in KERNELS[1:]}
    return out


JAX_WORKER = """
import json, sys, time
from dsv4_jax.model.generate import JaxGenerator
spec = json.load(open(sys.argv[1]))
p = spec["prompts"]
gen = JaxGenerator(spec["checkpoint"], dtype="bfloat16", kv_cache_dtype="fp8_ds_mla", max_batch_size=len(p),
                   max_model_len=spec["max_model_len"], max_num_batched_tokens=spec["max_num_batched_tokens"])
gen.generate(p, max_new_tokens=1)  # compiles
import resource
cpu_s = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
walls, cpus = [], []
for _ in range(spec["repeats"]):
    gen.reset_stats()
    c, t = cpu_s(), time.perf_counter(); gen.generate(p, max_new_tokens=1)
    walls.append(time.perf_counter() - t); cpus.append(cpu_s() - c)
json.dump({"wall": walls, "cpu": cpus, "stats": {k: v for k, v in gen.stats.items() if isinstance(v, (int, float))}},
          open(sys.argv[2], "w"))
"""


def run_jax(ckpt: str, prompts, args) -> dict | None:
    if not MAIN_PYTHON.exists():
        print(f"  JAX: skipped ({MAIN_PYTHON} missing; `make .venv/.installed`)")
        return None
    with tempfile.TemporaryDirectory() as d:
        spec, out = Path(d, "spec.json"), Path(d, "out.json")
        spec.write_text(
            json.dumps(
                {
                    "checkpoint": ckpt,
                    "prompts": prompts,
                    "repeats": args.repeats,
                    "max_model_len": max(4096, args.max_len + 16),
                    "max_num_batched_tokens": args.max_num_batched_tokens,
                }
            )
        )
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
        done = subprocess.run(
            [str(MAIN_PYTHON), "-c", JAX_WORKER, spec, out],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=7200,
        )
        if done.returncode != 0:
            raise RuntimeError(f"JAX run failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16, help="query heads (head_dim 512 each)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-jax", action="store_true")
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--checkpoint", help="an official-format checkpoint (default: written to a temp dir)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    from tools.official_checkpoint import vllm_cpu_config, write_official_checkpoint

    tmp = tempfile.TemporaryDirectory()
    ckpt = args.checkpoint or str(
        write_official_checkpoint(
            tmp.name,
            seed=0,
            # positions up to the longest prompt (vLLM refuses a max_model_len above the config's)
            config=vllm_cpu_config(
                num_attention_heads=args.heads, max_position_embeddings=max(8192, args.max_len + 16)
            ),
        )
    )
    prompts = make_prompts(args.prompts, args.min_len, args.max_len)
    n_tok = sum(map(len, prompts))
    print(
        f"{len(prompts)} prompts, {n_tok} prompt tokens ({args.min_len}..{args.max_len}), "
        f"max_num_batched_tokens {args.max_num_batched_tokens}, {args.heads} heads x 512, torch threads: vLLM's"
    )
    res = {"prompts": len(prompts), "prompt_tokens": n_tok, "args": vars(args)}
    res["vllm"] = run_vllm(ckpt, prompts, args)
    res["jax"] = None if args.no_jax else run_jax(ckpt, prompts, args)

    rows = []
    for k in KERNELS:
        name = NAMES[k]
        r = res["vllm"][k]
        w = statistics.median(r["wall"])
        s = r["stats"]
        c = statistics.median(r["cpu"])
        rows.append(
            (
                name,
                w,
                n_tok / w,
                c,
                n_tok / c,
                statistics.median(r["ttft_median"]),
                statistics.median(r["ttft_max"]),
                s["vllm_kernel_seconds"] + s["dsv4_prefill_seconds"],
                s["vllm_indexer_seconds"] + s["dsv4_indexer_seconds"],
                s["metadata_seconds"],
            )
        )
    if res["jax"]:
        j = res["jax"]
        w = statistics.median(j["wall"])
        c = statistics.median(j["cpu"]) if j.get("cpu") else None
        rows.append(
            ("our JAX model (bf16, fp8 cache)", w, n_tok / w, c, n_tok / c if c else None, None, None, None, None, None)
        )
    print(
        f"\n{'run (medians)':42s} {'wall s':>8s} {'tok/s':>8s} {'CPU s':>8s} {'tok/CPU-s':>10s} {'TTFT med s':>11s} "
        f"{'TTFT max s':>11s} {'attention s':>12s} {'indexer s':>10s} {'metadata s':>11s}"
    )
    f = lambda v, fmt: format(v, fmt) if v is not None else "-".rjust(int(fmt.split(".")[0]))  # noqa: E731
    for name, w, tps, c, tpc, tm, tx, att, idx, meta in rows:
        print(
            f"{name:42s} {w:8.2f} {tps:8.1f} {f(c, '8.2f')} {f(tpc, '10.1f')} {f(tm, '11.2f')} {f(tx, '11.2f')} "
            f"{f(att, '12.2f')} {f(idx, '10.2f')} {f(meta, '11.3f')}"
        )
    print(
        f"(our kernels ran on {res['vllm']['dsv4']['stats']['threads']} threads: torch's count in vLLM's worker; "
        f"attention / indexer / metadata: the plugin's timers, last run; indexer = forward_cpu, decode included)"
    )
    v = rows[0]
    for k, d in zip(KERNELS[1:], rows[1:]):
        print(
            f"{NAMES[k]} vs vLLM's: {v[1] / d[1]:.2f}x wall, {v[3] / d[3]:.2f}x CPU time per batch; attention "
            f"{v[7]:.2f} s -> {d[7]:.2f} s ({v[7] / max(d[7], 1e-9):.2f}x), indexer {v[8]:.2f} s -> {d[8]:.2f} s "
            f"({v[8] / max(d[8], 1e-9):.2f}x); first tokens equal in {res['vllm']['same_first_tokens'][k]}/{len(prompts)}"
        )
    for k in KERNELS:
        prof = res["vllm"][k].get("profile")
        if prof:
            print(
                f"\nprofile, prefill={k} (self time, top ops; our kernel is inside vllm::deepseek_v4_cpu_prepare_and_attn):"
            )
            for p in prof:
                print(f"  {p['op']:48s} {p['self_s']:8.2f} s {100 * p['share']:5.1f}%  x{p['calls']}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
