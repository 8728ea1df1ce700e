"""Chunk plans: which prefill requests share one workspace and one kernel launch (spec section 4).

Two layers of API:

* `get_prefill_chunk_plan` / `get_fixed_chunk_plan`: vLLM's tuples `(start, end, N, M)`, the same
  values vLLM returns for the same inputs (adaptive and the old fixed plan).
* `plan_step` -> `StepPlan`: one `KindPlan` per layer kind, computed once per step on the host and
  shared by every layer of that kind. A `KindPlan` holds the workspace layout of every chunk and
  compact per-token metadata as flat NumPy arrays (one host-to-device copy per kind per step);
  `KindPlan.chunks` gives a readable per-chunk view (`ChunkLayout`).

Beyond vLLM: requests with `query_len == 0` never form or widen a chunk (they are recorded in
`KindPlan.skipped`); an explicit `budget_rows` is honoured, splitting a request that does not fit
alone along its query axis (pieces see all the KV before them); an optional length-aware order.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from planner import contract
from planner.batch import PrefillBatch
from planner.contract import (
    ORDERS,
    POLICIES,
    V4_LAYERS,
    LayerKind,
    LayerSpec,
    _as_int,
    as_layer_specs,
)


@dataclass(frozen=True)
class PlanConfig:
    """Engine limits and planning choices; fixed for a server, reused every step.

    window_size: W, the sliding window (the query itself included).
    max_model_len, max_num_batched_tokens: the engine's limits; they set vLLM's workspace bound.
    prefill_chunk_size: requests per chunk of the old fixed plan (4 in vLLM); also scales the
      adaptive budget, which is exactly the fixed plan's workspace.
    policy: "adaptive" (vLLM's greedy packing), "fixed" (the old plan) or "per_request"
      (one request per chunk, vLLM's batch-invariant mode).
    budget_rows: workspace rows one chunk may use (adaptive and per_request). None = vLLM's bound
      `prefill_chunk_size * (cdiv(max_model_len, r) + W + max_num_batched_tokens)` (the
      cdiv term is 0 for layers without a compressed cache).
    order: "batch" (vLLM-compatible) or "length" (requests sorted by workspace width, which packs
      similar requests together and pads less; the permutation is `KindPlan.order`).
    """

    window_size: int
    max_model_len: int
    max_num_batched_tokens: int
    prefill_chunk_size: int = 4
    policy: str = "adaptive"
    budget_rows: int | None = None
    order: str = "batch"

    def __post_init__(self):
        _as_int(self.window_size, "window_size", minimum=1)
        _as_int(self.max_model_len, "max_model_len", minimum=1)
        _as_int(self.max_num_batched_tokens, "max_num_batched_tokens", minimum=1)
        _as_int(self.prefill_chunk_size, "prefill_chunk_size", minimum=1)
        if self.policy not in POLICIES:
            raise ValueError(f"policy: expected one of {POLICIES}, got {self.policy!r}")
        if self.order not in ORDERS:
            raise ValueError(f"order: expected one of {ORDERS}, got {self.order!r}")
        if self.budget_rows is not None:
            _as_int(self.budget_rows, "budget_rows", minimum=1)
            if self.policy == "fixed":
                raise ValueError("budget_rows: the fixed plan has its own workspace size; use policy='adaptive'")

    def max_compressed_len(self, layer: LayerSpec) -> int:
        """Upper bound of compressed rows per request: cdiv(max_model_len, r), 0 without a
        compressed cache."""
        return contract.max_compressed_len(self.max_model_len, layer.compress_ratio, layer.has_compressed)

    def vllm_budget_rows(self, layer: LayerSpec) -> int:
        """vLLM's adaptive workspace bound: exactly the fixed plan's workspace rows."""
        return self.prefill_chunk_size * self.fixed_M(layer)

    def fixed_M(self, layer: LayerSpec) -> int:
        return self.max_compressed_len(layer) + self.window_size + self.max_num_batched_tokens

    def budget(self, layer: LayerSpec) -> int:
        return self.vllm_budget_rows(layer) if self.budget_rows is None else int(self.budget_rows)


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
        "index", "start", "end", "N", "M", "request_ids", "seq_lens", "query_lens", "query_offsets",
        "compressed_lens", "gather_lens", "gather_starts", "row_bases",
        "token_index", "token_request", "token_position",
    )  # fmt: skip

    def __init__(self, plan: "KindPlan", c: int):
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
    budget_rows split one); `seg_*` arrays are per segment, `chunk_*` per chunk (`chunk_starts`
    and `chunk_token_starts` have one extra entry), `token_*` per planned token, chunk-major.
    All integer arrays are int32 (what device kernels want), read-only.
    """

    layer: LayerSpec  # the kind and compress ratio this plan serves
    config: PlanConfig
    budget_rows: int
    order: np.ndarray  # request ids with queries, in the order the planner scanned them
    skipped: np.ndarray  # request ids with query_len == 0
    split_requests: np.ndarray  # request ids cut into several segments by budget_rows
    seg_request: np.ndarray
    seg_seq_len: np.ndarray
    seg_query_len: np.ndarray
    seg_query_offset: np.ndarray
    seg_compressed_len: np.ndarray
    seg_gather_len: np.ndarray
    seg_gather_start: np.ndarray
    seg_row_base: np.ndarray
    chunk_starts: np.ndarray
    chunk_N: np.ndarray
    chunk_M: np.ndarray
    chunk_token_starts: np.ndarray
    token_index: np.ndarray
    token_request: np.ndarray
    token_position: np.ndarray
    _chunks: list = field(default_factory=list, repr=False)

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
        return int(self.chunk_N.shape[0])

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
        take no rows. Only defined for batch order without splits.
        """
        if self.config.order != "batch" or self.split_requests.size:
            raise ValueError("as_tuples: only defined for order='batch' plans without split requests")
        starts = self.seg_request[self.chunk_starts[:-1]].tolist()
        ends = (self.seg_request[self.chunk_starts[1:] - 1] + 1).tolist()
        return list(zip(starts, ends, self.chunk_N.tolist(), self.chunk_M.tolist()))


def _greedy_chunks(comp: list[int], gath: list[int], area: int):
    """vLLM's adaptive scan: grow a chunk while count * (max comp + max gather) <= area."""
    starts, Ns, Ms = [], [], []
    n, s = len(comp), 0
    while s < n:
        cm, gm, e = comp[s], gath[s], s + 1
        while e < n:
            c, g = comp[e], gath[e]
            if c < cm:
                c = cm
            if g < gm:
                g = gm
            if (e - s + 1) * (c + g) > area:
                break
            cm, gm, e = c, g, e + 1
        starts.append(s)
        Ns.append(cm)
        Ms.append(cm + gm)
        s = e
    starts.append(n)
    return starts, Ns, Ms


def _split_request(prefix: int, query_len: int, r: int, W: int, budget: int, request: int):  # r = 0: no compressed rows
    """Cut one request's queries into pieces [a, b) whose rows fit `budget` (greedy, longest first).

    A piece is planned as a request of seq_len prefix+b and query_len b-a: it gathers every
    compressed entry and window token its queries can see.
    """

    def rows(a, b):
        comp = 0 if r == 0 else (prefix + b) // r
        return comp + (b - a) + min(prefix + a, W - 1)

    pieces, a = [], 0
    while a < query_len:
        if rows(a, a + 1) > budget:
            raise ValueError(
                f"budget_rows: {budget} rows cannot hold even one query token of request {request} "
                f"(position {prefix + a} needs {rows(a, a + 1)} rows with ratio {r}, window {W})"
            )
        lo, hi = a + 1, query_len  # largest b in [lo, hi] with rows(a, b) <= budget
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if rows(a, mid) <= budget:
                lo = mid
            else:
                hi = mid - 1
        pieces.append((a, lo))
        a = lo
    return pieces


def _frozen32(*arrays) -> list[np.ndarray]:
    """Equal-length arrays as read-only int32 rows of one buffer (one copy, not one per array)."""
    buf = np.array(arrays, dtype=np.int32).reshape(len(arrays), -1)
    buf.setflags(write=False)
    return list(buf)


def _ro32(a) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.int32 or a.flags.writeable:
        a = np.ascontiguousarray(a, dtype=np.int32)
        a.setflags(write=False)
    return a


def _active_requests(batch: PrefillBatch, config: PlanConfig):
    """What every kind's plan shares: the checked requests with queries and their gather_lens."""
    if batch.max_model_len is None and batch.seq_lens.size and int(batch.seq_lens.max()) > config.max_model_len:
        i = int(np.argmax(batch.seq_lens))
        raise ValueError(f"seq_lens: seq_lens[{i}] = {int(batch.seq_lens[i])} exceeds max_model_len = {config.max_model_len}")
    if batch.query_lens.size and int(batch.query_lens.max()) > config.max_num_batched_tokens:
        i = int(np.argmax(batch.query_lens))
        raise ValueError(
            f"query_lens: query_lens[{i}] = {int(batch.query_lens[i])} exceeds "
            f"max_num_batched_tokens = {config.max_num_batched_tokens}"
        )
    has_queries = batch.query_lens > 0
    active = np.flatnonzero(has_queries)
    skipped = np.flatnonzero(~has_queries)
    seq_a = batch.seq_lens[active]
    qry_a = batch.query_lens[active]
    gath_a = contract.gather_len(seq_a, qry_a, config.window_size)
    return active, skipped, seq_a, qry_a, gath_a


def plan_kind(batch: PrefillBatch, config: PlanConfig, layer, _shared=None) -> KindPlan:
    """Plan one layer kind for one step.

    layer: a `LayerSpec` or `(kind, compress_ratio)` pair: any ratio >= 1 for CSA/HCA.
    """
    layer = LayerSpec.of(layer)
    r = layer.compress_ratio if layer.has_compressed else 0  # 0: no compressed rows
    W = config.window_size
    active, skipped, seq_a, qry_a, gath_a = _shared or _active_requests(batch, config)
    comp_a = contract.compressed_len(seq_a, r, layer.has_compressed)
    if config.order == "length" and active.size:
        perm = np.lexsort((-gath_a, -comp_a), axis=0)  # widest first; stable for ties
        active, seq_a, qry_a, comp_a, gath_a = (x[perm] for x in (active, seq_a, qry_a, comp_a, gath_a))

    budget = config.budget(layer)
    split: list[int] = []
    if config.policy != "fixed" and active.size and int((comp_a + gath_a).max()) > budget:
        rows = []  # (request, seq_len, query_len, query_offset)
        for i, s, q in zip(active.tolist(), seq_a.tolist(), qry_a.tolist()):
            pieces = _split_request(s - q, q, r, W, budget, i)
            if len(pieces) > 1:
                split.append(i)
            rows.extend((i, s - q + b, b - a, a) for a, b in pieces)
        seg = np.array(rows, dtype=np.int64).reshape(-1, 4)
        seg_req, seg_seq, seg_q, seg_off = seg.T
        seg_comp = contract.compressed_len(seg_seq, r, layer.has_compressed)
        seg_gath = contract.gather_len(seg_seq, seg_q, W)
    else:
        seg_req, seg_seq, seg_q = active, seq_a, qry_a
        seg_off = np.zeros_like(seg_q)
        seg_comp, seg_gath = comp_a, gath_a

    n = int(seg_req.shape[0])
    if config.policy == "adaptive":
        starts, Ns, Ms = _greedy_chunks(seg_comp.tolist(), seg_gath.tolist(), budget)
        chunk_starts = np.array(starts, dtype=np.int64)
        chunk_N, chunk_M = np.array(Ns, dtype=np.int64), np.array(Ms, dtype=np.int64)
    elif config.policy == "fixed":
        chunk_starts = np.append(np.arange(0, n, config.prefill_chunk_size), n)
        nc = chunk_starts.shape[0] - 1
        chunk_N = np.full(nc, config.max_compressed_len(layer), dtype=np.int64)
        chunk_M = np.full(nc, config.fixed_M(layer), dtype=np.int64)
    else:  # per_request
        chunk_starts = np.arange(n + 1, dtype=np.int64)
        chunk_N, chunk_M = seg_comp.astype(np.int64), (seg_comp + seg_gath).astype(np.int64)

    counts = np.diff(chunk_starts)
    seg_chunk = np.repeat(np.arange(counts.shape[0]), counts)
    seg_slot = np.arange(n) - chunk_starts[:-1][seg_chunk]
    seg_row_base = seg_slot * chunk_M[seg_chunk]
    if not split and config.order == "batch":
        # Segments are the requests with queries, in batch order: the planned tokens are the
        # step's tokens in their own order, so the per-token arrays come from the batch.
        token_index = batch.token_arange
        token_position = batch.token_position
        slot_of_request = np.zeros(batch.num_requests, dtype=np.int32)
        slot_of_request[seg_req] = seg_slot
        token_request = slot_of_request[batch.token_request]
        chunk_token_starts = np.append(batch.query_start_loc[seg_req[chunk_starts[:-1]]], batch.num_tokens)
    else:  # tokens in plan order: each segment's queries, segments in chunk order
        seg_tok0 = batch.query_start_loc[seg_req] + seg_off
        seg_cum = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(seg_q, out=seg_cum[1:])
        tok_seg = np.repeat(np.arange(n), seg_q)
        token_index = seg_tok0[tok_seg] + (np.arange(int(seg_cum[-1])) - seg_cum[tok_seg])
        token_position = batch.token_position[token_index]
        token_request = seg_slot[tok_seg]
        chunk_token_starts = seg_cum[chunk_starts]
    seg = _frozen32(seg_req, seg_seq, seg_q, seg_off, seg_comp, seg_gath, seg_seq - seg_gath, seg_row_base)
    chunk_N, chunk_M = _frozen32(chunk_N, chunk_M)
    chunk_starts, chunk_token_starts = _frozen32(chunk_starts, chunk_token_starts)
    return KindPlan(
        layer=layer, config=config, budget_rows=budget,
        order=_ro32(active), skipped=_ro32(skipped), split_requests=_ro32(split),
        seg_request=seg[0], seg_seq_len=seg[1], seg_query_len=seg[2], seg_query_offset=seg[3],
        seg_compressed_len=seg[4], seg_gather_len=seg[5], seg_gather_start=seg[6], seg_row_base=seg[7],
        chunk_starts=chunk_starts, chunk_N=chunk_N, chunk_M=chunk_M, chunk_token_starts=chunk_token_starts,
        token_index=_ro32(token_index), token_request=_ro32(token_request), token_position=_ro32(token_position),
    )  # fmt: skip


@dataclass(frozen=True, eq=False)
class StepPlan:
    """One step's plans: a `KindPlan` per layer kind, shared by all layers of that kind.

    Index it with a kind: `step[LayerKind.CSA]` or `step["CSA"]`.
    """

    batch: PrefillBatch
    config: PlanConfig
    kinds: dict[LayerKind, KindPlan]

    def __getitem__(self, kind) -> KindPlan:
        k = LayerKind.of(kind)
        if k not in self.kinds:
            raise KeyError(f"no plan for {k.name} in this step (planned: {[x.name for x in self.kinds]})")
        return self.kinds[k]

    @property
    def max_workspace_rows(self) -> int:
        return max((p.max_workspace_rows for p in self.kinds.values()), default=0)


def plan_step(batch: PrefillBatch, config: PlanConfig, layers=V4_LAYERS) -> StepPlan:
    """Plan every layer kind of `layers` once for this step.

    layers: `{kind: compress_ratio}` or `LayerSpec` / `(kind, ratio)` entries (a model's
      per-layer list is fine; `planner.layer_specs(config_json)` reads one). Default: the three
      kinds at V4.0's ratios (SWA, CSA 4, HCA 128).
    """
    shared = _active_requests(batch, config)
    kinds = {spec.kind: plan_kind(batch, config, spec, shared) for spec in as_layer_specs(layers)}
    return StepPlan(batch=batch, config=config, kinds=kinds)


def as_step_plan(plan_or_batch, config: PlanConfig | None = None, layers=V4_LAYERS,
                 policy: str | None = None) -> StepPlan:  # fmt: skip
    """A given `StepPlan`, or the plan of a `PrefillBatch` under `config` (with `policy` if set).

    What framework metadata builders accept: plan here once, or pass the plan you made.
    """
    if isinstance(plan_or_batch, StepPlan):
        if policy is not None and policy != plan_or_batch.config.policy:
            raise ValueError(f"policy: {policy!r} differs from the given StepPlan's policy {plan_or_batch.config.policy!r}")
        return plan_or_batch
    if isinstance(plan_or_batch, PrefillBatch):
        if config is None:
            raise ValueError("config: a PlanConfig is required to plan a PrefillBatch")
        if policy is not None:
            config = replace(config, policy=policy)
        return plan_step(plan_or_batch, config, layers)
    raise TypeError(f"plan_or_batch: expected a StepPlan or PrefillBatch, got {type(plan_or_batch).__name__}")


def _tuple_plan(policy, seq_lens, query_lens, compress_ratio, window_size, max_model_len,
                max_num_batched_tokens, prefill_chunk_size, has_compressed):  # fmt: skip
    config = PlanConfig(
        window_size=window_size,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        prefill_chunk_size=prefill_chunk_size,
        policy=policy,
    )
    batch = PrefillBatch(seq_lens, query_lens, max_model_len, max_num_batched_tokens)
    # Rows depend on whether a compressed cache is gathered, not on which compressed kind: HCA
    # stands for "has a compressed cache" here (CSA plans the very same chunks).
    hc = contract.has_compressed(compress_ratio, has_compressed)
    layer = LayerSpec(LayerKind.HCA, compress_ratio) if hc else LayerSpec(LayerKind.SWA, 0)
    return plan_kind(batch, config, layer).as_tuples()


def get_prefill_chunk_plan(
    seq_lens,
    query_lens,
    *,
    compress_ratio: int,
    window_size: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    prefill_chunk_size: int = 4,
    has_compressed: bool | None = None,
) -> list[tuple[int, int, int, int]]:
    """vLLM's adaptive DSv4 prefill chunk plan: `[(start, end, N, M), ...]` over batch indices.

    Requests are scanned in batch order; a chunk takes its first request and keeps adding the
    next while `count * (max compressed_len + max gather_len) <= prefill_chunk_size *
    (cdiv(max_model_len, r) + window_size + max_num_batched_tokens)`. N is the chunk's max
    compressed_len, M = N + its max gather_len. Identical to vLLM for batches whose requests all
    have queries; `query_len == 0` requests are skipped (they never start or widen a chunk).

    seq_lens, query_lens: 1-D integers (list, NumPy array, or anything with `__array__`).
    compress_ratio: r >= 0.
    has_compressed: vLLM 0.33's keyword: whether the layer gathers a compressed cache
      (`seq_len // r` rows per request); None means `r > 1` (V4.0's layers). True at r = 1 is
      DeepSeek-V4.1's full-length compressed cache.
    """
    return _tuple_plan("adaptive", seq_lens, query_lens, compress_ratio, window_size, max_model_len,
                       max_num_batched_tokens, prefill_chunk_size, has_compressed)  # fmt: skip


def get_fixed_chunk_plan(
    seq_lens,
    query_lens,
    *,
    compress_ratio: int,
    window_size: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    prefill_chunk_size: int = 4,
    has_compressed: bool | None = None,
) -> list[tuple[int, int, int, int]]:
    """The old fixed plan: `prefill_chunk_size` consecutive requests per chunk, with
    `N = cdiv(max_model_len, r)` (0 without a compressed cache) and `M = N + window_size + max_num_batched_tokens`.
    Same arguments (`has_compressed` included) and `query_len == 0` handling as
    `get_prefill_chunk_plan`."""
    return _tuple_plan("fixed", seq_lens, query_lens, compress_ratio, window_size, max_model_len,
                       max_num_batched_tokens, prefill_chunk_size, has_compressed)  # fmt: skip
