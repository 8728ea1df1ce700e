"""planner.cost.step_flops against a per-token count, and what decoder bounded replay saves."""

import numpy as np
import pytest

import planner as P
from planner import oracle
from tests.planner.test_v41_plans import brute_rows

V41 = P.contract.preset("V4.1")
TINY = P.contract.preset("V4.1-tiny")


def brute_flops(cfg, batch, replay):
    """Each layer's FLOPs, token by token: its band's rows (`brute_rows`), keys from oracle.key_set."""
    s = P.Schedule.from_config(cfg)
    c = {**V41, **cfg}
    h, ql, H, D, G, ol = (c[k] for k in ("hidden_size", "q_lora_rank", "num_attention_heads", "head_dim", "o_groups",
                                         "o_lora_rank"))  # fmt: skip
    IH, ID, hc = c["index_n_heads"], c["index_head_dim"], c["hc_mult"]
    W, topk = s.sliding_window, s.index_topk
    on = s.resolve_replay(replay) and int(batch.query_lens.max()) > W
    mix = 2 * hc * h * (2 + hc) * hc
    out = []
    for role in s:
        r, band = role.compress_ratio, role.band(on)

        def kv(rows):  # what forward_kv computes for these rows: (projections, indexer)
            proj = index = 0
            for _, p, _ in rows:
                proj += 2 * h * ql + 2 * h * D + mix
                if role.is_kv_source:
                    proj += 2 * h * D + (2 * h * D if r == 2 else 0)
                    if (p + 1) % r == 0:  # the token completes entry (p + 1) // r - 1
                        index += 2 * D * ID
                if role.is_index_source:
                    index += 2 * h * IH
            return proj, index

        rows = brute_rows(batch, band, W)
        att = 0
        proj, index = kv(rows)
        for _, p, window in rows:
            comp, _ = oracle.key_set(p, kind=role.spec.kind, compress_ratio=r, window_size=W,
                                     topk_row=list(range((p + 1) // r)) if r else None)  # fmt: skip
            att += 4 * H * D * (len(comp[:topk]) + len(window))
            proj += 2 * ql * H * D + 2 * H * D * ol + 2 * G * ol * h + mix
            if role.is_index_source:
                index += 2 * ql * IH * ID + ((p + 1) // r) * (2 * IH * ID + 2 * IH)
        if band == "cut":
            p2, i2 = kv(brute_rows(batch, "full", W))
            proj, index = proj + p2, index + i2
        moe = len(rows) * (2 * h * c["n_routed_experts"] + (c["num_experts_per_tok"] + c["n_shared_experts"]) * 6 * h
                           * c["moe_intermediate_size"])  # fmt: skip
        out.append((role.layer_id, band, len(rows), att, index, proj, moe))
    return out


@pytest.mark.parametrize("replay", [False, None])
@pytest.mark.parametrize("name", ["V4.1", "V4.1-tiny"])
def test_step_flops_against_a_per_token_count(name, replay):
    cfg = P.contract.preset(name)
    W = cfg["sliding_window"]
    batch = P.PrefillBatch(
        [3 * W + 5, 2 * W, W + 1, 7, 40], [2 * W + 3, 2 * W, W + 1, 7, 1], replay_start=[0, 0, 0, 0, 39]
    )
    got = P.cost.step_flops(cfg, batch, replay=replay)
    want = brute_flops(cfg, batch, replay)
    assert [(f.layer_id, f.band, f.rows, f.attention, f.indexer, f.projections, f.moe) for f in got] == want
    assert all(f.total == f.attention + f.indexer + f.projections + f.moe for f in got)
    assert {f.band for f in got} == ({"full"} if replay is False else {"full", "cut", "replay"})


def test_what_replay_saves():
    long = P.PrefillBatch([16384, 8192, 600], [4096, 8192, 600])
    exact, replay = P.cost.step_flops(V41, long, replay=False), P.cost.step_flops(V41, long, replay=True)
    assert exact[:20] == tuple(f for f in replay[:20] if f.band == "full")  # layers before the cut: the same
    rows = int(np.minimum(long.query_lens, 128).sum())
    assert [f.rows for f in replay[20:]] == [rows] * 20 and [f.rows for f in exact[20:]] == [long.num_tokens] * 20
    saved = 1 - sum(f.total for f in replay) / sum(f.total for f in exact)
    assert 0.4 < saved < 0.5  # half the layers on 384 of 12,888 rows
    # the cut also writes every row's KV: more than a past-cut layer, less than its exact cost
    assert replay[21].total < replay[20].total < exact[20].total
    # nothing trimmed (no request over W new rows): vLLM makes no replay batch; the same FLOPs
    short = P.PrefillBatch([1000, 50], [128, 50])
    assert P.cost.step_flops(V41, short, replay=True) == P.cost.step_flops(V41, short, replay=False)


def test_bad_inputs():
    with pytest.raises(TypeError, match="batch: expected a planner.PrefillBatch"):
        P.cost.step_flops(V41, [1, 2])
    with pytest.raises(ValueError, match="replay: True, but"):
        P.cost.step_flops(dict(TINY, compress_ratios=[0, 2, 2, 2, 2, 2, 1], kv_source_layer_ids=[1, 6],
                               index_source_layer_ids=[1, 6], candidate_source_layer_id=6),
                          P.PrefillBatch([100], [100]), replay=True)  # fmt: skip
