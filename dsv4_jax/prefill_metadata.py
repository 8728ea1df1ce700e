"""Per-step prefill metadata for JAX, built once on the host from the planner's step plan.

The JAX twin of `dsv4_torch.prefill_metadata`. `build_step_metadata` plans every layer kind (or
takes a `planner.StepPlan`) and packs each kind's plan into one int32 table `(NUM_FIELDS, L)`,
copied to the device in one transfer for the step, plus a few static ints (`KindShape`, the jit key
of `dsv4_jax.prefill.prefill_attention`). Host work and memory are O(requests + tokens): the
table holds per-token, per-segment and per-chunk arrays; gathers and index rows are formed on
the device from them, in the layer call. How the static sizes are chosen (token buckets, the
workspace rows and HCA width padded to powers of two, `sizes="fine" | "server"`) is described in
`dsv4_jax.prefill`'s docstring and `planner.sizes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import register_pytree_node_class

from planner import V4_LAYERS, LayerKind, PlanConfig, PrefillBatch, StepPlan, contract
from planner.checks import INT32_MAX, as_int
from planner.contract import INDEX_ALIGN, SIZES, PlanKey
from planner.kind_plan import KindPlan
from planner.layout import index_width
from planner.plan import as_step_plan, band_local_plan
from planner.sizes import MIN_TILE, bucket, pow2_bucket, tile_ladder, tiled_items

MIN_WORKSPACE_ROWS = 128


# Rows of `KindMetadata.table`; each row has L = padded_tokens + 1 int32 entries.
TOK_INDEX = 0  # planned token -> row of q / out
TOK_REQUEST = 1  # planned token -> chunk-local request b (its segment is chunk_seg_start + b)
TOK_POSITION = 2  # planned token -> absolute position p
SEG_REQUEST = 3  # segment -> batch request (row of the block table / logical offsets)
SEG_ROW_BASE = 4  # segment -> b * M
SEG_GATHER_START_POSITION = 5  # segment -> first raw position gathered (a token position)
# Row offsets into a kind's gathered rows: exclusive prefix sums over segments (entries >= n_seg: total)
SEG_COMP_ROW_OFFSET = 6  # of compressed_len: the segment's first row among all compressed rows
SEG_RAW_ROW_OFFSET = 7  # of gather_len: the segment's first row among all raw rows
CHUNK_SEG_START = 8  # chunk -> first segment; entries >= num_chunks: n_seg
CHUNK_TOKEN_START = 9  # chunk -> first planned token; entries >= num_chunks: T
CHUNK_N = 10  # chunk -> N
SCALARS = 11  # [num_chunks, T, n_seg, num_tiles]
# Query tiles of backend "mosaic_tpu" (`dsv4_jax.kernels.mosaic_tpu.prefill`): up to query_tile
# consecutive new tokens of one request, from the batch alone (the same tiles for every plan).
TILE_Q_ROW = 12  # tile -> first q row
TILE_LEN = 13  # tile -> tokens (1 .. query_tile)
TILE_REQUEST = 14  # tile -> batch request
TILE_POSITION = 15  # tile -> position of its first token
NUM_FIELDS = 16
QUERY_TILE = 16  # default tokens per tile
# The names dsv4_jax.prefill imported before the unit went into them (to drop once it uses the new ones).


@dataclass(frozen=True)
class KindShape:
    """The static part of a kind's metadata: the jit cache key (with the input shapes)."""

    kind: LayerKind
    compress_ratio: int
    window_size: int
    padded_tokens: int  # bucket(T) or the caller's count: every table row has padded_tokens + 1 entries
    index_width: int  # columns of every index row (a multiple of 128)
    workspace_rows: int  # pow2_bucket (or bucket) of a chunk's max rows, or the plan's budget (sizes="server")
    token_ladder: tuple[int, ...]  # attention tile sizes, largest first
    gather_ladder: tuple[int, ...]  # gather tile sizes, largest first
    query_tile: int = QUERY_TILE  # tokens per query tile (backend "mosaic_tpu")
    # some request's windows start above max(0, p - W + 1): replay_start, a DeepSeek-V4.1 replay band
    window_floors: bool = False


