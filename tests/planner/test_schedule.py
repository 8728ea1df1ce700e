"""DeepSeek-V4.1's layer schedule: defaults, every validation rule, the roles of the released and
tiny schedules, the replay cut, the presets."""

import re

import pytest

import planner as P
from planner.schedule import Schedule

TINY = dict(
    num_hidden_layers=7,
    num_nextn_predict_layers=0,
    compress_ratios=[0, 2, 2, 1, 1, 1, 1],
    kv_source_layer_ids=[1, 3],
    index_source_layer_ids=[1, 3, 5],
    candidate_source_layer_id=3,
    candidate_topk_blocks=4,
    candidate_block_size=4,
    index_topk=8,
    sliding_window=16,
)


def roles(s: Schedule):
    return [
        (r.compress_ratio, r.mode, r.kv_source_layer_id, r.index_source_layer_id, r.is_candidate_source,
         r.uses_candidates, r.is_cut, r.past_cut)
        for r in s
    ]  # fmt: skip


def test_released_schedule_roles():
    for s in (Schedule.from_config({}), Schedule.from_name("V4.1"), Schedule.from_config(P.contract.preset("V4.1"))):
        assert len(s) == s.num_layers == 40 and s.cut == 20 and s.can_replay and s.replay_off_reason is None
        assert s.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20
        assert s.kv_source_layer_ids == (2, 8, 14, 20) and s.index_source_layer_ids == (2, 8, 14, 20, 24, 28, 32, 36)
        assert s.candidate_source_layer_id == 20 and (s.index_topk, s.sliding_window) == (512, 128)
        assert (s.candidate_topk_blocks, s.candidate_block_size) == (2048, 8)
        for r in s:
            i = r.layer_id
            kv = None if i < 2 else max(x for x in (2, 8, 14, 20) if x <= i)
            ix = None if i < 2 else max(x for x in (2, 8, 14, 20, 24, 28, 32, 36) if x <= i)
            mode = (
                "window"
                if i < 2
                else "source"
                if i in (2, 8, 14, 20)
                else "reindex"
                if i in (24, 28, 32, 36)
                else "reuse"
            )
            assert (r.kv_source_layer_id, r.index_source_layer_id, r.mode) == (kv, ix, mode), i
            assert r.is_candidate_source == (i == 20) and r.uses_candidates == (i in (24, 28, 32, 36)), i
            assert (r.is_cut, r.past_cut) == (i == 20, i > 20), i
            assert r.band(False) == "full" and r.band(True) == ("cut" if i == 20 else "replay" if i > 20 else "full")
            assert r.spec == (P.LayerSpec("SWA", 0) if i < 2 else P.LayerSpec("CSA", 2 if i < 20 else 1))
            assert r.has_compressed == (i >= 2) and r.is_kv_source == (mode == "source")


def test_tiny_schedule_roles():
    s = Schedule.from_name("V4.1-tiny")
    assert s == Schedule.from_config(TINY) and s.sliding_window == 16 and s.index_topk == 8
    assert roles(s) == [
        (0, "window", None, None, False, False, False, False),
        (2, "source", 1, 1, False, False, False, False),
        (2, "reuse", 1, 1, False, False, False, False),
        (1, "source", 3, 3, True, False, True, False),
        (1, "reuse", 3, 3, False, False, False, True),
        (1, "reindex", 3, 5, False, True, False, True),
        (1, "reuse", 3, 5, False, False, False, True),
    ]
    assert s.layer_specs == tuple(P.LayerSpec(*x) for x in [("SWA", 0)] + [("CSA", 2)] * 2 + [("CSA", 1)] * 4)
    assert [str(s.plan_key(i, True)) for i in range(7)] == ["SWA/full", "CSA2/full", "CSA2/full", "CSA1/cut"] + [
        "CSA1/replay"
    ] * 3
    assert [s.plan_key(i, False).band for i in range(7)] == ["full"] * 7
    assert s[3] is s.layers[3] and list(s) == list(s.layers)


