"""The Lightning Indexer's top-k for PyTorch: backends "cpu" (the fused C kernel) and "reference" (torch ops).

    indexer_topk(q, weights, keys, token_request, token_position, compress_ratio, topk, *,
                 offsets=None, block_table=None, valid=None, num_entries=None,
                 candidate_block_size=None, candidate_topk_blocks=None, candidates=None,
                 backend="auto", reference_elems=None) -> IndexerResult

The same signature as `dsv4_jax.indexer.indexer_topk`. Token t (request b = token_request[t],
absolute position p = token_position[t]) scores the compressed index keys 0 .. (p + 1) //
compress_ratio - 1 of its request (ratio 4: V4's CSA; 2 and 1: V4.1's),

    logit[t, s] = sum_h weights[t, h] * relu(q[t, h] . k_b[s])        (x the key's scale: fp8 keys)

and keeps the `topk` best under the tie rule of `planner.indexer_oracle` (larger logit first,
equal logits: lower entry index first, NaN last), then -1. Every scale is folded into `weights`
(the model's `weights_proj(x) * H**-0.5 * D**-0.5`; vLLM's fp8 query scale).

keys:
  * vLLM's index key cache: uint8 `[num_blocks, block_size, D + 4]` (`planner.index_cache`, written
    by `dsv4_torch.index_cache.indexer_k_quant_and_cache`) with `block_table` [B, W] int32/int64:
    entry e of request b is slot e % block_size of page block_table[b, e // block_size];
  * rows `[N, D]` bfloat16 / float32 with `offsets` [B] (entry e of request b is row
    offsets[b] + e; None: one request, row e).
q: [T, H, D] bfloat16, float32 or float8_e4m3fn; weights [T, H] float (used as float32). Every
array argument may be a torch tensor or a NumPy array (ml_dtypes bfloat16 / float8_e4m3fn for
q and keys); token arrays, offsets, block table, valid and candidates are read on the host.
valid: optional bool [T]; a token with valid False is padding (its rows: -1 / -inf).
num_entries: optional bound on the entries any token sees (JAX's xla backend needs it static);
checked against every visible count here.

DeepSeek-V4.1's two-level top-k (`planner.indexer_oracle`'s module doc states the rules):
  * level 1, at the candidate source: `candidate_block_size`, `candidate_topk_blocks` given ->
    `result.candidates` int32 [T, candidate_topk_blocks]: per token the request-local blocks of
    `candidate_block_size` entries with the best max logit, the block of the newest visible entry
    first, then -1. The top-k itself is the ordinary one.
  * level 2, at a later index source: `candidates` [T, W] (level 1's rows, -1 = none) and
    `candidate_block_size` -> the top-k among the visible entries of each token's candidate blocks
    only ("cpu" scores only those: its cost stops growing with the context past W x block size).
  candidate_topk_blocks x candidate_block_size must hold `topk`; a candidate the token cannot see
  or listed twice is refused by name.

Backends: "cpu" reads the cache in place, scores keys in blocks shared by a request's tokens and
keeps a running top-k per token (memory O(tokens x topk), `dsv4_cpu/csrc/indexer.cc`); "reference"
dequantizes each request's keys and sorts float32 logits (memory O(tokens x keys) in slices of
`reference_elems` logits). "auto" is "cpu" for CPU tensors where the C library builds, else
"reference"; the result says which ran. Both compute products of the input values accumulated in
float32, so they agree up to float32 rounding (near ties may select differently;
`planner.indexer_oracle.compare_topk`).
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import numpy as np
import torch

from dsv4_torch import backends
from dsv4_torch.kernels.reference.indexer import REFERENCE_ELEMS
from planner.checks import as_int, candidate_options, check_candidates

logger = logging.getLogger(__name__)

BACKENDS = backends.INDEXER_BACKENDS
_Q_DTYPES = (torch.bfloat16, torch.float32, torch.float8_e4m3fn)
_ROW_DTYPES = (torch.bfloat16, torch.float32)
MAX_POSITION = 2**31 - 2**20  # dsv4_cpu.h's DSV4_MAX_POSITION


class IndexerResult(NamedTuple):
    indices: torch.Tensor  # [T, topk] int32, -1 padded
    logits: torch.Tensor  # [T, topk] float32, -inf padded
    backend: str  # the backend that ran
    candidates: torch.Tensor | None = None  # level 1: [T, candidate_topk_blocks] int32 block ids, -1 padded


_NP_VIEWS = {"bfloat16": (torch.uint16, torch.bfloat16), "float8_e4m3fn": (torch.uint8, torch.float8_e4m3fn)}


def as_tensor(x, name: str) -> torch.Tensor:
    """A torch tensor as is; a NumPy array (ml_dtypes bfloat16 / float8_e4m3fn included) as a CPU
    tensor sharing its memory."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        view = _NP_VIEWS.get(str(x.dtype))
        if view is not None:
            raw = np.ascontiguousarray(x).view(np.uint16 if view[0] == torch.uint16 else np.uint8)
            return torch.from_numpy(raw).view(view[1])
        try:
            return torch.from_numpy(x)
        except TypeError as e:
            raise TypeError(f"{name}: cannot be read as a tensor ({e})") from None
    raise TypeError(f"{name}: expected a torch.Tensor or a NumPy array, got {type(x).__name__}")


