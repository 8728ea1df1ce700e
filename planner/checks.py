"""Argument checks shared by the planner and both framework packages (no framework imports).

* `as_int`, `as_int_vector`: integers and 1-D integer arrays, with their bounds; plan sizes end up
  in int32 arrays (what device kernels index with), so lengths and limits are checked against
  `INT32_MAX` where they are taken.
* `sparse_attention_shapes`, `sm_scale_value`: `sparse_attention`'s shape and value rules (FlashMLA's
  `flash_mla_sparse_fwd` contract, spec section 2), one wording for `dsv4_torch`, `dsv4_jax` and
  the float64 oracle (`planner.oracle`). Each framework checks its own types and dtypes first.

Every error is a ValueError or TypeError whose message starts with the argument's name.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np

INT32_MAX = 2**31 - 1  # the largest length, position, row or limit a plan holds (int32 arrays)


def as_int(x, name: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """`x` as a Python int: an integer (not a bool) within [minimum, maximum] when given."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (numbers.Integral, np.integer)):
        raise ValueError(f"{name}: expected an integer, got {x!r}")
    v = int(x)
    if minimum is not None and v < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {v}")
    if maximum is not None and v > maximum:
        raise ValueError(f"{name}: must be <= {maximum}{_int32_note(maximum)}, got {v}")
    return v


def as_int_vector(x, name: str) -> np.ndarray:
    """A 1-D int64 copy of a list, NumPy array or anything with `__array__` (torch CPU tensors)."""
    try:
        a = np.asarray(x)
    except Exception as e:
        raise ValueError(f"{name}: cannot be read as a 1-D integer array ({e})") from None
    if a.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array, got shape {a.shape}")
    if a.dtype.kind in "iu":
        if a.dtype == np.uint64 and a.size and int(a.max()) > np.iinfo(np.int64).max:
            i = int(np.argmax(a))
            raise ValueError(f"{name}: {name}[{i}] = {int(a[i])} does not fit int64")
        return a.astype(np.int64)
    if a.size == 0 and a.dtype.kind == "f":  # np.asarray([]) is float64
        return a.astype(np.int64)
    raise ValueError(f"{name}: expected integers, got dtype {a.dtype} ({a[:4].tolist()}...)")


def check_at_most(a: np.ndarray, name: str, maximum: int, why: str = "") -> None:
    """Refuse an entry of the int vector `a` above `maximum`, naming the first one."""
    if a.size and int(a.max()) > maximum:
        i = int(np.argmax(a > maximum))
        raise ValueError(f"{name}: {name}[{i}] = {int(a[i])} exceeds {why or maximum}{_int32_note(maximum)}")


def shape_of(x):
    """For error messages: an array's shape as a tuple, else the object's type name."""
    shape = getattr(x, "shape", None)
    return tuple(shape) if shape is not None and not isinstance(x, type) else type(x).__name__


def _int32_note(maximum: int) -> str:
    return " (the int32 range of plan arrays)" if maximum == INT32_MAX else ""


# ----------------------------------------------------------------------------- sparse_attention


class SparseShapes(NamedTuple):
    """The sizes of one `sparse_attention` call; `squeeze_kv` / `squeeze_indices`: the argument
    came with its one-head axis ((S, 1, D) / (T, 1, K)), to drop before the kernel."""

    T: int
    H: int
    D: int
    S: int
    K: int
    squeeze_kv: bool
    squeeze_indices: bool


