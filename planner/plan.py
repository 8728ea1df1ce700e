"""Chunk plans: which prefill requests share one workspace and one kernel launch (spec section 4).

Two layers of API (the plan objects themselves: `planner.kind_plan`):

* `get_prefill_chunk_plan` / `get_fixed_chunk_plan`: vLLM's tuples `(start, end, N, M)`, the same
  values vLLM returns for the same inputs (adaptive and the old fixed plan).
* `plan_step` -> `StepPlan`: one `KindPlan` per distinct plan of the step's layers, computed once
  per step on the host and shared by every layer that reads it: per layer kind for V4's layers,
  per (layer spec, band) for a DeepSeek-V4.1 `planner.Schedule` (its ratio-2 and ratio-1 layers
  both take a top-k; under decoder bounded replay the cut and the layers past it compute each
  request's last min(query_len, W) rows only). A `KindPlan` holds the workspace layout of every
  chunk and compact per-token metadata as flat NumPy arrays (one host-to-device copy per plan
  per step); `KindPlan.chunks` gives a readable per-chunk view (`ChunkLayout`).

Beyond vLLM: requests with `query_len == 0` never form or widen a chunk (they are recorded in
`KindPlan.skipped`); an explicit `budget_rows` is honoured, splitting a request that does not fit
alone along its query axis (pieces see all the KV before them); an optional length-aware order.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from planner import contract
from planner.batch import BandRows, PrefillBatch
from planner.checks import INT32_MAX
from planner.config import PlanConfig
from planner.contract import (
    V4_LAYERS,
    LayerKind,
    LayerSpec,
    PlanKey,
    as_layer_specs,
)
from planner.kind_plan import EMPTY_INT32, KindPlan, readonly_int32
from planner.schedule import Schedule


def _greedy_chunks(comp: list[int], gath: list[int], area: int, breaks=()):
    """vLLM's adaptive scan: grow a chunk while count * (max comp + max gather) <= area.

    breaks: segment indices where a chunk must start (contiguous plans: after a skipped request).
    """
    starts, Ns, Ms = [], [], []
    n, s = len(comp), 0
    bounds = iter(list(breaks) + [n])
    stop = next(bounds)
    while s < n:
        while stop <= s:
            stop = next(bounds)
        cm, gm, e = comp[s], gath[s], s + 1
        while e < stop:
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


def _split_request(prefix: int, query_len: int, r: int, W: int, budget: int, request: int, window_start: int = 0):
    """Cut one request's queries into pieces [a, b) whose rows fit `budget` (greedy, longest first).

    A piece is planned as a request of seq_len prefix+b and query_len b-a: it gathers every
    compressed entry and window token its queries can see (none below `window_start`). r = 0: no
    compressed rows.
    """

    def rows(a, b):
        comp = 0 if r == 0 else (prefix + b) // r
        return comp + (b - a) + min(prefix + a - window_start, W - 1)

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


def _active_requests(batch: PrefillBatch, config: PlanConfig):
    """What every kind's plan shares: the checked requests with queries and their gather_lens.

    Computed once per batch and engine limits (kept on the batch): every kind of a step shares it.
    """
    key = (config.window_size, config.max_model_len, config.max_num_batched_tokens)
    memo = batch.__dict__.setdefault("_active_memo", {})
    hit = memo.get(key)
    if hit is not None:
        return hit
    seq, qry = batch.seq_lens, batch.query_lens
    # (a batch built with these limits has checked them already)
    if (
        (batch.max_model_len is None or batch.max_model_len > config.max_model_len)
        and seq.size
        and int(seq.max()) > config.max_model_len
    ):
        i = int(np.argmax(seq))
        raise ValueError(f"seq_lens: seq_lens[{i}] = {int(seq[i])} exceeds max_model_len = {config.max_model_len}")
    checked = batch.max_num_batched_tokens is not None and batch.max_num_batched_tokens <= config.max_num_batched_tokens
    if not checked and qry.size and int(qry.max()) > config.max_num_batched_tokens:
        i = int(np.argmax(qry))
        raise ValueError(
            f"query_lens: query_lens[{i}] = {int(qry[i])} exceeds max_num_batched_tokens = {config.max_num_batched_tokens}"
        )
    if batch.__dict__.get("_min_query_len", 0) > 0 or not qry.size:  # the common case: all have queries
        active, skipped, seq_a, qry_a = np.arange(qry.shape[0], dtype=np.int32), EMPTY_INT32, seq, qry
    else:
        has_queries = qry > 0
        active = np.flatnonzero(has_queries).astype(np.int32)
        skipped = np.flatnonzero(~has_queries).astype(np.int32)
        seq_a, qry_a = seq[active], qry[active]
        skipped.setflags(write=False)
    active.setflags(write=False)
    floor = batch.window_floor
    gath_a = contract.gather_len(seq_a, qry_a, config.window_size, floor if np.ndim(floor) == 0 else floor[active])
    memo[key] = hit = (active, skipped, seq_a, qry_a, gath_a)
    return hit


def _gather_list(batch: PrefillBatch, config: PlanConfig, gath: np.ndarray) -> list[int]:
    """`gath.tolist()`, made once per batch when `gath` is the batch's shared gather_lens."""
    memo = batch.__dict__.get("_active_memo", {})
    key = (config.window_size, config.max_model_len, config.max_num_batched_tokens)
    base = memo.get(key)
    if base is None or base[4] is not gath:
        return gath.tolist()
    out = memo.get(("list",) + key)
    if out is None:
        out = memo[("list",) + key] = gath.tolist()
    return out