def available_backends() -> dict[str, str | None]:
    """Each indexer backend -> None if it can run on this machine (its CPU), else why not."""
    return {name: b.unavailable(torch.device("cpu")) for name, b in backends.INDEXER.items()}


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """The backend `indexer_topk(q, ..., backend=backend)` runs (`dsv4_torch.backends.resolve_indexer_backend`)."""
    return backends.resolve_indexer_backend(backend, q)


def host_ints(x, name: str, n: int | None = None) -> np.ndarray:
    """A 1-D integer array on the host (a list, NumPy array or CPU tensor; a device tensor is
    refused: reading it would make the host wait for the device) as int64 NumPy."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError(
                f"{name}: expected host integers (a list, NumPy array or CPU tensor), got a tensor on {x.device}"
            )
        x = x.detach().numpy()
    a = np.asarray(x)
    if a.dtype.kind not in "iu" or a.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D integer array, got {a.dtype} {a.shape}")
    if n is not None and a.shape[0] != n:
        raise ValueError(f"{name}: expected {n} entries (one per token of q), got {a.shape[0]}")
    return a.astype(np.int64)


def _check(q, weights, keys, token_request, token_position, compress_ratio, topk, offsets, block_table):
    q, weights, keys = as_tensor(q, "q"), as_tensor(weights, "weights"), as_tensor(keys, "keys")
    if not isinstance(q, torch.Tensor) or q.ndim != 3 or q.dtype not in _Q_DTYPES:
        raise TypeError(
            f"q: expected a [T, H, D] bfloat16 / float32 / float8_e4m3fn tensor, got "
            f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}"
        )
    T, H, D = q.shape
    if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != (T, H) or not weights.dtype.is_floating_point:
        raise ValueError(
            f"weights: expected a float [{T}, {H}] tensor (tokens, heads), got {getattr(weights, 'shape', None)}"
        )
    if not isinstance(keys, torch.Tensor):
        raise TypeError(f"keys: expected a torch.Tensor, got {type(keys).__name__}")
    if keys.dtype == torch.uint8:
        if keys.ndim != 3 or keys.shape[2] != D + 4:
            raise ValueError(
                f"keys: fp8 index pages must be [num_blocks, block_size, D + 4 = {D + 4}], got {tuple(keys.shape)}"
            )
        if block_table is None:
            raise ValueError("block_table: fp8 index pages need a block table [requests, blocks]")
        if offsets is not None:
            raise ValueError("offsets: only for key rows; fp8 pages are addressed by block_table")
    elif keys.dtype in _ROW_DTYPES:
        if keys.ndim != 2 or keys.shape[1] != D:
            raise ValueError(f"keys: rows must be [N, D = {D}], got {tuple(keys.shape)}")
        if block_table is not None:
            raise ValueError("block_table: only for fp8 index pages; rows are addressed by offsets")
    else:
        raise TypeError(f"keys: expected uint8 fp8 index pages or bfloat16 / float32 rows, got {keys.dtype}")
    for name, t in (("weights", weights), ("keys", keys)):
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, q is on {q.device}")
    if isinstance(compress_ratio, bool) or not isinstance(compress_ratio, int) or compress_ratio < 1:
        raise ValueError(f"compress_ratio: expected an integer >= 1, got {compress_ratio!r}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk: expected an integer >= 1, got {topk!r}")
    req = host_ints(token_request, "token_request", T)
    pos = host_ints(token_position, "token_position", T)
    if T and (pos.min() < 0 or pos.max() >= MAX_POSITION):
        raise ValueError(
            f"token_position: positions must be in [0, {MAX_POSITION}), got {int(pos.min())} .. {int(pos.max())}"
        )
    if T and req.min() < 0:
        raise ValueError(f"token_request: requests must be >= 0, got {int(req.min())}")
    if offsets is not None:
        offsets = host_ints(offsets, "offsets")
    if block_table is not None:
        if isinstance(block_table, torch.Tensor) and block_table.device.type != "cpu":
            raise ValueError(
                f"block_table: expected a host array (NumPy or CPU tensor), got a tensor on {block_table.device}"
            )
        block_table = np.asarray(block_table.numpy() if isinstance(block_table, torch.Tensor) else block_table)
        if block_table.dtype.kind not in "iu" or block_table.ndim != 2:
            raise ValueError(
                f"block_table: expected a 2-D integer array [requests, blocks], got {block_table.dtype} {block_table.shape}"
            )
    return q, weights, keys, req, pos, offsets, block_table


def host_array(x, name: str) -> np.ndarray:
    """An integer or bool array on the host (list, NumPy, CPU tensor; a device tensor refused)."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError(
                f"{name}: expected a host array (a list, NumPy array or CPU tensor), got a tensor on {x.device}"
            )
        x = x.detach().numpy()
    return np.asarray(x)


