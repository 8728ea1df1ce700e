"""A DeepSeek-V4.1 prefill step of the JAX model, with and without decoder bounded replay.

    .venv/bin/python -m bench.bench_v41_model [--part tiny|real|both] [--repeats 3] [--json out.json]

Two parts, each timing `DeepseekV41.step` (the planner, the metadata, every layer; compile
excluded: one warm-up step first) with `replay=False` (every row, full windows: transformers'
computation) against `replay=None` (vLLM's default bounded replay):

* tiny: the whole step of the tiny V4.1 checkpoint (`tools.tiny_checkpoint --model v4.1`, 7
  layers, window 16, fake quantization on) on a few batches; and how far replay's logits of each
  request's last token are from the exact ones (fake quantization off, so only replay differs):
  the largest |logit difference| and whether the greedy tokens agree.
* real: the released layer shapes (hidden 5120, 64 heads of 512, q rank 1280, o 8 x 1024, 32
  indexer heads, index_topk 512, window 128, candidate blocks 2048 x 8, MoE 6 of 2304 per token
  plus the shared expert), one layer of each variant (the tiny schedule's 7 roles at real widths,
  random float32 weights; 8 routed experts instead of 384: the per-token work, 6 active experts, is
  the released one; vocabulary 1024, no Engram), each layer timed (waited for) in a step of one
  request. The released 40-layer step is then composed from the per-layer times: 2 window layers,
  3 ratio-2 sources, 15 ratio-2 reuses, the ratio-1 cut (candidate source), 15 ratio-1 reuses, 4
  Reindex layers; with replay the cut and the 19 layers after it take their kept-rows times.
  Alongside: `planner.cost.step_flops` of the released schedule for the same batch (the FLOP
  saving), and the machine's float32 matmul ceiling measured in this process (`bench.common`).

The machine may be shared: read the ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

TINY_BATCHES = (
    ("one 480-token prompt", [0], [480]),
    ("4 x 120-token prompts", [0, 0, 0, 0], [120, 120, 120, 120]),
    ("256-token chunk after 256", [256], [256]),
)
RELEASED_COUNTS = (  # (variant of the 7-layer real-width schedule, layers of the released 40)
    (0, 2),  # window
    (1, 3),  # ratio-2 KV + index source
    (2, 15),  # ratio-2 reuse
    (3, 1),  # ratio-1 source, candidate source, the cut
    (4, 15),  # ratio-1 reuse
    (5, 4),  # ratio-1 Reindex, candidate consumer
)


def _prompt(n, seed):
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


_PREFIXES: dict = {}


def _run(model, prefix, q_lens, seed=0, timings=None):
    """One prefill step of requests whose prefixes earlier steps wrote (once per model and batch,
    untimed; each timed step starts from a copy of that cache)."""
    import jax
    import jax.numpy as jnp

    slots = list(range(len(q_lens)))
    prompts = [_prompt(p + q, seed + i) for i, (p, q) in enumerate(zip(prefix, q_lens))]
    key = (id(model), tuple(prefix), tuple(q_lens), seed)
    if key not in _PREFIXES:
        cache = model.init_cache()
        for i, p in enumerate(prefix):
            if p:
                cache, _ = model.step(cache, [i], [0], [prompts[i][:p]])
        _PREFIXES[key] = cache
    cache = jax.tree.map(jnp.copy, _PREFIXES[key])
    jax.block_until_ready(cache)
    t0 = time.perf_counter()
    cache, out = model.step(cache, slots, prefix, [pr[p:] for pr, p in zip(prompts, prefix)], timings=timings)
    logits = np.asarray(out.logits)[: len(q_lens)]
    return time.perf_counter() - t0, logits, out.plan


def tiny_part(repeats: int, checkpoint=None) -> list[dict]:
    from dsv4_jax.model.v41 import DeepseekV41
    from dsv4_jax.model.v41_checkpoint import load_checkpoint
    from tools.tiny_checkpoint import write_tiny_v41_checkpoint

    with tempfile.TemporaryDirectory() as d:
        ckpt = Path(checkpoint) if checkpoint else write_tiny_v41_checkpoint(Path(d) / "tiny", seed=0)
        cfg, params = load_checkpoint(ckpt)
        tok = ckpt / "tokenizer.json"
        kw = dict(max_batch_size=4, max_model_len=1024, max_num_batched_tokens=512, tokenizer_file=tok)
        models = {
            (replay, fq): DeepseekV41(cfg, params, replay=replay, fake_quant=fq, **kw)
            for replay in (False, None)
            for fq in (True, False)
        }
        rows = []
        for name, prefix, q in TINY_BATCHES:
            rec = {"batch": name, "tokens": sum(q)}
            for replay in (False, None):
                m = models[(replay, True)]
                _run(m, prefix, q)  # compile
                rec["exact_ms" if replay is False else "replay_ms"] = 1e3 * statistics.median(
                    _run(m, prefix, q)[0] for _ in range(repeats)
                )
            _, exact, _ = _run(models[(False, False)], prefix, q)
            _, rep, plan = _run(models[(None, False)], prefix, q)
            rec["plans"] = plan.num_plans
            rec["max_abs_dlogit"] = float(np.abs(exact - rep).max())
            rec["greedy_agree"] = f"{int((exact.argmax(-1) == rep.argmax(-1)).sum())}/{len(q)}"
            rows.append(rec)
        return rows


def real_config(vocab: int = 1024, experts: int = 8) -> dict:
    from planner.contract import preset

    cfg = preset("V4.1")
    cfg.update(
        vocab_size=vocab,
        num_hidden_layers=7,
        compress_ratios=[0, 2, 2, 1, 1, 1, 1],
        kv_source_layer_ids=[1, 3],
        index_source_layer_ids=[1, 3, 5],
        candidate_source_layer_id=3,
        n_routed_experts=experts,
        engram_layer_ids=[],
        num_nextn_predict_layers=0,
        rms_norm_eps=1e-6,
    )
    return cfg


def real_params(cfg, seed: int = 0) -> dict:
    """One layer's random float32 weights at the config's widths (a superset: compressor with a
    gate, indexer with wk), shared by every layer of the model; small norms around 1."""
    import jax
    import jax.numpy as jnp

    key = iter(jax.random.split(jax.random.key(seed), 64))
    hid, H, D, qr = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    G, orank, nh, dh = cfg.o_groups, cfg.o_lora_rank, cfg.index_n_heads, cfg.index_head_dim
    E, inter, n = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hc_mult

    def w(*shape):
        return jax.random.normal(next(key), shape, jnp.float32) * shape[-1] ** -0.5

    def norm(d):
        return 1 + 0.1 * jax.random.normal(next(key), (d,), jnp.float32)

    def hc():
        return {"fn": w((2 + n) * n, n * hid), "base": 0.5 * w((2 + n) * n), "scale": jnp.ones(3, jnp.float32)}

    layer = {
        "attn_norm": norm(hid),
        "ffn_norm": norm(hid),
        "attn_hc": hc(),
        "ffn_hc": hc(),
        "attn": {
            "wq_a": w(qr, hid),
            "q_norm": norm(qr),
            "wq_b": w(H * D, qr),
            "wkv": w(D, hid),
            "kv_norm": norm(D),
            "wo_a": w(G * orank, H * D // G),
            "wo_b": w(hid, G * orank),
            "sink": jax.random.normal(next(key), (H,), jnp.float32),
            "compressor": {"wkv": w(D, hid), "wgate": w(D, hid), "norm": norm(D)},
            "indexer": {"wq_b": w(nh * dh, qr), "weights_proj": w(nh, hid), "wk": w(dh, D), "k_norm": norm(dh)},
        },
        "ffn": {
            "gate": w(E, hid),
            "bias": 0.1 * w(E),
            "w13": w(E, 2 * inter, hid),
            "w2": w(E, hid, inter),
            "shared_w1": w(inter, hid),
            "shared_w3": w(inter, hid),
            "shared_w2": w(hid, inter),
        },
    }
    return {
        "embed": jax.random.normal(next(key), (cfg.vocab_size, hid), jnp.float32),
        "head": w(cfg.vocab_size, hid),
        "norm": norm(hid),
        "layers": [layer] * cfg.num_hidden_layers,
    }


def real_part(repeats: int, context: int, new: int) -> dict:
    from dsv4_jax.model.v41 import DeepseekV41
    from dsv4_jax.model.v41_config import V41Config
    from planner import PrefillBatch, cost
    from planner.contract import preset

    cfg = V41Config.from_dict(real_config(), name="V4.1 real widths, 7 roles")
    params = real_params(cfg)
    prefix = context - new
    kw = dict(max_batch_size=1, max_model_len=context + 128, max_num_batched_tokens=max(new, prefix, 1))
    out = {"context": context, "new_tokens": new, "layers": {}}
    models = {
        mode: DeepseekV41(cfg, params, replay=replay, **kw) for mode, replay in (("exact", False), ("replay", None))
    }
    for m in models.values():
        _run(m, [prefix], [new])  # compile
    per = {mode: [] for mode in models}
    for _ in range(repeats):  # the modes interleaved: a change of the machine's load hits both
        for mode, m in models.items():
            t = []
            _run(m, [prefix], [new], timings=t)
            per[mode].append(t)
    ms = {}
    for mode, runs in per.items():
        ms[mode] = [1e3 * statistics.median(p[i][3] for p in runs) for i in range(cfg.num_hidden_layers)]
        out["layers"][mode] = {
            f"{i}:{runs[0][i][1]}:{runs[0][i][2]}": ms[mode][i] for i in range(cfg.num_hidden_layers)
        }
    out["released_step_ms"] = {mode: sum(ms[mode][v] * c for v, c in RELEASED_COUNTS) for mode in ms}
    batch = PrefillBatch([context], [new])
    released = preset("V4.1")
    flops = {
        mode: sum(
            f.attention + f.indexer + f.projections + f.moe for f in cost.step_flops(released, batch, replay=replay)
        )
        for mode, replay in (("exact", False), ("replay", None))
    }
    out["released_step_tflop"] = {k: v / 1e12 for k, v in flops.items()}
    return out


def main(argv=None) -> None:
    from bench.common import cpu_ceiling, describe_ceiling
    from planner.report import table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("tiny", "real", "both"), default="both")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--real-repeats", type=int, default=2)
    ap.add_argument("--context", type=int, default=512, help="real part: tokens after the step")
    ap.add_argument(
        "--new", type=int, default=512, help="real part: new tokens of the step (a fresh prompt: = context)"
    )
    ap.add_argument("--checkpoint", help="tiny part: a V4.1 checkpoint instead of the tiny one")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    import os

    ceiling = cpu_ceiling(os.cpu_count() or 1)
    print(f"machine ceiling: {describe_ceiling(ceiling)}")
    report = {"ceiling": ceiling}
    if args.part in ("tiny", "both"):
        rows = tiny_part(args.repeats, args.checkpoint)
        report["tiny"] = rows
        print("\nTiny V4.1 checkpoint: one prefill step (ms, median), exact vs bounded replay")
        print(
            table(
                [
                    [
                        r["batch"],
                        r["tokens"],
                        f"{r['exact_ms']:.1f}",
                        f"{r['replay_ms']:.1f}",
                        f"{r['exact_ms'] / r['replay_ms']:.2f}x",
                        r["plans"],
                        f"{r['max_abs_dlogit']:.3g}",
                        r["greedy_agree"],
                    ]
                    for r in rows
                ],
                ["batch", "tokens", "exact ms", "replay ms", "speed-up", "plans", "max |dlogit|", "greedy agree"],
            )
        )
    if args.part in ("real", "both"):
        real = real_part(args.real_repeats, args.context, args.new)
        report["real"] = real
        gf = ceiling["gflops"]
        print(
            f"\nReal layer shapes, one request: {args.new} new tokens, context {args.context} "
            "(ms per layer, median, waited for)"
        )
        lay = real["layers"]
        print(
            table(
                [
                    [a, f"{va:.1f}", b, f"{vb:.1f}"]
                    for (a, va), (b, vb) in zip(lay["exact"].items(), lay["replay"].items())
                ],
                ["layer:variant (exact)", "ms", "layer:variant:band (replay)", "ms"],
            )
        )
        s, f = real["released_step_ms"], real["released_step_tflop"]
        print(
            f"\nReleased 40-layer step composed from them: exact {s['exact'] / 1e3:.2f} s, replay "
            f"{s['replay'] / 1e3:.2f} s ({s['exact'] / s['replay']:.2f}x); planner FLOPs {f['exact']:.2f} vs "
            f"{f['replay']:.2f} TFLOP ({f['exact'] / f['replay']:.2f}x)"
            + f"; exact at {f['exact'] * 1e3 / (s['exact'] / 1e3):.0f} GFLOP/s vs the ceiling's {gf:.0f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
