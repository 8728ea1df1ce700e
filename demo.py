"""dsv4-prefill main job: plan a prefill step for every layer kind and show what it costs.

    python demo.py                                   # the spec's worked example batch
    python demo.py --seq-lens 4096,900,17 --query-lens 512,900,17 --window-size 128
"""

from __future__ import annotations

import argparse
import sys

from planner import PrefillBatch
from planner.report import SPEC_LIMITS, SPEC_QUERY_LENS, SPEC_SEQ_LENS, plan_report


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int_list, default=list(SPEC_SEQ_LENS), help="context length of each request after this step")
    p.add_argument("--query-lens", type=int_list, default=list(SPEC_QUERY_LENS), help="new tokens of each request this step")
    p.add_argument("--window-size", type=int, default=SPEC_LIMITS["window_size"])
    p.add_argument("--max-model-len", type=int, default=SPEC_LIMITS["max_model_len"])
    p.add_argument("--max-num-batched-tokens", type=int, default=SPEC_LIMITS["max_num_batched_tokens"])
    p.add_argument("--prefill-chunk-size", type=int, default=SPEC_LIMITS["prefill_chunk_size"])
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    limits = dict(
        window_size=args.window_size,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_chunk_size=args.prefill_chunk_size,
    )
    try:
        batch = PrefillBatch(args.seq_lens, args.query_lens, args.max_model_len, args.max_num_batched_tokens)
        print(plan_report(batch, limits))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
