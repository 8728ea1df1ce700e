"""Host prefill-planning time per step inside vLLM 0.33.0: vLLM's per-layer planning vs the plugin.

    .venv-vllm/bin/python -m bench.bench_vllm_planning [--seconds 1.5] [--models V4-Flash,V4-Pro,V4.1]
        [--sizes 8,64,256,1024] [--json out.json]

Both sides run vLLM's own `DeepseekSparseSWAMetadata` objects with the prefill fields vLLM's
builder fills (CPU int32 tensors): "vLLM" calls vLLM 0.33.0's own `get_prefill_chunk_plan` once
per attention layer, as `_forward_prefill` does (44 calls a step on V4-Flash, 62 on V4-Pro, MTP
included; SWA layers ask with ratio 1); "plugin" makes the same calls on the method the plugin
installed (loaded by vLLM's loader), which plans each kind once per step (3 plans) and answers the
other calls from the step's cache. Each step gets a fresh metadata object (vLLM builds one per
step), made before the clock starts. Batches: `bench.common.scaling_batch` (contexts up to 1M
tokens, 8192 batched tokens shared by the requests). The two sides run in alternating blocks in
one process; medians over blocks; read the ratio, the machine may be shared.

DeepSeek-V4.1 (the released 40-layer schedule, `planner.Schedule.from_name("V4.1")`; its layers
ask with `has_compressed = ratio != 0`): "V4.1 replay" is a step with vLLM's decoder bounded
replay, as `DeepseekV41ModelState._prepare_replay_batch` builds it: layers 0-19 plan on the
batch's metadata, the cut (layer 20) on the kept rows' first-SWA metadata and layers 21-39 on the
replay batch's (each request's last min(query_len, 128) rows; vLLM makes a replay batch only when
some request has more rows than that, else every layer runs on the batch); "V4.1" is the same step
without replay (`swa_bounded_replay` off, prompt logprobs, FULL graphs): 40 layers on the batch.
The plugin shares plans between metadata objects with equal lengths, so every step starts with
`chunk_plan.forget_steps()` on its side (a real step's lengths are new; this bench reuses one
batch per size).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import planner
from bench.common import scaling_batch
from planner import ModelShape
from planner.report import table

WINDOW, MAX_MODEL_LEN, MAX_BATCHED, CHUNK = 128, 1 << 20, 8192, 4
SIZES = (8, 64, 256, 1024)
MODELS = ("V4-Flash", "V4-Pro", "V4.1 replay", "V4.1")


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


def v41_batch(n: int, seed: int):
    """`n` requests sharing 8192 batched tokens, a few of them longer than the window (what makes
    vLLM build a replay batch): min(n // 8, 4096 // 129) requests, at least one, share half the
    tokens with more than 128 each; the others share the rest (`scaling_batch`)."""
    rng = np.random.default_rng(seed)
    n_long = max(1, min(n // 8, (MAX_BATCHED // 2) // (WINDOW + 1)))
    per_long = max(WINDOW + 1, (MAX_BATCHED // 2) // n_long)
    q_long = rng.integers(WINDOW + 1, per_long + 1, n_long)
    seq_s, q_s = scaling_batch(max(1, n - n_long), seed=seed, max_model_len=MAX_MODEL_LEN, tokens=MAX_BATCHED // 2)
    seq_s, q_s = seq_s[: n - n_long], q_s[: n - n_long]
    qry = np.concatenate([q_long, np.asarray(q_s, dtype=np.int64)])
    seq = np.concatenate([np.maximum(q_long, rng.integers(1, MAX_MODEL_LEN + 1, n_long)), np.asarray(seq_s, np.int64)])
    perm = rng.permutation(n)
    return seq[perm].tolist(), qry[perm].tolist()


def step_calls(model: str, seq, qry):
    """One step's calls: [(metadata number, compress_ratio, has_compressed)] per attention layer,
    the metadata objects' query lengths, and whether the step replays."""
    if model.startswith("V4.1"):
        sched = planner.Schedule.from_name("V4.1")
        replay = model.endswith("replay") and max(qry) > WINDOW  # vLLM's condition for a replay batch
        calls = []
        for role in sched:
            md = 0 if not replay or role.layer_id < sched.cut else 1 if role.is_cut else 2
            calls.append((md, role.compress_ratio, role.compress_ratio != 0))
        kept = [min(q, WINDOW) for q in qry]
        return calls, [qry, kept, kept] if replay else [qry], replay
    # vLLM's DeepseekV4Attention: compress_ratio = max(1, ratio); SWA layers ask with 1
    return [(0, max(1, spec.compress_ratio), None) for spec in ModelShape.from_name(model).layers], [qry], False


def time_steps(method, makes, calls, steps: int, before_step=None) -> float:
    """Seconds per step: `steps` fresh sets of metadata objects, each asked once per layer."""
    mds = [[make() for make in makes] for _ in range(steps)]
    t0 = time.perf_counter()
    for step in mds:
        if before_step is not None:
            before_step()
        for m, r, hc in calls:
            method(step[m], r, CHUNK, hc)
    return (time.perf_counter() - t0) / steps


def measure(seconds: float, models=MODELS, sizes=SIZES) -> list[dict]:
    from dsv4_torch.vllm import chunk_plan

    theirs, ours, cls = vllm_methods()
    forget = chunk_plan.forget_steps
    rows = []
    for model in models:
        for n in sizes:
            if model.startswith("V4.1"):
                seq, qry = v41_batch(n, seed=n)
            else:
                seq, qry = scaling_batch(n, seed=n, max_model_len=MAX_MODEL_LEN, tokens=MAX_BATCHED)
            calls, query_sets, replay = step_calls(model, seq, qry)
            makes = [metadata_factory(cls, seq, q) for q in query_sets]
            forget()
            a, b = [make() for make in makes], [make() for make in makes]
            for m, r, hc in calls:  # both plan the same thing
                assert ours(a[m], r, CHUNK, hc) == theirs(b[m], r, CHUNK, hc), (model, n, m, r)
            planned = len({id(chunk_plan.step_plans(md)) for md in a})
            plans = sum(chunk_plan.step_plans(md).planned for md in a[:planned])
            v, p, blocks = side_by_side(theirs, ours, makes, calls, seconds, forget)
            row_replay = {}
            if replay:  # the replay batch's calls alone (the cut and layers 21-39 on the kept rows)
                kept_calls = [c for c in calls if c[0] > 0]
                rv, rp, _ = side_by_side(theirs, ours, makes, kept_calls, seconds / 2, forget)
                row_replay = dict(
                    replay_calls=len(kept_calls), replay_vllm_ms=round(rv, 3), replay_plugin_ms=round(rp, 4)
                )
                row_replay["replay_ratio"] = round(rv / rp, 1)
            rows.append(
                dict(
                    model=model,
                    layers=len(calls),
                    plans=plans,
                    replay=replay,
                    requests=n,
                    tokens=int(sum(qry)),
                    max_context=int(max(seq)),
                    vllm_ms=round(v, 3),
                    plugin_ms=round(p, 4),
                    ratio=round(v / p, 1),
                    blocks=blocks,
                    **row_replay,
                )
            )
    return rows


def side_by_side(theirs, ours, makes, calls, seconds: float, forget):
    """(vLLM ms, plugin ms, blocks) per step: medians of alternating blocks."""
    one = time_steps(theirs, makes, calls, 1)
    steps_v = max(1, int(0.1 / max(one, 1e-6)))  # vLLM blocks of ~0.1 s
    steps_p = max(10, steps_v * 10)
    tv, tp, t_end = [], [], time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(tv) < 5:
        tv.append(time_steps(theirs, makes, calls, steps_v))
        tp.append(time_steps(ours, makes, calls, steps_p, forget))
    return float(np.median(tv)) * 1e3, float(np.median(tp)) * 1e3, len(tv)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.5, help="time per (model, size) and side, at least 5 blocks")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {MODELS}")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="requests per step, comma-separated")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    models = tuple(m.strip() for m in args.models.split(","))
    bad = [m for m in models if m not in MODELS]
    if bad:
        ap.error(f"--models: {bad} not in {MODELS}")
    rows = measure(args.seconds, models, tuple(int(x) for x in args.sizes.split(",")))
    print("Host prefill-planning time per step, vLLM 0.33.0 (median; alternating blocks, one process):")
    print(
        table(
            [
                [
                    r["model"],
                    r["layers"],
                    r["plans"],
                    "yes" if r["replay"] else "no",
                    r["requests"],
                    r["tokens"],
                    r["max_context"],
                    r["vllm_ms"],
                    r["plugin_ms"],
                    f"{r['ratio']}x",
                ]
                for r in rows
            ],
            [
                "model",
                "plan calls",
                "plugin plans",
                "replay batch",
                "requests",
                "tokens",
                "max context",
                "vLLM per-layer ms",
                "plugin ms",
                "ratio",
            ],
        )
    )
    replayed = [r for r in rows if "replay_calls" in r]
    if replayed:
        print("\nThe replay batch's calls alone (the cut and layers 21-39 on the kept rows' two metadata objects):")
        print(
            table(
                [
                    [
                        r["requests"],
                        r["replay_calls"],
                        r["replay_vllm_ms"],
                        r["replay_plugin_ms"],
                        f"{r['replay_ratio']}x",
                    ]
                    for r in replayed
                ],
                ["requests", "plan calls", "vLLM per-layer ms", "plugin ms", "ratio"],
            )
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