def test_transformers_defaults():
    # no compress_ratios: the released pattern scaled to n layers, KV sources at each run's start
    s = Schedule.from_config({"num_hidden_layers": 7, "num_nextn_predict_layers": 0})
    assert s.compress_ratios == (0, 0, 2, 2, 2, 1, 1)
    assert s.kv_source_layer_ids == s.index_source_layer_ids == (2, 5) and s.candidate_source_layer_id == 5
    # 1 or 2 layers: window only, the released ratios' prefix, so the released sources (transformers raises too)
    with pytest.raises(ValueError, match=r"kv_source_layer_ids: layer 2 out of range \[0, 1\)"):
        Schedule.from_config({"num_hidden_layers": 1})
    # explicit ratios that are not the released prefix: runs start sources; the index sources follow them
    s = Schedule.from_config({"num_hidden_layers": 5, "compress_ratios": [0, 2, 2, 1, 1]})
    assert s.kv_source_layer_ids == (1, 3) == s.index_source_layer_ids and s.candidate_source_layer_id == 3
    # the released ratios' prefix takes the released sources: out of range for 7 layers (as in transformers)
    with pytest.raises(ValueError, match=r"kv_source_layer_ids: layer 8 out of range \[0, 7\)"):
        Schedule.from_config({"num_hidden_layers": 7, "compress_ratios": [0, 0, 2, 2, 2, 2, 2]})
    # every layer window only: no source, no candidate, no cut
    s = Schedule.from_config({"num_hidden_layers": 3, "compress_ratios": [0, 0, 0]})
    assert s.kv_source_layer_ids == () and s.candidate_source_layer_id == -1 and s.cut is None
    assert s.replay_off_reason == "no KV source: nothing to cut at"
    # negative candidate: off (kept as given)
    s = Schedule.from_config(dict(TINY, candidate_source_layer_id=-3))
    assert s.candidate_source_layer_id == -3 and not any(r.is_candidate_source or r.uses_candidates for r in s)
    # draft entries (0) after the decoder layers, counted by num_nextn_predict_layers (default 3)
    assert Schedule.from_config(
        dict(TINY, num_nextn_predict_layers=None, compress_ratios=TINY["compress_ratios"] + [0] * 3)
    )
    assert (
        len(
            Schedule.from_config(
                dict(TINY, num_nextn_predict_layers=2, compress_ratios=TINY["compress_ratios"] + [0, 0])
            )
        )
        == 7
    )


def test_official_field_names():
    """The official composite config: text fields under `text_config`, `n_mtp_layers` for the draft layers."""
    tiny = {k: v for k, v in TINY.items() if k != "num_nextn_predict_layers"}
    composite = {
        "model_type": "deepseek_v41",
        "text_config": dict(tiny, n_mtp_layers=2, compress_ratios=tiny["compress_ratios"] + [0, 0]),
    }
    assert Schedule.from_config(composite) == Schedule.from_config(TINY)
    assert P.schedule.text_config(composite)["num_nextn_predict_layers"] == 2
    assert P.contract.is_v41_config(composite) and P.contract.is_v41_config({"kv_source_layer_ids": [1]})
    assert not P.contract.is_v41_config(P.contract.preset("V4-Flash")) and not P.contract.is_v41_config([1])
    with pytest.raises(ValueError, match=r"compress_ratios: 9 entries for .* 7 \+ 0 layers"):
        Schedule.from_config(dict(TINY, compress_ratios=TINY["compress_ratios"] + [0, 0]))
    with pytest.raises(TypeError, match="config.text_config: expected a dict"):
        Schedule.from_config({"text_config": [1]})
    with pytest.raises(TypeError, match="config: expected a config.json dict"):
        Schedule.from_config([1])


