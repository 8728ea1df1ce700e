"""FLOPs of one DeepSeek-V4.1 prefill step, layer by layer, with and without decoder bounded replay.

`step_flops(config, batch, replay=...)` counts what each decoder layer computes for the step's new
tokens (a multiply-add is 2 FLOPs), at the shapes of a V4.1 config.json dict (`text_config`
fields; missing ones: `contract.V41_PRESETS["V4.1"]`'s), for the rows its band computes
(`planner.schedule`, `PrefillBatch.band`). Per row (h hidden, ql q_lora_rank, H heads, D head_dim,
G o_groups, ol o_lora_rank, IH / ID index heads / dim, hc hc_mult, r the layer's ratio):

* projections: wq_a 2 h ql, wkv 2 h D, wq_b 2 ql H D, wo_a 2 H D ol, wo_b 2 G ol h, two mHC mixes
  2 (hc h) ((2 + hc) hc) each; a KV source's compressor 2 h D (wkv; its gate doubles it at r > 1);
* attention: 4 H D per key (q.k over D, p.v over d_v = D), keys = min((p + 1) // r, index_topk)
  compressed (none at r = 0) + the window max(p - W + 1, window start) .. p;
* indexer (index sources): wq_b 2 ql IH ID, weights_proj 2 h IH, scores 2 IH ID + 2 IH per visible
  entry ((p + 1) // r of them: the two-level top-k still scores every one); the index keys of a
  KV source, 2 D ID per compressed entry its rows complete;
* moe: router 2 h n_routed_experts, (num_experts_per_tok + n_shared_experts) SwiGLU experts of
  3 x 2 h moe_intermediate_size.

Under replay (when some request has more than W new rows: vLLM makes no replay batch otherwise),
layers past the cut do all of it on their kept rows; the cut layer first runs its KV
part (wq_a, wkv, the attention-site mHC mix, compressor, weights_proj, index keys: vLLM's
`forward_kv`) on every row, then the whole layer on its kept rows (vLLM's replay batch: that KV
part again there). Not counted: embeddings and the LM head, norms, RoPE, softmax, top-k
selection, Engram lookups, the DSpark draft layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.batch import BandRows, PrefillBatch
from planner.contract import V41_PRESETS
from planner.schedule import LayerRole, Schedule, text_config

SHAPE_FIELDS = (
    "hidden_size", "q_lora_rank", "num_attention_heads", "head_dim", "o_groups", "o_lora_rank", "index_n_heads",
    "index_head_dim", "hc_mult", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
    "n_shared_experts",
)  # fmt: skip


@dataclass(frozen=True)
class LayerFlops:
    """One layer's FLOPs in a step; `rows`: the query rows it computes (its band's)."""

    layer_id: int
    band: str
    rows: int
    attention: int
    indexer: int
    projections: int
    moe: int

    @property
    def total(self) -> int:
        return self.attention + self.indexer + self.projections + self.moe


def _row_sums(batch: PrefillBatch, rows: BandRows, r: int, topk: int, W: int) -> tuple[int, int, int]:
    """(attention keys, visible entries, completed compressed entries) summed over `rows`."""
    p = rows.token_position.astype(np.int64)
    start = rows.window_starts[batch.token_request[rows.token_index]]
    keys = int((p - np.maximum(p - W + 1, start) + 1).sum())
    if not r:
        return keys, 0, 0
    visible = (p + 1) // r
    completed = int((batch.seq_lens // r - (batch.seq_lens - rows.query_lens) // r).sum())
    return keys + int(np.minimum(visible, topk).sum()), int(visible.sum()), completed


def step_flops(config: dict, batch: PrefillBatch, *, replay: bool | None = False) -> tuple[LayerFlops, ...]:
    """Every decoder layer's FLOPs for `batch`'s new tokens (module doc for what is counted).

    config: a V4.1 config.json dict (`planner.Schedule.from_config` reads its schedule).
    replay: `Schedule.resolve_replay`'s: False (default) the exact computation (every row, full
      windows, as transformers), None vLLM's default, True required.
    """
    if not isinstance(batch, PrefillBatch):
        raise TypeError(f"batch: expected a planner.PrefillBatch, got {type(batch).__name__}")
    schedule = Schedule.from_config(config)
    # no request trimmed: vLLM makes no replay batch (`PrefillBatch.band` would keep every row)
    on = schedule.resolve_replay(replay) and bool((batch.query_lens > schedule.sliding_window).any())
    cfg = {**V41_PRESETS["V4.1"], **text_config(config)}
    h, ql, H, D, G, ol, IH, ID, hc, inter, E, k, S = (int(cfg[f]) for f in SHAPE_FIELDS)
    W, topk = schedule.sliding_window, schedule.index_topk
    mhc = 2 * (hc * h) * ((2 + hc) * hc)
    moe_row = 2 * h * E + (k + S) * 3 * 2 * h * inter
    sums: dict[tuple[int, str], tuple[int, int, int]] = {}

    def row_sums(r: int, band: str):
        if (r, band) not in sums:
            sums[(r, band)] = _row_sums(batch, batch.band(band, W), r, topk, W)
        return sums[(r, band)]

    def kv_part(role: LayerRole, n: int, completed: int) -> tuple[int, int]:
        """(projections, indexer) of the KV a layer writes for n rows completing `completed` entries."""
        proj = n * (2 * h * ql + 2 * h * D + mhc)
        if role.is_kv_source:
            proj += n * 2 * h * D * (2 if role.compress_ratio > 1 else 1)
        index = 0
        if role.is_index_source:
            index += n * 2 * h * IH
            if role.is_kv_source:
                index += completed * 2 * D * ID
        return proj, index

    out = []
    for role in schedule:
        band = role.band(on)
        r = role.compress_ratio
        rows = batch.band(band, W).num_tokens
        keys, visible, completed = row_sums(r, band)
        proj, index = kv_part(role, rows, completed)
        proj += rows * (2 * ql * H * D + 2 * H * D * ol + 2 * G * ol * h + mhc)
        if role.is_index_source:
            index += rows * 2 * ql * IH * ID + visible * (2 * IH * ID + 2 * IH)
        if band == "cut":  # forward_kv on every row first
            extra_proj, extra_index = kv_part(role, batch.num_tokens, row_sums(r, "full")[2])
            proj, index = proj + extra_proj, index + extra_index
        out.append(LayerFlops(role.layer_id, band, rows, 4 * H * D * keys, index, proj, rows * moe_row))
    return tuple(out)
