"""Float64 oracle of the Lightning Indexer (logits, then top-k) and the comparison of a kernel's top-k with it.

For a prefill token t of request b at absolute position p, with index queries q[t] (H, D) and
head weights w[t] (H,) (every scale folded in: the model's `weights_proj(x) * H**-0.5 *
D**-0.5`, and vLLM's fp8 query scale), over the request's compressed index keys k_b[s] (D,):

    logit[t, s] = sum_h w[t, h] * relu(q[t, h] . k_b[s])     for the visible s < (p + 1) // r

(r the compress ratio). Keys stored as fp8 with a per-key scale are dequantized first
(`k = e4m3 * scale`); a kernel may apply the (positive) scale after the ReLU, the same value.

Top-k and the tie rule: token t selects min(k, visible) entries: the largest logits, and among
equal logits the lower entry index first. A NaN logit ranks below every number (-inf included).
Its row lists the selected entries in that order (logit descending, then index ascending: the
order of `jax.lax.top_k` and of a stable descending sort), then -1 up to k.

Comparison (`compare_topk`): a kernel's row may differ from the oracle's only by near ties: the
entries it selected that the oracle did not, and those the oracle selected that it did not, must
have logits within `rel * (|logit| scale)` of each other, where the scale of an entry is
`sum_h |w[t, h]| * sum_d |q[t, h, d] k[s, d]|` (the size of the terms the kernel rounds) and
`rel` is the rounding of the arithmetic compared: `fp32_rel(D, H)` for a float32-accumulating
kernel on the same input values (`(D + H + 2) * 2**-24`: the worst-case rounding of a D-term dot
product and an H-term head sum), `2**-8` where one side rounded its inputs to bf16. The order of
a row is checked with the same tolerance. Every comparison reports how many tokens differed by
such near ties.

Visibility per ratio: entry j is visible to position p iff j < (p + 1) // r: ratio 4 (V4's CSA),
ratio 2 (V4.1: j < (p+1)//2) and ratio 1 (V4.1, unpooled: j <= p) alike.

The two-level top-k (DeepSeek-V4.1; transformers' and vLLM's `select_candidate_blocks`):

* Level 1, at the candidate source (`candidate_blocks`): per token, the request-local blocks
  of `block_size` entries (block i: entries i*bs .. i*bs+bs-1) are scored by the max logit over
  their visible entries (NaN if any is NaN: a NaN-propagating max, as both implementations'). The
  block holding the newest visible entry, (visible - 1) // bs, is pinned first. Then the other
  blocks by score descending and, on equal scores, the lower block first (ours: neither
  implementation settles ties; vLLM keeps torch.topk's order), up to `topk_blocks` blocks in all.
  A block scoring -inf (every logit -inf) or NaN is dropped: transformers drops both (`values >
  -inf`), vLLM drops -inf (writes -1) and keeps NaN; we drop both. The row lists the blocks in
  that order, then -1. The source's own top-k is the ordinary one (not masked).
* Level 2, at a later index source (`indexer_topk(..., candidates=, candidate_block_size=)`):
  only the visible entries of the token's candidate blocks are selectable (both implementations
  set the others' logits to -inf); the top-k is taken among them by the tie rule above, min(k,
  selectable) entries, then -1. A candidate row lists request-local block ids of the same entry
  space (the same compress ratio), -1 for none, in any order; a block the token cannot see or a
  block listed twice is refused (`planner.checks.candidate_entries`).
* Where every block fits (visible <= topk_blocks * bs) level 1 keeps every block and level 2
  equals the plain top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.checks import as_int, as_int_vector, candidate_entries, candidate_options


def fp32_rel(D: int, H: int) -> float:
    """Relative rounding bound of float32 accumulation of D-term dot products summed over H heads."""
    return (int(D) + int(H) + 2) * 2.0**-24


BF16_REL = 2.0**-8  # one side's inputs rounded to bf16 (8 significant bits)


def _f64(x, name: str, ndim: int) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype.kind not in "fiu" and str(a.dtype) not in ("bfloat16", "float8_e4m3fn"):
        raise TypeError(f"{name}: expected a numeric array, got dtype {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {a.shape}")
    return a.astype(np.float64)


@dataclass(frozen=True)
class IndexerInputs:
    """One call's inputs as float64: q (T, H, D), weights (T, H), keys: one (N_b, D) array per
    request, token_request / token_position (T,), compress_ratio."""

    q: np.ndarray
    weights: np.ndarray
    keys: tuple
    token_request: np.ndarray
    token_position: np.ndarray
    compress_ratio: int

    @classmethod
    def of(cls, q, weights, keys, token_request, token_position, compress_ratio) -> IndexerInputs:
        q = _f64(q, "q", 3)
        T, H, D = q.shape
        w = _f64(weights, "weights", 2)
        if w.shape != (T, H):
            raise ValueError(f"weights: expected shape ({T}, {H}) (tokens, heads), got {w.shape}")
        if isinstance(keys, np.ndarray) and keys.ndim == 2:
            keys = [keys]
        ks = tuple(_f64(k, f"keys[{b}]", 2) for b, k in enumerate(keys))
        for b, k in enumerate(ks):
            if k.shape[1] != D:
                raise ValueError(f"keys[{b}]: rows of {k.shape[1]} dims, q has D = {D}")
        req = as_int_vector(token_request, "token_request")
        pos = as_int_vector(token_position, "token_position")
        r = as_int(compress_ratio, "compress_ratio", minimum=1)
        if req.shape != (T,) or pos.shape != (T,):
            raise ValueError(f"token_request / token_position: expected ({T},) each, got {req.shape}, {pos.shape}")
        if T and (req.min() < 0 or req.max() >= len(ks)):
            raise ValueError(f"token_request: entries must be in [0, {len(ks)}) (one keys array per request)")
        if T and pos.min() < 0:
            raise ValueError("token_position: negative position")
        vis = (pos + 1) // r
        for t in np.flatnonzero(vis > np.array([ks[b].shape[0] for b in req], dtype=np.int64)):
            b = int(req[t])
            raise ValueError(
                f"keys[{b}]: {ks[b].shape[0]} rows, token {int(t)} at position {int(pos[t])} sees {int(vis[t])}"
            )
        return cls(q, w, ks, req, pos, r)

    def visible(self, t: int) -> int:
        return int((self.token_position[t] + 1) // self.compress_ratio)

    def logits(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """(logits, scales) of token t over its visible entries: float64, and the size of the
        rounded terms `sum_h |w| * sum_d |q k|` (see the module doc)."""
        n = self.visible(t)
        k = self.keys[int(self.token_request[t])][:n]
        dots = self.q[t] @ k.T  # (H, n)
        w = self.weights[t][:, None]
        logits = (w * np.maximum(dots, 0.0)).sum(axis=0)
        scales = (np.abs(w) * (np.abs(self.q[t]) @ np.abs(k).T)).sum(axis=0)
        return logits, scales


def rank_order(logits: np.ndarray) -> np.ndarray:
    """Entry ids sorted by the tie rule: logit descending, then index ascending; NaN last."""
    key = np.where(np.isnan(logits), np.inf, -logits)  # NaN ranks below -inf
    return np.lexsort((np.arange(logits.shape[0]), np.isnan(logits), key)).astype(np.int64)


def _selectable(inp: IndexerInputs, t: int, cand, bs: int):
    """(entry ids, logits, scales) token t may select: every visible entry, or (level 2) those of
    its candidate blocks, ascending."""
    logits, scales = inp.logits(t)
    if cand is None:
        return np.arange(logits.shape[0]), logits, scales
    ent = candidate_entries(cand[t], logits.shape[0], bs, t)
    return ent, logits[ent], scales[ent]


def _level2(inp: IndexerInputs, k: int, candidates, candidate_block_size):
    """(candidates as int64 [T, W] or None, block size): level 2's inputs, checked."""
    if candidates is None and candidate_block_size is None:
        return None, 0
    if candidates is None:
        raise ValueError("candidates: needed with candidate_block_size (level 2), got None")
    opt = candidate_options(k, candidate_block_size, None, np.shape(candidates))
    cand = np.asarray(candidates)
    if cand.dtype.kind not in "iu":
        raise ValueError(f"candidates: expected integer block ids, got dtype {cand.dtype}")
    if cand.shape[0] != inp.q.shape[0]:
        raise ValueError(f"candidates: expected {inp.q.shape[0]} rows (one per token), got shape {cand.shape}")
    return cand.astype(np.int64), opt.block_size


