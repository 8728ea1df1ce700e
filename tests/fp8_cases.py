"""Prefill cases on vLLM's fp8_ds_mla pages (NumPy): what both frameworks' fp8 prefill tests feed in.

`fp8_case` makes a `tests.cases` case with D = 512 whose raw and compressed latents are quantized
into shuffled fp8_ds_mla pages by the NumPy reference writer (`planner.kvcache`); the case's rows
are then replaced by what the pages hold (the dequantized values), so the float64 oracle runs on
exactly the rows a prefill reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from planner import kvcache as KV
from tests.cases import PrefillCase, make_case

D = KV.HEAD_DIM
RAW_SLOTS = 16  # slots per raw page here (vLLM: 64); compressed pages: max(1, RAW_SLOTS // r) ... S = 2 at r=128 too
GARBAGE = 0xFF  # bytes no gathered slot owns: e4m3 NaN codes and scale 255, NaN if ever read


@dataclass
class Fp8Pages:
    pages: np.ndarray  # uint8 (num_pages, page_bytes(S))
    block_table: np.ndarray  # int32 (B, max_pages)
    block_size: int
    rows: list[np.ndarray]  # per request, float32 holding the dequantized (bf16) values


def bf16_values(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def quantize_paged(rows: list[np.ndarray], S: int, seed: int) -> Fp8Pages:
    """Write per-request rows (len_i, 512) into shuffled fp8_ds_mla pages of S slots (planner.kvcache)."""
    rng = np.random.default_rng(seed)
    counts = [-(-len(x) // S) for x in rows]
    total = sum(counts) + 1
    perm = rng.permutation(total)
    pages = np.full((total, KV.page_bytes(S)), GARBAGE, np.uint8)
    table = np.zeros((len(rows), max(max(counts), 1)), np.int32)
    k, ks, slots = 0, [], []
    for i, x in enumerate(rows):
        for j in range(counts[i]):
            table[i, j] = perm[k]
            k += 1
        e = np.arange(len(x))
        slots.append(table[i, e // S].astype(np.int64) * S + e % S)
        ks.append(bf16_values(x))
    if ks and sum(len(x) for x in ks):
        KV.quantize_and_insert_k_cache(np.concatenate(ks), pages, np.concatenate(slots), S)
    deq = []
    for i, x in enumerate(rows):
        out = np.zeros((1, max(len(x), 1), D), np.float32)
        KV.dequantize_and_gather_k_cache(out, pages, [len(x)], None, table[i : i + 1], S, 0)
        deq.append(out[0, : len(x)])
    return Fp8Pages(pages, table, S, deq)


def comp_slots(ratio: int) -> int:
    return max(2, RAW_SLOTS // max(ratio, 1))


def fp8_case(
    name, seq_lens, query_lens, ratio, *, seed=0, scale=1.0, **kw
) -> tuple[PrefillCase, Fp8Pages, Fp8Pages | None]:
    """(case with D = 512 and dequantized rows, raw pages, compressed pages or None).

    scale multiplies the latents before quantization (tiny and huge magnitudes: other scale bytes).
    """
    case = make_case(name, seq_lens, query_lens, ratio, D=D, seed=seed, **kw)
    raw = quantize_paged([x * scale for x in case.raw], RAW_SLOTS, seed + 11)
    comp = (
        quantize_paged([x * scale for x in case.comp], comp_slots(ratio), seed + 12)
        if case.kind.has_compressed
        else None
    )
    case.raw = raw.rows
    if comp is not None:
        case.comp = comp.rows
    case.q = bf16_values(case.q)
    return case, raw, comp


def fp8_cases(ratio: int, kind=None) -> list:
    """A few fp8 cases per kind: fresh, long prefixes with small chunks, a zero-query request."""
    kw = dict(window_size=8, H=2, kind=kind)
    return [
        fp8_case("fp8-fresh", [3, 9, 21], [3, 9, 21], ratio, seed=1, **kw),
        fp8_case("fp8-long-prefix", [300, 517, 131], [7, 13, 4], ratio, seed=2, scale=1e-3, **kw),
        fp8_case("fp8-zero-query", [40, 200, 9], [0, 5, 9], ratio, seed=3, scale=300.0, **kw),
    ]