@register_pytree_node_class
class KindMetadata:
    """Device-side plan of one layer kind for one step; reuse it for every layer of that kind.

    Reuse is valid while the batch, the caches' block tables and the plan are those of this step.
    A pytree: `table` (NUM_FIELDS, padded_tokens + 1) int32 is its leaf, `shape` is static. The
    host plan (`plan`, `num_tokens`, `num_requests`) rides along outside `jax.jit` for checks
    and `build_indices`; a copy rebuilt by JAX inside a trace has them as None.
    """

    def __init__(
        self,
        table,
        shape: KindShape,
        plan: KindPlan | None = None,
        num_tokens=None,
        num_requests=None,
        allow_invalid: bool = False,
        step_tokens=None,
    ):
        self.table = table
        self.shape = shape
        self.plan = plan
        self.num_tokens = num_tokens  # the rows its layer call computes (a V4.1 band's: the band's)
        self.num_requests = num_requests
        # DeepSeek-V4.1 steps: a -1 among a token's used top-k entries is no key (vLLM V4.1's rows)
        self.allow_invalid = allow_invalid
        self.step_tokens = step_tokens  # the step's new tokens (None: num_tokens)
        # The concrete backend of the last `prefill_attention` call on this object. Under a
        # user's jax.jit the call sees a copy JAX rebuilt, so the caller's object keeps None:
        # there, `dsv4_jax.resolve_backend(backend)` names the backend (the call asks it too).
        self.last_backend: str | None = None

    @property
    def kind(self) -> LayerKind:
        return self.shape.kind

    @property
    def index_width(self) -> int:
        return self.shape.index_width

    @property
    def padded_tokens(self) -> int:
        return self.shape.padded_tokens

    def tree_flatten(self):
        return (self.table,), self.shape

    @classmethod
    def tree_unflatten(cls, shape, children):
        return cls(children[0], shape)

    def __repr__(self):
        return f"KindMetadata({self.shape}, num_tokens={self.num_tokens})"

    def padding(self) -> dict:
        """Real vs padded/processed elements of this kind's layer call (host; needs the plan).

        tokens: T; padded_tokens: the bucket; attended_tokens: tokens the attention tiles cover.
        rows: rows the gathers must write; gathered_rows: rows the gather tiles cover;
        max_chunk_rows / workspace_rows: the largest chunk's rows and the bucketed buffer.
        needed_width / index_width: the planner's index width for this step (HCA's grows with
        the longest context; CSA's and SWA's are fixed by topk and W) and the bucketed one.
        """
        kp = host_plan(self, "padding")
        s = self.shape
        tok = np.diff(kp.chunk_token_starts.astype(np.int64))
        comp = np.add.reduceat(kp.seg_compressed_len.astype(np.int64), kp.chunk_starts[:-1]) if kp.num_chunks else tok
        raw = np.add.reduceat(kp.seg_gather_len.astype(np.int64), kp.chunk_starts[:-1]) if kp.num_chunks else tok
        regions = [raw] + ([comp] if s.kind is not LayerKind.SWA else [])
        return dict(
            tokens=int(tok.sum()),
            padded_tokens=s.padded_tokens,
            attended_tokens=sum(tiled_items(n, s.token_ladder) for n in tok.tolist()),
            rows=int(sum(r.sum() for r in regions)),
            gathered_rows=sum(tiled_items(n, s.gather_ladder) for r in regions for n in r.tolist()),
            max_chunk_rows=kp.max_workspace_rows,
            workspace_rows=s.workspace_rows,
            needed_width=index_width(kp) if s.kind is LayerKind.HCA else s.index_width,
            index_width=s.index_width,
        )


