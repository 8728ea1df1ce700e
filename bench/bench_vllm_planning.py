"""Host prefill-planning time per step inside vLLM 0.33.0: vLLM's per-layer planning vs the plugin.

    .venv-vllm/bin/python -m bench.bench_vllm_planning [--seconds 1.5] [--json out.json]

Both sides run vLLM's own `DeepseekSparseSWAMetadata` objects with the prefill fields vLLM's
builder fills (CPU int32 tensors): "vLLM" calls vLLM 0.33.0's own `get_prefill_chunk_plan` once
per attention layer, as `_forward_prefill` does (44 calls a step on V4-Flash, 62 on V4-Pro, MTP
included; SWA layers ask with ratio 1); "plugin" makes the same calls on the method the plugin
installed (loaded by vLLM's loader), which plans each kind once per step (3 plans) and answers the
other calls from the step's cache. Each step gets a fresh metadata object (vLLM builds one per
step), made before the clock starts. Batches: `bench.common.scaling_batch` (contexts up to 1M
tokens, 8192 batched tokens shared by the requests). The two sides run in alternating blocks in
one process; medians over blocks; read the ratio, the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from bench.common import scaling_batch
from planner import ModelShape
from planner.report import table

WINDOW, MAX_MODEL_LEN, MAX_BATCHED, CHUNK = 128, 1 << 20, 8192, 4
SIZES = (8, 64, 256, 1024)


def vllm_methods():
    """(vLLM's own method, the plugin's method, the metadata class), the plugin loaded by vLLM."""
    import vllm.plugins

    vllm.plugins.load_general_plugins()
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata

    from dsv4_torch.vllm.plugin import original

    ours = DeepseekSparseSWAMetadata.get_prefill_chunk_plan
    theirs = original(ours)
    if theirs is None:
        raise SystemExit("the dsv4_prefill plugin is not active (is dsv4-prefill installed in this venv?)")
    return theirs, ours, DeepseekSparseSWAMetadata


def metadata_factory(cls, seq, qry):
    import torch

    seq_t, qry_t = torch.tensor(seq, dtype=torch.int32), torch.tensor(qry, dtype=torch.int32)
    empty = torch.zeros(0, dtype=torch.int32)

    def make():
        return cls(
            block_table=empty,
            slot_mapping=empty,
            block_size=64,
            num_prefills=len(seq),
            num_prefill_tokens=int(sum(qry)),
            prefill_seq_lens_cpu=seq_t,
            prefill_query_lens_cpu=qry_t,
            prefill_window_size=WINDOW,
            prefill_max_model_len=MAX_MODEL_LEN,
            prefill_max_num_batched_tokens=MAX_BATCHED,
        )

    return make


def time_steps(method, make, ratios, steps: int) -> float:
    """Seconds per step: `steps` fresh metadata objects, each asked once per layer."""
    mds = [make() for _ in range(steps)]
    t0 = time.perf_counter()
    for md in mds:
        for r in ratios:
            method(md, r, CHUNK)
    return (time.perf_counter() - t0) / steps


def measure(seconds: float) -> list[dict]:
    theirs, ours, cls = vllm_methods()
    rows = []
    for model in ("V4-Flash", "V4-Pro"):
        # vLLM's DeepseekV4Attention: compress_ratio = max(1, ratio); SWA layers ask with 1
        ratios = [max(1, spec.compress_ratio) for spec in ModelShape.from_name(model).layers]
        for n in SIZES:
            seq, qry = scaling_batch(n, seed=n, max_model_len=MAX_MODEL_LEN, tokens=MAX_BATCHED)
            make = metadata_factory(cls, seq, qry)
            md_a, md_b = make(), make()
            for r in set(ratios):  # both plan the same thing
                assert ours(md_a, r, CHUNK) == theirs(md_b, r, CHUNK), (model, n, r)
            one = time_steps(theirs, make, ratios, 1)
            steps_v = max(1, int(0.1 / max(one, 1e-6)))  # vLLM blocks of ~0.1 s
            steps_p = max(10, steps_v * 10)
            tv, tp, t_end = [], [], time.perf_counter() + seconds
            while time.perf_counter() < t_end or len(tv) < 5:
                tv.append(time_steps(theirs, make, ratios, steps_v))
                tp.append(time_steps(ours, make, ratios, steps_p))
            v, p = float(np.median(tv)) * 1e3, float(np.median(tp)) * 1e3
            rows.append(
                dict(
                    model=model,
                    layers=len(ratios),
                    requests=n,
                    tokens=int(sum(qry)),
                    max_context=int(max(seq)),
                    vllm_ms=round(v, 3),
                    plugin_ms=round(p, 4),
                    ratio=round(v / p, 1),
                    blocks=len(tv),
                )
            )
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.5, help="time per (model, size) and side, at least 5 blocks")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    rows = measure(args.seconds)
    print("Host prefill-planning time per step, vLLM 0.33.0 (median; alternating blocks, one process):")
    print(
        table(
            [
                [
                    r["model"],
                    r["layers"],
                    r["requests"],
                    r["tokens"],
                    r["max_context"],
                    r["vllm_ms"],
                    r["plugin_ms"],
                    f"{r['ratio']}x",
                ]
                for r in rows
            ],
            ["model", "plan calls", "requests", "tokens", "max context", "vLLM per-layer ms", "plugin ms", "ratio"],
        )
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
