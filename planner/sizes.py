"""Static sizes for jitted prefill: shape buckets and tile ladders.

Buckets: every integer 1..8, then m * 2^k for m in 4..7 (1, 1.25, 1.5, 1.75 x 2^k):
8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ... A value is padded to the smallest bucket that holds
it, so a padded shape is at most 1.25x the real one (the worst case is 2^k + 1 -> 1.25 * 2^k)
and a stream of sizes up to n touches about 4 * log2(n) buckets. `pow2_bucket` is the coarse
ladder (powers of two: pads under 2x, log2(n) buckets) for sizes that cost memory, not compute.

Tile ladders: a dynamic count of items (tokens of a chunk, rows of a gather) is covered by
static-size tiles: as many tiles of the largest size as fit, then of each smaller size (sizes
shrink 4x per rung), and the remainder by tiles of the smallest size, masked. The same
arithmetic runs on Python ints (to measure padding) and on traced int32 scalars (the device
loops), so the reported waste is what the device does.
"""

from __future__ import annotations

STEPS = (4, 5, 6, 7)  # x 2^k: the 1, 1.25, 1.5, 1.75 ladder
LADDER_RATIO = 4  # tile sizes shrink 4x per rung: few static sizes, at most 3 tiles per rung
MIN_TILE = 16  # the smallest tile (the xla backend's token block; pads nothing there)


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest bucket >= max(n, minimum): all of 1..8, then m * 2^k for m in (4, 5, 6, 7)."""
    n = max(int(n), int(minimum), 1)
    if n <= 8:
        return n
    k = (n - 1).bit_length() - 3  # 2^(k+2) < n <= 2^(k+3), so n <= 8 * 2^k
    for m in STEPS + (8,):
        if m << k >= n:
            return m << k
    raise AssertionError(n)  # unreachable: 8 << k >= n


def pow2_bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum) (a power of two `minimum` keeps it one)."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


def tile_ladder(largest: int, limit: int | None = None, smallest: int = MIN_TILE) -> tuple[int, ...]:
    """Static tile sizes, largest first: largest, largest/4, ... down to `smallest`.

    Sizes above `limit` (the padded count the tiles cover) are dropped: they could never run.
    `largest` must be a power of two.
    """
    if largest < 1 or largest & (largest - 1):
        raise ValueError(f"tile size: expected a power of two, got {largest}")
    sizes = []
    s = largest
    while s >= smallest or not sizes:
        sizes.append(s)
        s //= LADDER_RATIO
    if limit is not None:
        top = max(int(limit), 1)
        kept = [s for s in sizes if s <= top]
        sizes = kept if kept else [sizes[-1]]
    return tuple(sizes)


def ladder_counts(count, ladder):
    """Tiles of each size that cover `count` items: greedy, the last rung rounds up.

    Works on ints and on traced int32 scalars alike. Returns a list aligned with `ladder`.
    """
    counts, rem = [], count
    for i, size in enumerate(ladder):
        n = (rem + size - 1) // size if i == len(ladder) - 1 else rem // size
        counts.append(n)
        rem = rem - n * size
    return counts


def tiled_items(count: int, ladder) -> int:
    """Items the tiles of `ladder_counts(count, ladder)` process (>= count; masked beyond it)."""
    return sum(n * s for n, s in zip(ladder_counts(int(count), ladder), ladder))