def sparse_attention_shapes(
    q_shape, kv_shape, indices_shape, attn_sink_shape=None, topk_length_shape=None
) -> SparseShapes:
    """Check the shapes of `sparse_attention(q, kv, indices, sm_scale, attn_sink, topk_length)`.

    q (T, H, D) with D >= 1; kv (S, D) or (S, 1, D); indices (T, K) or (T, 1, K); attn_sink (H,);
    topk_length (T,) (None: argument not given). Shapes are tuples of ints (torch.Size, a NumPy
    or JAX shape). Raises ValueError naming the argument.
    """
    q_shape, kv_shape, indices_shape = tuple(q_shape), tuple(kv_shape), tuple(indices_shape)
    if len(q_shape) != 3:
        raise ValueError(f"q: expected shape (T, H, D), got {q_shape}")
    T, H, D = (int(n) for n in q_shape)
    if D < 1:
        raise ValueError(f"q: head dim D must be >= 1, got shape {q_shape}")
    squeeze_kv = len(kv_shape) == 3
    if squeeze_kv and kv_shape[1] != 1:
        raise ValueError(f"kv: expected shape (S, 1, D) (one KV head), got {kv_shape}")
    if len(kv_shape) not in (2, 3):
        raise ValueError(f"kv: expected shape (S, D) or (S, 1, D), got {kv_shape}")
    if kv_shape[-1] != D:
        raise ValueError(f"kv: last dim {kv_shape[-1]} does not match q's head dim D={D}")
    squeeze_indices = len(indices_shape) == 3
    if squeeze_indices and indices_shape[1] != 1:
        raise ValueError(f"indices: expected shape (T, 1, K), got {indices_shape}")
    if len(indices_shape) not in (2, 3):
        raise ValueError(f"indices: expected shape (T, K) or (T, 1, K), got {indices_shape}")
    if indices_shape[0] != T:
        raise ValueError(f"indices: {indices_shape[0]} rows for {T} query tokens")
    if attn_sink_shape is not None and tuple(attn_sink_shape) != (H,):
        raise ValueError(f"attn_sink: expected shape ({H},) (one logit per head), got {tuple(attn_sink_shape)}")
    if topk_length_shape is not None and tuple(topk_length_shape) != (T,):
        raise ValueError(f"topk_length: expected shape ({T},) (one per query token), got {tuple(topk_length_shape)}")
    return SparseShapes(T, H, D, int(kv_shape[0]), int(indices_shape[-1]), squeeze_kv, squeeze_indices)


def sm_scale_value(sm_scale) -> float:
    """`sm_scale` as a finite Python float (a real number, not a bool); TypeError / ValueError."""
    if isinstance(sm_scale, (bool, np.bool_)) or not isinstance(sm_scale, numbers.Real):
        raise TypeError(f"sm_scale: expected a real number, got {type(sm_scale).__name__} {sm_scale!r}")
    value = float(sm_scale)
    if not math.isfinite(value):
        raise ValueError(f"sm_scale: must be finite, got {value}")
    return value


# ----------------------------------------------------------------------------- the two-level top-k


class CandidateOptions(NamedTuple):
    """The two-level top-k options of one indexer call (`candidate_options`): `level` 0 (none), 1
    (emit each row's candidate blocks) or 2 (take the top-k inside given candidates);
    `block_size`, `topk_blocks` (0 when level is 0)."""

    level: int
    block_size: int
    topk_blocks: int