def check_two_level(T, topk, vis, valid, num_entries, candidate_block_size, candidate_topk_blocks, candidates):
    """(valid as bool [T] or None, CandidateOptions, candidates as host integers [T, W] or None): the
    options every backend shares, checked on the host."""
    if valid is not None:
        valid = host_array(valid, "valid")
        if valid.shape != (T,) or valid.dtype.kind not in "biu":
            raise ValueError(
                f"valid: expected a bool [{T}] array (one per token of q), got {valid.dtype} {valid.shape}"
            )
        valid = valid.astype(bool)
    live = vis if valid is None else vis[valid]
    if num_entries is not None:
        n = as_int(num_entries, "num_entries", minimum=0)
        if live.size and int(live.max()) > n:
            t = int(np.flatnonzero((vis == live.max()) & (True if valid is None else valid))[0])
            raise ValueError(f"num_entries: {n}, but token {t} sees {int(live.max())} entries")
    cand = None if candidates is None else host_array(candidates, "candidates")
    opt = candidate_options(topk, candidate_block_size, candidate_topk_blocks, None if cand is None else cand.shape)
    if cand is not None:
        if cand.shape[0] != T:
            raise ValueError(f"candidates: expected {T} rows (one per token of q), got shape {cand.shape}")
        if valid is None:
            check_candidates(cand, vis, opt.block_size)
        else:
            check_candidates(cand[valid], vis[valid], opt.block_size, tokens=np.flatnonzero(valid))
    return valid, opt, cand


def indexer_topk(
    q,
    weights,
    keys,
    token_request,
    token_position,
    compress_ratio: int,
    topk: int,
    *,
    offsets=None,
    block_table=None,
    valid=None,
    num_entries: int | None = None,
    candidate_block_size: int | None = None,
    candidate_topk_blocks: int | None = None,
    candidates=None,
    backend: str = "auto",
    reference_elems: int | None = None,
) -> IndexerResult:
    """The top-`topk` compressed entries per token, and level 1's candidate blocks when asked
    (see the module doc). No gradient. reference_elems: the reference backend's float32 logits
    block (tokens x keys) per slice (default `REFERENCE_ELEMS`)."""
    q, weights, keys, req, pos, offsets, block_table = _check(
        q, weights, keys, token_request, token_position, compress_ratio, topk, offsets, block_table
    )
    T = q.shape[0]
    valid, opt, cand = check_two_level(
        T,
        topk,
        (pos + 1) // compress_ratio,
        valid,
        num_entries,
        candidate_block_size,
        candidate_topk_blocks,
        candidates,
    )
    name = resolve_backend(backend, q)
    logger.debug(
        "indexer_topk: backend=%s (asked %r) T=%d H=%d D=%d topk=%d level=%d",
        name, backend, T, q.shape[1], q.shape[2], topk, opt.level,
    )  # fmt: skip
    rows = np.arange(T) if valid is None else np.flatnonzero(valid)
    every = 0 < rows.shape[0] == T
    if not every:  # rows no token fills: -1 / -inf (allocated only then: at 2048 x 512 a fill costs ms)
        idx = torch.full((T, topk), -1, dtype=torch.int32, device=q.device)
        val = torch.full((T, topk), float("-inf"), device=q.device)
        blocks = torch.full((T, opt.topk_blocks), -1, dtype=torch.int32, device=q.device) if opt.level == 1 else None
        if rows.shape[0] == 0:
            return IndexerResult(idx, val, name, blocks)
    sub = slice(None) if every else torch.from_numpy(rows).to(q.device)
    with torch.no_grad():
        fn = backends.INDEXER[name].kernel
        if name == "reference":
            fn = functools.partial(fn, elems=int(REFERENCE_ELEMS if reference_elems is None else reference_elems))
        out = fn(
            q[sub], weights[sub], keys, req[rows], pos[rows], compress_ratio, topk, offsets, block_table,
            cand=opt, candidates=cand if cand is None or every else cand[rows],
        )  # fmt: skip
    if every:
        return IndexerResult(out[0], out[1], name, out[2] if opt.level == 1 else None)
    idx[sub], val[sub] = out[0], out[1]
    if blocks is not None:
        blocks[sub] = out[2]
    return IndexerResult(idx, val, name, blocks)