@pytest.mark.parametrize(
    "fields, match",
    [
        # transformers' rules
        (dict(compress_ratios=[0, 2]), r"compress_ratios: needs num_hidden_layers = 7 entries, got 2"),
        (dict(compress_ratios=[0, 2, 2, 1, 1, 1, 1, 1]), r"compress_ratios: 8 entries for num_hidden_layers"),
        (dict(kv_source_layer_ids=[1, 7]), r"kv_source_layer_ids: layer 7 out of range \[0, 7\).*\[1, 7\]"),
        (dict(kv_source_layer_ids=[0, 1, 3]), r"kv_source_layer_ids: layer 0 has compress_ratios\[0\] = 0"),
        (dict(index_source_layer_ids=[0, 1, 3]), r"index_source_layer_ids: layer 0 has compress_ratios\[0\] = 0"),
        (
            dict(compress_ratios=[0, 2, 2, 2, 1, 1, 1], kv_source_layer_ids=[2, 4], index_source_layer_ids=[1, 2, 4]),
            r"index_source_layer_ids: layer 1 has no KV source at or before it.*got \[1, 2, 4\]",
        ),
        (dict(candidate_source_layer_id=4), r"candidate_source_layer_id: 4 is not an index source"),
        (
            dict(
                compress_ratios=[0, 2, 2, 2, 1, 1, 1],
                kv_source_layer_ids=[2, 4],
                index_source_layer_ids=[2, 4],
                candidate_source_layer_id=4,
            ),
            r"kv_source_layer_ids: compress_ratios\[1\] = 2 needs a KV source at or before layer 1, got \[2, 4\]",
        ),
        # vLLM's
        (dict(compress_ratios=[0, 2, 2, 1, 1, 1, 3]), r"compress_ratios\[6\]: expected 0, 1 or 2.*got 3"),
        (
            dict(index_source_layer_ids=[1, 5], candidate_source_layer_id=1),
            r"index_source_layer_ids: KV source layer 3 is not an index source.*got \[1, 5\]",
        ),
        # this module's
        (
            dict(compress_ratios=[0, 2, 2, 1, 1, 1, 1] + [2], num_nextn_predict_layers=1),
            r"compress_ratios\[7\]: the DSpark draft layers .* got 2",
        ),
        (dict(index_source_layer_ids=[1, 3, 9]), r"index_source_layer_ids: layer 9 out of range \[0, 7\)"),
        (
            dict(compress_ratios=[0, 2, 1, 1, 1, 1, 1]),
            r"compress_ratios\[2\]: 1 differs from its KV source layer 1's ratio 2",
        ),
        (dict(engram_layer_ids=[7]), r"engram_layer_ids: layer 7 out of range"),
        (dict(index_topk=0), r"index_topk: must be >= 1, got 0"),
        (dict(sliding_window=-1), r"sliding_window: must be >= 1, got -1"),
        (dict(candidate_topk_blocks=0), r"candidate_topk_blocks: must be >= 1"),
        (dict(candidate_block_size=0), r"candidate_block_size: must be >= 1"),
        # types
        (dict(compress_ratios=[0, 2.0, 2, 1, 1, 1, 1]), r"compress_ratios\[1\]: expected an integer, got 2.0"),
        (dict(compress_ratios=[0, True, 2, 1, 1, 1, 1]), r"compress_ratios\[1\]: expected an integer, got True"),
        (dict(kv_source_layer_ids="13"), r"kv_source_layer_ids: expected a list of layer ids, got '13'"),
        (dict(candidate_source_layer_id="3"), r"candidate_source_layer_id: expected an integer, got '3'"),
        (dict(num_hidden_layers=0), r"num_hidden_layers: must be >= 1, got 0"),
        (dict(num_nextn_predict_layers=-1), r"num_nextn_predict_layers: must be >= 0"),
    ],
)
def test_every_rule_names_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        Schedule.from_config(dict(TINY, **fields))