def indexer_topk(
    q, weights, keys, token_request, token_position, compress_ratio, topk, *, candidates=None, candidate_block_size=None
):
    """The oracle's top-k: (indices (T, topk) int32, -1 padded; logits (T, topk) float64, -inf padded).

    q (T, H, D), weights (T, H), keys: one (N_b, D) array per request (or one 2-D array for a
    single request), token_request / token_position (T,), compress_ratio r >= 1, topk >= 1.
    Level 2 of the two-level top-k: `candidates` [T, W] request-local block ids (-1: none) and
    `candidate_block_size`: only the visible entries of a token's candidate blocks are selectable.
    """
    inp = IndexerInputs.of(q, weights, keys, token_request, token_position, compress_ratio)
    k = as_int(topk, "topk", minimum=1)
    cand, bs = _level2(inp, k, candidates, candidate_block_size)
    T = inp.q.shape[0]
    ids = np.full((T, k), -1, dtype=np.int32)
    vals = np.full((T, k), -np.inf)
    for t in range(T):
        ent, logits, _ = _selectable(inp, t, cand, bs)
        top = rank_order(logits)[:k]
        ids[t, : top.shape[0]] = ent[top]
        vals[t, : top.shape[0]] = logits[top]
    return ids, vals


def block_scores(logits: np.ndarray, scales: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(score, scale) per block of `block_size` consecutive entries of one token's visible
    logits: the NaN-propagating max (the last block may be partial), and the largest rounding
    scale of its entries (`compare_candidates`' tolerance)."""
    n = logits.shape[0]
    nb = -(-n // block_size)
    pad = nb * block_size - n
    lg = np.concatenate([logits, np.full(pad, -np.inf)]).reshape(nb, block_size)
    sc = np.concatenate([scales, np.zeros(pad)]).reshape(nb, block_size)
    score = np.where(np.isnan(lg).any(axis=1), np.nan, lg.max(axis=1, initial=-np.inf))
    return score, sc.max(axis=1, initial=0.0)


def block_order(score: np.ndarray) -> np.ndarray:
    """Level 1's order of one token's blocks (every block visible, the last one pinned): the
    pinned block, then the others by score descending, the lower block first on equal scores;
    blocks scoring -inf or NaN dropped."""
    nb = score.shape[0]
    if nb == 0:
        return np.zeros(0, np.int64)
    rest = score[: nb - 1]
    live = np.flatnonzero(~np.isnan(rest) & (rest > -np.inf))
    order = live[np.lexsort((live, -rest[live]))]
    return np.concatenate([[nb - 1], order]).astype(np.int64)


def candidate_blocks(q, weights, keys, token_request, token_position, compress_ratio, block_size, topk_blocks):
    """Level 1 of the two-level top-k (see the module doc): (blocks (T, topk_blocks) int32, -1
    padded: the pinned block, then the best others; scores (T, topk_blocks) float64: each block's
    max logit, +inf for the pinned block, -inf padded)."""
    inp = IndexerInputs.of(q, weights, keys, token_request, token_position, compress_ratio)
    bs = as_int(block_size, "candidate_block_size", minimum=1)
    nb = as_int(topk_blocks, "candidate_topk_blocks", minimum=1)
    T = inp.q.shape[0]
    ids = np.full((T, nb), -1, dtype=np.int32)
    vals = np.full((T, nb), -np.inf)
    for t in range(T):
        logits, scales = inp.logits(t)
        score, _ = block_scores(logits, scales, bs)
        top = block_order(score)[:nb]
        ids[t, : top.shape[0]] = top
        vals[t, : top.shape[0]] = score[top]
        vals[t, : min(1, top.shape[0])] = np.inf
    return ids, vals


@dataclass(frozen=True)
class TopkComparison:
    """How a kernel's top-k rows compare with the oracle's: `near_ties` tokens whose selected set
    differs from the oracle's (each by near ties only; anything else raises), of `tokens`."""

    tokens: int
    near_ties: int
    swapped_entries: int  # entries selected by the kernel and not the oracle, over all tokens
    boundary_ties: int  # tokens whose k-th and (k+1)-th oracle logits are within the tolerance


def compare_topk(
    got,
    q,
    weights,
    keys,
    token_request,
    token_position,
    compress_ratio,
    *,
    rel: float,
    candidates=None,
    candidate_block_size=None,
):
    """Check a kernel's top-k rows `got` (T, k) against the oracle; returns a `TopkComparison`.

    Raises AssertionError naming the first token whose row is wrong: wrong length (each row holds
    exactly min(k, selectable) entries, then -1), an entry not selectable (out of range, outside
    the candidates) or repeated, a selected set that differs from the oracle's by more than near
    ties, or an order that breaks the tie rule by more than the tolerance. `rel`: see the module
    doc (`fp32_rel(D, H)`, `BF16_REL`). Level 2: `candidates`, `candidate_block_size` as for
    `indexer_topk`.
    """
    inp = IndexerInputs.of(q, weights, keys, token_request, token_position, compress_ratio)
    got = np.asarray(got)
    T = inp.q.shape[0]
    if got.ndim != 2 or got.shape[0] != T:
        raise AssertionError(f"got: expected ({T}, k) rows, got shape {got.shape}")
    k = got.shape[1]
    cand, bs = _level2(inp, k, candidates, candidate_block_size)
    near = swapped = boundary = 0
    for t in range(T):
        ent, logits, scales = _selectable(inp, t, cand, bs)
        n = logits.shape[0]
        want = min(k, n)
        row = got[t].astype(np.int64)
        sel = np.searchsorted(ent, row[:want])  # entry id -> its place among the selectable
        found = (sel < n) & (ent[np.minimum(sel, n - 1)] == row[:want]) if n else np.ones(0, bool)
        if (row[want:] != -1).any() or not found.all():
            raise AssertionError(
                f"token {t}: expected {want} entries of its {n} selectable, then -1, got {row.tolist()}"
            )
        if np.unique(sel).shape[0] != want:
            raise AssertionError(f"token {t}: repeated entries in {row[:want].tolist()}")
        order = rank_order(logits)
        ref = order[:want]
        if want < n:
            a, b = order[want - 1], order[want]
            boundary += bool(abs(logits[a] - logits[b]) <= rel * (scales[a] + scales[b]))
        extra = np.setdiff1d(sel, ref)
        if extra.size:
            missing = np.setdiff1d(ref, sel)
            worst_pick = extra[np.argmin(logits[extra])]
            best_miss = missing[np.argmax(logits[missing])]
            gap = logits[best_miss] - logits[worst_pick]
            if not gap <= rel * (scales[best_miss] + scales[worst_pick]):
                raise AssertionError(
                    f"token {t}: selected entry {int(ent[worst_pick])} (logit {logits[worst_pick]:.9g}) over entry "
                    f"{int(ent[best_miss])} (logit {logits[best_miss]:.9g}): a gap of {gap:.3g}, beyond the tolerance "
                    f"{rel * (scales[best_miss] + scales[worst_pick]):.3g}"
                )
            near += 1
            swapped += int(extra.size)
        v, s = logits[sel], scales[sel]
        drop = v[1:] - v[:-1]  # must not rise by more than the tolerance
        bad = np.flatnonzero(drop > rel * (s[1:] + s[:-1]))
        if bad.size:
            j = int(bad[0])
            raise AssertionError(
                f"token {t}: entry {int(ent[sel[j + 1]])} (logit {v[j + 1]:.9g}) listed after entry {int(ent[sel[j]])} "
                f"(logit {v[j]:.9g}): rows list logits in descending order"
            )
    return TopkComparison(tokens=T, near_ties=near, swapped_entries=swapped, boundary_ties=boundary)


@dataclass(frozen=True)
class CandidateComparison:
    """How a kernel's candidate-block rows compare with the oracle's (level 1): `near_ties` tokens
    whose kept set differs from the oracle's (by near ties of block scores only), of `tokens`."""

    tokens: int
    near_ties: int
    swapped_blocks: int


def compare_candidates(
    got, q, weights, keys, token_request, token_position, compress_ratio, block_size, *, rel: float
) -> CandidateComparison:
    """Check a kernel's level-1 rows `got` (T, topk_blocks) against the oracle (`candidate_blocks`).

    Each row must hold exactly as many blocks as the oracle's, the pinned block first, then -1; the
    other blocks may differ from the oracle's only by near ties (block scores within `rel` times
    the largest rounding scale of the blocks' entries, as `compare_topk`) and must be listed by
    score descending up to the same tolerance. AssertionError naming the first bad token otherwise.
    """
    inp = IndexerInputs.of(q, weights, keys, token_request, token_position, compress_ratio)
    bs = as_int(block_size, "candidate_block_size", minimum=1)
    got = np.asarray(got)
    T = inp.q.shape[0]
    if got.ndim != 2 or got.shape[0] != T:
        raise AssertionError(f"got: expected ({T}, topk_blocks) rows, got shape {got.shape}")
    nb = got.shape[1]
    near = swapped = 0
    for t in range(T):
        logits, scales = inp.logits(t)
        score, scale = block_scores(logits, scales, bs)
        ref = block_order(score)[:nb]
        want = ref.shape[0]
        row = got[t].astype(np.int64)
        if (row[want:] != -1).any() or (row[:want] < 0).any() or (row[:want] >= score.shape[0]).any():
            raise AssertionError(
                f"token {t}: expected {want} blocks in [0, {score.shape[0]}) then -1, got {row.tolist()}"
            )
        sel = row[:want]
        if want and sel[0] != ref[0]:
            raise AssertionError(f"token {t}: the pinned block {int(ref[0])} must come first, got {sel.tolist()}")
        if np.unique(sel).shape[0] != want:
            raise AssertionError(f"token {t}: repeated blocks in {sel.tolist()}")
        extra = np.setdiff1d(sel, ref)
        if extra.size:
            missing = np.setdiff1d(ref, sel)
            if np.isnan(score[extra]).any() or (score[extra] == -np.inf).any():
                raise AssertionError(f"token {t}: kept blocks scoring NaN or -inf: {extra.tolist()}")
            worst = extra[np.argmin(score[extra])]
            best = missing[np.argmax(score[missing])]
            gap = score[best] - score[worst]
            if not gap <= rel * (scale[best] + scale[worst]):
                raise AssertionError(
                    f"token {t}: kept block {int(worst)} (score {score[worst]:.9g}) over block {int(best)} "
                    f"(score {score[best]:.9g}): a gap of {gap:.3g}, beyond the tolerance "
                    f"{rel * (scale[best] + scale[worst]):.3g}"
                )
            near += 1
            swapped += int(extra.size)
        v, s = score[sel[1:]], scale[sel[1:]]
        bad = np.flatnonzero(v[1:] - v[:-1] > rel * (s[1:] + s[:-1]))
        if bad.size:
            j = int(bad[0]) + 1
            raise AssertionError(
                f"token {t}: block {int(sel[j + 1])} (score {score[sel[j + 1]]:.9g}) listed after block "
                f"{int(sel[j])} (score {score[sel[j]]:.9g}): rows list blocks by score descending"
            )
    return CandidateComparison(tokens=T, near_ties=near, swapped_blocks=swapped)
