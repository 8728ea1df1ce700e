"""The Lightning Indexer's prefill chunk plan, once per step (NumPy, no framework import).

A CSA layer's indexer scores every prefill token against every compressed index key its request
holds, then keeps the top `index_topk`. vLLM 0.33.0 splits a step's prefill requests for it with
`DeepseekV32IndexerMetadataBuilder._split_indexer_prefill_chunks`
(`vllm/v1/attention/backends/mla/indexer.py`): requests in batch order join a chunk while

    sum of their compressed lengths (N)           <= workspace_size      (the gathered keys)
    (sum of their query lengths (M)) * N * 4       <= max_logits_bytes    (the dense logits)

a request that fits neither alone forms a chunk of its own, and every chunk is cut along its
query axis into pieces of `max(1, (max_logits_bytes // 4) // N)` query tokens (`N == 0`: one
piece). It returns `[(request_slice, query_slice), ...]`, the query slice counting the chunk's
query tokens from 0. vLLM's loop reads two tensor items per request on every metadata build.

Here:

* `split_indexer_prefill_chunks`: the same list for the same inputs (checked against vLLM's own
  function on thousands of random batches, tests/vllm/test_indexer_plan.py), from one pass over
  the lengths read as Python lists (one `tolist()` each): vLLM's loop reads two tensor items per
  request, which is what its time goes to.
* `plan_indexer`: the step's `IndexerPlan` for our kernels: the same chunks in arrays (vLLM's
  budgets, or `max_logits_bytes=None`: the streaming mode of a kernel that keeps a running top-k
  per token and never holds a logits buffer, so only the key workspace, if any, bounds a chunk),
  plus the per-token arrays every CSA layer of the step shares (request, position, visible
  compressed entries), made once.

Every request is planned as vLLM plans it, zero-query requests included (vLLM keeps them in a
chunk's request range; a chunk left with no query tokens gets no piece). The streaming plan drops
pieces without query tokens as well, and needs no budget at all unless a key workspace is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat

import numpy as np

from planner.checks import INT32_MAX, as_int, as_int_vector
from planner.kind_plan import readonly_int32

MODES = ("vllm", "streaming")


def _lengths(compressed_seq_lens, query_lens):
    n_c = as_int_vector(compressed_seq_lens, "compressed_seq_lens")
    q = as_int_vector(query_lens, "query_lens")
    if n_c.shape != q.shape:
        raise ValueError(
            f"query_lens: {q.shape[0]} entries for {n_c.shape[0]} requests (compressed_seq_lens has {n_c.shape[0]})"
        )
    for name, a in (("compressed_seq_lens", n_c), ("query_lens", q)):
        if a.size and int(a.min()) < 0:
            i = int(np.argmax(a < 0))
            raise ValueError(f"{name}: {name}[{i}] = {int(a[i])} is negative")
    return n_c, q


def _chunk_ends(cn: list[int], cm: list[int], workspace: int | None, elems: int | None) -> list[int]:
    """Request boundaries of vLLM's greedy scan: ends[i] is the end (exclusive) of chunk i.

    cn, cm: cumulative compressed / query lengths with a leading 0 (Python lists). A chunk that
    starts at s takes requests while cn[e] - cn[s] <= workspace and (cm[e] - cm[s]) *
    (cn[e] - cn[s]) <= elems (None: no such bound); both only grow with e, so the last e that
    satisfies them is found by a galloping search (1, 2, 4, ... requests ahead, then bisection):
    about 2 log2(chunk size) checks per chunk. A request that fits neither alone is a chunk alone.
    """
    n = len(cn) - 1
    ends, s = [], 0
    while s < n:
        c0, m0 = cn[s], cm[s]

        def fits(e):
            dn = cn[e] - c0
            return (workspace is None or dn <= workspace) and (elems is None or (cm[e] - m0) * dn <= elems)

        lo, step = s, 1  # fits(lo) holds (lo = s: the empty chunk)
        while lo + step <= n and fits(lo + step):
            lo += step
            step *= 2
        hi = lo + step - 1 if lo + step <= n else n  # fits(hi + 1) fails (or hi = n): the last e is in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        e = lo if lo > s else s + 1
        ends.append(e)
        s = e
    return ends


def _pieces(chunk_m: np.ndarray, chunk_n: np.ndarray, elems: int | None):
    """Query pieces of every chunk: (chunk id, query start, query end), vLLM's rule
    max_q = max(1, elems // N) (N == 0 or no budget: one piece of all M tokens)."""
    if elems is None:
        max_q = np.maximum(chunk_m, 1)
    else:
        max_q = np.where(chunk_n > 0, np.maximum(1, elems // np.maximum(chunk_n, 1)), np.maximum(chunk_m, 1))
    count = -(-chunk_m // max_q)  # 0 for a chunk without query tokens
    cid = np.repeat(np.arange(chunk_m.shape[0], dtype=np.int64), count)
    first = np.cumsum(count) - count
    k = np.arange(cid.shape[0], dtype=np.int64) - first[cid]
    q0 = k * max_q[cid]
    q1 = np.minimum(q0 + max_q[cid], chunk_m[cid])
    return cid, q0, q1


@dataclass(frozen=True, eq=False)
class IndexerPlan:
    """One step's indexer prefill plan (shared by every CSA layer of the step).

    Chunks (arrays of length C, batch request indices with `request_offset` added):
      req_start, req_end: the chunk's requests [req_start, req_end).
      query_start, query_end: its query tokens, counted from the chunk's first query token (vLLM's
        query slice).
      keys: compressed index keys its requests hold (vLLM's N; a gathering kernel's workspace rows).
      logits_bytes: (query_end - query_start) * keys * 4, the dense logits a vLLM kernel allocates
        for the piece (a streaming kernel allocates none).
    Tokens (length T, the batch's prefill tokens in batch order; only with `plan_indexer`):
      token_request, token_position (absolute), token_visible = (position + 1) // ratio: the
      compressed entries the token may select from.
    """

    mode: str
    request_offset: int
    req_start: np.ndarray
    req_end: np.ndarray
    query_start: np.ndarray
    query_end: np.ndarray
    keys: np.ndarray
    token_request: np.ndarray | None = None
    token_position: np.ndarray | None = None
    token_visible: np.ndarray | None = None
    compress_ratio: int | None = None

    @property
    def num_chunks(self) -> int:
        return int(self.req_start.shape[0])

    @property
    def logits_bytes(self) -> np.ndarray:
        return (self.query_end - self.query_start).astype(np.int64) * self.keys * 4

    def as_slices(self) -> list[tuple[slice, slice]]:
        """vLLM's form: `[(slice(req_start, req_end), slice(query_start, query_end)), ...]`."""
        cols = (self.req_start.tolist(), self.req_end.tolist(), self.query_start.tolist(), self.query_end.tolist())
        return [(slice(a, b), slice(c, d)) for a, b, c, d in zip(*cols)]


def _chunks(n_c, q, workspace_size, max_logits_bytes, request_offset, streaming):
    workspace = None if workspace_size is None else as_int(workspace_size, "workspace_size", minimum=0)
    elems = None if max_logits_bytes is None else as_int(max_logits_bytes, "max_logits_bytes", minimum=0) // 4
    offset = as_int(request_offset, "request_offset", minimum=0)
    n = n_c.shape[0]
    if n == 0:
        e = np.zeros(0, dtype=np.int64)
        return offset, e, e, e, e, e
    cn = np.zeros(n + 1, dtype=np.int64)
    cm = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(n_c, out=cn[1:])
    np.cumsum(q, out=cm[1:])
    if workspace is None and elems is None:
        ends = [n]
    elif workspace is not None and elems is None and int(cn[n]) <= workspace:
        ends = [n]
    else:
        ends = _chunk_ends(cn.tolist(), cm.tolist(), workspace, elems)
    ends = np.asarray(ends, dtype=np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    chunk_m, chunk_n = cm[ends] - cm[starts], cn[ends] - cn[starts]
    cid, q0, q1 = _pieces(chunk_m, chunk_n, elems)
    if streaming:  # (vLLM's rule already gives no piece to a chunk without queries)
        keep = q1 > q0
        cid, q0, q1 = cid[keep], q0[keep], q1[keep]
    return offset, starts[cid] + offset, ends[cid] + offset, q0, q1, chunk_n[cid]


_INT_DTYPES = frozenset(
    f"{prefix}{t}"
    for prefix in ("", "torch.")
    for t in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32")
)


_LISTABLE: dict = {}  # dtype object -> whether it is one of _INT_DTYPES (str() once per dtype)


def _int_list(x, name: str) -> list[int]:
    """A 1-D integer array (list, NumPy array, CPU tensor) as a list of Python ints (not checked
    for signs: the caller does, once for all its lists).

    An integer NumPy vector or CPU tensor goes straight through its own `tolist()` (one C call);
    anything else through `as_int_vector`'s checks."""
    try:
        listable = _LISTABLE[x.dtype]
    except KeyError:
        listable = _LISTABLE[x.dtype] = str(x.dtype) in _INT_DTYPES
    except (AttributeError, TypeError):  # no dtype (a list), or an unhashable one
        listable = False
    # `is_cpu`: torch's flag (False for a device tensor, whose tolist would wait for the device)
    if listable and x.ndim == 1 and getattr(x, "is_cpu", True):
        return x.tolist()
    if type(x) is list and all(type(v) is int for v in x):
        return x
    if getattr(x, "is_cpu", True) is False:
        raise ValueError(f"{name}: expected a host array or CPU tensor, got a tensor on {x.device}")
    if isinstance(x, KeysAtLeast):
        raise TypeError(f"{name}: KeysAtLeast stands for compressed_seq_lens only")
    return as_int_vector(x, name).tolist()


class KeysAtLeast:
    """Compressed lengths counted as at least `minimum` keys each when a chunk is budgeted.

    DeepSeek-V4.1's sparse-logits indexer (vLLM's `DeepseekV41SparseIndexerMetadataBuilder`,
    `attention_config.indexer_sparse_logits`) scores every candidate consumer's row over its
    candidate blocks only, in bf16 logits of `candidate_topk_blocks * candidate_block_size`
    columns, and makes the chunker budget every request as if its fp32 logits row were that wide:
    `_prefill_split_seq_lens` clamps the compressed lengths from below at
    `min_split_seq_len = (columns * 2 + 3) // 4` (`CandidateLayout.min_split_keys`) before the
    split. `split_indexer_prefill_chunks(KeysAtLeast(lengths, minimum), ...)` is that clamp and
    the split in one pass (no tensor operation for the clamp).
    """

    __slots__ = ("values", "minimum")

    def __init__(self, values, minimum: int):
        self.values = values
        self.minimum = minimum if type(minimum) is int and minimum >= 0 else as_int(minimum, "minimum", minimum=0)

    def __len__(self) -> int:
        return len(self.values)

    def __repr__(self) -> str:
        return f"KeysAtLeast({self.values!r}, minimum={self.minimum})"


def _pieces_of(out: list, r0: int, r1: int, m: int, k: int, elems: int) -> None:
    """Append one chunk's query pieces (vLLM's `max(1, elems // N)` tokens each; N == 0: one piece;
    no query tokens: none). Many pieces (a long ratio-1 context's chunk) are made in C (`zip`,
    `map(slice, ...)`), a few in a plain loop."""
    step = elems // k if k > 0 else m
    rs = slice(r0, r1)
    if step >= m:
        if m:
            out.append((rs, slice(0, m)))
        return
    if step < 1:
        step = 1
    if m > 16 * step:  # many pieces: made in C
        out.extend(zip(repeat(rs), map(slice, range(0, m, step), [*range(step, m, step), m])))
        return
    append, a = out.append, 0
    while a < m:  # a few pieces: a plain loop costs less than building the iterators
        b = a + step
        append((rs, slice(a, b if b < m else m)))
        a = b


def split_indexer_prefill_chunks(
    compressed_seq_lens,
    query_lens,
    workspace_size: int,
    max_logits_bytes: int,
    request_offset: int = 0,
) -> list[tuple[slice, slice]]:
    """vLLM 0.33.0's `_split_indexer_prefill_chunks`: `[(request_slice, query_slice), ...]`.

    Same arguments, same result: requests are scanned in order and a chunk takes the next one
    while its compressed lengths sum to at most `workspace_size` and (query tokens) x (that sum) x
    4 bytes stay within `max_logits_bytes`; a request that fits neither alone is a chunk of its
    own; each chunk is cut into query pieces of `max(1, (max_logits_bytes // 4) // N)` tokens.

    compressed_seq_lens, query_lens: 1-D non-negative integers per prefill request (lists, NumPy
      arrays, CPU tensors), vLLM's `compressed_seq_lens_cpu` and `prefill_query_lens_cpu`.
      `KeysAtLeast(lengths, minimum)` for compressed_seq_lens: DeepSeek-V4.1's sparse-logits
      builder's lengths (each counted as at least `minimum`), vLLM's
      `_split_indexer_prefill_chunks(_prefill_split_seq_lens(lengths), ...)`.

    This runs every step, mostly on small batches, where NumPy's per-call overhead would dominate:
    the lengths become Python lists in one C call each and one pass over them closes each chunk at
    the first request that breaks a bound (both bounds only grow as a chunk takes requests, so a
    request that does not fit a chunk cannot fit it later, and one that does not fit alone is a
    chunk alone).
    """
    lo, lens = None, compressed_seq_lens
    if type(lens) is KeysAtLeast:
        lo, lens = lens.minimum, lens.values
    try:  # vLLM's call: two 1-D integer CPU tensors, read in one tolist() each
        if (
            _LISTABLE[lens.dtype]
            and _LISTABLE[query_lens.dtype]
            and lens.ndim == 1 == query_lens.ndim
            and lens.is_cpu
            and query_lens.is_cpu
        ):
            comp, qry = lens.tolist(), query_lens.tolist()
        else:
            raise KeyError
    except (KeyError, AttributeError, TypeError):  # anything else: checked and converted one by one
        comp = _int_list(lens, "compressed_seq_lens")
        qry = _int_list(query_lens, "query_lens")
    if lo is not None:  # V4.1's sparse-logits minimum, applied to checked lengths
        if comp and min(comp) < 0:
            _negative(comp, "compressed_seq_lens")
        comp = [c if c > lo else lo for c in comp]
    if len(comp) != len(qry):
        raise ValueError(
            f"query_lens: {len(qry)} entries for {len(comp)} requests (compressed_seq_lens has {len(comp)})"
        )
    if qry and (min(comp) < 0 or min(qry) < 0):
        _negative(comp, "compressed_seq_lens")
        _negative(qry, "query_lens")
    workspace, elems, offset = workspace_size, max_logits_bytes, request_offset
    if not (type(workspace) is int is type(elems) is type(offset) and workspace >= 0 and elems >= 0 and offset >= 0):
        workspace = as_int(workspace_size, "workspace_size", minimum=0)
        elems = as_int(max_logits_bytes, "max_logits_bytes", minimum=0)
        offset = as_int(request_offset, "request_offset", minimum=0)
    elems //= 4
    out: list[tuple[slice, slice]] = []
    append, sl = out.append, slice
    start = i = offset  # request indices as vLLM returns them (offset added)
    m = k = 0
    for c, q in zip(comp, qry):
        n2 = k + c
        m2 = m + q
        if (n2 > workspace or m2 * n2 > elems) and i > start:  # request i opens the next chunk
            if m * k <= elems:  # the common case, one piece (vLLM's max_q >= m), inline
                if m:
                    append((sl(start, i), sl(0, m)))
            else:
                _pieces_of(out, start, i, m, k, elems)
            start = i
            k = c
            m = q
        else:
            k = n2
            m = m2
        i += 1
    if m * k <= elems:
        if m:
            append((sl(start, i), sl(0, m)))
    else:
        _pieces_of(out, start, i, m, k, elems)
    return out


def _negative(a: list[int], name: str) -> None:
    """Raise naming the first negative entry of `a`, if any."""
    for i, v in enumerate(a):
        if v < 0:
            raise ValueError(f"{name}: {name}[{i}] = {v} is negative")


# vLLM 0.33's DeepGEMM sparse-logits block sizes (tokens), largest first (`SPARSE_BLOCK_KV_CHOICES`).
SPARSE_BLOCK_KV_CHOICES = (16, 8)


@dataclass(frozen=True)
class CandidateLayout:
    """DeepSeek-V4.1's two-level top-k buffers: their widths from the schedule, their rows per step.

    The candidate source keeps, per query row, the top `topk_blocks` blocks of `block_size`
    compressed entries (level 1); later index sources take their top `index_topk` inside them
    (level 2). vLLM 0.33 holds the blocks in one int32 buffer of `max_num_batched_tokens` rows and
    `topk_blocks` columns (`DeepseekV4Model.candidate_block_buffer`), indexed by the step's token
    row; its sparse-logits indexer (`DeepseekV41SparseIndexerMetadataBuilder`) adds per-row scratch
    of `num_sparse_blocks` DeepGEMM block ids, one end and `index_topk` columns, and budgets its
    prefill split with every compressed length at least `min_split_keys` (`KeysAtLeast`).

    `rows(step)`: the rows a step writes, from its `planner.StepPlan`: the candidate source's band
    (under bounded replay the candidate source is the cut, which computes each request's last
    min(query_len, W) rows only), where vLLM sizes for the largest step. `buffers(rows)`: the
    shapes for that many rows.
    """

    topk_blocks: int
    block_size: int
    index_topk: int

    def __post_init__(self):
        for name in ("topk_blocks", "block_size", "index_topk"):
            object.__setattr__(self, name, as_int(getattr(self, name), name, minimum=1))
        if not any(self.block_size % b == 0 for b in SPARSE_BLOCK_KV_CHOICES):
            raise ValueError(
                f"block_size: {self.block_size} is not a multiple of any DeepGEMM sparse block size "
                f"{SPARSE_BLOCK_KV_CHOICES} (vLLM's candidate_block_size rule)"
            )

    @classmethod
    def of(cls, schedule) -> CandidateLayout | None:
        """The layout of a `planner.Schedule` (None when its two-level top-k is off)."""
        if schedule.candidate_source_layer_id < 0:
            return None
        return cls(schedule.candidate_topk_blocks, schedule.candidate_block_size, schedule.index_topk)

    @property
    def sparse_block_kv(self) -> int:
        """Tokens per DeepGEMM sparse block: the largest choice dividing block_size."""
        return next(b for b in SPARSE_BLOCK_KV_CHOICES if self.block_size % b == 0)

    @property
    def num_sparse_blocks(self) -> int:
        return self.topk_blocks * (self.block_size // self.sparse_block_kv)

    @property
    def num_sparse_cols(self) -> int:
        """Columns of a row's sparse logits (every candidate block's entries)."""
        return self.num_sparse_blocks * self.sparse_block_kv

    @property
    def min_split_keys(self) -> int:
        """The keys a request counts as at least in the prefill split: its bf16 sparse logits row in
        fp32 units, vLLM's `min_split_seq_len`."""
        return (self.num_sparse_cols * 2 + 3) // 4

    def rows(self, step) -> int:
        """Candidate rows a step's prefill writes: the tokens of the band its candidate source
        computes (`step`: a `planner.StepPlan` planned from a Schedule)."""
        if step.schedule is None:
            raise ValueError("step: planned from a list of layers; the candidate rows need a planner.Schedule")
        layer = step.schedule.candidate_source_layer_id
        if layer < 0:
            raise ValueError("step: its schedule has no candidate source (candidate_source_layer_id < 0)")
        band = step.layer_keys[layer].band
        return step.batch.band(band, step.config.window_size).num_tokens

    def buffers(self, rows: int) -> dict[str, tuple[int, ...]]:
        """int32 buffer shapes for `rows` token rows: the candidate blocks and the sparse-logits
        scratch (sparse block ids, valid ends, top-k columns)."""
        r = as_int(rows, "rows", minimum=0)
        return {
            "candidate_blocks": (r, self.topk_blocks),
            "sparse_indices": (r, self.num_sparse_blocks),
            "end": (r,),
            "col_indices": (r, self.index_topk),
        }


def plan_indexer(
    seq_lens,
    query_lens,
    compress_ratio: int,
    *,
    workspace_size: int | None = None,
    max_logits_bytes: int | None = None,
    request_offset: int = 0,
) -> IndexerPlan:
    """The step's indexer plan: chunks and per-token arrays, shared by every CSA layer.

    seq_lens, query_lens: per prefill request (context after the step, new tokens); the request's
      queries sit at positions seq_len - query_len .. seq_len - 1 and see the compressed entries
      0 .. (position + 1) // compress_ratio - 1; the request holds seq_len // compress_ratio.
    max_logits_bytes: None = streaming mode (no logits budget: our kernels keep a running top-k
      per token); an integer = vLLM's mode, chunks equal to `split_indexer_prefill_chunks`.
    workspace_size: bound on the compressed keys one chunk gathers (None: none, our kernels read
      the paged cache in place).
    """
    r = as_int(compress_ratio, "compress_ratio", minimum=1)
    seq = as_int_vector(seq_lens, "seq_lens")
    n_c, q = _lengths(seq // r if seq.size else seq, query_lens)
    if seq.size:
        if int(seq.min()) < 0:
            i = int(np.argmax(seq < 0))
            raise ValueError(f"seq_lens: seq_lens[{i}] = {int(seq[i])} is negative")
        if int(seq.max()) > INT32_MAX:
            i = int(np.argmax(seq))
            raise ValueError(f"seq_lens: seq_lens[{i}] = {int(seq[i])} exceeds {INT32_MAX} (int32 positions)")
        bad = q > seq
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"query_lens: query_lens[{i}] = {int(q[i])} exceeds seq_lens[{i}] = {int(seq[i])}")
    streaming = max_logits_bytes is None
    offset, rs, re, q0, q1, keys = _chunks(n_c, q, workspace_size, max_logits_bytes, request_offset, streaming)
    T = int(q.sum())
    if T > INT32_MAX:
        raise ValueError(f"query_lens: {T} prefill tokens exceed {INT32_MAX} (int32 token rows)")
    token_request = np.repeat(np.arange(q.shape[0], dtype=np.int64), q)
    first = np.cumsum(q) - q
    token_position = seq[token_request] - q[token_request] + (np.arange(T, dtype=np.int64) - first[token_request])
    return IndexerPlan(
        mode="streaming" if streaming else "vllm",
        request_offset=offset,
        req_start=readonly_int32(rs),
        req_end=readonly_int32(re),
        query_start=readonly_int32(q0),
        query_end=readonly_int32(q1),
        keys=_readonly(keys.astype(np.int64)),
        token_request=readonly_int32(token_request),
        token_position=readonly_int32(token_position),
        token_visible=readonly_int32((token_position + 1) // r),
        compress_ratio=r,
    )


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a
