"""The main job runs end to end: planner tables, then both frameworks against the oracle."""

import re

import demo


def test_demo_runs_attention_in_both_frameworks(capsys):
    rc = demo.main(
        [
            "--seq-lens",
            "40,300,9",
            "--query-lens",
            "5,17,9",
            "--window-size",
            "8",
            "--max-model-len",
            "512",
            "--max-num-batched-tokens",
            "32",
            "--heads",
            "4",
            "--head-dim",
            "64",
            "--index-topk",
            "16",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "Sparse-attention kernel launches per prefill step" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"^(SWA|CSA|HCA)\s+(torch|jax)\s", line)]
    assert len(rows) == 12  # 3 kinds x 2 frameworks x 2 plans
    errors = [float(r[8]) for r in rows]  # kind framework backend plan chunks first steady tokens/s err ...
    assert max(errors) < 1e-5
    assert all(float(r[5]) > 0 and float(r[6]) > 0 for r in rows)  # the first call, then a median
    assert sum(r[9:10] == ["yes"] for r in rows) == 6  # every framework's plans agree bitwise


def test_demo_bad_input_is_a_clear_error(capsys):
    assert demo.main(["--seq-lens", "5,5", "--query-lens", "6,1", "--frameworks", ""]) == 2
    assert "query_lens[0] = 6 exceeds seq_lens[0] = 5" in capsys.readouterr().err


def test_demo_shows_a_v41_step_beside_v4(capsys):
    """The V4.1 section: 3 plans without replay, 4 with it (the cut and the replay band), and the
    replay bands compute each request's last min(query_len, 128) rows, counted here apart."""
    import re

    from planner.report import V41_QUERY_LENS

    assert demo.main(["--frameworks", ""]) == 0
    out = capsys.readouterr().out
    assert "DeepSeek-V4.1 (40 layers" in out
    assert "no request has more than 128 new rows" in out  # the spec batch: replay has nothing to drop
    fresh = out.rsplit("DeepSeek-V4.1 (40 layers", 1)[1]
    assert "3 without replay, 4 with it, against vLLM's 40 planner calls" in fresh
    kept = sum(min(q, 128) for q in V41_QUERY_LENS)
    rows = {m.group(1): int(m.group(2)) for m in re.finditer(r"^on\s+1\s+(cut|replay)\s+\S+.*?(\d+)$", fresh, re.M)}
    assert rows == {"cut": kept, "replay": kept}, rows
    full = [int(line.split()[-1]) for line in fresh.splitlines() if line.startswith("off ")]
    assert full == [sum(V41_QUERY_LENS)] * 3