@register_pytree_node_class
class StepMetadata:
    """All plans' metadata for one step. A pytree of its `KindMetadata`s.

    plans: {PlanKey: KindMetadata}, one per distinct plan of the step's `StepPlan` (V4: one per
      kind; DeepSeek-V4.1: per (ratio, band), shared by every layer reading that plan);
    kinds: {kind: KindMetadata} for the kinds with one plan (every kind of a V4 step).
    Index it with a kind (`meta["CSA"]`, where the step has one plan of it), a `PlanKey`, or ask
    per layer of a V4.1 schedule: `meta.for_layer(layer_id)`. A "cut" / "replay" plan's metadata
    runs on the band's rows only (q and top-k rows hold each request's kept rows, in the step's
    order: `step_plan.bands[band].token_index`; `planner.band_local_plan`).
    """

    def __init__(self, kinds: dict, padded_tokens: int, step_plan: StepPlan | None = None, plans=None):
        if plans is None:  # V4: a plan per kind
            plans = {
                PlanKey(m.plan.layer if m.plan is not None else (k, m.shape.compress_ratio)): m
                for k, m in kinds.items()
            }
        self.plans = plans
        self.kinds = kinds
        self.padded_tokens = padded_tokens
        self.step_plan = step_plan

    def __getitem__(self, key) -> KindMetadata:
        if isinstance(key, PlanKey):
            if key not in self.plans:
                raise KeyError(f"no metadata for {key} in this step (built: {[str(k) for k in self.plans]})")
            return self.plans[key]
        k = LayerKind.of(key)
        if k in self.kinds:
            return self.kinds[k]
        several = [str(x) for x in self.plans if x.kind is k]
        if several:
            raise KeyError(
                f"{k.name}: this step has {len(several)} {k.name} plans ({several}); index it with a PlanKey or "
                "ask meta.for_layer(layer_id)"
            )
        raise KeyError(f"no metadata for {k.name} in this step (built: {[str(x) for x in self.plans]})")

    def for_layer(self, layer_id: int) -> KindMetadata:
        """The metadata layer `layer_id` of the step's schedule runs on (`StepPlan.for_layer`)."""
        if self.step_plan is None or self.step_plan.schedule is None:
            raise ValueError(
                "layer_id: this metadata's step was not planned from a planner.Schedule (or is a copy rebuilt "
                "inside jax.jit); index it by kind or PlanKey"
            )
        return self.plans[self.step_plan.schedule.plan_key(layer_id, self.step_plan.replay)]

    @property
    def sharing(self) -> dict:
        """{PlanKey: the schedule's layers running on that metadata} (`StepPlan.sharing`)."""
        return {} if self.step_plan is None else self.step_plan.sharing

    def pad_tokens(self, x):
        """Pad axis 0 (tokens) of q or top-k rows with zeros to `padded_tokens` (NumPy or jax)."""
        n = x.shape[0]
        if n > self.padded_tokens:
            raise ValueError(f"x: {n} tokens exceed padded_tokens = {self.padded_tokens}")
        widths = [(0, self.padded_tokens - n)] + [(0, 0)] * (x.ndim - 1)
        return np.pad(x, widths) if isinstance(x, np.ndarray) else jnp.pad(x, widths)

    def tree_flatten(self):
        keys = tuple(self.plans)
        kinds = tuple((k, p) for k, m in self.kinds.items() for p in keys if self.plans[p] is m)
        return tuple(self.plans[k] for k in keys), (keys, kinds, self.padded_tokens)

    @classmethod
    def tree_unflatten(cls, aux, children):
        keys, kinds, padded = aux
        plans = dict(zip(keys, children))
        return cls({k: plans[p] for k, p in kinds}, padded, plans=plans)