def _check_inputs(batch, config) -> None:
    if not isinstance(batch, PrefillBatch):
        raise TypeError(
            f"batch: expected a planner.PrefillBatch (PrefillBatch(seq_lens, query_lens)), got {type(batch).__name__}"
        )
    if not isinstance(config, PlanConfig):
        raise TypeError(f"config: expected a planner.PlanConfig, got {type(config).__name__}")


def plan_kind(batch: PrefillBatch, config: PlanConfig, layer, _shared=None, *, band: str = "full") -> KindPlan:
    """Plan one layer kind for one step.

    layer: a `LayerSpec` or `(kind, compress_ratio)` pair: any ratio >= 1 for CSA/HCA.
    band: the rows its layers compute (`contract.BANDS`, `PrefillBatch.band`): "full" (every new
      row), "cut" / "replay" (each request's last min(query_len, W) rows, with the band's window
      starts). A plan's segments, chunks and per-token arrays cover those rows only.
    """
    _check_inputs(batch, config)
    layer = LayerSpec.of(layer)
    hc = layer.has_compressed
    r = layer.compress_ratio if hc else 0  # 0: no compressed rows
    W = config.window_size
    shared = _shared or _active_requests(batch, config)
    active, skipped, seq_a, qry_a, gath_a = shared
    floor = batch.window_floor
    ws_a = floor if np.ndim(floor) == 0 else floor[active]  # window starts (replay_start)
    off_a = None  # every query offset is 0
    if band != "full":
        rows_b = batch.band(band, W)
        qry_b = rows_b.query_lens[active]
        if (qry_b != qry_a).any():  # some requests trimmed: their last rows, their floors
            off_a, qry_a, ws_a = rows_b.query_offsets[active], qry_b, rows_b.window_starts[active]
            gath_a = rows_b.gather_lens[active]
    comp_a = contract.compressed_len(seq_a, r) if hc else None  # None: all zero (no compressed cache)
    if config.order == "length" and active.size:
        if comp_a is None:
            comp_a = np.zeros_like(seq_a)
        perm = np.lexsort((-gath_a, -comp_a), axis=0)  # widest first; stable for ties
        active, seq_a, qry_a, comp_a, gath_a = (x[perm] for x in (active, seq_a, qry_a, comp_a, gath_a))
        if off_a is not None:
            off_a = off_a[perm]
        if np.ndim(ws_a):
            ws_a = ws_a[perm]

    budget = config.budget(layer)
    if budget > INT32_MAX:  # workspace rows are int32 (row bases, indices into the workspace)
        raise ValueError(
            f"max_model_len: vLLM's workspace bound for {layer.kind.name} ratio {layer.compress_ratio} is {budget} "
            f"rows, beyond {INT32_MAX} (the int32 range of workspace rows); lower max_model_len, "
            "max_num_batched_tokens or prefill_chunk_size, or give budget_rows"
        )
    # vLLM's bound holds every request alone (_active_requests checked seq_len <= max_model_len and
    # query_len <= max_num_batched_tokens), so only an explicit budget_rows can split one.
    vllm_bound = config.budget_rows is None and (
        batch.max_model_len is None or batch.max_model_len <= config.max_model_len
    )
    split: list[int] = []
    if (
        config.policy != "fixed"
        and not vllm_bound
        and active.size
        and int(((0 if comp_a is None else comp_a) + gath_a).max()) > budget
    ):
        rows = []  # (request, seq_len, query_len, query_offset)
        offs = [0] * len(active) if off_a is None else off_a.tolist()
        starts = np.broadcast_to(ws_a, active.shape).tolist()
        for i, s, q, o, w in zip(active.tolist(), seq_a.tolist(), qry_a.tolist(), offs, starts):
            pieces = _split_request(s - q, q, r, W, budget, i, w)
            if len(pieces) > 1:
                split.append(i)
            rows.extend((i, s - q + b, b - a, o + a, w) for a, b in pieces)
        seg = np.array(rows, dtype=np.int64).reshape(-1, 5)
        seg_req, seg_seq, seg_q, seg_off, seg_ws = seg.T
        seg_comp = contract.compressed_len(seg_seq, r, hc)
        seg_gath = contract.gather_len(seg_seq, seg_q, W, seg_ws)
    else:
        seg_req, seg_seq, seg_q, seg_off = active, seq_a, qry_a, off_a
        seg_comp, seg_gath = comp_a, gath_a

    n = int(seg_req.shape[0])
    # Contiguous plans start a chunk after every skipped request (segment order is batch order).
    breaks = np.flatnonzero(np.diff(seg_req) > 1) + 1 if config.contiguous and skipped.size and n > 1 else ()
    if config.policy == "adaptive":
        gath_list = _gather_list(batch, config, seg_gath)
        comp_list = [0] * n if seg_comp is None else seg_comp.tolist()
        chunks = _greedy_chunks(comp_list, gath_list, budget, list(breaks))
    elif config.policy == "fixed":
        runs = np.concatenate([[0], breaks, [n]]).astype(np.int64)
        starts = np.concatenate(
            [np.arange(a, b, config.prefill_chunk_size) for a, b in zip(runs[:-1], runs[1:])] + [[n]]
        )
        nc = starts.shape[0] - 1
        chunks = (starts, np.full(nc, config.max_compressed_len(layer)), np.full(nc, config.fixed_M(layer)))
    else:  # per_request
        if seg_comp is None:
            seg_comp = np.zeros_like(seg_seq)
        chunks = (np.arange(n + 1), seg_comp, seg_comp + seg_gath)
    return KindPlan(
        layer=layer,
        config=config,
        budget_rows=budget,
        batch=batch,
        order=readonly_int32(active),
        skipped=readonly_int32(skipped),
        split_requests=readonly_int32(split) if split else EMPTY_INT32,
        seg_source=(seg_req, seg_seq, seg_q, seg_off, seg_comp, seg_gath),
        chunk_source=chunks,
        band=band,
    )