def candidate_options(topk, candidate_block_size, candidate_topk_blocks, candidates_shape) -> CandidateOptions:
    """The indexer's two-level options, checked (one wording for the oracle and both frameworks).

    Level 1 (the candidate source): `candidate_block_size` and `candidate_topk_blocks` given,
    `candidates` not (candidates_shape None). Level 2 (a later index source): `candidates` [T, W]
    and `candidate_block_size` given (`candidate_topk_blocks`, when given, must be W). Either way
    `candidate_topk_blocks * candidate_block_size` must hold `topk` entries.
    """
    if candidate_block_size is None:
        if candidate_topk_blocks is not None or candidates_shape is not None:
            raise ValueError(
                "candidate_block_size: needed with candidate_topk_blocks (level 1) or candidates (level 2), got None"
            )
        return CandidateOptions(0, 0, 0)
    bs = as_int(candidate_block_size, "candidate_block_size", minimum=1, maximum=INT32_MAX)
    if candidates_shape is None:
        if candidate_topk_blocks is None:
            raise ValueError(
                "candidate_topk_blocks: needed with candidate_block_size to select candidate blocks (level 1), "
                "or pass candidates (level 2)"
            )
        nb = as_int(candidate_topk_blocks, "candidate_topk_blocks", minimum=1, maximum=INT32_MAX)
        level = 1
    else:
        if len(candidates_shape) != 2:
            raise ValueError(f"candidates: expected [tokens, blocks], got shape {tuple(candidates_shape)}")
        nb = int(candidates_shape[1])
        if nb < 1:
            raise ValueError(f"candidates: expected at least one column, got shape {tuple(candidates_shape)}")
        if candidate_topk_blocks is not None and as_int(candidate_topk_blocks, "candidate_topk_blocks") != nb:
            raise ValueError(
                f"candidate_topk_blocks: {candidate_topk_blocks} differs from candidates' {nb} columns "
                f"(shape {tuple(candidates_shape)})"
            )
        level = 2
    k = int(topk)
    if nb * bs < k:
        raise ValueError(
            f"candidate_topk_blocks x candidate_block_size = {nb} x {bs} = {nb * bs} positions cannot hold "
            f"topk = {k} entries"
        )
    return CandidateOptions(level, bs, nb)


def candidate_entries(row: np.ndarray, visible: int, block_size: int, token: int) -> np.ndarray:
    """The entries a row of candidate blocks admits (level 2), ascending: every entry of each
    listed block that is visible. `row`: request-local block ids, -1 = none; each listed block
    must be one of the row's visible blocks, [0, ceil(visible / block_size)), and listed once:
    ValueError naming the token, the column and the value otherwise."""
    row = np.asarray(row, dtype=np.int64)
    nblocks = -(-int(visible) // int(block_size))
    bad = np.flatnonzero((row < -1) | (row >= nblocks))
    if bad.size:
        j = int(bad[0])
        raise ValueError(
            f"candidates: token {token}, column {j} is block {int(row[j])}, outside [-1, {nblocks}) "
            f"(the token sees {visible} entries, {nblocks} blocks of {block_size})"
        )
    live = row[row >= 0]
    s = np.sort(live)
    dup = np.flatnonzero(s[1:] == s[:-1])
    if dup.size:
        raise ValueError(f"candidates: token {token} lists block {int(s[dup[0]])} more than once")
    ent = (s[:, None] * block_size + np.arange(block_size)[None, :]).reshape(-1)
    return ent[ent < visible]


def check_candidates(cand: np.ndarray, visible: np.ndarray, block_size: int, tokens=None, chunk: int = 512) -> None:
    """Every row of host candidates [T, W] valid for its token (`candidate_entries`' rule),
    vectorized over `chunk` rows at a time (bounded temporaries): ValueError naming the first bad
    token (row t is token `tokens[t]`, default t), column and value."""
    cand = np.asarray(cand)
    if cand.dtype.kind not in "iu":
        raise ValueError(f"candidates: expected integer block ids, got dtype {cand.dtype}")
    nblocks = -(-np.asarray(visible, dtype=np.int64) // int(block_size))

    def name(t: int) -> int:
        return t if tokens is None else int(tokens[t])

    for t0 in range(0, cand.shape[0], chunk):
        c = cand[t0 : t0 + chunk]
        nb = nblocks[t0 : t0 + chunk, None]
        bad = (c < -1) | (c >= nb)
        if bad.any():
            t, j = (int(x) for x in np.argwhere(bad)[0])
            raise ValueError(
                f"candidates: token {name(t0 + t)}, column {j} is block {int(c[t, j])}, outside [-1, {int(nb[t, 0])}) "
                f"(the token sees {int(visible[t0 + t])} entries, {int(nb[t, 0])} blocks of {block_size})"
            )
        srt = np.sort(c, axis=1)
        dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
        if dup.any():
            t, j = (int(x) for x in np.argwhere(dup)[0])
            raise ValueError(f"candidates: token {name(t0 + t)} lists block {int(srt[t, j])} more than once")
