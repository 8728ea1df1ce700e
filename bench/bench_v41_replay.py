"""What DeepSeek-V4.1's decoder bounded replay saves: FLOPs of one prefill step, with and without it.

    .venv/bin/python -m bench.bench_v41_replay [--json out.json]

`planner.cost.step_flops` at the released V4.1 shapes (`contract.V41_PRESETS["V4.1"]`: 40 layers,
the cut at layer 20) for a few batches: every row at every layer with full windows (transformers'
computation, replay off) against vLLM's default (layers 20-39 on each request's last 128 rows;
layer 20 also writes every row's KV). A count of arithmetic, not a timing: what it bounds is the
work, not the speed; the attention / indexer / projections / MoE split shows where the saving is.
"""

from __future__ import annotations

import argparse
import json

from planner import PrefillBatch, cost
from planner.contract import preset
from planner.report import table

# (name, seq_lens, query_lens): fresh prompts, a chunk of a long prompt, decode-sized requests
BATCHES = (
    ("one 4K prompt", [4096], [4096]),
    ("one 16K prompt", [16384], [16384]),
    ("8K chunk of a 64K prompt", [65536], [8192]),
    ("prompts: 16 x 512", [512] * 16, [512] * 16),
    ("prompts: 64 x 128", [128] * 64, [128] * 64),
    ("mixed: 2 x 8K + 32 x 64", [8192, 8192] + [64] * 32, [8192, 8192] + [64] * 32),
)
PARTS = ("attention", "indexer", "projections", "moe")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    config = preset("V4.1")
    rows, records = [], []
    for name, seq, qry in BATCHES:
        batch = PrefillBatch(seq, qry)
        exact = cost.step_flops(config, batch, replay=False)
        replay = cost.step_flops(config, batch, replay=None)
        sums = {
            mode: {part: sum(getattr(f, part) for f in flops) for part in PARTS}
            for mode, flops in (("exact", exact), ("replay", replay))
        }
        tot = {mode: sum(v.values()) for mode, v in sums.items()}
        rows.append(
            [name, batch.num_tokens, f"{tot['exact'] / 1e12:.2f}", f"{tot['replay'] / 1e12:.2f}"]
            + [f"{100 * (1 - sums['replay'][p] / sums['exact'][p]):.1f}%" for p in PARTS]
            + [f"{100 * (1 - tot['replay'] / tot['exact']):.1f}%"]
        )
        records.append(dict(batch=name, tokens=batch.num_tokens, flops=sums))
    print("DeepSeek-V4.1 prefill step FLOPs (planner.cost.step_flops, released shapes): replay off vs vLLM's default")
    print(table(rows, ["batch", "tokens", "TFLOP exact", "TFLOP replay"] + [f"saved {p}" for p in PARTS] + ["saved"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
