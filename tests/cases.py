"""Framework-neutral prefill cases (NumPy): what every backend's prefill tests feed in.

A case is one step of one layer: per-request raw and compressed latents, the step's queries,
valid CSA top-k rows, a sink, and the same KV laid out in shuffled pages with block tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import planner as P

# Test convenience: the kind DeepSeek-V4.0 gives a ratio (0 SWA, 4 CSA, 128 HCA).
V4_KIND_OF_RATIO = {r: k for k, r in P.contract.V4_RATIOS.items()}


def v4_kind(ratio: int) -> P.LayerKind:
    """The kind of one of V4.0's ratios (cases built from 0 / 4 / 128)."""
    if ratio not in V4_KIND_OF_RATIO:
        raise ValueError(f"ratio: {ratio!r} is not one of V4.0's ratios {sorted(V4_KIND_OF_RATIO)}; pass kind=")
    return V4_KIND_OF_RATIO[ratio]


@dataclass
class PrefillCase:
    name: str
    seq_lens: list[int]
    query_lens: list[int]
    ratio: int
    window_size: int
    topk: int
    q: np.ndarray  # (T, H, D) float32
    raw: list[np.ndarray]  # per request (seq_len, D)
    comp: list[np.ndarray]  # per request (seq_len // r, D); empty for SWA
    topk_rows: np.ndarray  # (T, topk) int32, request-local, -1 past the visible count
    sink: np.ndarray  # (H,) float32
    block_size: int = 16
    kind: P.LayerKind | None = None  # None: V4.0's kind of `ratio`

    def __post_init__(self):
        self.kind = v4_kind(self.ratio) if self.kind is None else P.LayerKind.of(self.kind)

    @property
    def layer(self) -> P.LayerSpec:
        return P.LayerSpec(self.kind, self.ratio)

    @property
    def batch(self) -> P.PrefillBatch:
        return P.PrefillBatch(self.seq_lens, self.query_lens)

    @property
    def sm_scale(self) -> float:
        return self.q.shape[2] ** -0.5

    def plan_config(self, **kw) -> P.PlanConfig:
        mml = max(max(self.seq_lens), 1)
        mnbt = max(max(self.query_lens), 1)
        return P.PlanConfig(window_size=self.window_size, max_model_len=mml, max_num_batched_tokens=mnbt, **kw)

    def oracle(self):
        return P.oracle.prefill_attention(
            self.q,
            self.raw,
            self.comp,
            self.seq_lens,
            self.query_lens,
            kind=self.kind,
            compress_ratio=self.ratio,
            window_size=self.window_size,
            sm_scale=self.sm_scale,
            attn_sink=self.sink,
            topk_rows=self.topk_rows if self.kind is P.LayerKind.CSA else None,
        )

    def paged(self, which: str, seed: int = 0):
        """(pages, block_table) of `which` = "raw" or "comp", pages shuffled across requests."""
        src = self.raw if which == "raw" else self.comp
        page = self.block_size if which == "raw" else max(1, self.block_size // max(self.ratio, 1))
        D = self.q.shape[2]
        counts = [-(-len(x) // page) for x in src]
        total = sum(counts) + 1
        perm = np.random.default_rng(seed).permutation(total)  # page 0.. in random order
        pages = np.full((total, page, D), np.nan, dtype=np.float32)  # unused slots are NaN
        table = np.zeros((len(src), max(max(counts), 1)), dtype=np.int32)
        k = 0
        for i, x in enumerate(src):
            for j in range(counts[i]):
                pid = perm[k]
                k += 1
                table[i, j] = pid
                rows = x[j * page : (j + 1) * page]
                pages[pid, : rows.shape[0]] = rows
        return pages, table


def make_case(name, seq_lens, query_lens, ratio, *, kind=None, window_size=8, topk=6, H=4, D=32, seed=0, block_size=16):
    """kind: the layer kind; None means V4.0's kind of `ratio` (0 / 4 / 128)."""
    kind = v4_kind(ratio) if kind is None else P.LayerKind.of(kind)
    rng = np.random.default_rng(seed)
    batch = P.PrefillBatch(seq_lens, query_lens)
    raw = [rng.standard_normal((s, D)).astype(np.float32) for s in seq_lens]
    comp = [rng.standard_normal((s // ratio if kind.has_compressed else 0, D)).astype(np.float32) for s in seq_lens]
    q = rng.standard_normal((batch.num_tokens, H, D)).astype(np.float32)
    rows = np.full((batch.num_tokens, topk), -1, dtype=np.int32)
    if kind is P.LayerKind.CSA:
        for t, p in enumerate(batch.token_position.tolist()):
            visible = (p + 1) // ratio
            k = min(visible, topk)
            rows[t, :k] = rng.permutation(visible)[:k]
    sink = rng.standard_normal(H).astype(np.float32)
    return PrefillCase(
        name, list(seq_lens), list(query_lens), ratio, window_size, topk, q, raw, comp, rows, sink, block_size, kind
    )


def boundary_cases(ratio: int, window_size: int = 8, kind=None) -> list[PrefillCase]:
    """The case classes of spec section 5, scaled down for CPU (kind None: V4.0's kind of `ratio`)."""
    W, r = window_size, max(ratio, 1)
    kw = dict(window_size=W, kind=kind)
    out = [
        # fresh prefill, shorter and longer than the window
        make_case("fresh", [3, W - 1, W, W + 1, 21], [3, W - 1, W, W + 1, 21], ratio, **kw, seed=1),
        # queries at and around W-1, W, r-1, r and 128 (positions are seq_len - query_len + j)
        make_case("boundaries", [W + 1, r + 1, 129, 131], [2, 2, 3, 4], ratio, **kw, seed=2),
        # chunked prefill: long prefixes, small query chunks not aligned to 4, 128 or W
        make_case("long-prefix", [300, 517, 260], [7, 13, 1], ratio, **kw, seed=3),
        # query_len == 0 requests (KV-transfer loads) in the batch
        make_case("zero-query", [40, 200, 9, 64], [0, 5, 9, 0], ratio, **kw, seed=4),
    ]
    return out