def build_step_metadata(
    plan_or_batch: StepPlan | PrefillBatch,
    *,
    index_topk: int | None = None,
    config: PlanConfig | None = None,
    layers=V4_LAYERS,
    policy: str | None = None,
    sizes: str = "bucket",
    padded_tokens: int | None = None,
    token_tile: int = 256,
    gather_tile: int = 4096,
    min_tokens: int = MIN_TILE,
    min_workspace_rows: int = MIN_WORKSPACE_ROWS,
    query_tile: int = QUERY_TILE,
    device=None,
) -> StepMetadata:
    """Per-step metadata for every layer kind, built once on the host, one transfer for the step.

    Args:
      plan_or_batch: a `planner.StepPlan`, or a `PrefillBatch` to plan here with `config`.
      index_topk: the indexer's top-k (CSA index width); required when CSA is planned.
      config: the `PlanConfig` when a batch is given.
      layers: the model's layer specs (`{kind: ratio}` or (kind, ratio) pairs) when a batch is given.
      policy: "adaptive", "fixed" or "per_request": overrides `config.policy`.
      sizes: how the workspace rows and the HCA index width are sized (both static):
        "bucket" (default): from this step (the largest chunk's rows, the longest context),
          padded to powers of two (under 2x memory; they cost no attention work). A program
          per (tokens, rows, width) bucket combination.
        "fine": the same, padded to the 1.25x token buckets: tighter memory, about 1.5x the
          programs over a varied stream (bench/bench_jax_prefill.py --stream-only).
        "server": from the `PlanConfig` alone: the plan's workspace budget (what the fixed plan
          allocates and the adaptive plan never exceeds) and max_model_len's width. The token
          bucket is then the only static size that changes from step to step: a jitted model
          compiles once per token bucket, at the price of a budget-sized workspace every call.
      padded_tokens: the static token count (>= T); default `bucket(T, min_tokens)`. A model
        that pads its tokens to its own buckets passes its padded count here.
      token_tile: largest attention tile (tokens), a power of two; the ladder goes down 4x to 16.
      gather_tile: largest gather tile (workspace rows), a power of two; down 4x to 16.
      min_tokens, min_workspace_rows: the smallest token and workspace buckets (all smaller
        batches share them, and their compiled programs).
      query_tile: tokens per query tile of backend "mosaic_tpu" (consecutive new tokens of one
        request share their window and compressed keys), a power of two.
      device: where the tables go (default: JAX's default device).
    """
    step = as_step_plan(plan_or_batch, config, layers, policy)
    for name, v in (("token_tile", token_tile), ("gather_tile", gather_tile), ("query_tile", query_tile)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
            raise ValueError(f"{name}: expected a power of two, got {v!r}")
    for name, v in (("min_tokens", min_tokens), ("min_workspace_rows", min_workspace_rows)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    if index_topk is not None:
        index_topk = as_int(index_topk, "index_topk", minimum=1, maximum=INT32_MAX)
    if sizes not in SIZES:
        raise ValueError(f"sizes: expected one of {SIZES}, got {sizes!r}")
    T = step.batch.num_tokens
    if padded_tokens is None:
        padded_tokens = bucket(T, min_tokens)
    elif isinstance(padded_tokens, bool) or not isinstance(padded_tokens, int) or padded_tokens < T:
        raise ValueError(f"padded_tokens: expected an int >= the batch's {T} tokens, got {padded_tokens!r}")
    v41 = step.schedule is not None  # DeepSeek-V4.1: a metadata per PlanKey, band plans on their rows
    plans = (
        {key: band_local_plan(kp) for key, kp in step.plans.items()}
        if v41
        else {PlanKey(k.layer): k for k in step.kinds.values()}
    )
    built = {}
    for key, kp in plans.items():
        if key.kind is LayerKind.CSA and index_topk is None:
            raise ValueError(
                "index_topk: required when CSA layers are planned" + (f" (this step plans {key})" if v41 else "")
            )
        built[key] = _kind_table(
            kp, padded_tokens, index_topk, sizes, token_tile, gather_tile, min_workspace_rows, query_tile
        )
    tables = jax.device_put([table for _, table in built.values()], device)  # one transfer for the step
    metas = {
        key: KindMetadata(
            table,
            shape,
            plans[key],
            plans[key].batch.num_tokens,
            step.batch.num_requests,
            allow_invalid=v41,
            step_tokens=step.batch.num_tokens,
        )
        for (key, (shape, _)), table in zip(built.items(), tables)
    }
    kinds = {k: metas[p.key] for k, p in step.kinds.items()}
    return StepMetadata(kinds, padded_tokens, step, plans=metas)


def _kind_table(
    kp: KindPlan, padded: int, index_topk, sizes: str, token_tile: int, gather_tile: int, min_rows: int, query_tile: int
):
    L = padded + 1
    T, n_seg, n_c = kp.token_index.shape[0], kp.seg_request.shape[0], kp.num_chunks
    table = np.zeros((NUM_FIELDS, L), dtype=np.int32)
    table[TOK_INDEX, :T] = kp.token_index
    table[TOK_REQUEST, :T] = kp.token_request
    table[TOK_POSITION, :T] = kp.token_position
    table[SEG_REQUEST, :n_seg] = kp.seg_request
    table[SEG_ROW_BASE, :n_seg] = kp.seg_row_base
    table[SEG_GATHER_START_POSITION, :n_seg] = kp.seg_gather_start
    for row, lens in ((SEG_COMP_ROW_OFFSET, kp.seg_compressed_len), (SEG_RAW_ROW_OFFSET, kp.seg_gather_len)):
        cum = np.cumsum(lens, dtype=np.int64)
        table[row, 1 : n_seg + 1] = cum
        table[row, n_seg + 1 :] = cum[-1] if n_seg else 0
    table[CHUNK_SEG_START, : n_c + 1] = kp.chunk_starts
    table[CHUNK_SEG_START, n_c + 1 :] = n_seg
    table[CHUNK_TOKEN_START, : n_c + 1] = kp.chunk_token_starts
    table[CHUNK_TOKEN_START, n_c + 1 :] = T
    table[CHUNK_N, :n_c] = kp.chunk_N
    table[SCALARS, :3] = (n_c, T, n_seg)
    tiles = query_tiles(kp.batch, query_tile)
    table[TILE_Q_ROW : TILE_POSITION + 1, : tiles.shape[1]] = tiles
    table[SCALARS, 3] = tiles.shape[1]

    width = index_width(kp, index_topk if kp.kind is LayerKind.CSA else None)
    if sizes == "server":
        if kp.kind is LayerKind.HCA:  # the most entries any context up to max_model_len sees
            width = contract.index_width_for(kp.kind, kp.config.max_model_len, kp.compress_ratio, kp.window_size)
        rows = max(kp.budget_rows, min_rows)
        if kp.max_workspace_rows > rows:  # the planner keeps every chunk within its budget
            raise AssertionError(f"a chunk needs {kp.max_workspace_rows} rows, over the budget {rows}")
    else:  # "bucket": powers of two (they pad memory, not work); "fine": the 1.25x token buckets
        size = pow2_bucket if sizes == "bucket" else bucket
        if kp.kind is LayerKind.HCA:  # grows with the longest context of the batch: bucket it
            width = size(width // INDEX_ALIGN) * INDEX_ALIGN
        rows = size(kp.max_workspace_rows, min_rows)
    shape = KindShape(
        kind=kp.kind,
        compress_ratio=kp.compress_ratio,
        window_size=kp.window_size,
        padded_tokens=padded,
        index_width=width,
        workspace_rows=rows,
        token_ladder=tile_ladder(token_tile, padded),
        gather_ladder=tile_ladder(gather_tile, rows),
        query_tile=query_tile,
        window_floors=bool(
            (kp.seg_gather_start > np.maximum(kp.seg_seq_len - kp.seg_query_len - kp.window_size + 1, 0)).any()
        ),
    )
    return shape, table


def query_tiles(batch: PrefillBatch, query_tile: int) -> np.ndarray:
    """(4, num_tiles) int32: first q row, tokens, request, first position of each query tile.

    Request b's new tokens (q rows query_start_loc[b] ..., positions prefix_b ...) in runs of
    query_tile; requests without new tokens have none. O(tiles) host work, from the batch alone:
    every plan of a step gets the same tiles (at most T of them, one token each at worst)."""
    q_lens = batch.query_lens.astype(np.int64)
    counts = -(-q_lens // query_tile)
    req = np.repeat(np.arange(q_lens.shape[0]), counts)
    first = np.cumsum(counts) - counts
    k = np.arange(req.shape[0]) - first[req]  # tile index within its request
    start = k * query_tile
    prefix = batch.seq_lens.astype(np.int64) - q_lens
    rows = np.stack(
        [batch.query_start_loc[req] + start, np.minimum(query_tile, q_lens[req] - start), req, prefix[req] + start]
    )
    return rows.astype(np.int32)


def host_plan(meta: KindMetadata, what: str) -> KindPlan:
    """The host plan `meta` carries (refused for a copy JAX rebuilt inside a trace); `what` needs it."""
    if not isinstance(meta, KindMetadata):
        raise TypeError(f"meta: expected a KindMetadata (build_step_metadata(...)[kind]), got {type(meta).__name__}")
    if meta.plan is None:
        raise ValueError(f"meta: {what} needs the host plan, which a copy rebuilt inside jax.jit does not carry")
    return meta.plan
