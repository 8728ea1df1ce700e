"""DeepSeek-V4.1 prefill steps (NumPy): what both frameworks' V4.1 layer tests and the parity
suite's V4.1 rows feed in, with the float64 oracle's answer per layer (`planner.oracle.layer_attention`).

A case is one step of a V4.1 schedule (the tiny preset by default: layers of every role, ratios
0 / 2 / 1, the cut at layer 3): per layer its queries and window latents, per KV source its shared
compressed cache, per index source its top-k rows (request-local, with -1 picks among the used
entries, as vLLM V4.1's rows keep a failed pick), a sink. `replay` as `PlanConfig.replay` (None:
vLLM's default, on; False: every row with full windows). The batch can carry `replay_start`
(prefix hits).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import planner as P
from planner import oracle

TINY = P.Schedule.from_name("V4.1-tiny")  # W = 16, index_topk = 8; KV sources 1 (r 2), 3 (r 1, the cut)


@dataclass
class V41Case:
    name: str
    schedule: P.Schedule
    batch: P.PrefillBatch
    replay: bool | None
    q: dict[int, np.ndarray]  # layer -> (T, H, D) float32, every new token of the step
    raw: dict[int, list[np.ndarray]]  # layer -> per request (seq_len, D) float32
    caches: dict[int, list[np.ndarray]]  # KV source -> per request (seq_len // r, D) float32
    topk: dict[int, np.ndarray]  # index source -> (T, index_topk) int32
    sink: dict[int, np.ndarray]  # layer -> (H,) float32
    policy: dict = field(default_factory=dict)  # PlanConfig fields beside the limits

    @property
    def window_size(self) -> int:
        return self.schedule.sliding_window

    @property
    def index_topk(self) -> int:
        return self.schedule.index_topk

    @property
    def head_dim(self) -> int:
        return next(iter(self.q.values())).shape[2]

    @property
    def sm_scale(self) -> float:
        return self.head_dim**-0.5

    def plan_config(self, **kw) -> P.PlanConfig:
        cfg = dict(
            window_size=self.window_size,
            max_model_len=max(int(self.batch.seq_lens.max(initial=1)), 1),
            max_num_batched_tokens=max(int(self.batch.query_lens.max(initial=1)), 1),
            replay=self.replay,
        )
        cfg.update(self.policy)
        cfg.update(kw)
        return P.PlanConfig(**cfg)

    def step(self, **kw) -> P.StepPlan:
        return P.plan_step(self.batch, self.plan_config(**kw), self.schedule)

    def rows(self, layer_id: int, step: P.StepPlan) -> np.ndarray:
        """The step rows layer `layer_id` computes (its band's token_index)."""
        return step.bands[step.layer_keys[layer_id].band].token_index

    def layer_inputs(self, layer_id: int, step: P.StepPlan):
        """(q, raw, compressed cache or None, top-k rows or None) of one layer, q and top-k rows
        holding its band's rows only (what its layer call takes)."""
        role = self.schedule[layer_id]
        t = self.rows(layer_id, step)
        comp = self.caches[role.kv_source_layer_id] if role.has_compressed else None
        topk = self.topk[role.index_source_layer_id][t] if role.has_compressed else None
        return self.q[layer_id][t], self.raw[layer_id], comp, topk

    def oracle(self, layer_id: int, caches=None):
        """(token_index, out, lse) of the float64 oracle for one layer (`caches`: other values of
        the compressed caches, e.g. the ones mxfp8 pages hold)."""
        token_index, out, _, lse = oracle.layer_attention(
            self.schedule,
            layer_id,
            self.q[layer_id],
            self.raw[layer_id],
            self.caches if caches is None else caches,
            self.batch.seq_lens,
            self.batch.query_lens,
            sm_scale=self.sm_scale,
            attn_sink=self.sink[layer_id],
            topk_rows=self.topk,
            replay=self.replay,
            replay_start=self.batch.replay_start,
            allow_invalid=True,
        )
        return token_index, out, lse


def topk_rows(rng, batch: P.PrefillBatch, ratio: int, topk: int, invalid: float = 0.15) -> np.ndarray:
    """(T, topk) int32: each token's first min((p+1)//r, topk) entries a random choice of its
    visible ones, a fraction `invalid` of them -1 (vLLM V4.1's failed picks); -1 past them."""
    rows = np.full((batch.num_tokens, topk), -1, dtype=np.int32)
    for t, p in enumerate(batch.token_position.tolist()):
        vis = (p + 1) // ratio
        k = min(vis, topk)
        pick = rng.permutation(vis)[:k]
        pick[rng.random(k) < invalid] = -1
        rows[t, :k] = pick
    return rows


def v41_case(
    name, seq_lens, query_lens, *, replay=None, replay_start=None, H=2, D=16, seed=0, schedule=TINY, **policy
) -> V41Case:
    rng = np.random.default_rng(seed)
    batch = P.PrefillBatch(seq_lens, query_lens, replay_start=replay_start)
    seq = batch.seq_lens.tolist()
    T = batch.num_tokens
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    q = {i: f32(T, H, D) for i in range(len(schedule))}
    raw = {i: [f32(s, D) for s in seq] for i in range(len(schedule))}
    caches = {k: [f32(s // schedule[k].compress_ratio, D) for s in seq] for k in schedule.kv_source_layer_ids}
    topk = {
        k: topk_rows(rng, batch, schedule[k].compress_ratio, schedule.index_topk)
        for k in schedule.index_source_layer_ids
    }
    sink = {i: f32(H) for i in range(len(schedule))}
    return V41Case(name, schedule, batch, replay, q, raw, caches, topk, sink, policy)


def v41_cases() -> list[V41Case]:
    """Multi-request steps of the tiny schedule (W = 16, top-k 8): fresh prompts longer and shorter
    than W (trimmed by replay or not), chunked prefill with prefixes, query_len == 0 requests,
    prefix hits (replay_start), each with replay on and off; a budget that splits requests."""
    out = []
    for replay in (None, False):
        tag = "replay" if replay is None else "exact"
        out += [
            v41_case(f"fresh-{tag}", [40, 7, 16, 17, 33], [40, 7, 16, 17, 33], replay=replay, seed=1),
            v41_case(f"prefix-{tag}", [90, 61, 20, 150], [30, 5, 0, 17], replay=replay, seed=2),
            v41_case(f"prefix-hit-{tag}", [80, 64, 45], [40, 20, 45], replay=replay, replay_start=[24, 30, 0], seed=3),
        ]
    out.append(v41_case("budget-split-replay", [120, 70, 33], [100, 30, 33], seed=4, budget_rows=150))
    return out


def paged(arrays: list[np.ndarray], page: int, seed: int = 0):
    """(pages (n, page, D) float32, block_table (B, max_pages) int32) of per-request rows, pages
    shuffled across requests, unused slots NaN (a read of one shows in the output)."""
    D = arrays[0].shape[1]
    counts = [-(-len(x) // page) for x in arrays]
    total = sum(counts) + 1
    perm = np.random.default_rng(seed).permutation(total)
    pages = np.full((total, page, D), np.nan, dtype=np.float32)
    table = np.zeros((len(arrays), max(max(counts), 1)), dtype=np.int32)
    k = 0
    for i, x in enumerate(arrays):
        for j in range(counts[i]):
            table[i, j] = perm[k]
            part = x[j * page : (j + 1) * page]
            pages[perm[k], : len(part)] = part
            k += 1
    return pages, table
