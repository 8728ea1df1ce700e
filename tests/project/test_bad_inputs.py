"""Bad inputs are answered by a ValueError / TypeError naming the argument, never a silent wrong
answer or an error from deep inside NumPy, torch or JAX: the planner's int32 range, the plan and
metadata entry points, the shared sparse_attention checks (`planner.checks`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import planner as P
from dsv4_jax import prefill_metadata as jax_metadata
from dsv4_torch import prefill as torch_prefill
from dsv4_torch import prefill_metadata as torch_metadata
from planner.checks import INT32_MAX, sm_scale_value, sparse_attention_shapes

CFG = dict(window_size=128, max_model_len=1 << 20, max_num_batched_tokens=8192)


def test_lengths_beyond_int32_are_refused_not_wrapped():
    # an unchecked int32 cast made token_position [-2, -1] here
    with pytest.raises(ValueError, match=r"seq_lens: seq_lens\[0\] = 1099511627776 exceeds 2147483647"):
        P.PrefillBatch([2**40], [2])
    top = P.PrefillBatch([INT32_MAX], [2])  # the largest position that fits
    assert top.token_position.tolist() == [INT32_MAX - 2, INT32_MAX - 1]
    with pytest.raises(ValueError, match="query_lens: .* query tokens in all exceed 2147483647"):
        P.PrefillBatch([2**30] * 3, [2**30] * 3)
    with pytest.raises(ValueError, match=r"seq_lens: .* does not fit int64"):
        P.PrefillBatch(np.array([2**63], np.uint64), np.array([1], np.uint64))


@pytest.mark.parametrize("name", ["max_model_len", "max_num_batched_tokens"])
def test_limits_beyond_int32_are_refused(name):
    with pytest.raises(ValueError, match=rf"{name}: must be <= 2147483647 .*got 1099511627776"):
        P.PrefillBatch([5], [2], **{name: 2**40})
    with pytest.raises(ValueError, match=rf"{name}: must be <= 2147483647"):
        P.PlanConfig(**{**CFG, name: 2**40})


@pytest.mark.parametrize("name", ["window_size", "prefill_chunk_size", "budget_rows"])
def test_other_plan_limits_beyond_int32_are_refused(name):
    with pytest.raises(ValueError, match=rf"{name}: must be <= 2147483647"):
        P.PlanConfig(**{**CFG, name: 2**31})


def test_workspace_bound_beyond_int32_is_refused():
    """vLLM's bound prefill_chunk_size * (cdiv(max_model_len, r) + W + max_num_batched_tokens)
    sets the row bases of int32 plans: past int32 the plan says so instead of wrapping."""
    cfg = P.PlanConfig(window_size=128, max_model_len=INT32_MAX, max_num_batched_tokens=8192)
    batch = P.PrefillBatch([100], [10])
    with pytest.raises(ValueError, match="max_model_len: vLLM's workspace bound .* beyond 2147483647"):
        P.plan_step(batch, cfg, [("CSA", 1)])
    with pytest.raises(ValueError, match="max_model_len: vLLM's workspace bound for CSA ratio 4 is 2147516928 rows"):
        P.plan_step(batch, cfg, [("CSA", 4)])  # 4 * (2^29 + 128 + 8192)
    P.plan_step(batch, dataclasses.replace(cfg, prefill_chunk_size=1), [("CSA", 4), ("HCA", 128)])  # 2^29 + 8320 rows
    P.plan_step(batch, P.PlanConfig(**{**CFG, "max_model_len": INT32_MAX, "budget_rows": 4096}), [("CSA", 1)])


def test_plan_step_and_plan_kind_want_a_batch_and_a_config():
    cfg = P.PlanConfig(**CFG)
    with pytest.raises(TypeError, match="batch: expected a planner.PrefillBatch .*got list"):
        P.plan_step([1, 2], cfg)
    with pytest.raises(TypeError, match="batch: expected a planner.PrefillBatch"):
        P.plan_kind(np.array([1, 2]), cfg, ("CSA", 4))
    with pytest.raises(TypeError, match="config: expected a planner.PlanConfig, got dict"):
        P.plan_step(P.PrefillBatch([10], [5]), CFG)


@pytest.mark.parametrize("build", [torch_metadata.build_step_metadata, jax_metadata.build_step_metadata])
@pytest.mark.parametrize(
    "topk, error",
    [
        (-1, "index_topk: must be >= 1, got -1"),
        (0, "must be >= 1"),
        (2.5, "expected an integer"),
        (True, "expected an integer"),
        (2**31, "must be <= 2147483647"),
    ],
)
def test_step_metadata_index_topk(build, topk, error):
    step = P.plan_step(
        P.PrefillBatch([40], [8]), P.PlanConfig(window_size=8, max_model_len=64, max_num_batched_tokens=16)
    )
    with pytest.raises(ValueError, match=error):
        build(step, index_topk=topk)


def test_torch_prefill_attention_without_metadata():
    q = torch.zeros(4, 2, 16)
    raw = torch_prefill.PagedKV(torch.zeros(1, 64, 16), torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(TypeError, match="meta: expected a KindMetadata"):
        torch_prefill.prefill_attention(q, None, raw, sm_scale=0.25)


def test_sparse_attention_shape_rules():
    s = sparse_attention_shapes((3, 4, 16), (10, 1, 16), (3, 8), (4,), (3,))
    assert s == (3, 4, 16, 10, 8, True, False)
    for args, match in [
        (((3, 4), (10, 16), (3, 8)), r"q: expected shape \(T, H, D\), got \(3, 4\)"),
        (((3, 4, 0), (10, 0), (3, 8)), "q: head dim D must be >= 1"),
        (((3, 4, 16), (10, 2, 16), (3, 8)), r"kv: expected shape \(S, 1, D\) \(one KV head\)"),
        (((3, 4, 16), (16,), (3, 8)), r"kv: expected shape \(S, D\) or \(S, 1, D\)"),
        (((3, 4, 16), (10, 8), (3, 8)), "kv: last dim 8 does not match q's head dim D=16"),
        (((3, 4, 16), (10, 16), (3, 2, 8)), r"indices: expected shape \(T, 1, K\)"),
        (((3, 4, 16), (10, 16), (8,)), r"indices: expected shape \(T, K\) or \(T, 1, K\)"),
        (((3, 4, 16), (10, 16), (2, 8)), "indices: 2 rows for 3 query tokens"),
        (((3, 4, 16), (10, 16), (3, 8), (3,)), r"attn_sink: expected shape \(4,\)"),
        (((3, 4, 16), (10, 16), (3, 8), None, (4,)), r"topk_length: expected shape \(3,\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            sparse_attention_shapes(*args)
    assert sm_scale_value(np.float32(0.5)) == 0.5 and sm_scale_value(2) == 2.0
    for bad, error in [(float("nan"), ValueError), (float("inf"), ValueError), (True, TypeError), ("0.1", TypeError)]:
        with pytest.raises(error, match="sm_scale"):
            sm_scale_value(bad)


def test_one_wording_for_torch_jax_and_the_oracle():
    """The same bad shape gets the same message from every implementation."""
    import jax.numpy as jnp

    import dsv4_jax
    import dsv4_torch

    q, kv, idx = np.zeros((3, 4, 16), np.float32), np.zeros((10, 8), np.float32), np.zeros((3, 8), np.int32)
    messages = []
    for call in (
        lambda: P.oracle.sparse_attention(q, kv, idx, 0.25),
        lambda: dsv4_torch.sparse_attention(torch.from_numpy(q), torch.from_numpy(kv), torch.from_numpy(idx), 0.25),
        lambda: dsv4_jax.sparse_attention(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(idx), 0.25),
    ):
        with pytest.raises(ValueError) as e:
            call()
        messages.append(str(e.value))
    assert messages == ["kv: last dim 8 does not match q's head dim D=16"] * 3
