"""Cases for DeepSeek-V4.1's cache records (`planner.kvcache_v41`), shared by the NumPy, torch and
JAX tests: rows that hit every rounding rule (ties, saturation, zero and tiny groups, huge
groups), slot mappings, pages full of random bytes (NaN codes, scale bytes 0 and 255 included),
and gather requests."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from planner import kvcache_v41 as V


def bf16(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def rows(rng, T: int, dims: int, *, as_bf16: bool = True) -> np.ndarray:
    """[T, dims] float32 rows: per-row magnitudes from 1e-30 to 1e30, some zero groups, some groups
    of exact e2m1 / e4m3 ties, some huge outliers (saturation)."""
    x = rng.standard_normal((T, dims)) * 10.0 ** rng.integers(-30, 31, (T, 1))
    x[rng.random((T, dims)) < 0.02] = 0.0
    if T > 2:
        x[1, : dims // 4] = 0.0  # whole zero groups
        ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 0.1, 2.0**-12, 3.0])
        x[2] = rng.choice(ties, dims) * rng.choice([-1, 1], dims) * 2.0 ** rng.integers(-3, 4)
    x = x.astype(np.float32)
    return bf16(x) if as_bf16 else x


def slot_mapping(rng, T: int, num_slots: int) -> np.ndarray:
    s = rng.permutation(num_slots)[:T].astype(np.int64)
    s[rng.random(s.shape[0]) < 0.2] = -1
    return s


def random_pages(rng, nb: int, S: int, record: V.Record, pad: int = 0) -> np.ndarray:
    """uint8 [nb, S, W] pages of random bytes (a strided view with `pad` bytes after each page)."""
    W = record.bytes
    base = rng.integers(0, 256, (nb, S * W + pad), dtype=np.uint8)
    return np.lib.stride_tricks.as_strided(base, (nb, S, W), (S * W + pad, W, 1), writeable=True)


def gather_case(rng, nb: int, S: int, R: int = 3):
    """(seq_lens, gather_lens, block_table, rows, offset) for requests over nb pages of S slots."""
    seq = rng.integers(0, nb * S + 1, R).astype(np.int32)
    seq[0] = nb * S
    glen = np.minimum(seq, rng.integers(0, nb * S + 1, R)).astype(np.int32)
    bt = np.stack([rng.permutation(nb) for _ in range(R)]).astype(np.int32)
    offset = int(rng.integers(0, 4))
    return seq, glen, bt, nb * S + offset + 2, offset


def rope_case(rng, T: int, ratio: int, max_pos: int = 64):
    """(positions int64 [T], cos_sin_cache float32 [max_pos, 64]) with real rotations."""
    pos = rng.integers(0, max_pos, T).astype(np.int64)
    theta = rng.random((max_pos, 32)) * 2 * np.pi
    cs = np.concatenate([np.cos(theta), np.sin(theta)], axis=1).astype(np.float32)
    return pos, cs


def mxfp8_paged(rows: list[np.ndarray], S: int, seed: int, layout: str):
    """Per-request rows (len_i, 512) written into shuffled mxfp8 pages (total, S, 528) in `layout`
    (bytes no slot owns: 0xFF, NaN if ever read); returns (pages, block_table int32, the rows the
    pages hold: dequantized, float32 holding bf16 values)."""
    rng = np.random.default_rng(seed)
    counts = [-(-len(x) // S) for x in rows]
    total = sum(counts) + 1
    perm = rng.permutation(total)
    pages = np.full((total, S, 528), 0xFF, np.uint8)
    table = np.zeros((len(rows), max(max(counts), 1)), np.int32)
    k, slots = 0, []
    for i, x in enumerate(rows):
        for j in range(counts[i]):
            table[i, j] = perm[k]
            k += 1
        e = np.arange(len(x))
        slots.append(table[i, e // S].astype(np.int64) * S + e % S)
    if sum(len(x) for x in rows):
        V.quantize_and_insert_k_cache(bf16(np.concatenate(rows)), pages, np.concatenate(slots), layout=layout)
    deq = []
    for i, x in enumerate(rows):
        out = np.zeros((1, max(len(x), 1), 512), np.float32)
        V.dequantize_and_gather_k_cache(out, pages, [len(x)], None, table[i : i + 1], offset=0, layout=layout)
        deq.append(out[0, : len(x)])
    return pages, table, deq
