"""Hypothesis-driven random cases, kernel and prefill level.

CI: a fixed seed (derandomize) and a few examples. Locally, many more and wider shapes:

    DSV4_PARITY_EXAMPLES=500 python -m pytest tests/parity/test_parity_random.py
    DSV4_PARITY_SEED=7 ...     # another seed (random search instead of the fixed one)

Shapes are drawn from small sets in CI so that the JAX programs compile a handful of times.
"""

import os

import pytest
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st

import planner as P
from tests.parity import backends as B
from tests.parity import cases as C
from tests.parity import harness as H

LOCAL = "DSV4_PARITY_EXAMPLES" in os.environ
EXAMPLES = int(os.environ.get("DSV4_PARITY_EXAMPLES", "0"))
SEED = os.environ.get("DSV4_PARITY_SEED")


def parity_settings(ci_examples: int):
    s = settings(
        max_examples=EXAMPLES or ci_examples,
        derandomize=SEED is None,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    return (lambda f: seed(int(SEED))(s(f))) if SEED is not None else s


@st.composite
def kernel_case(draw):
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    if LOCAL:
        T, H = draw(st.integers(0, 12)), draw(st.sampled_from([1, 3, 16, 20, 64]))
        D = draw(st.sampled_from([16, 33, 64, 512, 576])) if dtype == "float32" else draw(st.sampled_from([512, 576]))
        S, K = draw(st.integers(1, 200)), draw(st.integers(1, 400))
    else:  # shapes of the fixed kernel cases: nothing new to compile
        T, H, S = 8, 16, 64
        D, K = (64 if dtype == "float32" else 512), draw(st.sampled_from([128, 256]))
    return C.random_kernel_case(
        "hypothesis",
        "random draw",
        dtype,
        seed=draw(st.integers(0, 2**31 - 1)),
        T=T,
        H=H,
        D=D,
        S=S,
        K=K,
        invalid=draw(st.sampled_from([0.0, 0.2, 0.7, 1.0])),
        duplicates=draw(st.sampled_from([0.0, 0.3])),
        topk=draw(st.sampled_from(["random", "none"])),
        sink=draw(st.sampled_from([None, "random", "mixed", 0.0])),
    )


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")  # Triton interpreter, huge sinks
@parity_settings(ci_examples=6)
@given(kernel_case())
def test_random_kernel_cases(case):
    (row,) = H.run_kernel_cases([case])
    assert row.passed, case.describe() + "\n" + "\n".join(row.failures())


@st.composite
def step_case(draw):
    n = draw(st.integers(1, 4))
    query = draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
    prefix = draw(
        st.lists(
            st.sampled_from([0, 1, 3, 4, 7, 8, 9, 31, 127, 128, 129, 200, 255]) | st.integers(0, 280),
            min_size=n,
            max_size=n,
        )
    )
    seq = [p + q for p, q in zip(prefix, query)]
    # engine limits above the batch's (they size the fixed plan and the adaptive budget)
    plan_kw = dict(
        max_model_len=max(max(seq), 1) + draw(st.integers(0, 300)),
        max_num_batched_tokens=max(max(query), 1) + draw(st.integers(0, 40)),
        prefill_chunk_size=draw(st.sampled_from([1, 2, 4])),
    )
    # the tiny family's shapes (W=8, top-k 6, H=4, D=32), paged only for JAX: few programs to compile
    return C.step_case(
        "hypothesis",
        "random batch",
        seq,
        query,
        seed=draw(st.integers(0, 2**20)),
        plan_kw=plan_kw,
        topk_junk=draw(st.booleans()),
        variants=C.FEW_VARIANTS,
        jax_layouts=("paged",),
    )


@parity_settings(ci_examples=4)
@given(step_case())
def test_random_prefill_steps(case):
    """Reference backends (and any GPU backend) on every plan and layout; bitwise across plans."""
    only = [b.name for b in B.BACKENDS if not B.machine_status()[b.name].interpreted]
    T = case.batch.num_tokens
    event(f"tokens: {'0' if T == 0 else '1-15' if T < 16 else '16-47' if T < 48 else '48+'}")
    rows = H.run_step_case(case, only=only)
    for row in rows:
        assert row.passed, case.describe() + "\n" + "\n".join(row.failures())
        assert {"oracle", "torch.reference", "jax.xla"} <= row.ran
        assert row.invariant("torch.reference").max_abs == 0 and row.invariant("jax.xla").max_abs == 0
    assert P.PrefillBatch(case.first.seq_lens, case.first.query_lens).num_tokens == case.batch.num_tokens
