"""planner.plan.vllm_chunk_tuples: vLLM's tuples on Python lists, equal to plan_kind's on NumPy.

The vLLM plugin plans small steps with it (tests/vllm checks it against vLLM 0.33.0 itself); here
it is checked against `plan_kind(...).as_tuples()` on random batches, every kind vLLM asks for,
zero-query requests with and without `contiguous`, and on the same bad inputs.
"""

import numpy as np
import pytest

import planner
from planner.plan import vllm_chunk_tuples

KINDS = [("SWA", 0), ("CSA", 4), ("HCA", 128), ("CSA", 1), ("CSA", 2)]


def test_equal_to_plan_kind_on_random_batches():
    rng = np.random.default_rng(64)
    multi = skipped = 0
    for _ in range(1500):
        n = int(rng.choice([1, 2, 3, 5, 8, 17, 64]))
        mml = int(rng.choice([256, 8192, 1 << 20]))
        mnbt = int(rng.choice([16, 512, 8192]))
        seq = np.where(rng.random(n) < 0.5, rng.integers(1, mml + 1, n), rng.integers(1, min(mml, 300) + 1, n))
        qry = rng.integers(1, np.minimum(seq, mnbt) + 1)
        if rng.random() < 0.3:
            qry[rng.random(n) < 0.4] = 0
        config = planner.PlanConfig(
            window_size=int(rng.choice([4, 64, 128])),
            max_model_len=mml,
            max_num_batched_tokens=mnbt,
            prefill_chunk_size=int(rng.choice([1, 4])),
            contiguous=bool(rng.random() < 0.7),
        )
        batch = planner.PrefillBatch(seq, qry, mml, mnbt)
        for spec in KINDS:
            want = planner.plan_kind(batch, config, spec).as_tuples()
            for form in (list, np.asarray):
                assert vllm_chunk_tuples(form(seq.tolist()), form(qry.tolist()), config, spec) == want
            multi += len(want) > 1
        skipped += bool((qry == 0).any())
    assert multi > 1000 and skipped > 200


@pytest.mark.parametrize(
    "seq, qry, match",
    [
        ([10, 20], [5], "lengths differ"),
        ([10], [11], r"query_lens\[0\] = 11 exceeds seq_lens\[0\] = 10"),
        ([10, -1], [5, 0], r"seq_lens: must be >= 0, got seq_lens\[1\] = -1"),
        ([5000], [5], "seq_lens.*exceeds max_model_len = 1024"),
        ([1000], [100], "query_lens.*exceeds max_num_batched_tokens = 64"),
        ([10.0], [5], "seq_lens: expected integers"),
    ],
)
def test_bad_inputs_as_the_batch_names_them(seq, qry, match):
    config = planner.PlanConfig(window_size=128, max_model_len=1024, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match=match):
        vllm_chunk_tuples(seq, qry, config, ("CSA", 4))


def test_only_vllms_plans():
    config = planner.PlanConfig(window_size=128, max_model_len=1024, max_num_batched_tokens=64, policy="fixed")
    with pytest.raises(ValueError, match="config: vllm_chunk_tuples plans vLLM's adaptive"):
        vllm_chunk_tuples([10], [5], config, ("CSA", 4))
    assert vllm_chunk_tuples([], [], planner.PlanConfig(128, 1024, 64), ("CSA", 4)) == []
    assert vllm_chunk_tuples([10, 20], [0, 0], planner.PlanConfig(128, 1024, 64), ("CSA", 4)) == []