def test_direct_construction_checks_the_same():
    s = Schedule((0, 2, 2, 1, 1, 1, 1), (3, 1), (5, 3, 1, 1), 3, sliding_window=16, index_topk=8)
    assert s.kv_source_layer_ids == (1, 3) and s.index_source_layer_ids == (1, 3, 5)  # sorted, repeats dropped
    with pytest.raises(ValueError, match=r"compress_ratios: expected one entry per decoder layer, got \[\]"):
        Schedule((), (), ())
    with pytest.raises(ValueError, match=r"index_source_layer_ids: KV source layer 3"):
        Schedule((0, 2, 2, 1), (1, 3), (1,))


def test_replay_cut_and_when_vllm_does_not_replay():
    base = dict(TINY)
    off = {
        r"the last KV source \(layer 6\) is the last layer": dict(
            compress_ratios=[0, 2, 2, 2, 2, 2, 1], kv_source_layer_ids=[1, 6], index_source_layer_ids=[1, 6],
            candidate_source_layer_id=6),
        r"compress_ratios\[3\] = 2 at the cut: vLLM asserts its ratio is <= 1": dict(
            compress_ratios=[0, 1, 1, 2, 2, 2, 2]),
        r"Engram layer 3 sits at or after the last KV source \(layer 3\)": dict(engram_layer_ids=[0, 3]),
    }  # fmt: skip
    for reason, fields in off.items():
        s = Schedule.from_config(dict(base, **fields))
        assert not s.can_replay and s.replay_off_reason is not None
        assert re.search(reason, s.replay_off_reason), s.replay_off_reason
        assert s.resolve_replay(None) is False and s.resolve_replay(False) is False
        with pytest.raises(ValueError, match="replay: True, but vLLM's bounded replay does not apply: " + reason):
            s.resolve_replay(True)
        assert {s.plan_key(i).band for i in range(len(s))} == {"full"}
    s = Schedule.from_config(dict(base, engram_layer_ids=[0, 2]))  # Engram before the cut: replay stays on
    assert s.can_replay and s.resolve_replay(None) is True and s.resolve_replay(True) is True
    for bad in ("yes", 1, 0):
        with pytest.raises(ValueError, match="replay: expected True, False or None"):
            s.resolve_replay(bad)
    with pytest.raises(ValueError, match=r"layer_id: expected 0..6, got 7"):
        s[7]


def test_presets():
    v41, tiny = P.contract.preset("V4.1"), P.contract.preset("v4.1_TINY")
    assert set(P.V41_PRESETS) == {"V4.1", "V4.1-tiny"} and not set(P.V41_PRESETS) & set(P.PRESETS)
    assert v41["hidden_size"] == 5120 and v41["num_attention_heads"] == 64 and v41["q_lora_rank"] == 1280
    assert (v41["index_n_heads"], v41["index_head_dim"], v41["head_dim"], v41["qk_rope_head_dim"]) == (32, 128, 512, 64)
    assert len(v41["compress_ratios"]) == 43 and v41["engram_layer_ids"] == [1, 14]
    assert (tiny["num_hidden_layers"], tiny["sliding_window"], tiny["index_n_heads"], tiny["index_head_dim"]) == (
        7,
        16,
        16,
        128,
    )
    assert (tiny["candidate_block_size"], tiny["candidate_topk_blocks"], tiny["head_dim"]) == (4, 4, 512)
    v41["hidden_size"] = 1  # a copy
    assert P.contract.preset("V4.1")["hidden_size"] == 5120
    # V4.0's readers refuse V4.1 configs with a pointer to the schedule; V4.0 is unchanged
    for cfg in (
        tiny,
        {"layer_types": ["sliding_attention", "shared_compressed_attention"], "kv_source_layer_ids": [1]},
    ):
        with pytest.raises(ValueError, match="config: a DeepSeek-V4.1 config .* Schedule.from_config"):
            P.layer_specs(cfg)
    with pytest.raises(ValueError, match="a DeepSeek-V4.1 config"):
        P.ModelShape.from_name("V4.1")
    assert len(P.ModelShape.from_name("V4-Flash").layers) == 44
    with pytest.raises(ValueError, match="name: expected one of .*V4.1-tiny"):
        P.contract.preset("V4.2")
