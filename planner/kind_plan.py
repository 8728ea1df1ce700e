"""The result of planning one layer kind for one step: `KindPlan` and its per-chunk view `ChunkLayout`.

Made by `planner.plan.plan_kind` (spec section 4). A `KindPlan` keeps the planner's segment and
chunk lists as they were made and derives its flat int32 arrays (per segment, per chunk, per
planned token; what device index builders take, one host-to-device copy per kind per step) on
first use, so a plan read only for vLLM's tuples makes none of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from planner.batch import PrefillBatch
from planner.config import PlanConfig
from planner.contract import LayerKind, LayerSpec, PlanKey


class ChunkLayout:
    """One chunk: its requests' places in the workspace `[num_requests * M, 512]` and its tokens.

    Chunk-local request b owns rows `b*M .. b*M + M - 1` (`row_bases[b] = b*M`): rows
    `b*M + j` (j < compressed_lens[b]) hold compressed entry j, rows `b*M + N + j`
    (j < gather_lens[b]) hold raw token `gather_starts[b] + j`. Other rows are never indexed.

    Per-request arrays (length num_requests): request_ids (index in the batch), seq_lens and
    query_lens of the piece planned (a whole request unless budget_rows split it), query_offsets
    (first query token of the piece within its request), compressed_lens, gather_lens,
    gather_starts, row_bases.
    Per-token arrays (length num_tokens): token_index (row in the step's token array, request-major
    as the batch orders them), token_request (chunk-local b), token_position (absolute position p).
    """

    __slots__ = (
        "index",
        "start",
        "end",
        "N",
        "M",
        "request_ids",
        "seq_lens",
        "query_lens",
        "query_offsets",
        "compressed_lens",
        "gather_lens",
        "gather_starts",
        "row_bases",
        "token_index",
        "token_request",
        "token_position",
    )

    def __init__(self, plan: KindPlan, c: int):
        s, e = int(plan.chunk_starts[c]), int(plan.chunk_starts[c + 1])
        t0, t1 = int(plan.chunk_token_starts[c]), int(plan.chunk_token_starts[c + 1])
        self.index, self.start, self.end = c, s, e
        self.N, self.M = int(plan.chunk_N[c]), int(plan.chunk_M[c])
        self.request_ids = plan.seg_request[s:e]
        self.seq_lens = plan.seg_seq_len[s:e]
        self.query_lens = plan.seg_query_len[s:e]
        self.query_offsets = plan.seg_query_offset[s:e]
        self.compressed_lens = plan.seg_compressed_len[s:e]
        self.gather_lens = plan.seg_gather_len[s:e]
        self.gather_starts = plan.seg_gather_start[s:e]
        self.row_bases = plan.seg_row_base[s:e]
        self.token_index = plan.token_index[t0:t1]
        self.token_request = plan.token_request[t0:t1]
        self.token_position = plan.token_position[t0:t1]

    @property
    def num_requests(self) -> int:
        return self.end - self.start

    @property
    def num_tokens(self) -> int:
        return int(self.token_index.shape[0])

    @property
    def workspace_rows(self) -> int:
        return self.num_requests * self.M

    def __repr__(self):
        return (
            f"ChunkLayout(#{self.index}: requests {self.request_ids.tolist()}, N={self.N}, M={self.M}, "
            f"tokens={self.num_tokens}, rows={self.workspace_rows})"
        )


@dataclass(frozen=True, eq=False)
class KindPlan:
    """The chunk plan and workspace layout of one layer kind for one step.

    Segments are the planned pieces in plan order (one per request with queries, unless
    budget_rows split one; of a "cut" / "replay" band, its kept rows, `seg_query_offset` saying
    where they start); `seg_*` arrays are per segment, `chunk_*` per chunk (`chunk_starts`
    and `chunk_token_starts` have one extra entry), `token_*` per planned token, chunk-major.
    All integer arrays are int32 (what device kernels want), read-only.
    """

    layer: LayerSpec  # the kind and compress ratio this plan serves
    config: PlanConfig
    budget_rows: int
    batch: PrefillBatch = field(repr=False)
    order: np.ndarray  # request ids with queries, in the order the planner scanned them
    skipped: np.ndarray  # request ids with query_len == 0
    split_requests: np.ndarray  # request ids cut into several segments by budget_rows
    # Sources of the per-segment and per-chunk arrays, as the planner made them: segments
    # (request, seq_len, query_len, query_offset, compressed_len, gather_len; None = all zero)
    # and chunks (starts, N, M). The int32 arrays below are made from them on first use.
    seg_source: tuple = field(repr=False)
    chunk_source: tuple = field(repr=False)
    band: str = "full"  # the rows it computes (`contract.BANDS`): segments hold each request's kept rows
    _chunks: list = field(default_factory=list, repr=False)

    # Everything but the chunk boundaries is derived on first use: a plan read only for its chunks
    # (vLLM's tuples) makes no per-segment or per-token array at all.

    @cached_property
    def _seg32(self):
        req, seq, q, off, comp, gath = self.seg_source
        zeros = np.zeros_like(q)
        return frozen_int32(req, seq, q, zeros if off is None else off, zeros if comp is None else comp, gath)

    @property
    def seg_request(self) -> np.ndarray:
        return self._seg32[0]

    @property
    def seg_seq_len(self) -> np.ndarray:
        return self._seg32[1]

    @property
    def seg_query_len(self) -> np.ndarray:
        return self._seg32[2]

    @property
    def seg_query_offset(self) -> np.ndarray:
        return self._seg32[3]

    @property
    def seg_compressed_len(self) -> np.ndarray:
        return self._seg32[4]

    @property
    def seg_gather_len(self) -> np.ndarray:
        return self._seg32[5]

    @cached_property
    def _chunk32(self):
        starts, Ns, Ms = self.chunk_source
        return (readonly_int32(starts),) + tuple(frozen_int32(Ns, Ms))

    @property
    def chunk_starts(self) -> np.ndarray:
        return self._chunk32[0]

    @property
    def chunk_N(self) -> np.ndarray:
        return self._chunk32[1]

    @property
    def chunk_M(self) -> np.ndarray:
        return self._chunk32[2]

    @cached_property
    def _segments(self):
        counts = np.diff(self.chunk_starts)
        seg_chunk = np.repeat(np.arange(counts.shape[0]), counts)
        seg_slot = np.arange(self.seg_request.shape[0]) - self.chunk_starts[:-1][seg_chunk]
        gather_start, row_base = frozen_int32(
            self.seg_seq_len - self.seg_gather_len, seg_slot * self.chunk_M[seg_chunk]
        )
        return seg_slot, gather_start, row_base

    @property
    def seg_gather_start(self) -> np.ndarray:
        """First raw token each segment gathers: seq_len - gather_len."""
        return self._segments[1]

    @property
    def seg_row_base(self) -> np.ndarray:
        """Each segment's first workspace row in its chunk: slot * M."""
        return self._segments[2]

    @cached_property
    def _tokens(self):
        batch, seg_req, chunk_starts = self.batch, self.seg_request, self.chunk_starts
        seg_slot = self._segments[0]
        if not self.split_requests.size and self.config.order == "batch" and self.seg_source[3] is None:
            # Segments are the requests with queries, in batch order: the planned tokens are the
            # step's tokens in their own order, so the per-token arrays come from the batch.
            token_index = batch.token_arange
            token_position = batch.token_position
            slot_of_request = np.zeros(batch.num_requests, dtype=np.int32)
            slot_of_request[seg_req] = seg_slot
            token_request = slot_of_request[batch.token_request]
            chunk_token_starts = np.append(batch.query_start_loc[seg_req[chunk_starts[:-1]]], batch.num_tokens)
        else:  # tokens in plan order: each segment's queries, segments in chunk order
            n, seg_q = seg_req.shape[0], self.seg_query_len
            seg_tok0 = batch.query_start_loc[seg_req] + self.seg_query_offset
            seg_cum = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(seg_q, out=seg_cum[1:])
            tok_seg = np.repeat(np.arange(n), seg_q)
            token_index = seg_tok0[tok_seg] + (np.arange(int(seg_cum[-1])) - seg_cum[tok_seg])
            token_position = batch.token_position[token_index]
            token_request = seg_slot[tok_seg]
            chunk_token_starts = seg_cum[chunk_starts]
        return (
            readonly_int32(chunk_token_starts),
            readonly_int32(token_index),
            readonly_int32(token_request),
            readonly_int32(token_position),
        )

    @property
    def chunk_token_starts(self) -> np.ndarray:
        """(num_chunks + 1,): chunk c's tokens are token_* entries chunk_token_starts[c] .. [c+1] - 1."""
        return self._tokens[0]

    @property
    def token_index(self) -> np.ndarray:
        """Per planned token: its row in the step's token array (request-major, batch order)."""
        return self._tokens[1]

    @property
    def token_request(self) -> np.ndarray:
        """Per planned token: its chunk-local request slot b."""
        return self._tokens[2]

    @property
    def token_position(self) -> np.ndarray:
        """Per planned token: its absolute position p."""
        return self._tokens[3]

    @property
    def key(self) -> PlanKey:
        """The layer spec and band this plan serves (layers with this key share it)."""
        return PlanKey(self.layer, self.band)

    @property
    def kind(self) -> LayerKind:
        return self.layer.kind

    @property
    def compress_ratio(self) -> int:
        return self.layer.compress_ratio

    @property
    def has_compressed(self) -> bool:
        return self.layer.has_compressed

    @property
    def window_size(self) -> int:
        return self.config.window_size

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_source[1])

    @property
    def chunks(self) -> list[ChunkLayout]:
        if not self._chunks and self.num_chunks:
            self._chunks.extend(ChunkLayout(self, c) for c in range(self.num_chunks))
        return self._chunks

    @cached_property
    def chunk_num_requests(self) -> np.ndarray:
        return np.diff(self.chunk_starts)

    @cached_property
    def chunk_workspace_rows(self) -> np.ndarray:
        return self.chunk_num_requests.astype(np.int64) * self.chunk_M

    @property
    def max_workspace_rows(self) -> int:
        """Rows of the one workspace buffer that serves every chunk of this kind."""
        return int(self.chunk_workspace_rows.max()) if self.num_chunks else 0

    @property
    def total_workspace_rows(self) -> int:
        return int(self.chunk_workspace_rows.sum())

    @property
    def padding_free_rows(self) -> int:
        """The lower bound: every segment's compressed_len + gather_len, no padding."""
        return int(self.seg_compressed_len.sum(dtype=np.int64) + self.seg_gather_len.sum(dtype=np.int64))

    def as_tuples(self) -> list[tuple[int, int, int, int]]:
        """vLLM's `(start, end, N, M)` tuples; start/end are batch request indices.

        A chunk spans its first to its last request; `query_len == 0` requests inside that range
        take no rows (a `contiguous` plan has none inside). Only defined for batch order without
        splits.
        """
        if self.config.order != "batch" or self.split_requests.size:
            raise ValueError("as_tuples: only defined for order='batch' plans without split requests")
        req, (cs, Ns, Ms) = self.seg_source[0].tolist(), self.chunk_source
        if isinstance(cs, np.ndarray):  # fixed / per_request plans keep arrays
            cs, Ns, Ms = cs.tolist(), Ns.tolist(), Ms.tolist()
        return [(req[a], req[b - 1] + 1, n, m) for a, b, n, m in zip(cs, cs[1:], Ns, Ms)]


def frozen_int32(*arrays) -> list[np.ndarray]:
    """Equal-length arrays as read-only int32 rows of one buffer (one copy, not one per array)."""
    buf = np.array(arrays, dtype=np.int32).reshape(len(arrays), -1)
    buf.setflags(write=False)
    return list(buf)


def readonly_int32(a) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.int32 or a.flags.writeable:
        a = np.ascontiguousarray(a, dtype=np.int32)
        a.setflags(write=False)
    return a


EMPTY_INT32 = np.zeros(0, dtype=np.int32)
EMPTY_INT32.setflags(write=False)