def vllm_chunk_tuples(seq_lens, query_lens, config: PlanConfig, layer) -> list[tuple[int, int, int, int]]:
    """`plan_kind(PrefillBatch(seq_lens, query_lens, max_model_len, max_num_batched_tokens),
    config, layer).as_tuples()` on Python lists: the same tuples, the same checks.

    For the plans vLLM asks for (policy "adaptive", batch order, no `budget_rows`, band "full"),
    every step, mostly of few requests, where NumPy's fixed cost per call is most of a plan's
    time: the lengths are read with one `tolist()` each (lists, NumPy arrays, CPU tensors), and
    compressed and gather lengths, zero-query breaks (`config.contiguous`) and the greedy scan
    (`_greedy_chunks`, shared with `plan_kind`) run on lists. Window floors (`replay_start`) do
    not enter: vLLM's plan does not read them.
    """
    from planner.indexer_plan import _int_list

    if not isinstance(config, PlanConfig):
        raise TypeError(f"config: expected a planner.PlanConfig, got {type(config).__name__}")
    if config.policy != "adaptive" or config.order != "batch" or config.budget_rows is not None:
        raise ValueError("config: vllm_chunk_tuples plans vLLM's adaptive batch-order plan only (no budget_rows)")
    layer = LayerSpec.of(layer)
    seq, qry = _int_list(seq_lens, "seq_lens"), _int_list(query_lens, "query_lens")
    n = len(seq)
    if len(qry) != n:
        raise ValueError(f"seq_lens and query_lens: lengths differ ({n} vs {len(qry)})")
    if not n:
        return []
    W, mml, mnbt = config.window_size, config.max_model_len, config.max_num_batched_tokens
    if min(seq) < 0 or min(qry) < 0 or max(seq) > mml or max(qry) > mnbt or any(q > s for s, q in zip(seq, qry)):
        PrefillBatch(seq, qry, mml, mnbt)  # raises naming the argument and the first bad entry
        raise AssertionError("unreachable: PrefillBatch accepted what vllm_chunk_tuples refused")
    if sum(qry) > INT32_MAX:
        PrefillBatch(seq, qry)  # raises: the step's tokens exceed int32
    budget = config.budget(layer)
    if budget > INT32_MAX:
        plan_kind(PrefillBatch(seq[:1], qry[:1]), config, layer)  # raises with plan_kind's message
    if min(qry) > 0:
        req, breaks = None, ()
    else:
        req = [i for i, q in enumerate(qry) if q > 0]
        if not req:
            return []
        seq = [seq[i] for i in req]
        qry = [qry[i] for i in req]
        breaks = [j for j in range(1, len(req)) if req[j] - req[j - 1] > 1] if config.contiguous else ()
    w1 = W - 1
    gath = [q + (s - q if s - q < w1 else w1) for s, q in zip(seq, qry)]
    if layer.has_compressed:
        r = layer.compress_ratio
        comp = [s // r for s in seq]
    else:
        comp = [0] * len(seq)
    starts, Ns, Ms = _greedy_chunks(comp, gath, budget, breaks)
    if req is None:
        return list(zip(starts, starts[1:], Ns, Ms))
    return [(req[a], req[b - 1] + 1, m, k) for a, b, m, k in zip(starts, starts[1:], Ns, Ms)]


@dataclass(frozen=True, eq=False)
class StepPlan:
    """One step's plans, each made once and shared by every layer that reads it.

    plans: {PlanKey: KindPlan}, one per distinct (layer spec, band) of the step's layers, in the
      order of the first layer reading each. Planned from a plain list of layers (V4): one per
      kind, band "full". Planned from a `planner.Schedule` (V4.1): one per distinct
      (compress_ratio, has_compressed = ratio != 0, band).
    schedule, layer_keys: the schedule planned from and each of its layers' key (None / ()
      for a plain list of layers).
    replay: whether decoder bounded replay changed this step: `PlanConfig.replay` resolved by the
      schedule, and some request has more than W new rows (vLLM makes no replay batch otherwise).

    Index it with a kind (`step[LayerKind.CSA]`, `step["CSA"]`: that kind's plan where the step
    has exactly one, `kinds`), a `PlanKey`, or ask per layer: `step.for_layer(i)`.

    A DeepSeek-V4.1 step (40 layers) has 3 plans without replay (ratio 0, 2 and 1, band "full")
    and 4 with it (ratio 0 and 2 "full", the cut's ratio 1 "cut", layers 21-39's ratio 1
    "replay"); vLLM 0.32 calls its planner once per attention layer (40 calls a step, recomputed
    each time, 3 distinct results: it plans the cut's and the later layers' kept rows alike, with
    the unclamped bound `query_len + min(prefix, W - 1)` of their window rows, where these plans
    take each band's exact gather lengths).
    """

    batch: PrefillBatch
    config: PlanConfig
    plans: dict[PlanKey, KindPlan]
    schedule: Schedule | None = None
    layer_keys: tuple[PlanKey, ...] = ()
    replay: bool = False

    @cached_property
    def kinds(self) -> dict[LayerKind, KindPlan]:
        """{kind: plan} for every kind with exactly one plan in the step (all kinds of a V4 step)."""
        counts = Counter(k.kind for k in self.plans)
        return {k.kind: p for k, p in self.plans.items() if counts[k.kind] == 1}

    def __getitem__(self, key) -> KindPlan:
        if isinstance(key, PlanKey):
            if key not in self.plans:
                raise KeyError(f"no plan for {key} in this step (planned: {[str(k) for k in self.plans]})")
            return self.plans[key]
        k = LayerKind.of(key)
        if k in self.kinds:
            return self.kinds[k]
        several = [str(x) for x in self.plans if x.kind is k]
        if several:
            raise KeyError(
                f"{k.name}: this step has {len(several)} {k.name} plans ({several}); index it with a PlanKey or "
                "ask step.for_layer(layer_id)"
            )
        raise KeyError(f"no plan for {k.name} in this step (planned: {[str(x) for x in self.plans]})")

    @property
    def num_plans(self) -> int:
        return len(self.plans)

    def for_layer(self, layer_id: int) -> KindPlan:
        """The plan layer `layer_id` of the schedule reads."""
        if self.schedule is None:
            raise ValueError("layer_id: this step was planned from a list of layers, not a Schedule; index it by kind")
        return self.plans[self.schedule.plan_key(layer_id, self.replay)]

    @cached_property
    def sharing(self) -> dict[PlanKey, tuple[int, ...]]:
        """{PlanKey: the schedule's layers reading that plan} (empty without a schedule)."""
        out: dict[PlanKey, list[int]] = {k: [] for k in self.plans}
        for i, k in enumerate(self.layer_keys):
            out[k].append(i)
        return {k: tuple(v) for k, v in out.items()} if self.layer_keys else {}

    @property
    def bands(self) -> dict[str, BandRows]:
        """{band: the rows its layers compute} for every band the step's plans use."""
        bands = dict.fromkeys(k.band for k in self.plans)
        return {b: self.batch.band(b, self.config.window_size) for b in bands}

    @property
    def max_workspace_rows(self) -> int:
        return max((p.max_workspace_rows for p in self.plans.values()), default=0)


def plan_step(batch: PrefillBatch, config: PlanConfig, layers=V4_LAYERS) -> StepPlan:
    """Plan every distinct plan of `layers` once for this step.

    layers: a `planner.Schedule` (DeepSeek-V4.1: a plan per distinct (ratio, has_compressed,
      band), `PlanConfig.replay` deciding the bands; its `sliding_window` must equal
      `config.window_size`), or V4's `{kind: compress_ratio}` / `LayerSpec` / `(kind, ratio)`
      entries, one ratio per kind (a model's per-layer list is fine;
      `planner.layer_specs(config_json)` reads one). Default: the three kinds at V4.0's ratios
      (SWA, CSA 4, HCA 128).
    """
    _check_inputs(batch, config)
    shared = _active_requests(batch, config)
    if isinstance(layers, Schedule):
        if layers.sliding_window != config.window_size:
            raise ValueError(
                f"window_size: PlanConfig.window_size = {config.window_size} differs from the schedule's "
                f"sliding_window = {layers.sliding_window}"
            )
        # vLLM builds its replay batch only when some request has more than W new rows: otherwise
        # every layer computes every row with the batch's windows (the "full" band's plans).
        replay = layers.resolve_replay(None if config.replay is None else bool(config.replay))
        replay = replay and bool((batch.query_lens > config.window_size).any())
        keys = tuple(layers.plan_key(i, replay) for i in range(layers.num_layers))
        plans: dict[PlanKey, KindPlan] = {}
        for k in keys:
            if k not in plans:
                plans[k] = plan_kind(batch, config, k.layer, shared, band=k.band)
        return StepPlan(batch=batch, config=config, plans=plans, schedule=layers, layer_keys=keys, replay=replay)
    if config.replay:
        raise ValueError(
            "replay: True needs a planner.Schedule (a V4.1 layer schedule with a cut); got a list of layers"
        )
    plans = {PlanKey(spec): plan_kind(batch, config, spec, shared) for spec in as_layer_specs(layers)}
    return StepPlan(batch=batch, config=config, plans=plans)


def band_local_plan(plan: KindPlan) -> KindPlan:
    """A plan's rows as a batch of their own: the same segments, chunks and workspace, with its
    tokens numbered 0 .. T_band - 1 in the band's order (`PrefillBatch.band(...).token_index`).

    A "cut" / "replay" band's plan equals the plan of `PrefillBatch(seq_lens, band.query_lens,
    replay_start=band.window_starts)` (each request's kept rows, its band's window floors): the
    plan a framework's layer call runs on q holding the band's rows only (what vLLM's replay
    batch holds). A "full" plan is returned as it is. Made once per plan (kept on it).
    """
    if not isinstance(plan, KindPlan):
        raise TypeError(f"plan: expected a planner.KindPlan, got {type(plan).__name__}")
    if plan.band == "full":
        return plan
    got = plan.__dict__.get("_band_local")
    if got is not None:
        return got
    rows = plan.batch.band(plan.band, plan.window_size)
    local = PrefillBatch(plan.batch.seq_lens, rows.query_lens, replay_start=rows.window_starts)
    req, seq, q, off, comp, gath = plan.seg_source
    if off is not None:  # offsets within the request's new rows -> within its kept rows
        off = np.asarray(off, np.int64) - rows.query_offsets[np.asarray(req, np.int64)]
        off = off if off.any() else None
    got = KindPlan(
        layer=plan.layer,
        config=plan.config,
        budget_rows=plan.budget_rows,
        batch=local,
        order=plan.order,
        skipped=plan.skipped,
        split_requests=plan.split_requests,
        seg_source=(req, seq, q, off, comp, gath),
        chunk_source=plan.chunk_source,
        band=plan.band,
    )
    plan.__dict__["_band_local"] = got
    return got


def as_step_plan(
    plan_or_batch, config: PlanConfig | None = None, layers=V4_LAYERS, policy: str | None = None
) -> StepPlan:
    """A given `StepPlan`, or the plan of a `PrefillBatch` under `config` (with `policy` if set).

    What framework metadata builders accept: plan here once, or pass the plan you made.
    """
    if isinstance(plan_or_batch, StepPlan):
        if policy is not None and policy != plan_or_batch.config.policy:
            raise ValueError(
                f"policy: {policy!r} differs from the given StepPlan's policy {plan_or_batch.config.policy!r}"
            )
        return plan_or_batch
    if isinstance(plan_or_batch, PrefillBatch):
        if config is None:
            raise ValueError("config: a PlanConfig is required to plan a PrefillBatch")
        if policy is not None:
            config = replace(config, policy=policy)
        return plan_step(plan_or_batch, config, layers)
    raise TypeError(f"plan_or_batch: expected a StepPlan or PrefillBatch, got {type(plan_or_batch).__name__}")


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
    policy: str = "adaptive",
) -> list[tuple[int, int, int, int]]:
    """vLLM's DSv4 prefill chunk plan: `[(start, end, N, M), ...]` over batch indices.

    policy "adaptive" (vLLM 0.33's, the default): requests are scanned in batch order; a chunk
    takes its first request and keeps adding the next while `count * (max compressed_len + max
    gather_len) <= prefill_chunk_size * (cdiv(max_model_len, r) + window_size +
    max_num_batched_tokens)`. N is the chunk's max compressed_len, M = N + its max gather_len.
    Identical to vLLM for batches whose requests all have queries; `query_len == 0` requests are
    skipped (they never start or widen a chunk).
    policy "fixed" (the plan before it): `prefill_chunk_size` consecutive requests per chunk, with
    `N = cdiv(max_model_len, r)` (0 without a compressed cache) and `M = N + window_size +
    max_num_batched_tokens`. ("per_request": one request per chunk.)

    seq_lens, query_lens: 1-D integers (list, NumPy array, or anything with `__array__`).
    compress_ratio: r >= 0.
    has_compressed: vLLM 0.33's keyword: whether the layer gathers a compressed cache
      (`seq_len // r` rows per request); None means `r > 1` (V4.0's layers). True at r = 1 is
      DeepSeek-V4.1's full-length compressed cache.
    """
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
